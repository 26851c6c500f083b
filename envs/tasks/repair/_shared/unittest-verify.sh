# Verifier shared by the repair tasks: the repository's own tests as shipped
# (/tests/repo_tests: edits to them do not count), plus the task's hidden
# tests (/tests/test_hidden.py), run against a scratch copy of the repo.
set -euo pipefail
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cp -a . "$work/"
rm -rf "$work/tests"
cp -a /tests/repo_tests "$work/tests"
cp /tests/test_hidden.py "$work/tests/test_hidden_verifier.py"
find "$work" -name __pycache__ -prune -exec rm -rf {} +
cd "$work"
python3 -B -m unittest discover -s tests
