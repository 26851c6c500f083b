#!/bin/bash
# Harbor's verifier: reward 1 iff /app/out.txt is exactly what the instruction asks for.
expected=$(printf 'hello world\nseed line\n')
mkdir -p /logs/verifier
if [ "$(cat /app/out.txt 2>/dev/null)" = "$expected" ] && [ "$(cat /app/built.txt)" = "built by world" ]; then
  echo 1 > /logs/verifier/reward.txt
else
  echo "out.txt: $(cat /app/out.txt 2>&1)"; echo 0 > /logs/verifier/reward.txt
fi
