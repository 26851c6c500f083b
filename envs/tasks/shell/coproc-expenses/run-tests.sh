# totals.txt must match both weeks converted at the given rates, and the accumulator must still run.
python3 /tests/check.py
