"""Build hooks: generate the gRPC code from crabd/api/v1/*.proto, and ship crab's data files.

The generated modules (``*_pb2.py``, ``*_pb2_grpc.py``, ``*_pb2.pyi``) are
written next to their ``.proto`` files, are git-ignored and are never edited
by hand.  They are produced by every build (wheel, sdist or editable
install) and by ``python setup.py build_proto``.

The data files crabd needs at run time (the inspector's C source, the env
image recipes, the host set-up script, the systemd files) live at the
repository's top level; a non-editable build copies each into the built
package as ``crabd/_data/<same path>`` (the list and the layout:
``crabd/util/resources.py``; ``MANIFEST.in`` puts the same files in the sdist).
"""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

from setuptools import Command, setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent


def generate_protos() -> None:
    from grpc_tools import protoc  # build-time dependency (pyproject build-system)

    protos = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "crabd" / "api").rglob("*.proto"))
    if not protos:
        return
    include = str(Path(protoc.__file__).parent / "_proto")
    args = [
        "grpc_tools.protoc",
        f"-I{ROOT}",
        f"-I{include}",
        f"--python_out={ROOT}",
        f"--pyi_out={ROOT}",
        f"--grpc_python_out={ROOT}",
        *protos,
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed on " + " ".join(protos))


class BuildProto(Command):
    description = "generate gRPC code from .proto files"
    user_options: list[tuple[str, str | None, str]] = []

    def initialize_options(self) -> None:
        pass

    def finalize_options(self) -> None:
        pass

    def run(self) -> None:
        generate_protos()


def shipped_files() -> tuple[str, ...]:
    """crabd.util.resources.SHIPPED, read without importing crabd (its dependencies may not be installed)."""
    spec = importlib.util.spec_from_file_location("_crab_resources", ROOT / "crabd" / "util" / "resources.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return tuple(module.SHIPPED)


def copy_data(target: Path) -> None:
    """Lay the shipped files into ``target`` (the built package's ``_data``), each at its repository path."""
    if target.exists():
        shutil.rmtree(target)
    for rel in shipped_files():
        src, dst = ROOT / rel, target / rel
        if src.is_dir():
            shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        elif src.is_file():
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst)
        else:
            raise SystemExit(f"{rel} is missing: the package would be incomplete (is MANIFEST.in up to date?)")


class BuildPy(build_py):
    def run(self) -> None:
        generate_protos()
        super().run()
        # An editable install reads the checkout's own files (crabd/util/resources.py), so it gets no copy.
        if not self.editable_mode:
            copy_data(Path(self.build_lib) / "crabd" / "_data")


setup(cmdclass={"build_py": BuildPy, "build_proto": BuildProto})
