# Make the repository a git checkout, so the agent can diff its changes.
git init -q -b main
git config user.name "Dev"
git config user.email "dev@example.com"
git add -A
git commit -qm "Initial import"
