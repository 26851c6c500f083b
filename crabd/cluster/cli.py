"""``crabctl cluster``: the cluster's TLS material (CA and per-host certificates), and its operation.

Mounted by crabctl as a sub-app; it imports no Ray, only ``cryptography``
(the ``cluster`` extra), so ``crabctl cluster ca init`` works on a machine
that only hands out certificates.  The commands that reach a running
cluster (``join``, ``hosts``, ``ls``, ``check``, ``fork``, ``migrate``,
``recover``; :mod:`crabd.cluster.cli_ops`) load Ray only when they run.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from crabd.cli.common import JsonOpt, emit_json, show_error, sub_app
from crabd.cluster import cli_ops

if TYPE_CHECKING:
    from crabd.cluster import tls

cluster = sub_app("The Ray cluster layer (crabctl --cluster ADDR cluster ...): hosts, fork, migrate, recover; TLS.")
ca_app = sub_app("The cluster's certificate authority.")
cluster.add_typer(ca_app, name="ca")

DirOpt = Annotated[Path, typer.Option("--dir", metavar="DIR", help="Directory of the cluster's TLS files.")]


def _tls() -> None:
    """:mod:`crabd.cluster.tls`, loaded when a TLS command runs (it needs the ``cluster`` extra's cryptography)."""
    try:
        from crabd.cluster import tls
    except ImportError as exc:
        from crabd.errors import HostError

        show_error(
            HostError(
                f"the cluster's TLS commands need the `cluster` extra: {exc}",
                hint="Install it: pip install 'crabd[cluster]'.",
            )
        )
        raise typer.Exit(1) from None
    del tls


def _fail(e: tls.TlsError) -> typer.Exit:
    from crabd.errors import CrabError

    show_error(CrabError(str(e), hint="See docs/cluster.md (TLS)."))
    return typer.Exit(1)


@ca_app.command("init")
def ca_init(
    directory: DirOpt,
    force: Annotated[bool, typer.Option("--force", help="Replace an existing CA (re-issue every host cert).")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Create the cluster CA (ca.crt, ca.key) in DIR."""
    _tls()
    from crabd.cluster import tls

    try:
        path = tls.init_ca(directory, force=force)
    except tls.TlsError as e:
        raise _fail(e) from None
    if as_json:
        emit_json({"ca": str(path)})
    else:
        typer.echo(str(path))


@cluster.command("cert")
def cert(
    host: Annotated[str, typer.Argument(metavar="HOST", help="The host id (also a DNS SAN).")],
    directory: DirOpt,
    ip: Annotated[
        list[str] | None, typer.Option("--ip", metavar="ADDR", help="An IP address other hosts reach HOST on.")
    ] = None,
    dns: Annotated[list[str] | None, typer.Option("--dns", metavar="NAME", help="Another DNS name of HOST.")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Issue HOST's key and certificate, signed by the CA in DIR; prints the Ray TLS environment."""
    _tls()
    from crabd.cluster import tls

    try:
        tls.issue_host_cert(directory, host, ips=ip or (), dns_names=dns or ())
        env = tls.ray_tls_env(directory, host)
    except tls.TlsError as e:
        raise _fail(e) from None
    if as_json:
        emit_json(env)
        return
    for k, v in env.items():
        typer.echo(f"{k}={v}")


cli_ops.register(cluster)
