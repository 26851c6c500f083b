"""crabctl commands for the remote tier: push a checkpoint, re-read the bucket's catalog."""

from __future__ import annotations

from dataclasses import asdict
from typing import Annotated

import typer

from crabd.cli.checkpoints import ck_app
from crabd.cli.common import JsonOpt, app, client, emit_json, err, out

store_app = typer.Typer(no_args_is_help=True, help="The remote checkpoint tier (an S3-compatible bucket).")
app.add_typer(store_app, name="store")


@ck_app.command("push")
def ck_push(
    checkpoint: Annotated[str, typer.Argument(help="The checkpoint to upload now.")],
    as_json: JsonOpt = False,
) -> None:
    """Upload a checkpoint to the remote tier now (crabd does it in the background anyway) and wait."""
    with client() as c:
        r = c.push(checkpoint)
    if as_json:
        emit_json(asdict(r))
    else:
        out.print(
            f"{r.checkpoint.id} is remote: {r.uploaded_blobs} of {r.blobs} blobs sent, "
            f"{r.bytes} bytes in {r.seconds:.2f} s"
        )


@store_app.command("sync")
def store_sync(as_json: JsonOpt = False) -> None:
    """Re-read the bucket's manifests into this host's index of remote checkpoints (root only)."""
    with client() as c:
        r = c.sync_store()
    if as_json:
        emit_json(asdict(r))
        return
    out.print(
        f"{r.manifests} checkpoints in the remote tier: {len(r.added)} newly known, "
        f"{len(r.forgotten)} gone from the bucket"
    )
    for ckpt_id in r.damaged:
        err.print(f"[red]{ckpt_id}[/red]: its manifest is damaged; it cannot be fetched")
    if r.damaged:
        raise typer.Exit(1)
