# The installed binary and the report must carry the ticket's BUILD_ID and UNIT.
python3 /tests/check.py
