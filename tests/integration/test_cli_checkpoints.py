"""crabctl checkpoint create|ls|inspect|rm, restore, fork, tree, gc, verify — human and --json."""

from __future__ import annotations

from tests.integration.conftest import Crabctl, js


def test_checkpoint_commands_round_trip(crabctl: Crabctl) -> None:
    sid = js(crabctl, "create", "busybox", "--name", "cli-ck")["id"]
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
        # Short ids: tables print a unique prefix, and any command takes one.
        human_ls = crabctl("checkpoint", "ls", "cli-ck").stdout
        assert ck["id"][:11] in human_ls and ck["id"] not in human_ls
        assert ck["id"] in crabctl("checkpoint", "ls", "cli-ck", "--no-trunc").stdout
        assert js(crabctl, "checkpoint", "inspect", ck["id"][:9])["checkpoint"]["id"] == ck["id"]
        assert js(crabctl, "inspect", sid[:6])["sandbox"]["name"] == "cli-ck"
        kept = crabctl("checkpoint", "inspect", ck["id"]).stdout
        assert "kept for" in kept and "None" not in kept

        assert crabctl("exec", "cli-ck", "--", "rm", "/f").returncode == 0
        restored = js(crabctl, "restore", "cli-ck", ck["id"])
        assert restored["head"] == ck["id"]
        assert crabctl("exec", "cli-ck", "--", "cat", "/f").stdout == "one\n"
        assert "now at" in crabctl("restore", "cli-ck", "--turn", "0").stdout

        forks = js(crabctl, "fork", ck["id"], "-n", "2", "--name-prefix", "cli-br")
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
        assert both.returncode == 2 and "not both" in both.stderr
        # The sandbox and its forks, in one command.
        gone = js(crabctl, "rm", "--force", "--with-forks", "cli-ck")["removed"]
        assert sorted(gone) == sorted([f["id"] for f in [*forks, *from_sb]] + [sid]) and gone[-1] == sid
        assert not {s["id"] for s in js(crabctl, "ps")} & set(gone)
    finally:
        if sid in {s["id"] for s in js(crabctl, "ps")}:
            assert crabctl("rm", "--force", "--with-forks", sid).returncode == 0
