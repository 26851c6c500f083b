"""``crabctl --cluster ADDR cluster ...``: operate the Ray cluster layer (hosts, sandboxes, fork, migrate, recover).

Each command reaches the cluster through :func:`_connect` (and ``join``
through :func:`_join`), which import :mod:`crabd.cluster.connect`, and
with it Ray, only when the command runs: ``crabctl --help`` and the other
commands never load Ray.  Tests replace those two functions.

Human tables by default, ``--json`` for machines; a :class:`CrabError`
is reported as every crabctl command reports it (message and hint on
stderr, exit code 1).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Annotated, Any, TypeVar

import typer

from crabd.cli.common import JsonOpt, emit_json, err, escape, out, plural, show, show_error, state, table

if TYPE_CHECKING:
    from crabd.cli.common import Columns
    from crabd.cluster.client import Cluster

#: Exit code when no cluster address was given (a usage error, as click's own).
NO_ADDRESS_EXIT = 2

T = TypeVar("T")


def _connect(address: str) -> Cluster:
    """The cluster at ``address`` (``ray.init`` on first use)."""
    from crabd.cluster.connect import connect

    return _reached(address, lambda: connect(address))


def _join(host_id: str, socket_path: str, capacity: int, address: str) -> dict[str, Any]:
    """Start this host's agent in the cluster at ``address``; the host's info."""
    from crabd.cluster.connect import join

    return _reached(address, lambda: join(host_id, socket_path, capacity=capacity, address=address))


def _reached(address: str, how: Callable[[], T]) -> T:
    """``how()``, with Ray's failure to reach ``address`` reported as crab's error."""
    from crabd.errors import CrabError

    try:
        return how()
    except (ConnectionError, TimeoutError) as exc:
        raise CrabError(
            f"cannot reach the Ray cluster at {address!r}: {exc}",
            hint="Check the address (the head node's GCS, host:port) and that `ray status` answers there.",
        ) from exc


def _address() -> str:
    from crabd.errors import InvalidRequest

    if not state.cluster:
        show_error(
            InvalidRequest(
                "no cluster address given; nothing was done",
                hint="Pass the Ray GCS address as `crabctl --cluster ADDR cluster ...` (e.g. 10.0.0.5:6379, "
                "or auto on a node of the cluster), or set CRAB_CLUSTER.",
            )
        )
        raise typer.Exit(NO_ADDRESS_EXIT)
    return state.cluster


@contextlib.contextmanager
def _reported() -> Iterator[None]:
    """A CrabError inside ends the command as crabctl's main() would (tracebacks only with --debug)."""
    from crabd.errors import CrabError

    try:
        yield
    except CrabError as exc:
        if state.debug:
            raise
        show_error(exc)
        raise typer.Exit(1) from None


def _cluster() -> Cluster:
    return _connect(_address())


def _sandbox_table(rows: list[dict[str, Any]]) -> Columns:
    t = table("id", "name", "state", "turn", "host")
    for sb in rows:
        t.add_row(sb["id"], sb["name"], str(sb.get("state", "")), str(sb.get("turn", "")), sb.get("host_id", ""))
    return t


# --- hosts ----------------------------------------------------------------------------


