import os, random, subprocess, sys

REPO = "/app/shop"
BOT = "Release Bot <release-bot@shop.test>"

def git(*args):
    r = subprocess.run(["git", "-C", REPO, *args], capture_output=True, text=True)
    if r.returncode:
        raise AssertionError(f"git {' '.join(args)}: {r.stderr.strip()}")
    return r.stdout.strip()

try:
    version = f"1.{random.Random(1221).randrange(3, 40)}.0"
    assert git("rev-parse", "--abbrev-ref", "HEAD") == "main", "main is not checked out"
    assert git("status", "--porcelain") == "", "the working tree is not clean"
    assert subprocess.run(["git", "-C", REPO, "config", "user.name"], capture_output=True).returncode != 0, \
        "a git identity was written to the configuration"
    head = git("rev-parse", "main")
    parents = git("rev-list", "--parents", "-n1", head).split()[1:]
    assert len(parents) == 2 and parents[1] == git("rev-parse", "fix/rounding"), "main's tip is not the merge of fix/rounding"
    first = parents[0]
    p2 = git("rev-list", "--parents", "-n1", first).split()[1:]
    assert len(p2) == 2 and p2[1] == git("rev-parse", "feature/discounts"), "fix/rounding's merge does not follow the merge of feature/discounts"
    base = p2[0]
    assert git("log", "-1", "--format=%s", base) == f"Start {version} development", "the merges do not start from the original main"
    for br in ("feature/discounts", "fix/rounding"):
        assert git("rev-parse", f"{br}^") == base and git("rev-list", "--count", f"{base}..{br}") == "1", \
            f"{br} is not one commit on top of the original main"
    new = git("rev-list", f"{base}..main").split()
    assert len(new) == 4, f"expected 4 new commits on main, found {len(new)}"
    for c in new:
        who = git("log", "-1", "--format=%an <%ae>|%cn <%ce>", c)
        assert who == f"{BOT}|{BOT}", f"commit {c[:8]} was made by {who}"
    tag = f"v{version}"
    assert git("cat-file", "-t", tag) == "tag", f"{tag} is missing or not an annotated tag"
    assert git("rev-parse", f"{tag}^{{commit}}") == head, f"{tag} does not point at main"
    tagger = git("for-each-ref", "--format=%(taggername) %(taggeremail)", f"refs/tags/{tag}")
    assert tagger == BOT, f"{tag} was tagged by {tagger}"
    assert os.path.exists(f"{REPO}/discounts.py"), "discounts.py is not on main"
    assert "+ 0.5" in open(f"{REPO}/pricing.py").read(), "the rounding fix is not on main"
    t = subprocess.run([sys.executable, "-m", "unittest", "-q"], cwd=REPO, capture_output=True, text=True)
    assert t.returncode == 0, "the unit tests fail on main"
except Exception as e:
    sys.exit(f"FAIL: {e}")
print("PASS")
