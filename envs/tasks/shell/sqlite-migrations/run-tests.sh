# Schema at version 4 through migrate.py, backfill done, report right.
python3 /tests/check.py
