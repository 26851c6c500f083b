"""crabctl's click layer: help grouped into panels, readable metavars, ``-h`` everywhere, fast values.

crabctl renders help as plain text (typer's rich help would load rich,
markdown and pygments-sized modules on every ``--help``, and eats square
brackets such as ``[quota]`` as markup).  The panels are typer's
``rich_help_panel`` of each command, drawn here as click sections in the
order of :data:`PANELS`.

Usage lines and option lists name values as ``SB``, ``N``, ``KEY=VAL`` or
``auto|fs|full|none`` rather than typer's ``<list[str]>`` or ``<bool>``:
:func:`tidy` gives every parameter of a command crabctl's own classes
(:class:`Argument`, :class:`Option`) before click lays it out.

Those classes also convert the plain values crabctl takes (str, int,
float, bool, paths, a choice of words, lists of them) themselves: typer
would build a pydantic validator per parameter on every run, and
importing pydantic alone costs a command more than its own work.
Anything else still goes through typer's own conversion.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal, cast, get_args, get_origin

from typer import _click
from typer._coercion import RuntimeParam
from typer.core import TyperArgument, TyperCommand, TyperGroup, TyperOption

#: Context settings of every crabctl command: ``-h`` is ``--help``.
CONTEXT: dict[str, Any] = {"help_option_names": ["-h", "--help"], "max_content_width": 120}

#: The top-level help's panels, in order (a command names its own with ``rich_help_panel``).
PANELS = ("Sandboxes", "Turns", "Checkpoints", "Store", "Host")
#: The order of commands within a panel (others follow in the order they were added).
ORDER = (
    *("create", "ps", "inspect", "exec", "sh", "session", "stop", "rm", "recover"),
    *("turn", "log"),
    *("checkpoint", "restore", "fork", "tree"),
    *("store", "retention", "quota", "gc", "verify"),
    *("doctor", "env", "host", "daemon", "engine", "rock", "cluster"),
)
#: The order of a group's own commands, where it is not the order they were added.
GROUP_ORDER = {
    "checkpoint": ("create", "ls", "inspect", "rm", "failures", "pin", "unpin", "thin", "export", "import", "push"),
    "cluster": ("join", "hosts", "check", "ls", "fork", "migrate", "recover", "cert", "ca"),
}

#: Type names (typer's) shown as crabctl shows them.
_TYPE_WORDS = {"int": "N", "float": "SECONDS", "str": "TEXT", "Path": "PATH", "bool": ""}


_WORDS = {int: "integer", float: "number"}


def _convert_one(kind: Any, value: Any, info: Any) -> Any:
    """``value`` (a word from the command line, or a default) as ``kind``; ValueError says why not."""
    if get_origin(kind) is Literal:
        if value not in get_args(kind):
            choices = ", ".join(repr(c) for c in get_args(kind))
            raise ValueError(f"{value!r} is not one of {choices}.")
        return value
    if kind is str:
        return value if isinstance(value, str) else str(value)
    if kind is Path:
        return Path(value)
    if kind is bool:
        if isinstance(value, bool):
            return value
        word = str(value).lower()
        if word in ("1", "true", "yes", "on", "y", "t"):
            return True
        if word in ("0", "false", "no", "off", "n", "f"):
            return False
        raise ValueError(f"{value!r} is not a valid boolean.")
    try:
        number = kind(value)
    except (TypeError, ValueError):
        raise ValueError(f"{value!r} is not a valid {_WORDS.get(kind, kind.__name__)}.") from None
    if info.min is not None and number < info.min:
        raise ValueError(f"{number} is smaller than the minimum of {info.min}.")
    if info.max is not None and number > info.max:
        raise ValueError(f"{number} is larger than the maximum of {info.max}.")
    return number


def _simple(kind: Any) -> bool:
    return kind in (str, int, float, bool, Path) or (
        get_origin(kind) is Literal and all(isinstance(c, str) for c in get_args(kind))
    )


class _Plain(RuntimeParam):
    """typer's conversion of a parameter, for the plain kinds crabctl uses, without pydantic."""

    def _coerce_value(self, value: Any, param: Any, ctx: _click.Context) -> Any:
        info, kind = self.parameter_info, cast(Any, self.annotation)
        try:
            if get_origin(kind) is list:
                return [_convert_one(get_args(kind)[0], v, info) for v in value]
            return _convert_one(kind, value, info)
        except ValueError as exc:
            raise _click.exceptions.BadParameter(str(exc), ctx=ctx, param=param) from None


def _runtime(param: TyperArgument | TyperOption) -> RuntimeParam | None:
    """A :class:`_Plain` conversion when ``param``'s kind allows one (None: typer's own)."""
    desc = param.type_descriptor
    kind, info = cast(Any, desc.annotation), desc.parameter_info
    if desc.file_annotation is not None or getattr(info, "clamp", False) or getattr(info, "parser", None):
        return None
    inner = get_args(kind)[0] if get_origin(kind) is list else kind
    if not _simple(inner):
        return None
    return _Plain(parameter_info=info, annotation=kind)


