# A git checkout with a short history; the last commit added the failing test.
set -e
git init -q -b main
git config user.name "Dev"
git config user.email "dev@example.com"
commit() {  # $1: date, $2: message
    GIT_AUTHOR_DATE="$1" GIT_COMMITTER_DATE="$1" git commit -qm "$2"
}
cp tests/test_text.py /tmp/test_text.py.last
python3 - <<'PY'
from pathlib import Path
p = Path("tests/test_text.py")
s = p.read_text()
start = s.index("    def test_accented_letters_keep_their_base_letter")
end = s.index("class ExcerptTest")
p.write_text(s[:start].rstrip() + "\n\n\n" + s[end:])
PY
git add .gitignore README.md blogkit
commit 2024-01-05T10:00:00Z "blogkit: posts, slugs and the post list"
git add content/2024-01-welcome.md tests
commit 2024-01-08T09:12:00Z "First post, and tests"
git add content/2024-02-creme-brulee.md content/2024-03-postmortem.md
commit 2024-03-18T17:40:00Z "Two posts"
git add content
mv /tmp/test_text.py.last tests/test_text.py
git add tests/test_text.py
commit 2024-04-23T08:05:00Z "Zürich offsite notes; test for accented titles (their URLs are mangled)"
git status --short
