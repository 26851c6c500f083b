# A git checkout with a short history; a refactoring of the loader swapped the precedence.
set -e
git init -q -b main
git config user.name "Dev"
git config user.email "dev@example.com"
commit() {  # $1: date, $2: message
    GIT_AUTHOR_DATE="$1" GIT_COMMITTER_DATE="$1" git commit -qm "$2"
}
cp svcconf/loader.py /tmp/loader.py.last
python3 - <<'PY'
from pathlib import Path
p = Path("svcconf/loader.py")
s = p.read_text()
old = "    merged = dict(DEFAULTS, **env_values)\n    merged.update(file_values)\n"
assert s.count(old) == 1
p.write_text(s.replace(old, "    merged = {**DEFAULTS, **file_values, **env_values}\n"))
PY
git add .gitignore README.md svcconf docs
commit 2024-05-02T09:30:00Z "Load settings from defaults, INI files and SVC_* variables"
git add tests config/service.ini
commit 2024-05-03T14:10:00Z "Tests for the loader; example config"
git add config/production.ini
commit 2024-05-21T10:00:00Z "Production config"
mv /tmp/loader.py.last svcconf/loader.py
git add svcconf/loader.py
commit 2024-06-04T15:20:00Z "loader: merge into one dict in place (no temporary dicts)"
git status --short
