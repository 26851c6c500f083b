#!/bin/bash
# Reward 1 iff the copy is byte-exact (its SHA-256 is the one the task shipped).
mkdir -p /logs/verifier
want=$(cat /tests/blob.sha256)
got=$(sha256sum /work/out/blob.bin | cut -d' ' -f1)
cp /work/out/blob.bin /logs/verifier/blob.bin  # downloaded back by Harbor: checked byte for byte
if [ "$want" = "$got" ]; then echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi
