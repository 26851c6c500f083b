"""crabctl builds the click command of the command it runs only (crabd/cli/main.py ``_app_for``)."""

from __future__ import annotations

from crabd.cli.common import app
from crabd.cli.main import _app_for, _command_name


def test_the_command_name_is_the_first_word_that_is_no_global_option_or_its_value() -> None:
    assert _command_name(["ps"]) == "ps"
    assert _command_name(["--socket", "/run/x.sock", "--debug", "ps", "-a"]) == "ps"
    assert _command_name(["--config", "ps", "checkpoint", "ls"]) == "checkpoint"  # a file named ps
    assert _command_name(["--help"]) is None
    assert _command_name([]) is None


def test_a_known_command_gets_an_app_of_that_command_alone() -> None:
    ps = _app_for(["ps"])
    assert ps is not app
    assert [c.callback.__name__ for c in ps.registered_commands if c.callback] == ["ps"]
    assert ps.registered_groups == []
    group = _app_for(["checkpoint", "ls", "SB"])
    assert [g.name for g in group.registered_groups] == ["checkpoint"] and group.registered_commands == []
    assert len(app.registered_commands) > 10  # the whole app is left as it was


def test_help_and_typos_get_the_whole_app() -> None:
    assert _app_for(["--help"]) is app
    assert _app_for(["pss"]) is app  # so click can say "Did you mean 'ps'?"
