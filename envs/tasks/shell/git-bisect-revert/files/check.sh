#!/bin/bash
# check.sh [REPO]: the checksum regression test.  Exit 0 when checksum.py in
# REPO (default: the current directory) computes the reference check digits.
cd "${1:-.}" || exit 2
python3 -B - <<'PY'
import sys
sys.path.insert(0, ".")
from checksum import check_digit
ref = {"7992739871": 3, "455673758689985": 5, "123456781234567": 0, "401288888888188": 1, "18": 2}
bad = {k: check_digit(k) for k, v in ref.items() if check_digit(k) != v}
print("ok" if not bad else f"wrong check digits: {bad}")
sys.exit(1 if bad else 0)
PY
