import json, os, sys, urllib.request

def get(path):
    return urllib.request.urlopen("http://127.0.0.1:8800" + path, timeout=5).read()

try:
    want_routes = {"/api": "http://127.0.0.1:9102", "/docs": "http://127.0.0.1:9101"}
    pages = open("/app/sites/docs/INDEX").read().split()
    for p in pages + ["version.json"]:
        assert os.path.exists(f"/app/fetched/{p}"), f"/app/fetched/{p} is missing"
    for p in pages:
        assert open(f"/app/fetched/{p}", "rb").read() == open(f"/app/sites/docs/{p}", "rb").read(), f"fetched/{p} differs"
    version = open("/app/sites/api/v1/version.json", "rb").read()
    assert open("/app/fetched/version.json", "rb").read() == version, "fetched/version.json differs"
    assert os.path.exists("/app/routes.json") and json.load(open("/app/routes.json")) == want_routes, "routes.json is wrong"
    try:
        routes = json.loads(get("/_admin/routes"))
    except OSError as e:
        raise AssertionError(f"the router on port 8800 does not answer ({e})")
    assert routes == want_routes, f"the router's routes are {routes}"
    hits = json.loads(get("/_admin/stats"))
    assert hits.get("/docs", 0) >= len(pages), f"the router forwarded only {hits.get('/docs', 0)} /docs requests"
    assert get(f"/docs/{pages[0]}") == open(f"/app/sites/docs/{pages[0]}", "rb").read(), "/docs is not served through the router"
    assert get("/api/v1/version.json") == version, "/api is not served through the router"
except Exception as e:
    sys.exit(f"FAIL: {e}")
print("PASS")
