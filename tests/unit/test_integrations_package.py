"""crabd.integrations: the framework integrations are in the package; their old agents.integrations paths still work."""

from __future__ import annotations

import importlib
import sys
from typing import Any

import pytest

pytest.importorskip("minisweagent")

from crabd.integrations.minisweagent import CrabEnvironment, CrabEnvironmentError


@pytest.mark.parametrize("name", ["minisweagent", "minisweagent_data"])
def test_an_old_import_path_warns_and_is_the_new_module_itself(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sys.modules, f"agents.integrations.{name}", raising=False)
    with pytest.warns(DeprecationWarning, match=f"crabd.integrations.{name}"):
        old = importlib.import_module(f"agents.integrations.{name}")
    # The same module, not a copy: classes compare equal and monkeypatching either patches both.
    assert old is importlib.import_module(f"crabd.integrations.{name}")


def test_the_old_class_path_names_the_same_class(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sys.modules, "agents.integrations.minisweagent", raising=False)
    with pytest.warns(DeprecationWarning):
        from minisweagent.environments import get_environment_class

        cls = get_environment_class("agents.integrations.minisweagent.CrabEnvironment")
    assert cls is CrabEnvironment


def test_crab_task_without_a_checkout_says_what_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    # An installed crabd has no agents package: crab_task's suites are a checkout's.
    monkeypatch.setitem(sys.modules, "agents", None)
    monkeypatch.setitem(sys.modules, "agents.tasks", None)
    client: Any = object()  # never reached: the task is looked up first
    with pytest.raises(CrabEnvironmentError, match="only a crab checkout has") as raised:
        CrabEnvironment(client=client, crab_task="shell/kv-server")
    assert isinstance(raised.value.__cause__, ModuleNotFoundError)
