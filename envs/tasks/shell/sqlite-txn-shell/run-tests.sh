# The batch must be committed to shop.db, validated and accounted for, and the console alive and idle.
python3 /tests/check.py
