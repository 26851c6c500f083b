"""`crabd`: the daemon's command line.  Runs in the foreground (for systemd)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from pathlib import Path

from crabd.config import load_config
from crabd.daemon import logs
from crabd.daemon.app import Daemon, serve
from crabd.errors import CrabError
from crabd.models import InspectorMode
from crabd.util import faults


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="crabd", description="crab's host daemon (foreground).")
    p.add_argument("--config", help="crabd.toml (default /etc/crab/crabd.toml or $CRAB_CONFIG)")
    p.add_argument("--socket", help="override [paths] socket")
    p.add_argument("--state-dir", help="override [paths] state_dir")
    p.add_argument("--log-dir", help="override [paths] log_dir")
    p.add_argument("--log-file", help="also write JSON logs to this file")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.add_argument(
        "--ephemeral", action="store_true", help="remove every sandbox of this daemon on shutdown (embedded/test mode)"
    )
    p.add_argument("--inspector", choices=list(InspectorMode), type=InspectorMode, help="override [inspector] mode")
    p.add_argument("--inspector-shadow", action="store_true", help="set [inspector] shadow = true")
    p.add_argument(
        "--proxy-upstream", help="enable the OpenAI proxy in front of this LLM server (sets [proxy] upstream)"
    )
    p.add_argument("--proxy-listen", help="enable the OpenAI proxy on this loopback host:port (sets [proxy] listen)")
    args = p.parse_args(argv)
    overrides: dict[str, dict[str, object]] = {"paths": {}}
    for key in ("socket", "state_dir", "log_dir"):
        value = getattr(args, key)
        if value:
            overrides["paths"][key] = value
    if args.inspector or args.inspector_shadow:
        overrides["inspector"] = {}
        if args.inspector:
            overrides["inspector"]["mode"] = args.inspector
        if args.inspector_shadow:
            overrides["inspector"]["shadow"] = True
    if args.proxy_upstream or args.proxy_listen:
        overrides["proxy"] = {"enabled": True}
        if args.proxy_upstream:
            overrides["proxy"]["upstream"] = args.proxy_upstream
        if args.proxy_listen:
            overrides["proxy"]["listen"] = args.proxy_listen
    logs.setup(args.log_level, Path(args.log_file) if args.log_file else None)
    try:
        cfg = load_config(args.config, overrides=overrides)
        # Test-only fault injection (util/faults.py): read once, here, from crabd's own environment.
        armed = faults.arm_from_env()
        if armed:
            logging.getLogger("crabd").warning("fault injection armed", extra={"points": armed})
        daemon = Daemon(cfg, ephemeral=args.ephemeral, log_level=args.log_level, log_file=args.log_file)
        asyncio.run(serve(daemon))
    except CrabError as exc:
        sys.stderr.write(f"crabd: {exc.message}\nhint: {exc.hint}\n")
        sys.exit(1)
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
