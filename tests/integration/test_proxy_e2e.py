"""crabd's OpenAI proxy in front of the stand-in LLM, over real sockets, with real sandboxes and checkpoints."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping

import pytest

from crabd.llm.standin import StandinServer
from crabd.sdk import Client, EmbeddedDaemon, Sandbox
from tests.conftest import REPO, have_docker, have_root, require
from tests.integration.conftest import USER_IN_GROUP, USER_OUTSIDE

pytestmark = [pytest.mark.integration, pytest.mark.docker, pytest.mark.criu]


@pytest.fixture(scope="module")
def llm() -> Iterator[StandinServer]:
    # About a tenth of real time: calls take tens of milliseconds.
    with StandinServer(seed=7, time_scale=0.1) as srv:
        yield srv


@pytest.fixture(scope="module")
def proxied(llm: StandinServer) -> Iterator[tuple[EmbeddedDaemon, str]]:
    require(have_root(), "needs root")
    require(have_docker(), "needs a reachable Docker engine (run `make setup`)")
    d = EmbeddedDaemon(extra_args=["--proxy-upstream", llm.url, "--proxy-listen", "127.0.0.1:0"])
    d.start()
    try:
        with Client(d.socket) as c:
            url = c.status().proxy_url
        assert url.startswith("http://127.0.0.1:")
        yield d, url
    finally:
        d.close()


@pytest.fixture
def sandbox(proxied: tuple[EmbeddedDaemon, str]) -> Iterator[Sandbox]:
    with Client(proxied[0].socket) as c:
        sb = c.create("bookworm")
        try:
            yield sb
        finally:
            sb.remove(force=True)


def chat(
    url: str, *, stream: bool = False, headers: dict[str, str] | None = None, tokens: int = 16
) -> tuple[int, dict[str, str], bytes]:
    body = {
        "model": "crab-standin-small",
        "messages": [{"role": "user", "content": "what next?"}],
        "max_tokens": tokens,
        "stream": stream,
    }
    req = urllib.request.Request(
        url + "/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", **(headers or {})},
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


def test_llm_request_ends_the_turn_and_answer_waits_for_the_checkpoint(sandbox: Sandbox) -> None:
    base = sandbox.llm_base_url()
    # 48 MiB of new data: its checkpoint takes longer than the stand-in's answer.
    sandbox.session.run("head -c 50331648 /dev/urandom > /root/big")
    status, headers, body = chat(base)
    assert status == 200, body
    assert json.loads(body)["choices"][0]["message"]["content"]
    held = float(headers["X-Crab-Held-Seconds"])
    assert held > 0
    # The answer was released only once the turn's checkpoint was durable:
    # it is done now, without any further call waiting for it.
    t = sandbox.turns(limit=1)[0]
    assert not t.open and t.decision is not None and t.decision.kind == "fs"
    assert t.checkpoint_state == "done" and t.checkpoint_id

    # A read-only action, then the next LLM call: nothing to checkpoint, nothing held.
    sandbox.session.run("wc -c /root/big")
    status, headers, _ = chat(base)
    assert status == 200 and float(headers["X-Crab-Held-Seconds"]) < 0.05
    t2 = sandbox.turns(limit=1)[0]
    assert t2.number == t.number + 1 and t2.checkpoint_state == "skipped"

    # No action at all since the last call: no turn to end, the call just passes.
    status, _, _ = chat(base)
    assert status == 200 and sandbox.turns(limit=1)[0].number == t2.number


def test_streaming_passes_through_after_release_and_header_routing(
    proxied: tuple[EmbeddedDaemon, str], sandbox: Sandbox
) -> None:
    _, url = proxied
    sandbox.session.run("echo streamed > /root/s")
    status, headers, body = chat(url + "/v1", stream=True, headers={"X-Crab-Sandbox": sandbox.id}, tokens=24)
    assert status == 200 and headers["Content-Type"].startswith("text/event-stream")
    events = [line[6:] for line in body.decode().splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    text = "".join(json.loads(e)["choices"][0]["delta"].get("content", "") for e in events[:-1])
    assert len(text.split()) == 24
    t = sandbox.turns(limit=1)[0]
    assert t.checkpoint_state == "done" and t.decision is not None and t.decision.kind == "fs"


def test_models_pass_through_and_metrics_are_exported(
    proxied: tuple[EmbeddedDaemon, str], sandbox: Sandbox, llm: StandinServer
) -> None:
    _, url = proxied
    sandbox.session.run("true")
    with urllib.request.urlopen(sandbox.llm_base_url() + "/models", timeout=30) as resp:
        assert json.loads(resp.read())["data"][0]["id"] == "crab-standin-small"
    assert sandbox.turns(limit=1)[0].open  # /models does not end a turn
    with urllib.request.urlopen(url + "/metrics", timeout=30) as resp:
        text = resp.read().decode()
    assert "crab_proxy_requests_total" in text and "crab_engine_exposed_delay_seconds_count" in text


def test_an_upstream_error_passes_through_held_like_an_answer(proxied: tuple[EmbeddedDaemon, str]) -> None:
    _, url = proxied
    status, _, body = chat(url + "/v1", headers={"X-Crab-Sandbox": "no-such-sandbox"})
    assert status == 404 and json.loads(body)["error"]["code"] == "SandboxNotFound"
    req = urllib.request.Request(
        url + "/v1/chat/completions",
        data=json.dumps({"model": "nope", "messages": [{"role": "user", "content": "x"}]}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(req, timeout=30)
    assert info.value.code == 404 and "does not exist" in info.value.read().decode()


def test_another_user_cannot_end_my_turn(
    proxied: tuple[EmbeddedDaemon, str], sandbox: Sandbox, users: dict[str, tuple[int, int]]
) -> None:
    _, url = proxied
    sandbox.session.run("echo mine > /root/m")
    uid, gid = users[USER_OUTSIDE]
    script = textwrap.dedent(f"""\
        # encodings.idna is loaded while still root (the interpreter lives under /root).
        import encodings.idna, json, os, urllib.request, urllib.error
        os.setgroups([]); os.setgid({gid}); os.setuid({uid})
        body = json.dumps({{"model": "crab-standin-small", "messages": [{{"role": "user", "content": "x"}}]}})
        req = urllib.request.Request({url + "/sandboxes/" + sandbox.id + "/v1/chat/completions"!r},
                                     data=body.encode(), headers={{"Content-Type": "application/json"}})
        try:
            urllib.request.urlopen(req, timeout=30)
            print(json.dumps([200, ""]))
        except urllib.error.HTTPError as e:
            print(json.dumps([e.code, json.loads(e.read())["error"]["code"]]))
        """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, cwd=str(REPO))
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == [403, "PermissionDenied"]
    assert sandbox.turns(limit=1)[0].open  # the turn was not ended by the other user


def _as_user(uid: int, gid: int, groups: list[int], url: str, body: Mapping[str, object] | None) -> tuple[int, str]:
    """(status, error message or body text) of one request made by a child that became ``uid`` first."""
    script = textwrap.dedent(f"""\
        import encodings.idna, json, os, urllib.request, urllib.error
        os.setgroups({groups!r}); os.setgid({gid}); os.setuid({uid})
        data = {json.dumps(dict(body)).encode() if body is not None else None!r}
        req = urllib.request.Request({url!r}, data=data, headers={{"Content-Type": "application/json"}})
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                print(json.dumps([r.status, r.read().decode()[:2000]]))
        except urllib.error.HTTPError as e:
            print(json.dumps([e.code, json.loads(e.read())["error"]["message"]]))
        """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, cwd=str(REPO))
    assert done.returncode == 0, done.stderr
    status, text = json.loads(done.stdout)
    return int(status), str(text)


def test_only_crab_members_may_use_the_proxy(
    proxied: tuple[EmbeddedDaemon, str], sandbox: Sandbox, users: dict[str, tuple[int, int]]
) -> None:
    import grp

    _, url = proxied
    crab_gid = grp.getgrnam("crab").gr_gid
    out_uid, out_gid = users[USER_OUTSIDE]
    in_uid, in_gid = users[USER_IN_GROUP]
    # Outside the group: refused everywhere, /metrics and the plain pass-through included.
    for target in (url + "/metrics", url + "/v1/models"):
        status, message = _as_user(out_uid, out_gid, [], target, None)
        assert status == 403 and "not in group 'crab'" in message, (target, status, message)
    # A member may read metrics and pass through, even without the group in its process
    # (membership is read from the group database for the socket's owner).
    for groups in ([crab_gid], []):
        status, text = _as_user(in_uid, in_gid, groups, url + "/metrics", None)
        assert status == 200 and "crab_proxy_requests_total" in text
    status, text = _as_user(in_uid, in_gid, [crab_gid], url + "/v1/models", None)
    assert status == 200 and "crab-standin-small" in text
    # A member still cannot end another user's sandbox's turn.
    sandbox.session.run("echo mine > /root/m")
    body = {"model": "crab-standin-small", "messages": [{"role": "user", "content": "x"}]}
    status, message = _as_user(
        in_uid, in_gid, [crab_gid], url + "/sandboxes/" + sandbox.id + "/v1/chat/completions", body
    )
    assert status == 403 and "not in group" not in message
    assert sandbox.turns(limit=1)[0].open
