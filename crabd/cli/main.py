"""`crabctl`: the operator's command line.

Human tables by default, ``--json`` for machines.  A :class:`CrabError`
ends the command with its message and hint on stderr and exit code 1;
tracebacks appear only with ``--debug``.
"""

from __future__ import annotations

import sys
from typing import Annotated

import typer
from rich.table import Table

from crabd.cli import archives, checkpoints, engine, host, quota, retention, sandboxes, store, turns  # noqa: F401  (register their commands)
from crabd.cli.common import JsonOpt, app, emit_json, err, out, show_error, state
from crabd.config import load_config
from crabd.errors import CrabError
from crabd.host import doctor as doctor_mod
from crabd.host import images
from crabd.host.checks import Status

env_app = typer.Typer(no_args_is_help=True, help="Sandbox env images.")
app.add_typer(env_app, name="env")

try:
    from crabd.cluster.cli import cluster as cluster_app
except ImportError:  # the `cluster` extra (cryptography, Ray) is not installed: no `crabctl cluster`
    pass
else:
    app.add_typer(cluster_app, name="cluster")

_STYLE = {"ok": "green", "warn": "yellow", "fail": "red"}


@app.command()
def doctor(as_json: JsonOpt = False) -> None:
    """Check every host capability crab needs; exit non-zero if any fails."""
    cfg = load_config(state.config)
    checks = doctor_mod.run_checks(cfg)
    failed = [c for c in checks if c.status is Status.FAIL]
    if as_json:
        emit_json({"ok": not failed, "checks": [c.as_dict() for c in checks]})
    else:
        table = Table(show_header=True, header_style="bold")
        table.add_column("check")
        table.add_column("status")
        table.add_column("details")
        for c in checks:
            detail = c.summary + (f"\n[dim]fix:[/dim] {c.fix}" if c.fix else "")
            table.add_row(c.name, f"[{_STYLE[c.status.value]}]{c.status.value}[/]", detail)
        out.print(table)
        out.print(f"{len(failed)} failed" if failed else "all required checks passed")
    if failed:
        raise typer.Exit(1)


@env_app.command("build")
def env_build(
    names: Annotated[list[str] | None, typer.Argument(help="Envs to build (default: all).")] = None,
    force: Annotated[bool, typer.Option("--force", help="Rebuild even if the content tag exists.")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Build env images whose recipe changed (content-tagged; unchanged ones are skipped)."""
    recipes = [images.find_recipe(n) for n in names] if names else images.list_recipes()
    results = []
    for recipe in recipes:
        if not as_json:
            typer.echo(f"[setup] image {recipe.name}: checking {recipe.image_ref}", err=True)
        ref, built = images.build(recipe, force=force)
        stale = images.remove_stale(recipe) if built else []
        results.append({"env": recipe.name, "image": ref, "built": built, "removed": stale})
        if not as_json:
            typer.echo(f"[setup] image {recipe.name}: {'built' if built else 'up to date'} {ref}", err=True)
    if as_json:
        emit_json(results)


@env_app.command("ls")
def env_ls(as_json: JsonOpt = False) -> None:
    """List the envs crab knows and whether their current image is built."""
    rows = [(r.name, r.image_ref, images.image_exists(r.image_ref)) for r in images.list_recipes()]
    if as_json:
        emit_json([{"env": name, "image": ref, "built": built} for name, ref, built in rows])
        return
    table = Table("env", "image", "built")
    for name, ref, built in rows:
        table.add_row(name, ref, "yes" if built else "no")
    out.print(table)


def main() -> None:
    try:
        # With standalone_mode=False click returns a command's exit code
        # instead of calling sys.exit itself.
        rc = app(standalone_mode=False)
    except CrabError as exc:
        if state.debug:
            raise
        show_error(exc)
        sys.exit(1)
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except typer.Abort:
        err.print("aborted")
        sys.exit(130)
    except Exception as exc:  # click usage errors and the unexpected
        import click

        if isinstance(exc, click.ClickException):
            exc.show()
            sys.exit(exc.exit_code)
        if state.debug:
            raise
        err.print(f"[red]internal error:[/red] {exc!r}", highlight=False)
        err.print("[dim]hint:[/dim] rerun with --debug for a traceback and report it")
        sys.exit(2)
    sys.exit(rc if isinstance(rc, int) else 0)


if __name__ == "__main__":
    main()
