"""After kill -9, crabd serves before it has adopted its sandboxes, and then adopts each correctly.

``coordinator/adoption.py``: a restarted crabd answers at once; each sandbox
is taken over in the background, and a request for one waits for that
sandbox's adoption.  Each adoption is held open here by a test-only delay
point (``CRAB_DELAY_AT=adopt.sandbox:<s>``, ``util/faults.py``), so that
"served before adoption finished" is observable, not a race.
"""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path

from crabd.errors import CrabError
from crabd.sdk import Client
from crabd.util.faults import CRASH_ENV, DELAY_ENV
from tests.conftest import have_docker, have_root, require
from tests.integration.conftest import container_running, kill_container, start_kept, start_kept_serving

#: Each sandbox's adoption waits this long first: far longer than crabd takes to answer once serving.
DELAY_S = 4.0


def _runc_status(container_id: str) -> str:
    from crabd.backends.runc.cleanup import Layout
    from crabd.backends.runc.cli import Runc

    st = Runc(Layout().runc_root).state(container_id)
    return st.status.value if st is not None else "gone"


def _log_since(log: Path, offset: int) -> list[dict[str, object]]:
    with open(log, "rb") as f:
        f.seek(offset)
        lines = f.read().decode(errors="replace").splitlines()
    out = []
    for line in lines:
        with contextlib.suppress(ValueError):
            out.append(json.loads(line))
    return out


def test_killed_crabd_serves_first_and_adopts_every_sandbox(kept_state: Path) -> None:
    require(have_root(), "needs root")
    require(have_docker(), "needs a reachable Docker engine (run `make setup`)")
    d = start_kept(kept_state)
    try:
        with Client(d.socket) as c:
            boxes = {name: c.create("busybox", name=name) for name in ("one", "two", "three", "frozen", "doomed")}
            for sb in boxes.values():
                sb.run(["sh", "-c", f"echo {sb.name} > /root/name"])
        d.close()  # not ephemeral: the sandboxes run on
        # crabd dies with the sandbox "frozen" frozen for its checkpoint (the thaw never runs).
        d = start_kept(kept_state, **{CRASH_ENV: "checkpoint.frozen"})
        with Client(d.socket) as c, contextlib.suppress(CrabError):  # crabd is killed under the call
            c.get("frozen").checkpoint(kind="fs")
        assert d.proc is not None
        d.proc.wait(60)
        d.close()
        frozen_cid = boxes["frozen"].info.container_id
        assert _runc_status(frozen_cid) == "paused", "the crash point did not leave the sandbox frozen"
        # One dies while crabd is down.
        kill_container(boxes["doomed"].info.container_id)

        log = d.log_file
        offset = log.stat().st_size
        t0 = time.monotonic()
        d = start_kept_serving(kept_state, **{DELAY_ENV: f"adopt.sandbox:{DELAY_S}"})
        serving_s = time.monotonic() - t0
        with Client(d.socket) as c:
            assert c.status().sandboxes == 5  # served...
            msgs = [e["msg"] for e in _log_since(log, offset)]
            assert "crabd ready" in msgs
            assert "adoption done" not in msgs, f"adopted before serving ({serving_s:.1f} s to answer)"
            # ...while no sandbox is adopted yet; a listing does not wait: the registry's states.
            assert {sb.name for sb in c.list()} == set(boxes)
            # A request for a sandbox waits for that sandbox's adoption, which thawed it.
            got = c.get("frozen")
            assert got.info.state == "running"
            assert _runc_status(frozen_cid) == "running"
            assert got.run(["cat", "/root/name"], timeout=20).stdout == b"frozen\n"

            d.wait_settled()
            events = _log_since(log, offset)
            [done] = [e for e in events if e["msg"] == "adoption done"]
            assert (done["adopted"], done["dead"], done["failed"]) == (4, 1, 0), done
            ready_at = next(e["ts"] for e in events if e["msg"] == "crabd ready")
            assert isinstance(ready_at, float) and isinstance(done["ts"], float) and ready_at < done["ts"]
            # Every sandbox adopted as it was: the running ones usable, the dead one reported dead.
            for name in boxes:
                again = c.get(name)
                if name == "doomed":
                    assert again.info.state == "dead", again.info
                    continue
                assert again.info.state == "running" and container_running(again.info.container_id)
                assert again.run(["cat", "/root/name"], timeout=20).stdout == f"{name}\n".encode()
            assert {sb.info.state for sb in c.list() if sb.name != "doomed"} == {"running"}
    finally:
        d.close()
