"""`crabctl quota`: a uid's use against its per-uid quotas ([quota] in crabd.toml)."""

from __future__ import annotations

from dataclasses import asdict
from typing import Annotated

import typer

from crabd.cli.checkpoints import _size
from crabd.cli.common import JsonOpt, app, client, emit_json, out, plural


@app.command(rich_help_panel="Store")
def quota(
    uid: Annotated[
        int | None, typer.Option("--uid", metavar="UID", help="Another uid's (root only); default: yours")
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """Show your use of sandboxes, forks and checkpoint store against your quotas."""
    with client() as c:
        q = c.quota(uid)
    if as_json:
        emit_json(asdict(q))
        return
    from rich.table import Table

    table = Table(show_header=True, header_style="bold", title=f"uid {q.uid}" + ("" if q.limited else " (exempt)"))
    table.add_column("quota")
    table.add_column("used", justify="right")
    table.add_column("limit", justify="right")
    table.add_row("sandboxes", str(q.sandboxes), str(q.max_sandboxes))
    table.add_row("sandboxes being forked", str(q.forks_in_flight), str(q.max_concurrent_forks))
    table.add_row(
        f"checkpoint store ({plural(q.checkpoints, 'checkpoint')} + live sandboxes' files)",
        _size(q.store_bytes),
        _size(q.max_store_bytes),
    )
    table.add_row("session state per turn", "", _size(q.max_session_state_bytes))
    table.add_row("turns kept per sandbox", "", str(q.turns_kept))
    out.print(table)
    if not q.limited:
        out.print("root is exempt ([quota] exempt_root): the limits above are not applied to it", markup=False)
