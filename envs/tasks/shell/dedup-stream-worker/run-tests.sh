# unique.jsonl and the stats must be exact, and the worker alive: a replayed batch must add nothing.
python3 /tests/check.py
