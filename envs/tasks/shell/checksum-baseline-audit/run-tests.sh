# audit.txt must list exactly what the deployment changed.
python3 /tests/check.py
