# A git checkout with a short history: the last commit taught the tokenizer
# apostrophes, and lost the lower-casing on the way.
set -e
git init -q -b main
git config user.name "Dev"
git config user.email "dev@example.com"
commit() {  # $1: date, $2: message
    GIT_AUTHOR_DATE="$1" GIT_COMMITTER_DATE="$1" git commit -qm "$2"
}
mkdir -p /tmp/wordfreq-last
cp src/words.c README.md /tmp/wordfreq-last/
python3 - <<'PY'
from pathlib import Path
w = Path("src/words.c")
s = w.read_text()
start = s.index("        if (c == '\\'') {")
end = s.index("        if (n + 1 < size)\n            buf[n++] = (char)c;")
s = s[:start] + s[end:]
s = s.replace("buf[n++] = (char)c;", "buf[n++] = (char)tolower(c);")
s = s.replace(" && (is_word_char(c) || c == '\\''));", " && is_word_char(c));")
w.write_text(s)
r = Path("README.md")
t = r.read_text()
old = "A word is a run of ASCII letters and digits; an apostrophe between two such\ncharacters belongs to the word (`don't`, `rock'n'roll`).  Words"
assert old in t
r.write_text(t.replace(old, "A word is a run of ASCII letters and digits.  Words"))
PY
git add .gitignore Makefile README.md src
commit 2024-02-01T10:00:00Z "wordfreq: count words on stdin, most frequent first"
git add tests/run.sh tests/cases/basic.* tests/cases/top.* tests/cases/mixed-case.*
commit 2024-02-02T09:00:00Z "make test: input/output cases"
cp /tmp/wordfreq-last/words.c src/words.c
cp /tmp/wordfreq-last/README.md README.md
rm -rf /tmp/wordfreq-last
git add src/words.c README.md tests/cases/apostrophes.*
commit 2024-02-27T17:30:00Z "words: an apostrophe between two word characters belongs to the word"
git status --short
