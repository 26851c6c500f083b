# The rendered files must carry the staging values plus the rollout adjustments.
python3 /tests/check.py
