# The router must still route both prefixes (its routes exist only in memory) to live backends.
python3 /tests/check.py
