import csv, hashlib, io, os, sqlite3, sys

try:
    db = sqlite3.connect("file:/app/app.db?mode=ro", uri=True)
    mig = db.execute("SELECT version, name, sha256 FROM schema_migrations ORDER BY version").fetchall()
    assert [v for v, _, _ in mig] == [1, 2, 3, 4], f"applied migrations: {[v for v, _, _ in mig]}"
    for v, name, h in mig:
        p = f"/app/migrations/{name}"
        assert os.path.exists(p) and hashlib.sha256(open(p).read().encode()).hexdigest() == h, f"{name} changed or is missing"
    cols = {r[1]: r for r in db.execute("PRAGMA table_info(orders)")}
    assert "status" in cols and cols["status"][3] == 1 and cols["status"][4] == "'open'", "orders.status is not TEXT NOT NULL DEFAULT 'open'"
    idx = {r[1]: r for r in db.execute("PRAGMA index_list(orders)")}
    assert "idx_orders_customer" in idx, "index idx_orders_customer is missing"
    assert [r[2] for r in db.execute("PRAGMA index_info(idx_orders_customer)")] == ["customer_id"], "idx_orders_customer is not on customer_id"
    assert "tier" in {r[1] for r in db.execute("PRAGMA table_info(customers)")}, "003 was not applied"
    shipped = {int(x) for x in open("/app/shipped.txt").read().split()}
    cancelled = {int(x) for x in open("/app/cancelled.txt").read().split()}
    gold = {l.strip() for l in open("/app/gold.txt") if l.strip()}
    orders = db.execute("SELECT id, customer_id, total_cents, status FROM orders").fetchall()
    assert len(orders) == 120, "orders were added or lost"
    for oid, _, _, st in orders:
        want = "shipped" if oid in shipped else "cancelled" if oid in cancelled else "open"
        assert st == want, f"order {oid} has status {st!r}, expected {want!r}"
    custs = db.execute("SELECT id, name, tier FROM customers ORDER BY name").fetchall()
    for _, name, tier in custs:
        assert tier == ("gold" if name in gold else "standard"), f"{name} has tier {tier}"
    out = io.StringIO()
    w = csv.writer(out)
    w.writerow(["customer", "tier", "open_orders", "shipped_cents"])
    for cid, name, tier in custs:
        mine = [o for o in orders if o[1] == cid]
        w.writerow([name, tier, sum(1 for o in mine if o[3] == "open"), sum(o[2] for o in mine if o[3] == "shipped")])
    assert os.path.exists("/app/report.csv"), "/app/report.csv is missing"
    assert open("/app/report.csv", newline="").read() == out.getvalue(), "report.csv is wrong"
except Exception as e:
    sys.exit(f"FAIL: {e}")
print("PASS")
