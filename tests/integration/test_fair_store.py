"""Fair store access (issue 17, "one tenant wedges everyone"), against a real crabd and two users.

User A verifies a large checkpoint of theirs and, while that runs, deletes
one; user B (root here) takes a checkpoint meanwhile.  With a store lock that
verify held shared for its whole run and a writer-preferring queue, B's
checkpoint waited for A's verify to end; now it finishes while A's verify is
still hashing.
"""

from __future__ import annotations

import contextlib
import grp
import os
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from crabd.sdk import Client, EmbeddedDaemon, Sandbox
from tests.integration.conftest import USER_IN_GROUP, run_as

#: Size of A's checkpointed file: large enough that verifying it takes seconds here.
BIG_MB = 1024


def test_a_long_verify_and_a_delete_do_not_hold_up_another_users_checkpoint(
    daemon: EmbeddedDaemon,
    client: Client,
    make_sandbox: Callable[..., Sandbox],
    users: dict[str, tuple[int, int]],
) -> None:
    os.chmod(daemon.base, 0o711)  # let the other user reach the socket (it stays 0660 root:crab)
    uid, gid = users[USER_IN_GROUP]
    groups = [grp.getgrnam("crab").gr_gid]
    b = make_sandbox("busybox", name="fair-b")
    b.run(["sh", "-c", "echo b > /b.txt"])
    marker = Path(f"/tmp/crab-fair-{uuid.uuid4().hex}")
    try:
        setup = run_as(
            uid,
            gid,
            groups,
            daemon.socket,
            f"""
            sb = c.create("busybox", name="fair-a")
            w = sb.run(["sh", "-c", "dd if=/dev/urandom of=/big bs=1048576 count={BIG_MB} 2>&1"], timeout=300)
            out["write"] = ["ok", w.exit_code, w.text[-300:]]
            attempt("big", lambda: sb.checkpoint("big").id)
            sb.run(["sh", "-c", "echo small > /small"])
            attempt("small", lambda: sb.checkpoint("small").id)
            """,
        )
        assert setup["write"][:2] == ["ok", 0], setup  # type: ignore[index]
        big = setup["big"][1]  # type: ignore[index]
        result: dict[str, object] = {}

        def tenant_a() -> None:
            result.update(
                run_as(
                    uid,
                    gid,
                    groups,
                    daemon.socket,
                    f"""
                    import threading, time
                    marks = {{}}
                    def verify():
                        marks["verify_start"] = time.time()
                        r = c.verify()
                        marks["verify_end"] = time.time()
                        marks["verify_ok"] = r.ok
                        marks["verify_bytes"] = r.bytes_checked
                    def delete():
                        with Client({str(daemon.socket)!r}) as c2:
                            marks["delete_start"] = time.time()
                            c2.delete_checkpoint({big!r})
                            marks["delete_end"] = time.time()
                    tv = threading.Thread(target=verify)
                    tv.start()
                    time.sleep(0.1)
                    td = threading.Thread(target=delete)
                    td.start()
                    time.sleep(0.1)
                    open({str(marker)!r}, "w").close()
                    tv.join()
                    td.join()
                    out["marks"] = ["ok", marks]
                    """,
                )
            )

        a = threading.Thread(target=tenant_a)
        a.start()
        deadline = time.monotonic() + 120
        while not marker.exists() and a.is_alive() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert marker.exists(), result
        b_start = time.time()
        b.checkpoint("b-during-a")
        b_end = time.time()
        a.join(timeout=300)
        marks: dict[str, float] = result["marks"][1]  # type: ignore[index]
        took = marks["verify_end"] - marks["verify_start"]
        timeline = {k: round(v - b_start, 3) for k, v in marks.items() if isinstance(v, float)}  # 0: B starts
        # The scenario held: B started while A's verify was running and a delete had been sent.
        assert marks["verify_start"] < marks["delete_start"] < b_start < marks["verify_end"], timeline
        assert b_end < marks["verify_end"], (
            f"B's checkpoint ({b_end - b_start:.2f}s) waited for A's verify ({took:.2f}s) and delete: {timeline}"
        )
        assert marks["delete_end"] < marks["verify_end"]  # the delete did not wait for the verify either
        assert marks["verify_ok"] is True and marks["verify_bytes"] >= BIG_MB << 20
        assert client.verify().ok
        stats = client.engine_status().stats["store_lock"]
        assert stats["exclusive"]["count"] >= 1 and stats["shared"]["count"] >= 1
    finally:
        with contextlib.suppress(Exception):
            client.get("fair-a").remove()
        marker.unlink(missing_ok=True)
