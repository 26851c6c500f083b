import os, subprocess, sys, tempfile

REPO = "/app/calc"

def git(*args):
    r = subprocess.run(["git", "-C", REPO, *args], capture_output=True, text=True)
    if r.returncode:
        raise AssertionError(f"git {' '.join(args)}: {r.stderr.strip()}")
    return r.stdout.strip()

def good_at(commit):
    with tempfile.TemporaryDirectory() as d:
        with open(os.path.join(d, "checksum.py"), "w") as f:
            f.write(git("show", f"{commit}:checksum.py") + "\n")
        return subprocess.run(["/app/check.sh", d], capture_output=True).returncode == 0

try:
    assert not os.path.exists(f"{REPO}/.git/BISECT_LOG"), "a bisect session is still in progress"
    assert git("rev-parse", "--abbrev-ref", "HEAD") == "main", "main is not checked out"
    assert git("status", "--porcelain") == "", "the working tree is not clean"
    parents = git("rev-list", "--parents", "-n1", "main").split()[1:]
    fix = git("rev-parse", "fix/checksum")
    assert len(parents) == 2 and parents[1] == fix, "main's tip is not a merge of fix/checksum"
    history = git("rev-list", "--reverse", "v1.0..main^1").split()
    assert len(history) == 25, f"main's original history changed ({len(history)} commits after v1.0)"
    culprit = next(c for c in history if not good_at(c))
    assert os.path.exists("/app/first_bad.txt"), "/app/first_bad.txt is missing"
    assert open("/app/first_bad.txt").read().strip() == culprit, "first_bad.txt does not name the first bad commit"
    assert git("cat-file", "-t", "regression-start") == "commit", "regression-start should be a lightweight tag"
    assert git("rev-parse", "regression-start") == culprit, "regression-start is not on the first bad commit"
    assert parents[0] == history[-1], "the merge is not on top of the original main"
    assert git("rev-parse", "fix/checksum^") == history[-1], "fix/checksum is not one commit on top of main"
    msg = git("log", "-1", "--format=%B", fix)
    assert msg.startswith("Revert") and culprit in msg, "fix/checksum's commit is not a revert of the culprit"
    assert subprocess.run(["/app/check.sh", REPO], capture_output=True).returncode == 0, "check.sh fails on main"
except Exception as e:
    sys.exit(f"FAIL: {e}")
print("PASS")
