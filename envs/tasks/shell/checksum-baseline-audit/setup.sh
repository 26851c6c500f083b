# A site tree, and a deployment plan (modify / add / delete) nobody can see in advance.
python3 - <<'PY'
import os, random
rng = random.Random(1999)
words = "alpha beta gamma delta omega sigma kappa lambda theta zeta".split()
files = []
for d in ["", "css", "js", "img", "docs", "docs/api"]:
    os.makedirs(os.path.join("site", d), exist_ok=True)
    for _ in range(rng.randrange(3, 7)):
        name = os.path.join(d, f"{rng.choice(words)}-{rng.randrange(100, 999)}.{rng.choice(['html', 'txt', 'json'])}")
        if name in files:
            continue
        files.append(name)
        with open(os.path.join("site", name), "w") as f:
            f.write(" ".join(rng.choice(words) for _ in range(rng.randrange(10, 80))) + "\n")
rng.shuffle(files)
modify, delete = files[:5], files[5:8]
# One "modification" rewrites a file with identical content: not a change.
plan = ["cd site"]
for i, name in enumerate(modify):
    if i == 0:
        plan.append(f"cp '{name}' /tmp/.same && cat /tmp/.same > '{name}' && rm /tmp/.same")
    else:
        plan.append(f"echo 'patched {rng.randrange(10**6)}' >> '{name}'")
for name in delete:
    plan.append(f"rm '{name}'")
for _ in range(3):
    d = rng.choice(["", "css", "js", "docs"])
    plan.append(f"echo 'new {rng.randrange(10**6)}' > '{os.path.join(d, f'new-{rng.randrange(100, 999)}.txt')}'")
# A file moved between directories: deleted at one path, added at another.
src = files[8]
plan.append(f"mv '{src}' 'docs/api/{os.path.basename(src)}'")
with open(".deploy-plan.sh", "w") as f:
    f.write("\n".join(plan) + "\n")
PY
