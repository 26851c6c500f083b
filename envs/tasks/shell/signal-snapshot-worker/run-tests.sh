# The snapshot must cover all nine files, and the live worker must still hold the same balances.
python3 /tests/check.py
