"""crabctl commands for checkpoints: create, list, inspect, delete, restore, fork, tree, gc, verify."""

from __future__ import annotations

import contextlib
import sys
import time
from dataclasses import asdict
from typing import TYPE_CHECKING, Annotated, Any

import typer

from crabd.cli.common import (
    JsonOpt,
    NoTruncOpt,
    app,
    client,
    emit_json,
    err,
    escape,
    fmt_time,
    out,
    plural,
    short_ids,
    show,
    sub_app,
    table,
)
from crabd.cli.sandboxes import SbArg, field_text

if TYPE_CHECKING:
    from rich.tree import Tree as RichTree

    from crabd.cli.common import Columns
    from crabd.sdk.models import CheckpointInfo, SandboxInfo, Tree

CHECKPOINTS = "Checkpoints"
ck_app = sub_app("Checkpoints: create, list, inspect, delete, pin, export, import, push.")
app.add_typer(ck_app, name="checkpoint", rich_help_panel=CHECKPOINTS)

CkArg = Annotated[str, typer.Argument(metavar="CK", help="A checkpoint: its id (ck-...) or a unique prefix of it.")]
CksArg = Annotated[list[str], typer.Argument(metavar="CK", help="Checkpoints: ids (ck-...) or unique prefixes.")]


def _size(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} B"  # pragma: no cover


def _path(raw: bytes) -> str:
    """A sandbox path for people: invalid UTF-8 shown as \\x escapes, control characters escaped."""
    text = raw.decode("utf-8", "backslashreplace")
    return "/" + "".join(ch if ch.isprintable() else ch.encode("unicode_escape").decode() for ch in text)


def _ck_dict(c: CheckpointInfo) -> dict[str, Any]:
    return asdict(c)


def _ck_table(cks: list[CheckpointInfo], no_trunc: bool) -> Columns:
    t = table(
        "checkpoint id",
        "kind",
        "sandbox",
        "turn",
        "branch",
        "parent",
        "changed",
        "new bytes",
        "freeze",
        "total",
        "created",
        "where",
        "kept for",
        "label",
    )
    short = short_ids([c.id for c in cks], no_trunc)
    for c in cks:
        t.add_row(
            short(c.id),
            c.kind,
            c.sandbox_name,
            str(c.turn),
            str(c.branch),
            short(c.parent_id) or "-",
            f"+{c.changed} -{c.deleted}",
            _size(c.new_bytes),
            f"{c.freeze_s * 1000:.1f} ms",
            f"{c.total_s * 1000:.0f} ms",
            fmt_time(c.created_at),
            _where(c),
            kept_for(c),
            c.label,
        )
    return t


def kept_for(c: CheckpointInfo) -> str:
    """Why retention keeps it, for people ("thinned next": no reason left; "not known": e.g. only remote)."""
    if c.kept_for is None:
        return "not known"
    return ", ".join(str(getattr(r, "value", r)) for r in c.kept_for) or "thinned next"


def _where(c: CheckpointInfo) -> str:
    """local | local+remote | remote (only the bucket has it), with the host that took an imported one."""
    where = "remote" if c.remote_only else "local+remote" if c.remote else "local"
    return f"{where} ({c.host})" if c.host else where


