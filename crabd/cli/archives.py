"""crabctl commands for portable archives: `checkpoint export` and `checkpoint import`.

The file is written and read here, with the caller's own permissions: crabd
streams the archive and never opens a path a client names.
"""

from __future__ import annotations

import sys
import time
from dataclasses import asdict
from typing import Annotated

import typer

from crabd.cli.checkpoints import CkArg, ck_app
from crabd.cli.common import JsonOpt, client, emit_json, err, escape, out, plural


@ck_app.command("export")
def export(
    checkpoint: CkArg,
    output: Annotated[
        str, typer.Option("-o", "--output", metavar="FILE", help="The archive file to write; - for stdout.")
    ],
    ancestors: Annotated[
        bool, typer.Option("--ancestors", help="Its ancestors on its line too, so earlier turns restore after import.")
    ] = False,
    as_json: JsonOpt = False,
) -> None:
    """Write a checkpoint as one portable archive (tar): files, session, process image, hashes."""
    t0 = time.monotonic()
    with client() as c:
        size = c.export_checkpoint(checkpoint, sys.stdout.buffer if output == "-" else output, ancestors=ancestors)
    seconds = time.monotonic() - t0
    if as_json:
        # With -o - stdout carries the archive: the report goes to stderr.
        report = {"checkpoint": checkpoint, "output": output, "bytes": size, "seconds": round(seconds, 3)}
        (err.print_json if output == "-" else out.print_json)(data=report)
        return
    err.print(
        f"[dim]{escape(checkpoint)} -> {escape(output)}: {plural(size, 'byte')} in {seconds:.2f} s[/dim]",
        highlight=False,
    )


@ck_app.command("import")
def import_(
    archive: Annotated[str, typer.Argument(metavar="FILE", help="The archive file to import; - for stdin.")],
    as_json: JsonOpt = False,
) -> None:
    """Import a portable archive as your checkpoints (verified whole before anything is visible)."""
    with client() as c:
        result = c.import_checkpoint(sys.stdin.buffer if archive == "-" else archive)
    if as_json:
        emit_json(
            {
                "checkpoints": [asdict(i) for i in result.checkpoints],
                "dropped": result.dropped,
                "blobs": result.blobs,
                "stored_blobs": result.stored_blobs,
                "bytes": result.bytes,
                "seconds": result.seconds,
            }
        )
        return
    for item in result.checkpoints:
        ck = item.checkpoint
        state = "already here" if item.already_present else "imported"
        out.print(f"{ck.id} {ck.kind} {escape(ck.sandbox_name)} turn {ck.turn}: {state}", highlight=False)
        if item.process_image_dropped:
            err.print(
                f"[yellow]warning:[/yellow] {ck.id}: process image not imported (files and session were):"
                f" {escape(item.process_image_dropped)}",
                highlight=False,
            )
    err.print(
        f"[dim]{result.stored_blobs} of {plural(result.blobs, 'blob')} new here, {plural(result.bytes, 'byte')}"
        f" in {result.seconds:.2f} s; fork it with `crabctl fork {result.checkpoint.id}`[/dim]",
        highlight=False,
    )
