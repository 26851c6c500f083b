import csv, glob, os, subprocess, sys

def fmt(cents, cur):
    sign = "-" if cents < 0 else ""
    whole, frac = divmod(abs(cents), 100)
    return f"{cur} {sign}{whole:,}.{frac:02d}"

def report(path):
    totals = {}
    for row in csv.DictReader(open(path)):
        totals[row["account"]] = totals.get(row["account"], 0) + int(row["amount_cents"])
    lines = [f"# {os.path.basename(path)} (ledger-report 0.4.2, EUR)"]
    lines += [f"{a:<12} {fmt(totals[a], 'EUR'):>18}" for a in sorted(totals)]
    lines.append(f"{'TOTAL':<12} {fmt(sum(totals.values()), 'EUR'):>18}")
    return "\n".join(lines) + "\n"

try:
    for name in ("moneyfmt-1.2.0", "ledgerkit-0.4.2"):
        assert glob.glob(f"/app/wheels/{name}-*.whl"), f"no {name} wheel in /app/wheels"
    py = "/app/.venv/bin/python"
    assert os.access(py, os.X_OK), "/app/.venv is not a virtual environment"
    r = subprocess.run([py, "-c", "import importlib.metadata as m; print(m.version('ledgerkit'), m.version('moneyfmt'))"],
                       capture_output=True, text=True)
    assert r.stdout.split() == ["0.4.2", "1.2.0"], f"the venv does not have ledgerkit 0.4.2 and moneyfmt 1.2.0: {r.stderr.strip()[-200:]}"
    assert os.access("/app/.venv/bin/ledger-report", os.X_OK), "ledger-report is not installed in the venv"
    r = subprocess.run(["python3", "-c", "import ledgerkit"], capture_output=True)
    assert r.returncode != 0, "ledgerkit was installed into the system Python"
    for q in (1, 2):
        p = f"/app/reports/q{q}.txt"
        assert os.path.exists(p), f"{p} is missing"
        assert open(p).read() == report(f"/app/data/2024-q{q}.csv"), f"{p} is not the EUR report of 2024-q{q}.csv"
except Exception as e:
    sys.exit(f"FAIL: {e}")
print("PASS")
