import csv, json, os, random, socket, sqlite3, sys

def original():
    """The products and the batch exactly as setup.sh made them (same seed, same draws)."""
    rng = random.Random(8675)
    skus = [f"SKU-{rng.randrange(1000, 9999)}" for _ in range(12)]
    products = {s: (rng.randrange(199, 9999), rng.randrange(20, 60)) for s in skus}
    for _ in range(40):
        rng.choice(skus), rng.randrange(1, 4), rng.randrange(100, 999)
    rows = []
    for i in range(1001, 1061):
        sku = rng.choice(skus) if rng.random() > 0.1 else f"SKU-{rng.randrange(1000, 9999)}X"
        qty = rng.randrange(1, 5) if rng.random() > 0.08 else rng.choice([0, -2])
        rows.append((i, sku, qty, f"c{rng.randrange(100, 999)}"))
    return products, rows

def console(sql):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(5)
    s.connect("/tmp/dbshell.sock")
    s.sendall(json.dumps({"sql": sql}).encode())
    s.shutdown(socket.SHUT_WR)
    data = b""
    while True:
        b = s.recv(65536)
        if not b:
            break
        data += b
    return json.loads(data)

try:
    products, rows = original()
    good = [r for r in rows if r[1] in products and r[2] > 0]
    revenue = sum(q * products[s][0] for _, s, q, _ in good)
    sold = {}
    for _, s, q, _ in good:
        sold[s] = sold.get(s, 0) + q
    db = sqlite3.connect("file:/app/shop.db?mode=ro", uri=True, timeout=2)
    log = db.execute("SELECT batch, orders, rejected, revenue_cents FROM import_log").fetchall()
    assert log == [("incoming-orders", len(good), len(rows) - len(good), revenue)], f"import_log is {log}"
    got = db.execute("SELECT id, sku, qty, customer FROM orders WHERE id > 1000 ORDER BY id").fetchall()
    assert got == good, f"the batch's orders in shop.db: {len(got)} rows, expected {len(good)} (or they differ)"
    assert db.execute("SELECT count(*) FROM orders WHERE id <= 1000").fetchone()[0] == 40, "old orders changed"
    stock = dict(db.execute("SELECT sku, stock FROM products"))
    want = {s: st - sold.get(s, 0) for s, (_, st) in products.items()}
    assert stock == want, f"stock is {stock}, expected {want}"
    try:
        r = console("SELECT count(*) FROM orders")
    except OSError as e:
        raise AssertionError(f"the console on /tmp/dbshell.sock does not answer ({e})")
    assert r["ok"] and not r["in_transaction"], f"the console is not idle: {r}"
except Exception as e:
    sys.exit(f"FAIL: {e}")
print("PASS")
