# Every artifact and the checksum file carry a valid signature, the passphrase is gone,
# and an agent still holds the release key.
python3 /tests/check.py
