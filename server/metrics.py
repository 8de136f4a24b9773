"""Prometheus metrics. Store and tier figures are read at scrape time, so the hot path only
keeps plain integer counters; RPC latencies are histograms observed per call."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvstore.server.metrics_http import serve_metrics
from kvstore.server.store import TieredStore
from kvstore.server.tenancy import OwnerNames
from kvstore.tiers.remote import RemoteStats


class StoreCollector(Collector):
    def __init__(self, store: TieredStore, connected: dict[str, int],
                 names: OwnerNames) -> None:
        self.store = store
        self.connected = connected
        self.names = names  # owner tag -> tenant name ("": unscoped)

    def collect(self) -> Iterator[Metric]:
        c = self.store.counters
        remote = self.store.remote.stats() if self.store.remote is not None else None
        for name, value, doc in (
            ("kvstore_lookups", c.lookups, "Lookup calls."),
            ("kvstore_hit_blocks", c.hit_blocks, "Blocks served by Fetch."),
            ("kvstore_miss_blocks", c.miss_blocks, "Blocks asked for by Fetch and not served."),
            ("kvstore_integrity_failures",
             c.integrity_failures + (remote.integrity_failures if remote else 0),
             "Stored payloads that failed verification (served as misses, then deleted)."),
            ("kvstore_demotions", c.demotions, "Blocks written down a tier on eviction."),
            ("kvstore_promotions", c.promotions, "Blocks copied up a tier on a hit."),
            ("kvstore_scratch_reads", c.scratch_reads,
             "Blocks of prompts larger than the host tier's share, served without promotion."),
            ("kvstore_stored_blocks", c.stored_blocks, "Blocks published."),
            ("kvstore_expired_leases", c.expired_leases,
             "Leases reclaimed by lease_timeout_s because their client never ended them."),
            ("kvstore_fenced_leases", self.store.fences.fenced_total,
             "Expired publish leases whose writer still lived: their space was kept out of "
             "use (write_fence_s)."),
            ("kvstore_lifts_skipped", c.lifts_skipped,
             "Promotions into the gpu tier not started: another prompt's was running."),
            ("kvstore_late_fetches", c.late_fetches,
             "Fetches answered short, before some disk reads started: their client's deadline "
             "was half gone (the client asks for the rest)."),
            ("kvstore_prefetches", c.prefetches,
             "Prefetches started by lookups: a waiting caller's hit promoted into host."),
            ("kvstore_prefetched_blocks", c.prefetched_blocks,
             "Blocks those prefetches promoted into host (remote or disk hits)."),
            ("kvstore_sessions_ended", c.sessions_ended,
             "EndSession hints: conversations their clients said had ended."),
            ("kvstore_session_blocks_marked", c.session_blocks_marked,
             "Blocks those hints marked to be evicted first (once per tier holding one)."),
        ):
            yield CounterMetricFamily(name, doc, value=value)
        hits = CounterMetricFamily("kvstore_tier_hits", "Fetched blocks by the tier that held "
                                   "them.", labels=["tier"])
        moved = CounterMetricFamily("kvstore_tier_bytes", "Bytes moved per tier and direction.",
                                    labels=["tier", "direction"])
        evictions = CounterMetricFamily("kvstore_tier_evictions", "Blocks evicted per tier.",
                                        labels=["tier"])
        used = GaugeMetricFamily("kvstore_tier_used_bytes", "Bytes held per tier.",
                                 labels=["tier"])
        cap = GaugeMetricFamily("kvstore_tier_capacity_bytes", "Capacity per tier.",
                                labels=["tier"])
        blocks = GaugeMetricFamily("kvstore_tier_blocks", "Blocks held per tier.", labels=["tier"])
        shares = GaugeMetricFamily(
            "kvstore_tier_tenant_bytes", "Bytes held per tier and tenant, blocks and a read's "
            "scratch space (\"\": unscoped callers); a full tier evicts from the tenant that "
            "would hold the most per unit of weight.",
            labels=["tier", "tenant"])
        fair = GaugeMetricFamily(
            "kvstore_tier_tenant_share_bytes", "Each tenant's share of a tier: the capacity "
            "times its weight (tenant_weights) over those of the tenants holding space there; "
            "what it holds up to this, no other tenant's blocks evict.",
            labels=["tier", "tenant"])
        for tier in self.store.tiers:
            for owner, nbytes in tier.policy.owners().items():
                shares.add_metric([tier.name, self.names(owner)], nbytes)
                fair.add_metric([tier.name, self.names(owner)], tier.policy.fair_share(owner))
            s = tier.stats()
            hits.add_metric([s.name], c.tier_hits.get(s.name, 0))
            moved.add_metric([s.name, "read"], c.bytes_read.get(s.name, 0))
            moved.add_metric([s.name, "write"], c.bytes_written.get(s.name, 0))
            evictions.add_metric([s.name], s.evictions)
            used.add_metric([s.name], s.used_bytes)
            cap.add_metric([s.name], s.capacity_bytes)
            blocks.add_metric([s.name], s.blocks)
        if remote is not None:
            hits.add_metric(["remote"], c.tier_hits.get("remote", 0))
            moved.add_metric(["remote", "read"], c.bytes_read.get("remote", 0))
            moved.add_metric(["remote", "write"], remote.bytes_written)
        rates = GaugeMetricFamily(
            "kvstore_tier_read_bandwidth_bytes_per_second", "Measured read bandwidth of a tier "
            "into host staging (an average over fetches; what clients plan loads from).",
            labels=["tier"])
        for name, rate in sorted(self.store.read_bandwidth().items()):
            rates.add_metric([name], rate)
        yield from (hits, moved, evictions, used, cap, blocks, shares, fair, rates)
        if self.store.disk is not None:
            yield from self._disk()
        if remote is not None:
            yield from self._remote(remote)
        yield from self._kv_events()
        yield GaugeMetricFamily("kvstore_active_leases", "Open fetch and publish leases.",
                                value=len(self.store.leases))
        yield GaugeMetricFamily("kvstore_inflight_rpcs", "RPCs being served.",
                                value=self.connected.get("inflight", 0))
        yield GaugeMetricFamily("kvstore_host_prefaulted_bytes", "Bytes of the host arena "
                                "backed so far by the background prefault (host_prefault).",
                                value=self.store.host.prefaulted_bytes)
        yield GaugeMetricFamily("kvstore_fenced_bytes", "Host arena bytes kept out of use for "
                                "expired publishes whose writer lives on (write_fence_s).",
                                value=self.store.fences.nbytes)

    def _kv_events(self) -> Iterator[Metric]:
        """KV events' batches, 0 while events are off (as Stats reports them), so an alert on
        drops needs no `absent()` and a dashboard shows a flat line rather than no data."""
        events = self.store.events
        publisher = events.publisher if events is not None else None
        for name, value, doc in (
            ("kvstore_kv_events_published_batches", publisher.published if publisher else 0,
             "KV event batches given a sequence number and handed to the PUB socket "
             "(kv_events)."),
            ("kvstore_kv_events_dropped_batches", publisher.dropped if publisher else 0,
             "KV event batches dropped: the publisher's queue (kv_events_queue) was full "
             "(no sequence number given: subscribers see no gap), a send failed, or the "
             "events' process is gone."),
        ):
            yield CounterMetricFamily(name, doc, value=value)

    def _disk(self) -> Iterator[Metric]:
        """The disk tier's health: degraded (no writes), failures, index rebuilds."""
        disk = self.store.disk
        if disk is None:
            return
        yield GaugeMetricFamily(
            "kvstore_disk_degraded", "1 while the disk tier takes no writes (disk full, "
            "read-only, I/O errors: Stats and the log say why) and only serves what it holds.",
            value=int(bool(disk.degraded)))
        for name, value, doc in (
            ("kvstore_disk_write_failures", disk.write_failures,
             "Failed disk writes and index updates (the first one degrades the tier)."),
            ("kvstore_disk_recoveries", disk.recoveries,
             "Times the degraded disk tier took writes again (`disk_recheck_s`)."),
            ("kvstore_disk_index_rebuilds", disk.index_rebuilds,
             "Damaged disk indexes quarantined and rebuilt from the data file at start."),
            ("kvstore_disk_index_recovered_blocks", disk.recovered_blocks,
             "Blocks those rebuilds brought back (every record verified)."),
        ):
            yield CounterMetricFamily(name, doc, value=value)

    def _remote(self, r: RemoteStats) -> Iterator[Metric]:
        """The remote tier's health and write-through queue."""
        q = self.store.write_queue.stats() if self.store.write_queue is not None else None
        for name, value, doc in (
            ("kvstore_remote_written_blocks", r.blocks_written, "Blocks written through."),
            ("kvstore_remote_shed_writes", q.shed if q else 0,
             "Blocks not written through because the queue was full."),
            ("kvstore_remote_failed_writes", r.failed_writes,
             "Block writes that failed (each attempt counts)."),
            ("kvstore_remote_lost_writes", self.store.counters.remote_lost_writes,
             "Queued blocks evicted from every local tier before their write."),
            ("kvstore_remote_dropped_writes", self.store.counters.remote_dropped_writes,
             "Blocks whose write-through was given up (refused, or failed repeatedly)."),
            ("kvstore_remote_errors", r.errors, "Failed remote calls (timeouts included)."),
            ("kvstore_remote_timeouts", r.timeouts, "Remote calls past their deadline."),
            ("kvstore_remote_breaker_opens", r.breaker_opens,
             "Times a remote failure opened the breaker."),
            ("kvstore_remote_skipped_calls", r.skipped_calls,
             "Remote calls answered as misses while the breaker was open."),
            ("kvstore_remote_integrity_failures", r.integrity_failures,
             "Remote values that failed verification (misses, deleted)."),
            ("kvstore_remote_lookup_hits", self.store.counters.remote_lookup_hits,
             "Blocks lookups found only in the remote tier."),
        ):
            yield CounterMetricFamily(name, doc, value=value)
        yield GaugeMetricFamily("kvstore_remote_queue_depth", "Blocks waiting for write-through.",
                                value=q.depth if q else 0)
        yield GaugeMetricFamily("kvstore_remote_available", "1 unless the breaker is open.",
                                value=int(r.available))


class Metrics:
    def __init__(self, store: TieredStore, tenants: Iterable[str] = ()) -> None:
        self.registry = CollectorRegistry()
        self.gauges: dict[str, int] = {"inflight": 0}
        self.names = OwnerNames(tenants)  # more added when the tokens file is reloaded
        self.registry.register(StoreCollector(store, self.gauges, self.names))
        self.latency = Histogram(
            "kvstore_rpc_seconds", "RPC latency by method and outcome.", ["method", "code"],
            registry=self.registry,
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5))

    def serve(self, port: int, host: str = "127.0.0.1") -> None:
        """Expose /metrics on `host:port` (loopback unless configured otherwise), bounded
        against clients that connect and never finish (`metrics_http`)."""
        serve_metrics(self.registry, port, host)
