# A git checkout with a short history; the last commit added the tests of the planned option.
set -e
git init -q -b main
git config user.name "Dev"
git config user.email "dev@example.com"
commit() {  # $1: date, $2: message
    GIT_AUTHOR_DATE="$1" GIT_COMMITTER_DATE="$1" git commit -qm "$2"
}
mkdir -p /tmp/logstats-last
cp tests/test_filters.py tests/test_cli.py /tmp/logstats-last/
python3 - <<'PY'
from pathlib import Path
f = Path("tests/test_filters.py")
s = f.read_text()
s = s.replace("from logstats.filters import by_method, by_prefix, by_status, top_paths",
              "from logstats.filters import by_method, by_prefix, top_paths")
f.write_text(s[: s.index("    def test_status_exact")].rstrip() + "\n\n\nif __name__ == \"__main__\":\n    unittest.main()\n")
c = Path("tests/test_cli.py")
s = c.read_text()
c.write_text(s[: s.index("    def test_status_filter")].rstrip() + "\n\n\nif __name__ == \"__main__\":\n    unittest.main()\n")
PY
git add .gitignore logstats
commit 2024-08-01T10:00:00Z "logstats: top paths, by method and path prefix"
git add README.md logs tests
commit 2024-08-05T16:20:00Z "README, a sample log, tests"
cp /tmp/logstats-last/test_filters.py /tmp/logstats-last/test_cli.py tests/
rm -rf /tmp/logstats-last
git add tests
commit 2024-08-13T09:45:00Z "Tests for the planned --status filter"
git status --short
