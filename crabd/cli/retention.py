"""crabctl commands for retention: `checkpoint pin|unpin|thin` and `retention set|show` (docs/retention.md)."""

from __future__ import annotations

import re
from dataclasses import asdict
from typing import Annotated

import typer

from crabd.cli.checkpoints import CksArg, ck_app, kept_for
from crabd.cli.common import JsonOpt, app, client, emit_json, escape, out, plural, sub_app
from crabd.cli.sandboxes import SbArg

ret_app = sub_app("Retention policies: which checkpoints each sandbox keeps.")
app.add_typer(ret_app, name="retention", rich_help_panel="Store")

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_duration(text: str) -> float:
    """Seconds in ``text``: a number with an optional unit s, m, h, d or w (``90m``, ``7d``, ``3600``)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*", text)
    if m is None:
        from crabd.errors import InvalidRequest

        raise InvalidRequest(f"{text!r} is not a duration; write e.g. 3600, 90m, 12h or 7d")
    return float(m.group(1)) * _UNITS[m.group(2) or "s"]


@ck_app.command("pin")
def ck_pin(
    checkpoints: CksArg,
    as_json: JsonOpt = False,
) -> None:
    """Pin checkpoints: retention never thins them (`unpin` gives them back to the policy)."""
    _pin(checkpoints, True, as_json)


@ck_app.command("unpin")
def ck_unpin(
    checkpoints: CksArg,
    as_json: JsonOpt = False,
) -> None:
    """Unpin checkpoints: their sandbox's retention policy may thin them again."""
    _pin(checkpoints, False, as_json)


def _pin(checkpoints: list[str], pinned: bool, as_json: bool) -> None:
    with client() as c:
        done = [c.pin(ck) if pinned else c.unpin(ck) for ck in checkpoints]
    if as_json:
        emit_json([asdict(ck) for ck in done])
        return
    for ck in done:
        out.print(f"{ck.id}  {'pinned' if ck.pinned else 'unpinned'}  kept for: {kept_for(ck)}", highlight=False)


@ck_app.command("thin")
def ck_thin(
    sandbox: SbArg,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Only list what would be deleted.")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Thin a sandbox's checkpoints by its retention policy now (crabd also does it after each checkpoint)."""
    with client() as c:
        res = c.thin(sandbox, dry_run=dry_run)
    if as_json:
        emit_json(asdict(res))
        return
    verb = "would delete" if res.dry_run else "deleted"
    out.print(
        f"{escape(res.policy)}: {verb} {plural(len(res.deleted), 'checkpoint')}, kept {res.kept}", highlight=False
    )
    for ck in res.deleted:
        out.print(f"  {ck}", highlight=False)
    if not res.dry_run:
        out.print(f"{plural(res.bytes_freed, 'byte')} freed", highlight=False)


@ret_app.command("set")
def ret_set(
    sandbox: SbArg,
    keep_last: Annotated[int, typer.Option("--keep-last", help="Keep the newest N checkpoints.")] = 0,
    hourly: Annotated[int, typer.Option("--hourly", help="Keep the newest of each of the last N hours.")] = 0,
    daily: Annotated[int, typer.Option("--daily", help="Keep the newest of each of the last N days.")] = 0,
    within: Annotated[
        str, typer.Option("--within", metavar="AGE", help="Keep everything younger than this (e.g. 12h, 7d).")
    ] = "",
    default: Annotated[
        bool, typer.Option("--default", help="Drop the sandbox's own policy: the daemon's default applies.")
    ] = False,
    as_json: JsonOpt = False,
) -> None:
    """Give a sandbox its own retention policy (rules add up: a checkpoint any rule keeps is kept)."""
    from crabd.models import RetentionPolicy

    chosen = bool(keep_last or hourly or daily or within)
    if default == chosen:
        raise typer.BadParameter(
            "give either --default or at least one of --keep-last, --hourly, --daily, --within "
            "(e.g. `crabctl retention set SB --keep-last 50 --daily 7`)"
        )
    policy = None if default else RetentionPolicy(keep_last, hourly, daily, parse_duration(within) if within else 0.0)
    with client() as c:
        sb = c.set_retention(sandbox, policy)
    if as_json:
        emit_json(asdict(sb.info))
        return
    words = sb.info.retention.describe() if sb.info.retention is not None else "the daemon's default"
    out.print(f"{escape(sb.info.name)}: {escape(words)}", highlight=False)


@ret_app.command("show")
def ret_show(sandbox: SbArg, as_json: JsonOpt = False) -> None:
    """A sandbox's policy, and why each of its checkpoints is kept."""
    with client() as c:
        sb = c.get(sandbox)
        cks = c.checkpoints(sb.info.id)
    policy = sb.info.retention
    if as_json:
        emit_json(
            {
                "sandbox": sb.info.name,
                "retention": asdict(policy) if policy is not None else None,
                "checkpoints": [{"id": k.id, "turn": k.turn, "pinned": k.pinned, "kept_for": k.kept_for} for k in cks],
            }
        )
        return
    words = policy.describe() if policy is not None else "the daemon's default [retention]"
    out.print(f"{escape(sb.info.name)}: {escape(words)}", highlight=False)
    for k in cks:
        out.print(f"  {k.id}  turn {k.turn}  {kept_for(k)}", highlight=False)
