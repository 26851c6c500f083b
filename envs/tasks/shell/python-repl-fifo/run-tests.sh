# The summary must be right, the batches gone, and the REPL still alive holding the data.
python3 /tests/check.py
