#!/bin/bash
set -euo pipefail
mkdir -p /work/out
cp /solution/blob.bin /work/out/blob.bin