class Argument(TyperArgument):
    """A positional parameter shown by its metavar: ``SB``, ``[CK]``, ``SB...``."""

    def get_runtime_param(self) -> RuntimeParam:
        if self._runtime_param is None:
            self._runtime_param = _runtime(self)
        return self._runtime_param or super().get_runtime_param()

    def display_type_rich(self, ctx: _click.Context) -> str | None:
        return None

    def _usage_display_name(self) -> str:
        name = self.display_name_raw + ("..." if self.nargs != 1 else "")
        return name if self.required else f"[{name}]"

    def _rich_display_name(self) -> str:
        return self.display_name_raw + ("..." if self.nargs != 1 else "")


class Option(TyperOption):
    """An option shown with a word for its value (``--timeout SECONDS``), flags with none."""

    def get_runtime_param(self) -> RuntimeParam:
        if self._runtime_param is None:
            self._runtime_param = _runtime(self)
        return self._runtime_param or super().get_runtime_param()

    def display_type_rich(self, ctx: _click.Context) -> str | None:
        if self.metavar is not None:
            return self.metavar
        if self.is_flag or self.count:
            return None
        desc = self.type_descriptor
        if desc.is_choice and desc.choices is not None:
            return "|".join(str(getattr(c, "value", c)) for c in desc.choices)
        bare = self.bare_type()
        if bare.startswith("list[") and bare.endswith("]"):
            bare = bare[5:-1]
        return _TYPE_WORDS.get(bare, bare.upper()) or None


def _tidy_help(opt: _click.core.Parameter | None) -> None:
    if opt is not None and type(opt) is TyperOption:
        opt.__class__ = Option


def tidy(cmd: _click.Command) -> _click.Command:
    """``cmd`` with crabctl's parameter classes and metavars (idempotent)."""
    if type(cmd) is TyperCommand:
        cmd.__class__ = CrabCommand
    for p in cmd.params:
        if type(p) is TyperArgument:
            p.__class__ = Argument
            if p.metavar is None and p.name:
                p.metavar = p.name.upper()
        elif type(p) is TyperOption:
            p.__class__ = Option
    return cmd


class CrabCommand(TyperCommand):
    """A crabctl command: its help option converts its value as the others (:func:`tidy`)."""

    def get_help_option(self, ctx: _click.Context) -> Any:
        opt = super().get_help_option(ctx)
        _tidy_help(opt)
        return opt


class CrabGroup(TyperGroup):
    """A crabctl command group: its commands tidied as click resolves them, listed by panel."""

    def get_help_option(self, ctx: _click.Context) -> Any:
        opt = super().get_help_option(ctx)
        _tidy_help(opt)
        return opt

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        tidy(self)

    def get_command(self, ctx: _click.Context, cmd_name: str) -> _click.Command | None:
        cmd = super().get_command(ctx, cmd_name)
        return None if cmd is None else tidy(cmd)

    def format_commands(self, ctx: _click.Context, formatter: _click.HelpFormatter) -> None:
        cmds = [(name, cmd) for name in self.list_commands(ctx) if (cmd := self.get_command(ctx, name)) is not None]
        cmds = [(name, cmd) for name, cmd in cmds if not cmd.hidden]
        if not cmds:
            return
        limit = formatter.width - 6 - max(len(name) for name, _ in cmds)
        panels: dict[str, list[tuple[str, str]]] = {}
        for name, cmd in cmds:
            panel = getattr(cmd, "rich_help_panel", None) or "Commands"
            panels.setdefault(panel, []).append((name, cmd.get_short_help_str(limit)))
        order = {p: i for i, p in enumerate(PANELS)}
        rank = {name: i for i, name in enumerate(GROUP_ORDER.get(self.name or "", ORDER))}
        for panel in sorted(panels, key=lambda p: order.get(p, len(PANELS))):
            with formatter.section(panel):
                formatter.write_dl(sorted(panels[panel], key=lambda row: rank.get(row[0], len(ORDER))))


class ExecCommand(CrabCommand):
    """``crabctl exec SB [OPTIONS] [--] CMD...``: crabctl's options end where the command begins.

    The command begins after ``--``, or at the first word after SB that is
    not one of exec's options: ``exec SB --timeout 2 sleep 9`` and ``exec
    SB --timeout 2 -- sleep 9`` both run ``sleep 9`` with a 2 s timeout,
    and ``exec SB ls -l`` runs ``ls -l``.
    """

    def parse_args(self, ctx: _click.Context, args: list[str]) -> list[str]:
        return super().parse_args(ctx, split_command(self, args))


def split_command(cmd: _click.Command, args: Sequence[str]) -> list[str]:
    """``args`` with ``--`` put where ``cmd``'s own options and its one positional (SB) end."""
    takes_value: dict[str, bool] = {}
    for p in cmd.params:  # (not get_params: it would cache a help option made without crabctl's -h)
        if isinstance(p, TyperOption):
            for opt in (*p.opts, *p.secondary_opts):
                takes_value[opt] = not (p.is_flag or p.count)
    head: list[str] = []
    seen_positional = False
    i = 0
    while i < len(args):
        a = args[i]
        if a == "--":
            return [*head, *args[i:]]
        if a.startswith("-") and a != "-":
            head.append(a)
            name = a.split("=", 1)[0]
            if takes_value.get(name) and "=" not in a and i + 1 < len(args):
                head.append(args[i + 1])
                i += 1
            i += 1
            continue
        if seen_positional:
            return [*head, "--", *args[i:]]
        seen_positional = True
        head.append(a)
        i += 1
    return head
