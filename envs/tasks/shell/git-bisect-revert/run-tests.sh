# The recorded culprit must be the real first bad commit, and main must be fixed by a merged revert.
python3 /tests/check.py
