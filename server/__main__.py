"""`kvstore-server` / `python -m kvstore.server`: parse flags, load the configuration, run the
daemon."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys

from kvstore.config import ServerConfig, load_config, problems
from kvstore.errors import ConfigError
from kvstore.server.logsetup import setup_logging


def build_parser() -> argparse.ArgumentParser:
    # No prefixes of flags: `--host-byte 2GiB` or `--data /x` must be refused, not taken for
    # `--host-bytes` or `--data-dir` (a typo that happens to be a prefix configures silently).
    p = argparse.ArgumentParser(prog="kvstore-server", description="kvstore storage daemon",
                                allow_abbrev=False)
    p.add_argument("--config", help="TOML configuration file")
    p.add_argument("--print-config", action="store_true",
                   help="print the effective configuration (secrets redacted) and exit")
    import dataclasses

    for f in dataclasses.fields(ServerConfig):
        meta = f.metadata
        unit = f" [{meta['unit']}]" if meta["unit"] else ""
        p.add_argument(f"--{f.name.replace('_', '-')}", dest=f.name, default=None,
                       help=f"{meta['doc']}{unit} (default: {f.default!r})")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    flags = {k: v for k, v in vars(args).items() if k not in ("config", "print_config")}
    try:
        config = load_config(args.config or os.environ.get("KVSTORE_CONFIG"), os.environ, flags)
    except ConfigError as e:
        print(f"kvstore-server: invalid configuration: {problems(e)}", file=sys.stderr)
        return 2
    if args.print_config:
        print(json.dumps(config.redacted(), indent=2))
        return 0
    setup_logging(config.log_level, config.log_format)
    # SIGHUP reloads the tokens (`Daemon.reload_tokens`); one arriving while the daemon starts
    # (imports, the arena, a disk index rebuilt) is kept for `run`, not the default: exit.
    early_hups: list[int] = []
    signal.signal(signal.SIGHUP, lambda signum, frame: early_hups.append(signum))
    if args.token is not None:  # the environment and token_file are private to the user
        logging.getLogger("kvstore.server").warning(
            "--token on the command line is readable by every local user (/proc/PID/cmdline, "
            "ps); put it in token_file (mode 0600) or KVSTORE_TOKEN instead")
    from kvstore.malloc_tuning import keep_large_buffers
    from kvstore.server.app import Daemon

    keep_large_buffers()  # streamed fetches: 1 MiB messages from warm heap pages

    try:
        daemon = Daemon(config)
    except ConfigError as e:
        print(f"kvstore-server: {e}", file=sys.stderr)
        return 2
    try:
        asyncio.run(daemon.run(reload_pending=lambda: bool(early_hups)))
    except ConfigError as e:  # a port in use: the daemon gave back what it held
        print(f"kvstore-server: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
