# A git checkout with a short history.
set -e
git init -q -b main
git config user.name "Dev"
git config user.email "dev@example.com"
commit() {  # $1: date, $2: message
    GIT_AUTHOR_DATE="$1" GIT_COMMITTER_DATE="$1" git commit -qm "$2"
}
git add .gitignore README.md vertools/__init__.py vertools/semver.py
commit 2023-11-02T10:00:00Z "semver: parse versions and order them"
git add vertools/constraints.py vertools/__main__.py
commit 2023-11-06T15:45:00Z "Constraints, and the sort/latest commands"
git add tests/test_constraints.py
commit 2023-11-07T09:10:00Z "Tests for constraints"
git add docs tests/test_semver.py
commit 2024-01-15T11:30:00Z "Document precedence; tests for it (pre-releases are ordered wrongly)"
git status --short
