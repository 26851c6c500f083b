# A clean build of the working tree, then the shipped cases (as shipped, at
# /tests/repo_tests) and the hidden ones (/tests/cases), on a scratch copy.
set -euo pipefail
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
cp -a . "$scratch/"
rm -rf "$scratch/tests" "$scratch/.git"
cp -a /tests/repo_tests "$scratch/tests"
cd "$scratch"
make -s clean
make -s wordfreq
bash tests/run.sh tests/cases
bash tests/run.sh /tests/cases
