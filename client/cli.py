"""`kvstore`: operator commands against a running daemon.

    kvstore stats  [--target T] [--json]     tiers, capacity, hit rate, traffic
    kvstore ping   [--target T]              exit 0 when the daemon answers
    kvstore clear  (--namespace HEX | --all) remove blocks (HEX: a digest or its start)
    kvstore inspect [--target T] [--json]    namespaces: layout, tenant, blocks per tier
    kvstore top    [--interval S] [--count N] live view: stats and rates, refreshed
    kvstore config check FILE                validate a TOML configuration file

Global flags (`--target`, `--json`, `--timeout`, `--token-file`, `--token`) go before or after
the subcommand: `kvstore --json stats` and `kvstore stats --json` are the same.

Over TCP the token comes from `--token-file FILE` (mode 0600), `KVSTORE_TOKEN_FILE` or
`KVSTORE_TOKEN`; `--token` works but warns (every local user reads it in /proc).

Exit codes: 0 success, 1 daemon unreachable or call failed, 2 bad usage.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

import grpc
from google.protobuf.json_format import MessageToDict

from kvstore.proto import kvstore_pb2 as pb
from kvstore.proto import kvstore_pb2_grpc as pb_grpc

# No torch on this path (an operator's command, a health check every few seconds): nothing
# here imports kvstore.client.aio / kvstore.client.sync; tests/unit/test_cli_fast.py checks
# sys.modules.

DEFAULT_TARGET = "unix:.data/kvstore/kv.sock"  # the default data_dir, relative


def normalize_target(target: str) -> tuple[str, bool]:
    """gRPC target and whether it is a Unix socket; as `kvstore.client.aio.normalize_target`, which
    imports torch with the client."""
    if target.startswith("/"):
        return f"unix:{target}", True
    if target.startswith("unix:"):
        return target, True
    return target, False


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def format_stats(s: pb.StatsReply) -> str:
    served = s.hit_blocks + s.miss_blocks
    rate = f"{100 * s.hit_blocks / served:.1f}%" if served else "n/a"
    lines = [f"kvstore {s.version}  up {s.uptime_s:.0f}s  hit rate {rate} "
             f"({s.hit_blocks} of {served} blocks fetched)  leases {s.active_leases}",
             f"{'tier':<6} {'blocks':>8} {'used':>11} {'capacity':>11} {'use':>6} {'hits':>8} "
             f"{'read':>11} {'written':>11} {'evicted':>8} {'read rate':>11}"]
    for t in s.tiers:
        use = f"{100 * t.used_bytes / t.capacity_bytes:.0f}%" if t.capacity_bytes else "-"
        lines.append(f"{t.name:<6} {t.blocks:>8} {_human(t.used_bytes):>11} "
                     f"{_human(t.capacity_bytes):>11} {use:>6} {t.hits:>8} "
                     f"{_human(t.bytes_read):>11} {_human(t.bytes_written):>11} {t.evictions:>8} "
                     f"{_human(t.read_bandwidth) + '/s' if t.read_bandwidth else '-':>11}")
    lines.append(f"published {s.stored_blocks}  demoted {s.demotions}  promoted {s.promotions}  "
                 f"integrity failures {s.integrity_failures}")
    lines += [f"{t.name} tier DEGRADED (serves what it holds, takes no writes): "
              f"{t.degraded_reason}" for t in s.tiers if t.degraded]
    return "\n".join(lines)


def format_inspect(r: pb.InspectReply) -> str:
    if not r.namespaces:
        return "no blocks stored"
    tiers = sorted({t.tier for ns in r.namespaces for t in ns.tiers},
                   key=lambda n: ("gpu", "host", "disk").index(n) if n in ("gpu", "host", "disk")
                   else 9)
    head = f"{'namespace':<16} {'tenant':<10} {'layout':<44}"
    lines = [head + "".join(f" {t + ' blocks':>12}" for t in tiers) + f" {'bytes':>11}"]
    for ns in r.namespaces:
        lay = ns.layout
        desc = (f"{lay.model} {lay.num_layers}x{lay.num_kv_heads}x{lay.head_dim} {lay.dtype} "
                f"b{lay.block_tokens}" + (f" tp{lay.tp_rank}/{lay.tp_size}" if lay.tp_size > 1
                                          else "")
                if ns.HasField("layout") else "(layout not seen since start)")
        per = {t.tier: t for t in ns.tiers}
        lines.append(f"{ns.namespace.hex()[:16]:<16} {ns.tenant or '-':<10} {desc[:44]:<44}"
                     + "".join(f" {per[t].blocks if t in per else 0:>12}" for t in tiers)
                     + f" {_human(sum(t.bytes for t in ns.tiers)):>11}")
    total = sum(t.blocks for ns in r.namespaces for t in ns.tiers)
    lines.append(f"{len(r.namespaces)} namespaces, {total} blocks")
    return "\n".join(lines)


def _call(args: argparse.Namespace, method: str, request: Any) -> Any:
    target, _ = normalize_target(args.target)
    metadata = (("authorization", f"Bearer {args.token}"),) if args.token else None
    with grpc.insecure_channel(target) as channel:
        stub = pb_grpc.KVStoreStub(channel)
        return getattr(stub, method)(request, timeout=args.timeout, metadata=metadata)


def _add_global_flags(p: argparse.ArgumentParser, *, defaults: bool) -> None:
    """The flags every command takes. On the main parser with their defaults; on each
    subcommand without (SUPPRESS), so a flag after the subcommand sets the value and its
    absence there keeps the one given before it."""

    def d(value: Any) -> Any:
        return value if defaults else argparse.SUPPRESS

    p.add_argument("--target", default=d(os.environ.get("KVSTORE_TARGET", DEFAULT_TARGET)),
                   help="unix:///path/kv.sock or HOST:PORT (env KVSTORE_TARGET)")
    p.add_argument("--token", default=d(None),
                   help="bearer token for TCP; visible to every local user in /proc, prefer "
                   "--token-file or env KVSTORE_TOKEN")
    p.add_argument("--token-file", default=d(os.environ.get("KVSTORE_TOKEN_FILE")),
                   help="file holding the bearer token, mode 0600 (env KVSTORE_TOKEN_FILE)")
    p.add_argument("--timeout", type=float, default=d(5.0), help="seconds per call")
    p.add_argument("--json", action="store_true", default=d(False),
                   help="machine-readable output")


def build_parser() -> argparse.ArgumentParser:
    # allow_abbrev=False here and on every subcommand: a prefix of a flag (`--tim 1`,
    # `--name ...`) is refused, not taken for the flag it starts.
    p = argparse.ArgumentParser(prog="kvstore", description="Talk to a kvstore daemon.",
                                allow_abbrev=False)
    _add_global_flags(p, defaults=True)
    sub = p.add_subparsers(dest="command", required=True)

    def command(parent: Any, name: str, text: str) -> argparse.ArgumentParser:
        c: argparse.ArgumentParser = parent.add_parser(name, help=text, allow_abbrev=False)
        _add_global_flags(c, defaults=False)
        return c

    command(sub, "stats", "tiers, capacity, hit rate, traffic")
    command(sub, "ping", "check that the daemon answers")
    command(sub, "inspect", "namespaces held: layout, tenant, blocks per tier")
    top = command(sub, "top", "live view of stats and rates")
    top.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes")
    top.add_argument("--count", type=int, default=0, help="stop after N refreshes (0: never)")
    config = command(sub, "config", "configuration tools")
    config_sub = config.add_subparsers(dest="config_command", required=True)
    check = command(config_sub, "check", "validate a TOML configuration file")
    check.add_argument("file")
    clear = command(sub, "clear", "remove blocks of a namespace, or all")
    group = clear.add_mutually_exclusive_group(required=True)
    group.add_argument("--namespace", help="namespace digest: 64 hex characters, or the "
                       "start of one `kvstore inspect` lists (its 16, say)")
    group.add_argument("--all", action="store_true",
                       help="every block in every namespace (the shared remote tier too: every "
                       "daemon's blocks there)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    if args.command == "config":
        return _config_check(args)
    if args.token is not None:
        print("kvstore: warning: --token on the command line is visible to every local user "
              "(/proc/PID/cmdline, ps); use --token-file or KVSTORE_TOKEN", file=sys.stderr)
    elif args.token_file:
        from kvstore.config import read_token_file
        from kvstore.errors import ConfigError

        try:
            args.token = read_token_file(args.token_file, "--token-file")
        except ConfigError as e:
            print(f"kvstore: {e}", file=sys.stderr)
            return 2
    else:
        args.token = os.environ.get("KVSTORE_TOKEN")
    try:
        if args.command == "top":
            return _top(args)
        if args.command == "stats":
            reply = _call(args, "Stats", pb.StatsRequest())
            print(json.dumps(MessageToDict(reply, always_print_fields_with_no_presence=True))
                  if args.json else format_stats(reply))
        elif args.command == "inspect":
            reply = _call(args, "Inspect", pb.InspectRequest())
            if args.json:
                out = MessageToDict(reply, always_print_fields_with_no_presence=True)
                for d, ns in zip(out["namespaces"], reply.namespaces, strict=True):
                    d["namespace"] = ns.namespace.hex()  # as `kvstore clear --namespace` takes it
                print(json.dumps(out))
            else:
                print(format_inspect(reply))
        elif args.command == "ping":
            info = _call(args, "Info", pb.InfoRequest())
            print(json.dumps({"ok": True, "version": info.version}) if args.json
                  else f"ok: kvstore {info.version} at {args.target}")
        else:
            if args.namespace:
                ns, error = _namespace(args)
                if ns is None:
                    print(f"kvstore clear: {error}", file=sys.stderr)
                    return 2
                req = pb.ClearRequest(namespace=ns)
            else:
                req = pb.ClearRequest(all=True)
            reply = _call(args, "Clear", req)
            print(json.dumps({"removed": reply.removed}) if args.json
                  else f"removed {reply.removed} blocks")
    except grpc.RpcError as e:
        msg = f"{e.code().name}: {e.details()}"
        print(json.dumps({"ok": False, "error": msg}) if args.json
              else f"kvstore {args.command}: {msg}", file=sys.stderr)
        return 1
    return 0


def _namespace(args: argparse.Namespace) -> tuple[bytes | None, str]:
    """`--namespace`: a whole digest, or the start of exactly one that `Inspect` lists (as
    `kvstore inspect` prints the first 16 characters); else None and why."""
    text = args.namespace.strip().lower()
    if len(text) > 64 or any(c not in "0123456789abcdef" for c in text):
        return None, f"--namespace {args.namespace!r}: expected hex characters (64, or a prefix)"
    if len(text) == 64:
        return bytes.fromhex(text), ""
    if len(text) < 8:
        return None, f"--namespace {args.namespace!r}: give at least 8 hex characters"
    held = [n.namespace.hex() for n in _call(args, "Inspect", pb.InspectRequest()).namespaces]
    matches = [h for h in held if h.startswith(text)]
    if len(matches) == 1:
        return bytes.fromhex(matches[0]), ""
    if not matches:
        return None, (f"no namespace the daemon holds starts with {text} (`kvstore inspect` "
                      "lists them; a namespace only the remote tier holds takes all 64)")
    return None, f"{text} starts {len(matches)} namespaces: {', '.join(matches)}"


def _config_check(args: argparse.Namespace) -> int:
    from kvstore.config import admin_token, load_config, parse_tenant_weights, problems
    from kvstore.errors import ConfigError

    try:
        config = load_config(args.file)
        admin_token(config)  # a short token, or an unreadable or exposed token_file
        if config.listen and config.tenant_tokens_file:  # read as the daemon reads them
            from kvstore.server.tenancy import load_tenant_tokens, owner_weights

            tenants = set(load_tenant_tokens(config.tenant_tokens_file).values())
            owner_weights(parse_tenant_weights(config.tenant_weights), tenants)
        elif config.tenant_weights:
            owner_weights(parse_tenant_weights(config.tenant_weights), None)
    except ConfigError as e:
        print(json.dumps({"ok": False, "error": str(e)}) if args.json
              else f"{args.file}: invalid: {problems(e)}", file=sys.stderr)
        return 2
    print(json.dumps({"ok": True, "config": config.redacted()}) if args.json
          else f"{args.file}: ok")
    return 0


def _top(args: argparse.Namespace) -> int:
    """Refresh stats with per-second rates until interrupted (or `--count` refreshes)."""
    prev: pb.StatsReply | None = None
    shown = 0
    try:
        while True:
            cur = _call(args, "Stats", pb.StatsRequest())
            lines = [format_stats(cur)]
            if prev is not None:
                dt = max(cur.uptime_s - prev.uptime_s, 1e-9)
                moved = sum(t.bytes_read + t.bytes_written for t in cur.tiers) - sum(
                    t.bytes_read + t.bytes_written for t in prev.tiers)
                lines.append(f"rates: {(cur.hit_blocks - prev.hit_blocks) / dt:.1f} hit blocks/s"
                             f"  {(cur.lookups - prev.lookups) / dt:.1f} lookups/s  "
                             f"{_human(moved / dt)}/s moved")
            text = "\n".join(lines)
            if args.json:
                print(json.dumps(MessageToDict(cur, always_print_fields_with_no_presence=True)))
            else:
                print(("\033[H\033[2J" if sys.stdout.isatty() else "") + text, flush=True)
            prev, shown = cur, shown + 1
            if args.count and shown >= args.count:
                return 0
            time.sleep(args.interval)
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    sys.exit(main())
