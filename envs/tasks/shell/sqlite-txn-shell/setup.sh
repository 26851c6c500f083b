# A shop database (products with stock, past orders) and a new batch of orders to import.
python3 - <<'PY'
import csv, random, sqlite3
rng = random.Random(8675)
db = sqlite3.connect("shop.db")
db.executescript("""
CREATE TABLE products (sku TEXT PRIMARY KEY, name TEXT NOT NULL, price_cents INTEGER NOT NULL, stock INTEGER NOT NULL);
CREATE TABLE orders (id INTEGER PRIMARY KEY, sku TEXT NOT NULL REFERENCES products(sku), qty INTEGER NOT NULL, customer TEXT NOT NULL);
CREATE TABLE import_log (batch TEXT PRIMARY KEY, orders INTEGER NOT NULL, rejected INTEGER NOT NULL, revenue_cents INTEGER NOT NULL);
""")
skus = [f"SKU-{rng.randrange(1000, 9999)}" for _ in range(12)]
for s in skus:
    db.execute("INSERT INTO products VALUES (?,?,?,?)", (s, f"item {s[-4:]}", rng.randrange(199, 9999), rng.randrange(20, 60)))
for i in range(1, 41):
    db.execute("INSERT INTO orders VALUES (?,?,?,?)", (i, rng.choice(skus), rng.randrange(1, 4), f"c{rng.randrange(100, 999)}"))
db.commit()
with open("incoming-orders.csv", "w", newline="") as f:
    w = csv.writer(f)
    w.writerow(["id", "sku", "qty", "customer"])
    for i in range(1001, 1061):
        sku = rng.choice(skus) if rng.random() > 0.1 else f"SKU-{rng.randrange(1000, 9999)}X"
        qty = rng.randrange(1, 5) if rng.random() > 0.08 else rng.choice([0, -2])
        w.writerow([i, sku, qty, f"c{rng.randrange(100, 999)}"])
PY
