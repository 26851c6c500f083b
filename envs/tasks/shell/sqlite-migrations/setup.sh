# A database at schema version 2 (001 and 002 applied), with data; 003 is pending.
set -e
mkdir -p /tmp/m && cp migrations/001_init.sql migrations/002_order_dates.sql /tmp/m/
python3 migrate.py app.db /tmp/m > /dev/null
rm -rf /tmp/m
python3 - <<'PY'
import random, sqlite3
rng = random.Random(1066)
db = sqlite3.connect("app.db")
first = ["Ana", "Bram", "Chen", "Dara", "Emil", "Farah", "Goran", "Hana", "Ivo", "Jun", "Kai", "Lena"]
last = ["Moss", "Novak", "Okoye", "Perez", "Quinn", "Rossi", "Sato", "Tran"]
names = rng.sample([f"{f} {l}" for f in first for l in last], 15)
for i, n in enumerate(names, 1):
    db.execute("INSERT INTO customers (id, name) VALUES (?, ?)", (i, n))
ids = []
for oid in range(1, 121):
    db.execute("INSERT INTO orders (id, customer_id, total_cents, placed_on) VALUES (?,?,?,?)",
               (oid, rng.randrange(1, 16), rng.randrange(500, 90000), f"2024-0{rng.randrange(1, 10)}-{rng.randrange(1, 29):02d}"))
    ids.append(oid)
db.commit()
rng.shuffle(ids)
open("shipped.txt", "w").write("\n".join(map(str, sorted(ids[:70]))) + "\n")
open("cancelled.txt", "w").write("\n".join(map(str, sorted(ids[70:85]))) + "\n")
open("gold.txt", "w").write("\n".join(rng.sample(names, 4)) + "\n")
PY
