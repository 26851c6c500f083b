# New entries written with mode 600, kept entries untouched, INDEX exact.
python3 /tests/check.py
