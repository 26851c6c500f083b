from __future__ import annotations

import importlib
import os
import pickle
import pkgutil
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import docker.errors
import pytest
import requests

import crabd.errors
from crabd.backends.criu.images import COMMON_MAGIC, PSTREE_MAGIC, dumped_tasks
from crabd.backends.docker_errors import docker_errors
from crabd.errors import (
    CrabError,
    CriuError,
    CriuImageInvalid,
    DockerError,
    DumpError,
    HostError,
    ImageError,
    SandboxBusy,
    error_class,
    registered,
)


def crabd_error_classes(cls: type[CrabError] = CrabError) -> Iterator[type[CrabError]]:
    """Every CrabError subclass defined in crabd, depth first."""
    for sub in cls.__subclasses__():
        if sub.__module__.startswith("crabd."):
            yield sub
        yield from crabd_error_classes(sub)


def test_attrs_and_hint() -> None:
    err = CriuError("dump failed", log_path="/var/log/crab/x.log", log_excerpt="Error (criu/x.c:1)")
    assert err.log_path == "/var/log/crab/x.log"
    assert err.attrs["log_excerpt"].startswith("Error")
    assert "CRIU log" in err.hint
    assert "hint:" in err.describe()


def test_every_error_is_a_crab_error_and_registered() -> None:
    assert issubclass(HostError, CrabError)
    assert error_class("CriuError") is CriuError
    assert error_class("SomethingElse") is CrabError
    for cls in crabd_error_classes():
        assert error_class(cls.__name__) is cls


def _error_modules() -> Iterator[ModuleType]:
    """Every module of the crabd.errors package (imported here, so a module the package forgets is still found)."""
    for info in pkgutil.iter_modules(crabd.errors.__path__, "crabd.errors."):
        yield importlib.import_module(info.name)


def test_the_package_exports_and_registers_every_class_of_its_modules() -> None:
    # A class registers when its module is imported, and crabd.errors imports only the modules it
    # re-exports from: a class it did not re-export could cross gRPC and come back as plain CrabError.
    defined = {
        name: cls
        for mod in _error_modules()
        for name, cls in vars(mod).items()
        if isinstance(cls, type) and issubclass(cls, CrabError) and cls.__module__ == mod.__name__
    }
    assert len(defined) > 40
    assert set(defined) <= set(crabd.errors.__all__)
    ours = {name for name, cls in registered().items() if cls.__module__.startswith("crabd.errors.")}
    assert ours == set(defined)
    for name, cls in defined.items():
        assert getattr(crabd.errors, name) is cls and error_class(name) is cls


def test_importing_crabd_errors_alone_registers_every_class() -> None:
    # In a fresh interpreter: what the SDK has before anything else is imported.
    code = (
        "import crabd.errors as e; "
        "print(sorted(n for n, c in e.registered().items() if c.__module__.startswith('crabd.errors')))"
    )
    root = str(Path(crabd.errors.__file__).parents[2])  # this checkout, whatever the venv has installed
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env).stdout
    exported = sorted(n for n in crabd.errors.__all__ if isinstance(getattr(crabd.errors, n), type))
    assert out.strip() == repr(exported)


def test_explicit_hint_wins() -> None:
    assert HostError("x", hint="do y").hint == "do y"


def test_fields_are_the_constructor_keywords() -> None:
    assert SandboxBusy.fields == ("sandbox",)
    assert HostError.fields == ()
    err = SandboxBusy("busy", sandbox="sb-1")
    assert err.attrs == {"sandbox": "sb-1"}


def test_a_second_class_of_one_name_is_refused() -> None:
    with pytest.raises(TypeError, match="SandboxBusy"):

        class SandboxBusy(CrabError):  # the point of the test: this name is taken
            pass

    assert error_class("SandboxBusy") is crabd.errors.SandboxBusy


def test_errors_pickle_with_their_data() -> None:
    err = SandboxBusy("busy", sandbox="sb-1", hint="wait")
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is SandboxBusy and back.attrs == err.attrs and back.hint == "wait" and str(back) == "busy"


def _docstring_tree() -> dict[str, str | None]:
    """Class name -> parent's name, from the tree in crabd/errors/__init__.py's docstring (indented 4 per level)."""
    doc = crabd.errors.__doc__ or ""
    block = doc.split("::\n", 1)[1]
    parents: dict[str, str | None] = {}
    stack: list[str] = []
    for line in block.splitlines():
        found = re.fullmatch(r"(    +)(\w+): \S.*", line)
        if found is None:
            assert not line.strip(), f"not a tree line: {line!r}"
            continue
        depth = len(found.group(1)) // 4 - 1
        assert depth <= len(stack), f"{found.group(2)} is indented too deep"
        del stack[depth:]
        parents[found.group(2)] = stack[-1] if stack else None
        stack.append(found.group(2))
    return parents


def test_docstring_tree_lists_every_class_under_its_parent() -> None:
    tree = _docstring_tree()
    ours = {name: cls for name, cls in registered().items() if cls.__module__.startswith("crabd.")}
    assert set(tree) == set(ours), "update the tree in crabd/errors/__init__.py's docstring"
    for name, cls in ours.items():
        parent = None if cls is CrabError else cls.__bases__[0].__name__
        assert tree[name] == parent, f"{name} is listed under {tree[name]}, but derives from {parent}"


def _response(status: int) -> requests.Response:
    res = requests.Response()
    res.status_code = status
    return res


def test_docker_errors_translates_each_kind_and_keeps_the_cause() -> None:
    cases: list[tuple[Exception, type[CrabError], int | None]] = [
        (docker.errors.ImageNotFound("gone", _response(404), explanation="no such image"), ImageError, None),
        (docker.errors.APIError("conflict", _response(409), explanation="name in use"), DockerError, 409),
        (requests.ConnectionError("socket closed"), DockerError, None),
        (docker.errors.DockerException("no engine"), DockerError, None),
    ]
    for raised, expected, status in cases:
        with pytest.raises(expected) as info, docker_errors("create container"):
            raise raised
        assert type(info.value) is expected and info.value.__cause__ is raised
        assert str(info.value).startswith("create container: ")
        if isinstance(info.value, DockerError):
            assert info.value.status == status


def test_docker_errors_lets_crab_errors_and_results_through() -> None:
    with pytest.raises(CriuError), docker_errors("start container"):
        raise CriuError("refused", log_path=None, log_excerpt="")
    with docker_errors("docker version"):
        version = "27.0"
    assert version == "27.0"


def test_a_malformed_criu_image_is_not_a_criu_refusal(tmp_path: Path) -> None:
    (tmp_path / "pstree.img").write_bytes(
        COMMON_MAGIC.to_bytes(4, "little") + PSTREE_MAGIC.to_bytes(4, "little") + b"\x01"
    )
    with pytest.raises(CriuImageInvalid) as info:
        dumped_tasks(tmp_path)
    assert isinstance(info.value, DumpError) and not isinstance(info.value, CriuError)
    assert info.value.path == str(tmp_path / "pstree.img") and "truncated" in str(info.value)
