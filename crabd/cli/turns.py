"""crabctl commands for turns: ``turn begin|end`` and ``log``.

A turn is one agent action.  A command run outside ``turn begin``/``turn
end`` goes into an *implicit* turn, which stays open until the next ``turn
begin`` (or ``turn end``) closes it: a shell-driven agent that wants a
checkpoint boundary per action brackets each action with ``turn begin`` and
``turn end``, or runs it with ``crabctl sh SB --as-turn SCRIPT``.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import TYPE_CHECKING, Annotated

import typer

from crabd.cli.common import JsonOpt, app, client, emit_json, escape, fmt_time, out, sub_app
from crabd.cli.sandboxes import SbArg

if TYPE_CHECKING:
    from crabd.sdk.models import Turn

turn_app = sub_app("Explicit turns: one agent action each, checkpointed at its end.")
app.add_typer(turn_app, name="turn", rich_help_panel="Turns")


def checkpoint_text(t: Turn) -> str:
    """A turn's checkpoint in a few words: its state, and the checkpoint it took or ended in."""
    if not t.checkpoint_state:
        return "open" if t.open else "-"
    if t.checkpoint_state == "done" and t.checkpoint_id:
        return f"done {t.checkpoint_id}"
    if t.checkpoint_state == "skipped" and t.basis_checkpoint:
        return f"skipped (= {t.basis_checkpoint})"
    if t.checkpoint_error:
        return f"{t.checkpoint_state}: {t.checkpoint_error}"
    return t.checkpoint_state


@turn_app.command("begin")
def begin(sandbox: SbArg, as_json: JsonOpt = False) -> None:
    """Begin a turn and print its number (an implicit turn still open is ended first)."""
    with client() as c:
        t = c.get(sandbox).begin_turn()
    emit_json(asdict(t)) if as_json else out.print(str(t.number))


@turn_app.command("end")
def end(
    sandbox: SbArg,
    wait: Annotated[
        bool,
        typer.Option("--wait", help="Return once the turn's checkpoint is taken (or skipped): exit 1 if it failed."),
    ] = False,
    as_json: JsonOpt = False,
) -> None:
    """End the open turn (explicit or implicit); print its number and its checkpoint's state.

    Without --wait it returns once crab decided what the turn needs; the
    checkpoint may still be pending then (crab takes it in the background,
    and the sandbox's next action waits for it).
    """
    with client() as c:
        t = c.get(sandbox).end_turn(wait=wait)
    emit_json(asdict(t)) if as_json else out.print(f"turn {t.number}: {escape(checkpoint_text(t))}", highlight=False)


@app.command(rich_help_panel="Turns")
def log(
    sandbox: SbArg,
    limit: Annotated[int, typer.Option("--limit", "-n", help="Last N turns.")] = 0,
    as_json: JsonOpt = False,
) -> None:
    """Show a sandbox's turns (explicit or implicit, and their checkpoints) and the commands run in each."""
    with client() as c:
        turns = c.get(sandbox).turns(limit)
    if as_json:
        emit_json([asdict(t) for t in turns])
        return
    if not turns:
        out.print("no turns yet")
    for t in turns:
        dur = f"{(t.ended_at or 0) - t.started_at:.2f}s" if t.ended_at else "open"
        kind = "implicit" if t.implicit else "explicit"
        head = f"[bold]turn {t.number}[/bold] ({kind})  {fmt_time(t.started_at)}  {dur}"
        if not t.open:
            head += f"  checkpoint {escape(checkpoint_text(t))}"
        out.print(head, highlight=False)
        if not t.commands:
            out.print("  [dim](no commands)[/dim]")
            continue
        from rich.table import Table
        from rich.text import Text

        table = Table.grid(padding=(0, 2), pad_edge=False)
        for _ in range(4):
            table.add_column(no_wrap=True)
        table.add_column(overflow="fold")
        for cmd in t.commands:
            exit_text = "timeout" if cmd.timed_out else f"exit {cmd.exit_code}"
            table.add_row(f"  #{cmd.seq}", cmd.kind, exit_text, f"{cmd.duration_s:.3f}s", Text(cmd.command[:80]))
        out.print(table, highlight=False)
