#!/usr/bin/env bash
# timed.sh STEP CMD...: run CMD, then say how long set-up step STEP took (`make setup` prints one line a
# step, so that a slow step on a fresh machine can be told from the others; README "The two commands").
set -uo pipefail
step=$1; shift
start=$(date +%s%N)
"$@"
rc=$?
ms=$(( ($(date +%s%N) - start) / 1000000 ))
printf '[setup] %s: %d.%01d s%s\n' "$step" $((ms / 1000)) $((ms % 1000 / 100)) "$([ $rc -eq 0 ] || echo " (failed, exit $rc)")" >&2
exit $rc
