"""crabctl commands for the remote tier: push a checkpoint, re-read the bucket's catalog."""

from __future__ import annotations

from dataclasses import asdict

import typer

from crabd.cli.checkpoints import CkArg, ck_app
from crabd.cli.common import JsonOpt, app, client, emit_json, err, out, plural, sub_app

store_app = sub_app("The remote checkpoint tier (an S3-compatible bucket).")
app.add_typer(store_app, name="store", rich_help_panel="Store")


@ck_app.command("push")
def ck_push(
    checkpoint: CkArg,
    as_json: JsonOpt = False,
) -> None:
    """Upload a checkpoint to the remote tier now (crabd does it in the background anyway) and wait."""
    with client() as c:
        r = c.push(checkpoint)
    if as_json:
        emit_json(asdict(r))
    else:
        out.print(
            f"{r.checkpoint.id} is remote: {r.uploaded_blobs} of {plural(r.blobs, 'blob')} sent, "
            f"{plural(r.bytes, 'byte')} in {r.seconds:.2f} s",
            highlight=False,
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
        f"{plural(r.manifests, 'checkpoint')} in the remote tier: {len(r.added)} newly known, "
        f"{len(r.forgotten)} gone from the bucket",
        highlight=False,
    )
    for ckpt_id in r.damaged:
        err.print(f"[red]{ckpt_id}[/red]: its manifest is damaged; it cannot be fetched")
    if r.damaged:
        raise typer.Exit(1)
