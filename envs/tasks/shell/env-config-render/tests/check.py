import os, sys

def load(path, env):
    for line in open(path):
        line = line.strip()
        if line and not line.startswith("#"):
            k, v = line.split("=", 1)
            env[k] = v

try:
    env = {}
    load("/app/envs/base.env", env)
    load("/app/envs/staging.env", env)
    env.update(APP_RELEASE=open("/app/RELEASE").read().strip(), APP_LOG_LEVEL="debug", PROXY_MAX_FAILS="5")
    del env["APP_DEBUG_TOKEN"]
    e = env
    app = f"""[app]
name = {e['APP_NAME']}
environment = staging
release = {e['APP_RELEASE']}
log_level = debug
workers = {e['APP_WORKERS']}
debug_token = 

[database]
url = postgres://{e['DB_USER']}:{e['DB_PASSWORD']}@{e['DB_HOST']}:{e['DB_PORT']}/{e['DB_NAME']}
pool = {e['DB_POOL']}
"""
    proxy = f"""upstream {e['APP_NAME']} {{
    server 127.0.0.1:{e['APP_PORT']} max_fails=5;
}}
server {{
    listen {e['PROXY_PORT']};
    server_name {e['PUBLIC_HOST']};
    location / {{ proxy_pass http://{e['APP_NAME']}; }}
}}
"""
    out = "/app/out/staging"
    for name, want in (("app.ini", app), ("proxy.conf", proxy)):
        p = f"{out}/{name}"
        assert os.path.exists(p), f"{p} is missing"
        got = open(p).read()
        if got != want:
            bad = [f"{g!r} (expected {w!r})" for g, w in zip(got.splitlines(), want.splitlines()) if g != w]
            raise AssertionError(f"{p} differs: {bad[:2] or 'length'}")
    envfile = f"{out}/ENV"
    assert os.path.exists(envfile), f"{envfile} is missing"
    want_env = "".join(f"{k}={v}\n" for k, v in sorted(env.items()))
    assert open(envfile).read() == want_env, "ENV does not list exactly the staging environment"
except Exception as e:
    sys.exit(f"FAIL: {e}")
print("PASS")
