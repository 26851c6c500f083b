"""`crabctl host setup|install-service`: set a host up from the installed package alone.

These run here, as root, and never talk to crabd (crabd/host/provision.py and
crabd/host/service_install.py do the work; docs/host.md and docs/systemd.md).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from crabd.cli.common import JsonOpt, app, emit_json, sub_app

host_app = sub_app("Set this host up for crab (runs locally, as root).")
app.add_typer(host_app, name="host", rich_help_panel="Host")

DryRunOpt = Annotated[bool, typer.Option("--dry-run", help="List what would change; change nothing.")]


def _echo(line: str) -> None:
    typer.echo(line, err=True)


def _say(line: str) -> None:
    typer.echo(line)


@host_app.command("setup")
def setup(
    dry_run: DryRunOpt = False,
    skip_images: Annotated[bool, typer.Option("--skip-images", help="Do not build the sandbox env images.")] = False,
    as_json: JsonOpt = False,
) -> None:
    """`make setup` without a checkout: packages, CRIU, headers, Docker, crab-init, env images, CRIU's cache.

    Idempotent: each step checks first and changes only what is missing.
    """
    from crabd.host import provision

    steps = provision.setup(dry_run=dry_run, skip_images=skip_images, echo=_echo)
    for line in steps[0].log:  # a dry run's script log (a real run's went to stderr as it ran)
        _echo(line)
    if as_json:
        emit_json({"dry_run": dry_run, "steps": [s.as_dict() for s in steps]})
        return
    if dry_run:
        changes = [(s.name, c) for s in steps for c in s.changes]
        if not changes:
            _say("nothing to change: this host is set up")
            return
        _say("would change:")
        for name, change in changes:
            _say(f"  {name}: would {change}")
        return
    _say("host ready")


@host_app.command("install-service")
def install_service(
    dry_run: DryRunOpt = False,
    no_start: Annotated[
        bool, typer.Option("--no-start", help="Install the files only; enable and start nothing.")
    ] = False,
    prefix: Annotated[
        Path | None,
        typer.Option(
            "--prefix", metavar="DIR", help="The environment whose bin/crabd the unit runs (default: this one)."
        ),
    ] = None,
    root: Annotated[
        Path,
        typer.Option("--root", metavar="DIR", help="Install under this directory instead of / (no group, no service)."),
    ] = Path("/"),
    as_json: JsonOpt = False,
) -> None:
    """Install crabd's systemd unit, sysusers and tmpfiles files, the crab group, and start crabd where systemd runs."""
    from crabd.host import service_install

    report = service_install.install(root=root, prefix=prefix, dry_run=dry_run, start=not no_start)
    if as_json:
        emit_json({"dry_run": dry_run, **report.as_dict()})
        return
    verbs = {
        service_install.Action.CREATE: ("would write", "wrote"),
        service_install.Action.REPLACE: ("would replace", "replaced"),
        service_install.Action.KEEP: ("unchanged", "unchanged"),
    }
    for f in report.files:
        where = "" if f.path == f.target else f" (at {f.path})"
        _say(f"{verbs[f.action][0 if dry_run else 1]}: {f.target}{where}")
    for cmd in report.commands:
        _say(f"{'would run' if dry_run else 'ran'}: {cmd}")
    for note in report.notes:
        _say(f"note: {note}")
