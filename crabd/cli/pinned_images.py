"""`crabctl image ls|prune`: the images crabd pinned (``crab-loaded:<hex>``) and their collection.

docs/images.md, "Pinned images and their collection".  Through crabd (the
``crab.v1.CrabImages`` service): only crabd knows what its sandboxes and
checkpoints name, and it removes under the lock its creates take.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Annotated

import typer

from crabd.cli.checkpoints import _size
from crabd.cli.common import JsonOpt, app, client, emit_json, fmt_time, out, plural, show, sub_app, table

image_app = sub_app("Images crabd pinned for sandboxes of any image (crab-loaded:<digest hex>).")
app.add_typer(image_app, name="image", rich_help_panel="Host")


@image_app.command("ls")
def image_ls(as_json: JsonOpt = False) -> None:
    """List crab's pinned images: digest, size, and the sandboxes and checkpoints that name each."""
    from crabd.sdk.images import list_pinned_images

    with client() as c:
        rows = list_pinned_images(c)
    if as_json:
        emit_json([asdict(r) for r in rows])
        return
    t = table("digest", "size", "sandboxes", "checkpoints", "remote", "pinned", "state", "names")
    for r in rows:
        state = f"grace until {fmt_time(r.removable_at)}" if r.state == "grace" else r.state
        names = ",".join(n for n in r.tags if not n.startswith("crab-loaded:")) or "-"
        t.add_row(
            r.digest.removeprefix("sha256:")[:12],
            _size(r.size),
            str(r.sandboxes),
            str(r.checkpoints),
            str(r.remote_checkpoints),
            fmt_time(r.pinned_at),
            state,
            names,
        )
    show(t)


@image_app.command("prune")
def image_prune(
    dry_run: Annotated[bool, typer.Option("--dry-run", help="List what would be removed; remove nothing.")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Remove every pinned image nothing needs now (root only); crabd also does it every [images] gc_interval_s."""
    from crabd.sdk.images import prune_pinned_images

    with client() as c:
        r = prune_pinned_images(c, dry_run=dry_run)
    if as_json:
        emit_json(asdict(r))
        return
    if r.busy:
        out.print("creates held the image lock: nothing was looked at; try again in a moment", markup=False)
        raise typer.Exit(1)
    verb = "would remove" if dry_run else "removed"
    out.print(f"{verb} {plural(len(r.removed), 'image')}, {_size(r.bytes_freed)} freed", markup=False)
    for digest in r.removed:
        out.print(f"  {digest}", markup=False)
    for digest, why in r.left.items():
        out.print(f"  kept {digest}: {why}", markup=False)
