"""`crabctl`: the operator's command line.

Human tables by default, ``--json`` for machines.  :func:`run` is the one
place an error ends a command:

* a :class:`CrabError`: its message and hint on stderr, exit code 1;
* a usage error (a missing argument, an unknown option or command, a bad
  value): click's own message and how to get help, exit code 2;
* anything else is a bug: "internal error", exit code 1, the traceback
  with ``--debug``.

Under ``--json`` each of them is one JSON object on stderr,
``{"error": {"type", "message", "hint"}}``, with the same exit codes.
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Annotated

import typer
from typer import _click
from typer.models import CommandInfo

from crabd.cli import (  # noqa: F401
    archives,
    checkpoints,
    engine,
    host,
    pinned_images,
    quota,
    retention,
    rock,
    sandboxes,
    sessions,
    store,
    turns,
)
from crabd.cli.common import JsonOpt, app, emit_json, err, error_json, escape, out, show_error, state, sub_app

if TYPE_CHECKING:
    from crabd.host.checks import Check

env_app = sub_app("Sandbox env images.")
app.add_typer(env_app, name="env", rich_help_panel="Host")

try:
    from crabd.cluster.cli import cluster as cluster_app
except ImportError:  # the `cluster` extra is not installed: no `crabctl cluster`
    pass
else:
    app.add_typer(cluster_app, name="cluster", rich_help_panel="Host")

_STYLE = {"ok": "green", "warn": "yellow", "fail": "red"}


@app.command(rich_help_panel="Host")
def doctor(as_json: JsonOpt = False) -> None:
    """Check every host capability crab needs; exit non-zero if any fails."""
    from crabd.config import load_config
    from crabd.host import doctor as doctor_mod
    from crabd.host.checks import Status

    cfg = load_config(state.config)
    checks: list[Check] = doctor_mod.run_checks(cfg)
    failed = [c for c in checks if c.status is Status.FAIL]
    if as_json:
        emit_json({"ok": not failed, "checks": [c.as_dict() for c in checks]})
    else:
        from rich.table import Table

        table = Table(show_header=True, header_style="bold")
        table.add_column("check")
        table.add_column("status")
        table.add_column("details")
        for c in checks:
            detail = escape(c.summary) + (f"\n[dim]fix:[/dim] {escape(c.fix)}" if c.fix else "")
            table.add_row(escape(c.name), f"[{_STYLE[c.status.value]}]{c.status.value}[/]", detail)
        out.print(table)
        out.print(f"{len(failed)} failed" if failed else "all required checks passed")
    if failed:
        raise typer.Exit(1)


@env_app.command("build")
def env_build(
    names: Annotated[list[str] | None, typer.Argument(metavar="ENV", help="Envs to build (default: all).")] = None,
    force: Annotated[bool, typer.Option("--force", help="Rebuild even if the content tag exists.")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Build env images whose recipe changed (content-tagged; unchanged ones are skipped)."""
    from crabd.host import images

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
    from crabd.host import images

    rows = [(r.name, r.image_ref, images.image_exists(r.image_ref)) for r in images.list_recipes()]
    if as_json:
        emit_json([{"env": name, "image": ref, "built": built} for name, ref, built in rows])
        return
    from rich.table import Table

    table = Table("env", "image", "built")
    for name, ref, built in rows:
        table.add_row(name, ref, "yes" if built else "no")
    out.print(table)


def wants_json(args: Sequence[str]) -> bool:
    """--json among crabctl's own arguments (not after ``--``, where a command's arguments begin)."""
    for a in args:
        if a == "--":
            return False
        if a == "--json":
            return True
    return False


def _usage_error(exc: _click.exceptions.ClickException) -> int:
    """Report a usage error (exit 2) as click words it, with how to get help."""
    ctx = getattr(exc, "ctx", None)
    if isinstance(exc, _click.exceptions.NoArgsIsHelpError) and ctx is not None:
        # `crabctl` or `crabctl checkpoint` alone: the help is the answer.
        typer.echo(ctx.get_help())
        return 0
    if state.json:
        path = ctx.command_path if ctx is not None else "crabctl"
        error_json("UsageError", exc.format_message(), f"See `{path} --help`.")
    else:
        exc.show()
    return exc.exit_code


#: crabctl's own options that take a value (``--socket PATH``): the token after one is no command name.
_GLOBAL_VALUED = frozenset({"--config", "--socket", "--cluster"})


def _command_name(args: Sequence[str]) -> str | None:
    """The top-level command ``args`` invoke (``ps`` in ``--socket S ps -a``), or None (only options)."""
    skip = False
    for a in args:
        if skip:
            skip = False
        elif a in _GLOBAL_VALUED:
            skip = True
        elif not a.startswith("-"):
            return a
    return None


def _app_for(args: Sequence[str]) -> typer.Typer:
    """``app`` with only the command ``args`` invoke, else all of it.

    Typer builds a click command for every command of the app at each call
    (~24 ms, a sixth of the 150 ms a call may take); only the invoked one is
    needed.  Help, a typo and anything not told apart get the whole app, so
    their messages (the command list, "No such command") are the same.
    """
    name = _command_name(args)
    if name is None:
        return app
    commands = [c for c in app.registered_commands if (c.name or _default_name(c)) == name]
    groups = [g for g in app.registered_groups if g.name == name]
    if not commands and not groups:
        return app
    only = copy.copy(app)
    only.registered_commands = commands
    only.registered_groups = groups
    return only


def _default_name(command: CommandInfo) -> str:
    # typer's own rule for a command registered without a name: the function's, dashed.
    callback = command.callback
    return callback.__name__.lower().replace("_", "-") if callback is not None else ""


def run(args: Sequence[str], prog_name: str = "crabctl") -> int:
    """Run crabctl with ``args``; its exit code (every error reported as the module doc says)."""
    state.json = wants_json(args)
    try:
        rc = _app_for(args)(args=list(args), prog_name=prog_name, standalone_mode=False)
    except typer.Exit as exc:
        return exc.exit_code
    except typer.Abort:
        err.print("aborted")
        return 130
    except _click.exceptions.ClickException as exc:
        return _usage_error(exc)
    except Exception as exc:
        from crabd.errors import CrabError  # (only now: importing it costs every command time)

        if state.debug:
            raise
        if isinstance(exc, CrabError):
            show_error(exc)
            return 1
        # A bug.
        if state.json:
            error_json("InternalError", repr(exc), "Rerun with --debug for a traceback and report it.")
        else:
            err.print(f"[red]internal error:[/red] {escape(repr(exc))}", highlight=False)
            err.print("[dim]hint:[/dim] rerun with --debug for a traceback and report it")
        return 1
    return rc if isinstance(rc, int) else 0


def main() -> None:
    sys.exit(run(sys.argv[1:]))


if __name__ == "__main__":
    main()