@ck_app.command("create")
def ck_create(
    sandbox: SbArg,
    label: Annotated[str, typer.Option("--label", "-l", help="A note kept with the checkpoint.")] = "",
    full: Annotated[
        bool | None, typer.Option("--full/--fs", help="Dump every process too (default: the sandbox's policy).")
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """Take a checkpoint of a sandbox now."""
    kind = "" if full is None else "full" if full else "fs"
    with client() as c:
        ck = c.get(sandbox).checkpoint(label, kind=kind)
    if as_json:
        emit_json(_ck_dict(ck))
    else:
        out.print(
            f"{ck.id}  {ck.kind}  turn {ck.turn}  +{ck.changed} -{ck.deleted}  {_size(ck.new_bytes)} new  "
            f"freeze {ck.freeze_s * 1000:.1f} ms  total {ck.total_s * 1000:.0f} ms"
        )


@ck_app.command("ls")
def ck_ls(
    sandbox: Annotated[str, typer.Argument(metavar="SB", help="Only this sandbox's checkpoints.")] = "",
    remote: Annotated[
        bool, typer.Option("--remote", help="Also those only the remote tier holds (as of `crabctl store sync`).")
    ] = False,
    no_trunc: NoTruncOpt = False,
    as_json: JsonOpt = False,
) -> None:
    """List checkpoints (yours; root sees all) and where each is: local, remote, or both."""
    with client() as c:
        cks = c.checkpoints(sandbox, include_remote=remote)
    if as_json:
        emit_json([_ck_dict(k) for k in cks])
    else:
        show(_ck_table(cks, no_trunc))


@ck_app.command("inspect")
def ck_inspect(
    checkpoint: CkArg,
    files: Annotated[int, typer.Option("--files", help="Show up to N changed paths.")] = 50,
    as_json: JsonOpt = False,
) -> None:
    """Show one checkpoint: its stats, lineage, session state and what changed in it."""
    with client() as c:
        d = c.checkpoint(checkpoint)
    if as_json:
        data = asdict(d)
        data["changes"] = [
            {"path": _path(x.path), "path_bytes_hex": x.path.hex(), "change": x.change, "kind": x.kind}
            for x in d.changes
        ]
        emit_json(data)
        return
    fields = table("field", "value", header=False)
    for key, value in _ck_dict(d.checkpoint).items():
        if key == "kept_for":
            fields.add_row("kept for", kept_for(d.checkpoint))
        else:
            fields.add_row(key, field_text(key, value))
    fields.add_row("lineage", " > ".join(d.lineage))
    if d.session_state:
        fields.add_row("session cwd", str(d.session_state.get("cwd", "")))
        fields.add_row("session env", plural(len(d.session_state.get("env", {})), "exported variable"))
    show(fields)
    if d.changes:
        changes = table("change", "kind", "path")
        for x in d.changes[:files]:
            changes.add_row(x.change, x.kind, _path(x.path))
        sys.stdout.write("\n")
        show(changes)
        more = len(d.changes) - files
        if more > 0 or d.changes_truncated:
            out.print(f"... {'more than ' if d.changes_truncated else ''}{max(more, 0)} more (use --files N or --json)")


@ck_app.command("rm")
def ck_rm(
    checkpoints: CksArg,
    as_json: JsonOpt = False,
) -> None:
    """Delete checkpoints.  Their children stay restorable; data only they used is freed."""
    done: list[tuple[str, int]] = []
    with client() as c:
        for ref in checkpoints:
            done.append((ref, c.delete_checkpoint(ref)))  # (crabd resolves a prefix; it is echoed as given)
    if as_json:
        emit_json({"removed": [{"id": ref, "bytes_freed": freed} for ref, freed in done]})
    else:
        for ref, freed in done:
            out.print(f"{escape(ref)}  freed {_size(freed)}")


@ck_app.command("failures")
def ck_failures(
    sandbox: Annotated[str, typer.Argument(metavar="SB", help="Only this sandbox's.")] = "",
    no_trunc: NoTruncOpt = False,
    as_json: JsonOpt = False,
) -> None:
    """Checkpoints that were attempted and not made, and why (with CRIU's log when CRIU failed)."""
    with client() as c:
        rows = c.checkpoint_failures(sandbox)
    if as_json:
        emit_json([asdict(f) for f in rows])
        return
    short = short_ids([f.sandbox_id for f in rows], no_trunc)
    t = table("when", "sandbox id", "turn", "kind", "error", "criu log")
    for f in rows:
        t.add_row(fmt_time(f.at), short(f.sandbox_id), str(f.turn), f.kind, f.error[:300], f.log_path or "-")
    show(t)


@app.command(rich_help_panel="Sandboxes")
def recover(sandbox: SbArg, as_json: JsonOpt = False) -> None:
    """Recreate a sandbox whose container died (killed, OOM, host reboot) from its latest checkpoint."""
    with client() as c:
        done = c.get(sandbox).recover()
    if as_json:
        emit_json(asdict(done))
        return
    what = "processes and files" if done.kind == "full" else "files and shell state (no processes)"
    out.print(
        f"{escape(done.sandbox.name)} recreated from {done.checkpoint} (turn {done.checkpoint_turn}): {what}",
        highlight=False,
    )
    if done.lost_turns:
        lost = ", ".join(map(str, done.lost_turns))
        err.print(f"[yellow]lost: the effects of turn{'s' if len(done.lost_turns) > 1 else ''} {lost}[/yellow]")
    _print_not_restored(done.not_restored)


def _sources(info: SandboxInfo) -> str:
    """Where a restore took the state from, as "; files from snapshot, processes from hot images"."""
    parts = [f"files from {info.files_from}"] if info.files_from else []
    parts += [f"processes from {info.images_from} images"] if info.images_from else []
    return f"; {', '.join(parts)}" if parts else ""


def _print_not_restored(items: list[str], name: str = "") -> None:
    """What a restore, fork or recovery could not bring back (on stderr, so scripts still parse stdout)."""
    for item in items:
        err.print(f"[yellow]not restored{f' in {escape(name)}' if name else ''}: {escape(item)}[/yellow]")


@app.command(rich_help_panel=CHECKPOINTS)
def restore(
    sandbox: SbArg,
    checkpoint: Annotated[str, typer.Argument(metavar="CK", help="Checkpoint id or prefix (or use --turn).")] = "",
    turn: Annotated[
        int | None, typer.Option("--turn", "-t", help="Restore the state this turn ended in (0: the start).")
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """Roll a sandbox back (or forward) in place: its files and session become the checkpoint's."""
    if bool(checkpoint) == (turn is not None):
        raise typer.BadParameter("name a checkpoint CK or give --turn N (one of them, not both)")
    t0 = time.monotonic()
    with client() as c:
        sb = c.get(sandbox)
        info = sb.restore(checkpoint or None, turn=turn)
    if as_json:
        emit_json(asdict(info))
    else:
        out.print(
            f"{escape(info.name)} now at {info.head} (branch {info.branch}) in {time.monotonic() - t0:.2f} s"
            f"{_sources(info)}",
            highlight=False,
        )
        _print_not_restored(info.not_restored)


@app.command(rich_help_panel=CHECKPOINTS)
def fork(
    source: Annotated[
        str, typer.Argument(metavar="CK|SB", help="A checkpoint (id or prefix), or a sandbox (its latest checkpoint).")
    ],
    n: Annotated[int, typer.Option("-n", "--count", min=1, help="How many sandboxes to make.")] = 1,
    name_prefix: Annotated[
        str, typer.Option("--name-prefix", metavar="PREFIX", help="Name them PREFIX-1 .. PREFIX-N.")
    ] = "",
    turn: Annotated[
        int | None, typer.Option("--turn", "-t", help="With a sandbox: the state at the end of this turn of it.")
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """Start N new sandboxes from a checkpoint, each with its own container and network identity."""
    from crabd.errors import CheckpointNotFound

    t0 = time.monotonic()
    with client() as c:
        sbs = None
        if source.startswith("ck-") and turn is None:
            with contextlib.suppress(CheckpointNotFound):  # a sandbox may be named like one
                sbs = c.fork(source, n, name_prefix=name_prefix)
        if sbs is None:
            sbs = c.get(source).fork(n, name_prefix=name_prefix, turn=turn)
    infos: list[SandboxInfo] = [s.info for s in sbs]
    if as_json:
        emit_json([asdict(i) for i in infos])
        return
    for i in infos:
        out.print(f"{i.id} {i.name} {i.ip_address or ''}".rstrip(), markup=False, highlight=False)
        _print_not_restored(i.not_restored, i.name)
    made = plural(len(infos), "sandbox", "sandboxes")
    err.print(f"[dim]{made} from {infos[0].origin} in {time.monotonic() - t0:.2f} s[/dim]", highlight=False)


def render_tree(tree: Tree) -> RichTree:
    from rich.tree import Tree as RichTree

    heads: dict[str, list[str]] = {}
    for sb in tree.sandboxes:
        at = sb.head or sb.origin
        if at:
            heads.setdefault(at, []).append(escape(f"{sb.name} ({sb.state})"))
    top = RichTree("[bold]checkpoints[/bold]" + (" [yellow](truncated)[/yellow]" if tree.truncated else ""))

    def label(c: CheckpointInfo) -> str:
        text = f"[cyan]{c.id}[/cyan] {escape(c.sandbox_name)} turn {c.turn}" + (
            " [magenta]full[/magenta]" if c.kind == "full" else ""
        )
        if c.label:
            text += f" [dim]{escape(c.label)}[/dim]"
        text += f" [dim]+{c.changed} -{c.deleted}, {_size(c.new_bytes)}[/dim]"
        if c.id in heads:
            text += " [green]◀ " + ", ".join(heads[c.id]) + "[/green]"
        return text

    def add(node: RichTree, parent: str) -> None:
        for c in tree.children(parent):
            add(node.add(label(c)), c.id)

    add(top, "")
    return top


@app.command(name="tree", rich_help_panel=CHECKPOINTS)
def tree_cmd(
    target: Annotated[str, typer.Argument(metavar="SB|CK", help="A sandbox, or a checkpoint (id or prefix).")],
    as_json: JsonOpt = False,
) -> None:
    """Draw the lineage of checkpoints, rollbacks and forks around a sandbox."""
    from crabd.errors import CheckpointNotFound

    with client() as c:
        tree = None
        if target.startswith("ck-"):
            with contextlib.suppress(CheckpointNotFound):
                tree = c.tree(checkpoint=target)
        if tree is None:
            tree = c.tree(sandbox=target)
    if as_json:
        emit_json(asdict(tree))
    else:
        out.print(render_tree(tree))


@app.command(rich_help_panel="Store")
def gc(as_json: JsonOpt = False) -> None:
    """Remove stored blobs that no checkpoint references (root only); sizes are on disk (compressed)."""
    with client() as c:
        r = c.gc()
    if as_json:
        emit_json(asdict(r))
    else:
        out.print(
            f"removed {plural(r.blobs_removed, 'blob')} ({_size(r.bytes_freed + r.tmp_bytes_freed)} on disk); "
            f"{plural(r.live_blobs, 'live blob')} ({_size(r.live_bytes)} on disk, compressed) in {r.seconds:.2f} s",
            highlight=False,
        )


@app.command(rich_help_panel="Store")
def verify(as_json: JsonOpt = False) -> None:
    """Re-hash stored checkpoint data; name any corrupt blob and the checkpoints that need it.

    The size it reports is of the content it re-hashed (uncompressed), where
    `crabctl gc` reports the blobs' size on disk (compressed).
    """
    with client() as c:
        r = c.verify()
    if as_json:
        emit_json({**asdict(r), "ok": r.ok})
    else:
        out.print(
            f"checked {plural(r.blobs_checked, 'blob')} ({_size(r.bytes_checked)} of content, uncompressed) "
            f"in {r.seconds:.2f} s",
            highlight=False,
        )
        for p in r.problems:
            err.print(f"[red]{p.blob}[/red]: {escape(p.problem)}", highlight=False)
            err.print(f"  needed by checkpoints: {', '.join(p.checkpoints) or '-'}", highlight=False)
            if p.sandboxes:
                err.print(f"  and the current files of sandboxes: {', '.join(p.sandboxes)}", highlight=False)
        out.print("all intact" if r.ok else f"[red]{plural(len(r.problems), 'damaged blob')}[/red]")
    if not r.ok:
        raise typer.Exit(1)
