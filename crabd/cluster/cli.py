"""``crabctl cluster``: the cluster's TLS material (CA and per-host certificates), and its operation.

Mounted by crabctl as a sub-app; it imports no Ray, only ``cryptography``
(the ``cluster`` extra), so ``crabctl cluster ca init`` works on a machine
that only hands out certificates.  The commands that reach a running
cluster (``join``, ``hosts``, ``ls``, ``check``, ``fork``, ``migrate``,
``recover``; :mod:`crabd.cluster.cli_ops`) load Ray only when they run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from crabd.cluster import cli_ops, tls

cluster = typer.Typer(
    no_args_is_help=True,
    help="The Ray cluster layer (crabctl --cluster ADDR cluster ...): hosts, fork, migrate, recover; TLS.",
)
ca_app = typer.Typer(no_args_is_help=True, help="The cluster's certificate authority.")
cluster.add_typer(ca_app, name="ca")

DirOpt = Annotated[Path, typer.Option("--dir", help="Directory of the cluster's TLS files.")]


def _fail(e: tls.TlsError) -> typer.Exit:
    typer.echo(f"error: {e}", err=True)
    return typer.Exit(1)


@ca_app.command("init")
def ca_init(
    directory: DirOpt,
    force: Annotated[bool, typer.Option("--force", help="Replace an existing CA (re-issue every host cert).")] = False,
) -> None:
    """Create the cluster CA (ca.crt, ca.key) in DIR."""
    try:
        path = tls.init_ca(directory, force=force)
    except tls.TlsError as e:
        raise _fail(e) from None
    typer.echo(str(path))


@cluster.command("cert")
def cert(
    host: Annotated[str, typer.Argument(help="The host id (also a DNS SAN).")],
    directory: DirOpt,
    ip: Annotated[list[str] | None, typer.Option("--ip", help="An IP address other hosts reach HOST on.")] = None,
    dns: Annotated[list[str] | None, typer.Option("--dns", help="Another DNS name of HOST.")] = None,
) -> None:
    """Issue HOST's key and certificate, signed by the CA in DIR; prints the Ray TLS environment."""
    try:
        tls.issue_host_cert(directory, host, ips=ip or (), dns_names=dns or ())
        env = tls.ray_tls_env(directory, host)
    except tls.TlsError as e:
        raise _fail(e) from None
    for k, v in env.items():
        typer.echo(f"{k}={v}")


cli_ops.register(cluster)
