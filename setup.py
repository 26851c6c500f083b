"""Build hook: generate the gRPC code from crabd/api/v1/*.proto.

The generated modules (``*_pb2.py``, ``*_pb2_grpc.py``, ``*_pb2.pyi``) are
written next to their ``.proto`` files, are git-ignored and are never edited
by hand.  They are produced by every build (wheel, sdist or editable
install) and by ``python setup.py build_proto``.
"""

from __future__ import annotations

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


class BuildPy(build_py):
    def run(self) -> None:
        generate_protos()
        super().run()


setup(cmdclass={"build_py": BuildPy, "build_proto": BuildProto})
