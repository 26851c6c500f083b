# The repository's own tests, unchanged, then hidden ones.
set -e
cp /tests/test_hidden.py tests/test_hidden_verifier.py
trap 'rm -f tests/test_hidden_verifier.py' EXIT
python3 -m unittest discover -s tests
