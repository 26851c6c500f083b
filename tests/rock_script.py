"""A ROCK script as ROLL users write them, run unmodified against crab's ROCK server (tests/integration/test_rock.py).

``ROCK_BASE_URL`` must be set before ``rock`` is imported (its config reads it once).  Prints one JSON
object of what it saw; the test judges it.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import tempfile

import httpx
from rock.actions import (
    CloseBashSessionRequest,
    Command,
    CreateBashSessionRequest,
    ReadFileRequest,
    UploadRequest,
    WriteFileRequest,
)
from rock.sdk.sandbox.client import Sandbox
from rock.sdk.sandbox.config import SandboxConfig


async def main() -> dict[str, object]:
    out: dict[str, object] = {}
    sandbox = Sandbox(SandboxConfig(image="python:3.11", memory="2g", cpus=1.0, startup_timeout=120))
    await sandbox.start()
    out["sandbox_id"] = sandbox.sandbox_id
    for name in ("bash-1", "bash-2", "killer"):
        await sandbox.create_session(CreateBashSessionRequest(session=name, env_enable=True))
    await sandbox.arun("cd /tmp && export GREETING=hi", session="bash-1")
    out["state"] = (await sandbox.arun("echo $GREETING $PWD", session="bash-1")).output
    # A job in one session; commands in temporary sessions gathered meanwhile; a kill from a third.
    job = asyncio.create_task(sandbox.arun("sleep 300 && echo never", session="bash-2"))
    outs = await asyncio.gather(*(sandbox.arun(f"echo task{i}") for i in range(3)))
    out["gathered"] = [o.output for o in outs]
    out["job_running_meanwhile"] = not job.done()
    await sandbox.arun("pkill -f 'sleep 300'", session="killer")
    try:
        await job
        out["job"] = "returned"
    except Exception as exc:  # check="raise": the killed command's non-zero exit is ROCK's Failed
        out["job"] = f"raised: {exc}"[:200]
    try:
        await sandbox.arun("false", session="bash-1")
        out["false"] = "returned"
    except Exception:
        out["false"] = "raised"
    out["nohup"] = (await sandbox.arun("echo from-nohup", session="bash-1", mode="nohup", wait_interval=1)).output
    await sandbox.write_file(WriteFileRequest(content="hello\n", path="/tmp/x/a.txt"))
    out["read"] = (await sandbox.read_file(ReadFileRequest(path="/tmp/x/a.txt"))).content
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        f.write("uploaded\n")
    up = await sandbox.upload(UploadRequest(source_path=f.name, target_path="/tmp/x/up.txt"))
    os.unlink(f.name)
    out["upload"] = up.success
    ls = await sandbox.execute(Command(command=["ls", "/tmp/x"]))
    out["ls"] = ls.stdout.split()
    # crab's own operations next to ROCK's: a checkpoint, then a change, then back.
    base = os.environ["ROCK_BASE_URL"] + "/apis/envs/sandbox/v1"
    async with httpx.AsyncClient(timeout=120) as http:
        ck = (await http.post(base + "/crab/checkpoint", json={"sandbox_id": sandbox.sandbox_id})).json()
        out["checkpoint"] = ck["status"]
        await sandbox.arun("rm -rf /tmp/x && export GREETING=gone", session="bash-1")
        back = (
            await http.post(
                base + "/crab/restore",
                json={"sandbox_id": sandbox.sandbox_id, "checkpoint": ck["result"]["checkpoint"]},
            )
        ).json()
        out["restore"] = back["status"]
    out["after_restore"] = (await sandbox.arun("echo $GREETING; cat /tmp/x/a.txt", session="bash-1")).output
    await sandbox.close_session(CloseBashSessionRequest(session="bash-2"))
    await sandbox.stop()
    return out


if __name__ == "__main__":
    json.dump(asyncio.run(main()), sys.stdout)
