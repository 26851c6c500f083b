# The outputs must be right, and the daemon still running with the job table that produced them.
python3 /tests/check.py
