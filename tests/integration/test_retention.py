"""Retention on the real daemon: policies, pins, background thinning, `checkpoint ls` reasons, exact restores."""

from __future__ import annotations

import time

from crabd.sdk import Client, EmbeddedDaemon, RetentionPolicy
from tests.integration.conftest import Crabctl, js


def _files(client: Client, name: str) -> str:
    res = client.get(name).run(["sh", "-c", "cat /f* 2>/dev/null | sort | tr '\\n' ' '"])
    assert res.exit_code == 0, res.stderr
    return res.stdout.decode().strip()


def test_retention_thins_by_policy_and_keeps_lines_pins_and_exact_restores(
    daemon: EmbeddedDaemon, crabctl: Crabctl
) -> None:
    with Client(daemon.socket) as c:
        sb = c.create("busybox", name="ret")
        try:
            # A process whose memory matters: full checkpoints must bring it back after thinning.
            sb.run(["sh", "-c", "sleep 100000 >/dev/null 2>&1 &"])
            expected: dict[str, str] = {}
            for i in range(8):
                sb.run(["sh", "-c", f"echo {i} > /f{i}"])
                ck = sb.checkpoint(kind="full" if i % 2 else "fs")
                expected[ck.id] = " ".join(str(j) for j in range(i + 1))
            before = js(crabctl, "checkpoint", "ls", "ret")
            assert len(before) == 9 and all("no-policy" in k["kept_for"] for k in before)
            assert before[0]["kept_for"] == ["root", "no-policy"] and before[-1]["kept_for"] == ["head", "no-policy"]

            # Bad input changes nothing.
            bad = crabctl("retention", "set", "ret")
            assert bad.returncode == 2 and "--keep-last" in bad.stderr and "Traceback" not in bad.stderr
            bad = crabctl("retention", "set", "ret", "--keep-last", "-1")
            assert bad.returncode != 0
            assert len(js(crabctl, "checkpoint", "ls", "ret")) == 9

            pinned = before[2]["id"]
            assert js(crabctl, "checkpoint", "pin", pinned)[0]["pinned"] is True
            dry = js(crabctl, "checkpoint", "thin", "ret", "--dry-run")
            assert dry["deleted"] == [] and "everything" in dry["policy"]  # no policy yet: nothing goes
            assert js(crabctl, "retention", "set", "ret", "--keep-last", "3")["retention"]["keep_last"] == 3

            # Setting the policy queued a background thinning: root + pinned + the last 3 remain.
            deadline = time.monotonic() + 60
            while len(listed := js(crabctl, "checkpoint", "ls", "ret")) > 5 and time.monotonic() < deadline:
                time.sleep(0.2)
            why = {k["id"]: k["kept_for"] for k in listed}
            assert len(why) == 5, why
            assert why[before[0]["id"]] == ["root"] and why[pinned] == ["pinned"]
            assert why[before[-1]["id"]] == ["head", "last"]
            human = crabctl("checkpoint", "ls", "ret").stdout
            assert "KEPT FOR" in human and "pinned" in human and "root" in human
            assert js(crabctl, "verify")["ok"] is True

            # Every kept checkpoint restores exactly; full ones with the process.  No thinning meanwhile: each
            # restore moves the head, and what the policy keeps then is another set (asserted below).
            js(crabctl, "retention", "set", "ret", "--default")
            for ck_id in why:
                if ck_id not in expected:
                    continue
                sb.restore(ck_id)
                assert _files(c, "ret") == expected[ck_id], ck_id
                kind = next(k["kind"] for k in listed if k["id"] == ck_id)
                procs = sb.run(["sh", "-c", "ps | grep -c '[s]leep 100000'"]).stdout.decode().strip()
                assert procs == ("1" if kind == "full" else "0"), (ck_id, kind, procs)

            # The commands above went into an implicit turn, whose end may checkpoint (on the head's line):
            # end it and wait, so that the line's end is known before the restore leaves that line behind.
            sb.begin_turn()
            sb.end_turn(wait=True)
            old_head = next(k["id"] for k in js(crabctl, "checkpoint", "ls", "ret") if "head" in k["kept_for"])
            js(crabctl, "retention", "set", "ret", "--keep-last", "3")
            # A restore leaves a line behind: its end and the branch point are never thinned.
            sb.restore(before[-3]["id"])
            for i in range(4):
                sb.run(["sh", "-c", f"echo b{i} > /g{i}"])
                sb.checkpoint()
            js(crabctl, "checkpoint", "thin", "ret")
            why = {k["id"]: k["kept_for"] for k in js(crabctl, "checkpoint", "ls", "ret")}
            assert "line-end" in why[old_head]
            assert "branch-point" in why[before[-3]["id"]]
            assert all(why.values()), why

            # Unpinned, the pinned one goes at the next thinning (the unpin queues one in the background).
            assert js(crabctl, "checkpoint", "unpin", pinned)[0]["kept_for"] == []
            js(crabctl, "checkpoint", "thin", "ret")
            assert pinned not in {k["id"] for k in js(crabctl, "checkpoint", "ls", "ret")}
            gone = crabctl("restore", "ret", pinned)
            assert gone.returncode == 1 and "no checkpoint" in gone.stderr

            # Back to the daemon's default (keep everything): nothing more is thinned.
            assert js(crabctl, "retention", "set", "ret", "--default")["retention"] is None
            assert js(crabctl, "checkpoint", "thin", "ret", "--dry-run")["deleted"] == []
            c.set_retention("ret", RetentionPolicy(keep_last=1))
            assert c.thin("ret").kept >= 3  # root, the line end, the branch point, the head
        finally:
            sb.remove(force=True)
