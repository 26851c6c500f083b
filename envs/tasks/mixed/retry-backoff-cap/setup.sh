# A git checkout with a short history; an "optimisation" of the backoff broke the cap.
set -e
git init -q -b main
git config user.name "Dev"
git config user.email "dev@example.com"
commit() {  # $1: date, $2: message
    GIT_AUTHOR_DATE="$1" GIT_COMMITTER_DATE="$1" git commit -qm "$2"
}
cp pollkit/backoff.py /tmp/backoff.py.last
sed -i "s/        delay \*= factor/        delay = min(delay * factor, cap)/" pollkit/backoff.py
grep -q 'min(delay \* factor, cap)' pollkit/backoff.py
git add .gitignore README.md pollkit/__init__.py pollkit/backoff.py pollkit/retry.py pollkit/poll.py
commit 2024-09-02T08:30:00Z "pollkit: retry with capped exponential backoff, wait_until"
git add tests
commit 2024-09-02T12:00:00Z "Tests"
mv /tmp/backoff.py.last pollkit/backoff.py
git add pollkit/backoff.py
commit 2024-09-19T14:40:00Z "backoff: clamp once, up front (fewer min() calls)"
git status --short
