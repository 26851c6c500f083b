# Wheels built, installed into the venv only, and both reports produced by it in EUR.
python3 /tests/check.py
