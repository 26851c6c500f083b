# Verifier shared by the mixed suite's Python tasks: the repository's tests as
# shipped (/tests/repo_tests, so edits to them do not count) plus the task's
# hidden tests (/tests/test_hidden.py), run on a scratch copy of the working
# tree, without its git metadata or byte-code.
set -euo pipefail
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
cp -a . "$scratch/"
rm -rf "$scratch/tests" "$scratch/.git"
cp -a /tests/repo_tests "$scratch/tests"
cp /tests/test_hidden.py "$scratch/tests/test_zz_hidden.py"
find "$scratch" -name __pycache__ -prune -exec rm -rf {} +
cd "$scratch"
python3 -B -m unittest discover -s tests
