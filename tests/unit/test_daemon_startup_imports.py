"""What crabd's start-up imports: each module is time before a restarted crabd serves again."""

from __future__ import annotations

import subprocess
import sys


def test_the_daemon_does_not_import_the_proxy_unless_it_is_enabled() -> None:
    """aiohttp (the OpenAI proxy's server, ~140 ms) is imported by ``_start_proxy`` only when
    ``[proxy] enabled``: it is off by default."""
    probe = "import sys, crabd.daemon.app; print(sorted(m for m in sys.modules if m.split('.')[0] == 'aiohttp'))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "[]"


def test_the_daemon_and_the_runc_backend_do_not_import_docker_py() -> None:
    """docker-py (and requests, urllib3 under it: ~65 ms) is imported only where Docker is called:
    the Docker backend's assembly, and the runc backend's image lookups when one runs."""
    probe = (
        "import sys, pkgutil, importlib, crabd.daemon.main, crabd.backends.runc as r\n"
        "for m in pkgutil.iter_modules(r.__path__): importlib.import_module('crabd.backends.runc.' + m.name)\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('docker', 'requests', 'urllib3')))"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "[]"
