# tallyd must still run and hold exactly the tally of the three stations.
python3 /tests/check.py
