# Every file of every wave processed (by the loop), the right grand total, and the loop still running.
python3 /tests/check.py