def join(
    host: Annotated[str, typer.Argument(help="This host's id in the cluster (its Ray node carries crab-host:HOST).")],
    capacity: Annotated[int, typer.Option("--capacity", min=0, help="How many sandboxes this host takes.")],
    socket: Annotated[
        str | None,
        typer.Option("--socket", help="This host's crabd socket (default: crabctl's --socket, or the config's)."),
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """Make this host's crabd part of the cluster: start its agent on this node and register it."""
    from crabd.errors import InvalidRequest

    address = _address()
    with _reported():
        if socket is None:
            from crabd.config_file import socket_path

            socket = state.socket or str(socket_path(state.config))
        try:
            info = _join(host, socket, capacity, address)
        except ValueError as exc:  # a bad host id, or (Ray) an agent of that name is alive already
            raise InvalidRequest(
                f"host {host!r} cannot join: {exc}",
                hint="Host ids are letters, digits, '.', '_', '-'; a host that joined already is listed by "
                "`crabctl --cluster ADDR cluster hosts`.",
            ) from exc
    if as_json:
        emit_json(info)
        return
    out.print(
        f"{info.get('host_id', host)} joined: capacity {info.get('capacity', capacity)}, "
        f"{plural(info.get('sandboxes', 0), 'sandbox', 'sandboxes')}, {info.get('free', '-')} free"
        + (f" (crabd {info['crabd_version']} on {info.get('hostname', '?')})" if info.get("crabd_version") else "")
    )


def hosts(as_json: JsonOpt = False) -> None:
    """The cluster's hosts (as the hosts themselves report, after a refresh): alive, capacity, load, free."""
    with _reported():
        got = _cluster().refresh()
    rows = [{"id": h, **s} for h, s in sorted(got.items())]
    if as_json:
        emit_json(rows)
        return
    t = table("id", "alive", "capacity", "load", "free")
    for r in rows:
        t.add_row(r["id"], "yes" if r["alive"] else "no", str(r["capacity"]), str(r["load"]), str(r["free"]))
    show(t)


def check(as_json: JsonOpt = False) -> None:
    """Probe every known host; the ones that are gone (now marked dead) are listed."""
    with _reported():
        c = _cluster()
        known = c.registry.hosts()
        dead = c.check()
    if as_json:
        emit_json({"hosts": sorted(known), "dead": sorted(dead)})
        return
    if not known:
        out.print("no hosts in the cluster (join them with `crabctl --cluster ADDR cluster join ...`)")
    elif not dead:
        out.print(f"all hosts answer ({len(known)})")
    for h in dead:
        out.print(f"[red]{h}[/red]: does not answer (marked dead; `crabctl --cluster ADDR cluster recover {h}`)")


# --- sandboxes --------------------------------------------------------------------------


def ls(as_json: JsonOpt = False) -> None:
    """Every sandbox on the live hosts, with its host."""
    with _reported():
        c = _cluster()
        c.refresh()
        sandboxes = sorted(c.list(), key=lambda sb: (sb.get("host_id", ""), sb["name"]))
    if as_json:
        emit_json(sandboxes)
    else:
        show(_sandbox_table(sandboxes))


def fork(
    checkpoint: Annotated[str, typer.Argument(help="The checkpoint to fork (any host's; fetched from the bucket).")],
    n: Annotated[int, typer.Option("-n", "--count", min=1, help="How many sandboxes.")] = 1,
    name_prefix: Annotated[str, typer.Option("--name-prefix", metavar="PREFIX", help="Name them PREFIX-HOST-I.")] = "",
    host: Annotated[str, typer.Option("--host", help="Make all of them on this host (default: spread).")] = "",
    as_json: JsonOpt = False,
) -> None:
    """N forks of CHECKPOINT spread over the hosts with free capacity (all or nothing)."""
    with _reported():
        kids = _cluster().fork(checkpoint, n, name_prefix=name_prefix, host=host)
    if as_json:
        emit_json(kids)
    else:
        show(_sandbox_table(kids))


def migrate(
    sandbox: Annotated[str, typer.Argument(help="The sandbox (id or name).")],
    to: Annotated[str, typer.Option("--to", help="The live host to move it to.")],
    as_json: JsonOpt = False,
) -> None:
    """Move SANDBOX to another host, keeping its id, name and lineage (processes too)."""
    with _reported():
        moved = _cluster().migrate(sandbox, to)
    if as_json:
        emit_json(moved)
        return
    sb = moved["sandbox"]
    out.print(
        f"{sb['id']} ({escape(sb['name'])}) moved from {moved['from']} to {moved['to']} via {moved['checkpoint']}"
    )
    out.print(
        f"paused {moved['paused_s']:.2f} s: checkpoint {moved['checkpoint_s']:.2f} s, "
        f"push {moved['push_s']:.2f} s, import {moved['import_s']:.2f} s"
    )
    for what in moved.get("not_restored") or []:
        err.print(f"[yellow]not restored:[/yellow] {escape(what)}", highlight=False)


def recover(
    host: Annotated[str, typer.Argument(help="The lost host.")],
    force: Annotated[
        bool, typer.Option("--force", help="Recover even if HOST still answers (its sandboxes then run twice).")
    ] = False,
    as_json: JsonOpt = False,
) -> None:
    """Bring the sandboxes of a lost HOST back on the live hosts, each from its newest remote checkpoint.

    Exit code 1 when any could not be recovered.
    """
    from crabd.errors import InvalidRequest

    with _reported():
        c = _cluster()
        if host not in c.registry.hosts():
            raise InvalidRequest(f"no host {host!r} in the cluster", hint="See `crabctl --cluster ADDR cluster hosts`.")
        if not force and host not in c.check():
            raise InvalidRequest(
                f"host {host!r} still answers; recovering it would run its sandboxes twice",
                hint="Migrate them instead (`crabctl --cluster ADDR cluster migrate SB --to HOST`), "
                "or pass --force if its crabd is lost although its agent answers.",
            )
        report = c.recover_host(host)
    if as_json:
        emit_json(report)
    else:
        t = table("id", "name", "host", "checkpoint", "lost turns")
        for r in report["recovered"]:
            lost = ", ".join(str(n) for n in r["lost_turns"]) or "-"
            t.add_row(r["sandbox"]["id"], r["sandbox"]["name"], r["host"], r["checkpoint"], lost)
        made = plural(len(report["recovered"]), "sandbox", "sandboxes")
        out.print(f"{made} of {escape(host)} recovered", highlight=False)
        if report["recovered"]:
            show(t)
        for sb, why in sorted(report["unrecoverable"].items()):
            err.print(f"[red]{escape(sb)}[/red]: not recovered: {escape(why)}", highlight=False)
    if report["unrecoverable"]:
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    """Add these commands to ``crabctl cluster``."""
    for fn in (join, hosts, ls, check, fork, migrate, recover):
        app.command(fn.__name__)(fn)
