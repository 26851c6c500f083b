# History, authorship, tag and tests of /app/shop.
python3 /tests/check.py
