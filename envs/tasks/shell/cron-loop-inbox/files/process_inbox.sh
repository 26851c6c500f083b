#!/bin/bash
# One pass over the inbox: every *.csv file there is converted into a
# per-file summary in outbox/ (rows, sum of the 2nd column), logged, and
# moved into archive/.  Safe to run repeatedly (meant to be run periodically).
set -u
cd "$(dirname "$0")"
mkdir -p outbox archive
for f in inbox/*.csv; do
    [ -e "$f" ] || continue
    name=$(basename "$f" .csv)
    rows=$(grep -c . "$f")
    total=$(awk -F, '{s += $2} END {print s + 0}' "$f")
    echo "$name rows=$rows total=$total" > "outbox/$name.summary"
    echo "$(date -u +%FT%TZ) processed $name" >> processed.log
    mv "$f" archive/
done
