"""One tenant's hit rate while another floods the tier: tenants sharing a tier fairly, or not.

Tenant bravo replays the conversation trace (`../shared/traces/conversation_trace.jsonl`, the
Mooncake format `benchmarks.simulate` reads); tenant alpha, after each of bravo's requests,
sends `flood` requests of as many fresh blocks, never reused (a tenant publishing without end,
or a scan). Both go to one host tier of `--capacity` blocks under the daemon's own
`kvstore.tiering.TierPolicy` and eviction policy: with **shares**, each tenant's blocks carry its
owner, as a daemon with `tenant_tokens_file` gives them (docs/RELIABILITY.md, "Tenants"); with
**one order**, every block is unscoped, as before tenants shared tiers. A request's blocks are
pinned while it runs, as the daemon pins a fetch's and a publish's; the policies' clock is the
trace's, as in `benchmarks.simulate`. The figure is bravo's
prefix hit rate (blocks found, of its requests' full blocks); "alone at half" is bravo alone
in half the tier, the least fair sharing promises it. `--weight W` gives bravo that weight
against alpha's 1 (`tenant_weights`): its share is then W/(W+1) of the tier, and the last
column is bravo alone in that.

    python -m benchmarks.tenant_flood [--capacity 4096,16384] [--flood 0,1,4,16] [--eviction prefix]
                                      [--weight 1]
"""

from __future__ import annotations

import argparse
import itertools
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tqdm import tqdm

from benchmarks.common import RESULTS, figure, save, table, write_results
from benchmarks.simulate import DEFAULT_TRACE, Request, load_trace
from kvstore.errors import CapacityError
from kvstore.eviction import DEFAULT_POLICY
from kvstore.tiering import TierPolicy

ALPHA, BRAVO = b"\xa7kvTalph", b"\xa7kvTbrav"  # two owners, as `owner_of` names tenants


def _run_request(tier: TierPolicy, keys: Sequence[bytes], owner: bytes) -> int:
    """Serve one request: its longest cached prefix is a hit, the rest is stored; returns
    the hits. Its blocks stay pinned until it ends."""
    hits = 0
    for key in keys:
        if key not in tier:
            break
        hits += 1
    pinned = list(keys[:hits])
    for key in pinned:
        tier.pin(key)
    tier.touch_chain(keys[:hits])
    try:
        for key in keys[hits:]:
            for victim in tier.victims(1, owner):
                tier.remove(victim)
            tier.add(key, 1, owner)
            tier.pin(key)
            pinned.append(key)
    except CapacityError:  # the tier is all pinned: the rest of this request is not stored
        pass
    for key in pinned:
        tier.unpin(key)
    tier.touch_chain(keys)
    return hits


def bravo_hit_rate(requests: Sequence[Request], capacity: int, flood: int, shares: bool,
                   eviction: str = DEFAULT_POLICY, progress: Any = None,
                   weight: float = 1.0) -> float:
    """Bravo's prefix hit rate with alpha sending `flood` fresh requests after each of its;
    with `shares`, bravo weighs `weight` against alpha's 1."""
    now = [0.0]  # the trace's clock, as the simulator's: `prefix` learns reuse gaps by it
    tier = TierPolicy("host", capacity, eviction, clock=lambda: now[0])
    bravo, alpha = (BRAVO, ALPHA) if shares else (b"", b"")
    if shares and weight != 1:
        tier.set_weights({BRAVO: weight})
    fresh = itertools.count()
    hits = total = 0
    for r in requests:
        now[0] = r.timestamp_ms / 1000  # alpha's flood comes at the same time
        keys = [b"b" + k for k in r.keys[: r.full_blocks]]
        hits += _run_request(tier, keys, bravo)
        total += len(keys)
        for _ in range(flood):
            _run_request(tier, [b"a%d" % next(fresh) for _ in keys], alpha)
        if progress is not None:
            progress.update(1)
    return hits / max(total, 1)


def plot(rows: list[dict[str, Any]], eviction: str, path: Path, alone: str = "alone at half",
         ) -> None:
    """Bravo's hit rate against the flood, per capacity: shares, one order, alone in its
    share (column `alone`)."""
    fig, ax = figure()
    floods = sorted({r["flood"] for r in rows})
    for c in sorted({r["capacity"] for r in rows}):
        mine = [r for r in rows if r["capacity"] == c]
        xs = [r["flood"] for r in mine]
        line = ax.plot(xs, [r["shares"] for r in mine], marker="o",
                       label=f"{c} blocks, shares")[0]
        ax.plot(xs, [r["one order"] for r in mine], marker="x", linestyle="--",
                color=line.get_color(), label=f"{c} blocks, one order")
        ax.axhline(mine[0][alone], color=line.get_color(), linestyle=":", linewidth=1)
    ax.set_xscale("symlog", linthresh=1)
    ax.set_xticks(floods, [str(f) for f in floods])
    ax.set_xlabel("alpha's fresh requests per one of bravo's")
    ax.set_ylabel("bravo's prefix hit rate")
    ax.set_title(f"A tenant flooding the host tier ({eviction}; dotted: bravo {alone})")
    ax.legend(fontsize=7)
    save(fig, path)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    p.add_argument("--limit", type=int, default=None, help="bravo's first N requests")
    p.add_argument("--capacity", default="4096,16384", help="host tier sizes, in blocks")
    p.add_argument("--flood", default="0,1,4,16", help="alpha's requests per one of bravo's")
    p.add_argument("--eviction", default=DEFAULT_POLICY)
    p.add_argument("--weight", type=float, default=1.0,
                   help="bravo's weight against alpha's 1 (tenant_weights)")
    p.add_argument("--name", default="tenant_flood")
    args = p.parse_args(argv)
    if not args.weight > 0:
        p.error(f"--weight must be above 0, got {args.weight}")
    w = args.weight
    alone = "alone at half" if w == 1 else f"alone at {w:g}/{w + 1:g}"
    requests = load_trace(args.trace, args.limit)
    capacities = [int(c) for c in args.capacity.split(",")]
    floods = [int(f) for f in args.flood.split(",")]
    runs = [(c, f, s) for c in capacities for f in floods for s in (True, False)]
    rows: list[dict[str, Any]] = []
    with tqdm(total=len(requests) * (len(runs) + len(capacities)), unit="req") as bar:
        for c in capacities:
            # Bravo's share, as `TierPolicy` sizes it (in whole blocks: these are 1 byte).
            share = c // 2 if w == 1 else int(c * w / (w + 1))
            half = bravo_hit_rate(requests, share, 0, False, args.eviction, bar)
            for f in floods:
                rates = {s: bravo_hit_rate(requests, c, f, s, args.eviction, bar, w)
                         for s in (True, False)}
                rows.append({"capacity": c, "flood": f, "shares": rates[True],
                             "one order": rates[False], alone: half})
    print(table(rows, ["capacity", "flood", "shares", "one order", alone]))
    meta = {"trace": str(args.trace), "requests": len(requests), "eviction": args.eviction}
    if w != 1:
        meta["bravo_weight"] = w
    path = write_results(args.name, {**meta, "rows": rows})
    plot(rows, args.eviction, RESULTS / f"{args.name}.png", alone)
    print(f"results: {path}, plot: {RESULTS / (args.name + '.png')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
