#!/bin/bash
set -euo pipefail
cd /app
# Slow enough (3 s) for the recovery test to kill the sandbox while this runs.
touch /tmp/solve-started
sleep 3
{ echo "$GREETING $WHO"; cat seed.txt; } > out.txt
