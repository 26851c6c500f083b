import sys
import urllib.request

def get(key):
    return urllib.request.urlopen(f"http://127.0.0.1:7070/{key}", timeout=5).read().decode()

try:
    seed = dict(line.strip().split(",") for line in open("/app/seed.csv") if line.strip())
    for k, v in seed.items():
        assert get(k) == v, f"{k}: server has {get(k)!r}, seed says {v!r}"
    total = sum(int(v) for v in seed.values())
    assert get("total") == str(total), f"total on the server is {get('total')!r}, expected {total}"
    assert open("/app/answer.txt").read().strip() == str(total), "answer.txt is wrong"
except Exception as e:
    sys.exit(f"FAIL: {e}")
print("PASS")
