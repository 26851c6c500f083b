"""crabctl checkpoint create|ls|inspect|rm, restore, fork, tree, gc, verify — human and --json."""

from __future__ import annotations

from tests.integration.conftest import Crabctl, js


def test_checkpoint_commands_round_trip(crabctl: Crabctl) -> None:
    sid = js(crabctl, "create", "--env", "busybox", "--name", "cli-ck")["id"]
    try:
        assert crabctl("exec", "cli-ck", "--", "sh", "-c", "echo one > /f; printf 'x' > '/bad\\nname'").returncode == 0
        ck = js(crabctl, "checkpoint", "create", "cli-ck", "--label", "first")
        assert ck["label"] == "first" and ck["changed"] >= 2
        human = crabctl("checkpoint", "create", "cli-ck")
        assert human.returncode == 0 and "ck-" in human.stdout and "freeze" in human.stdout
        listed = js(crabctl, "checkpoint", "ls", "cli-ck")
        assert [c["label"] for c in listed] == ["created", "first", ""]
        detail = js(crabctl, "checkpoint", "inspect", ck["id"])
        paths = {c["path"] for c in detail["changes"]}
        assert "/f" in paths and "/bad\\nname" in paths
        assert "/f" in crabctl("checkpoint", "inspect", ck["id"]).stdout

        assert crabctl("exec", "cli-ck", "--", "rm", "/f").returncode == 0
        restored = js(crabctl, "restore", "cli-ck", ck["id"])
        assert restored["head"] == ck["id"]
        assert crabctl("exec", "cli-ck", "--", "cat", "/f").stdout == "one\n"
        assert "now at" in crabctl("restore", "cli-ck", "--turn", "0").stdout

        forks = js(crabctl, "fork", ck["id"], "-n", "2", "--name", "cli-br")
        assert [f["name"] for f in forks] == ["cli-br-1", "cli-br-2"]
        from_sb = js(crabctl, "fork", "cli-ck", "-n", "1")
        assert from_sb[0]["origin"]
        tree = js(crabctl, "tree", "cli-ck")
        names = {s["name"] for s in tree["sandboxes"]}
        assert {"cli-ck", "cli-br-1", "cli-br-2"} <= names
        drawn = crabctl("tree", "cli-ck").stdout
        assert ck["id"] in drawn and "cli-br-1" in drawn

        removed = js(crabctl, "checkpoint", "rm", listed[-1]["id"])
        assert removed["removed"][0]["id"] == listed[-1]["id"]
        assert js(crabctl, "gc")["live_blobs"] > 0
        assert js(crabctl, "verify")["ok"] is True
        assert "all intact" in crabctl("verify").stdout

        bad = crabctl("restore", "cli-ck", "ck-000000000000")
        assert bad.returncode == 1 and "no checkpoint" in bad.stderr and "hint:" in bad.stderr
        assert "Traceback" not in bad.stderr
        both = crabctl("restore", "cli-ck", ck["id"], "--turn", "1")
        assert both.returncode == 1 and "not both" in both.stderr
        for f in [*forks, *from_sb]:
            assert crabctl("rm", "--force", f["id"]).returncode == 0
    finally:
        assert crabctl("rm", "--force", sid).returncode == 0
