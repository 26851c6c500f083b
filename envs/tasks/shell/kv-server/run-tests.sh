# The server must still run and hold every seed record plus the right total.
python3 /tests/check.py
