# The staging environment file, with credentials nobody could guess, and the release id.
python3 - <<'PY'
import random
rng = random.Random(6502)
pw = "".join(rng.choice("abcdefghjkmnpqrstuvwxyz23456789") for _ in range(20))
with open("envs/staging.env", "w") as f:
    f.write(f"""# Staging overrides (loaded after base.env).
APP_ENV=staging
APP_WORKERS={rng.randrange(3, 9)}
DB_HOST=db-{rng.randrange(10, 99)}.staging.internal
DB_USER=orders_stg
DB_PASSWORD={pw}
DB_POOL={rng.randrange(10, 30)}
PUBLIC_HOST=staging-{rng.randrange(100, 999)}.orders.example
""")
with open("RELEASE", "w") as f:
    f.write(f"2024.{rng.randrange(1, 12)}.{rng.randrange(1, 30)}-rc{rng.randrange(1, 5)}\n")
PY
