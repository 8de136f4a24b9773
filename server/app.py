"""Start, serve and drain the daemon.

One process: a `grpc.aio` server on a Unix socket (mode 0600), optionally a second one on TCP
guarded by a token, the gRPC health service on both, Prometheus metrics on loopback. SIGTERM or
SIGINT turns health to NOT_SERVING, lets in-flight calls finish within the grace period, releases
leases, closes the tiers (flushing the disk index) and removes the socket and the arena file,
or leaves the arena for the next daemon (`host_handover_s`).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import functools
import gc
import json
import logging
import math
import os
import resource
import signal
import socket
import stat
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from kvstore import arena_keeper
from kvstore.config import ServerConfig, admin_token, parse_tenant_weights
from kvstore.errors import ConfigError
from kvstore.server.auth import TokenInterceptor
from kvstore.server.inspect import NamespaceBook
from kvstore.server.metrics import Metrics
from kvstore.server.service import Admission, KVStoreService, add_service
from kvstore.server.store import TieredStore
from kvstore.server.tenancy import TokenTable, load_tenant_tokens, owner_tag, owner_weights
from kvstore.tiers.disk import DiskTier
from kvstore.tiers.gpu import GpuTier  # imports torch only when one is built
from kvstore.tiers.host import HostTier
from kvstore.tiers.remote import RemoteOptions, RemoteTier

log = logging.getLogger("kvstore.server")
KEEPER = Path(arena_keeper.__file__)  # run by path: it needs no package on its path
SERVICE_NAME = "kvstore.v1.KVStore"
# A TCP connection that has not completed gRPC's handshake within this is closed, so silent
# ones (a flood) give their slot of `max_tcp_connections` back soon (gRPC's default: 120 s).
HANDSHAKE_MS = 10_000
# A SIGHUP's reading of the tokens files gives up after this and changes nothing: a hung NFS or
# FUSE secrets mount must not hold the reload for good (the reading runs off the event loop).
RELOAD_READ_TIMEOUT_S = 5.0


def _grpc_options(config: ServerConfig) -> list[tuple[str, int]]:
    return [
        ("grpc.max_receive_message_length", config.max_message_bytes),
        ("grpc.max_send_message_length", config.max_message_bytes),
        ("grpc.keepalive_time_ms", 30_000),
        ("grpc.keepalive_timeout_ms", 10_000),
        ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.so_reuseport", 0),
    ]


def raise_open_file_limit() -> int:
    """Raise the soft limit on open files to the hard one (as a server should: systemd's
    default soft limit is 1024) and return it: descriptors bound how many TCP connections the
    daemon can hold beside its disk tier and the Unix socket's engines."""
    inf = resource.RLIM_INFINITY  # -1 in Python: compare, never order
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != inf and (hard == inf or soft < hard):
        want = hard if hard != inf else max(soft, 1 << 20)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            log.info("open files: soft limit raised from %d to %d", soft, want)
            soft = want
        except (OSError, ValueError) as e:
            log.warning("open files: cannot raise the soft limit %d to %d: %s", soft, want, e)
    return soft if soft != inf else 1 << 30


def tcp_connection_limit(configured: int, open_files: int) -> int:
    """`max_tcp_connections`, at most half the open-file limit: the rest stays for the disk
    tier, the arena, the Unix socket's engines and the daemon's own threads."""
    limit = min(configured, max(1, open_files // 2))
    if limit < configured:
        log.warning("max_tcp_connections %d is more than half the open-file limit %d; the TCP "
                    "listener holds at most %d connections (raise `ulimit -n`)",
                    configured, open_files, limit)
    return limit


def _lock_data_dir(data_dir: Path) -> int:
    """Hold an exclusive lock so two daemons never share one data directory."""
    try:
        data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        try:
            fd = os.open(data_dir / "LOCK", os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as e:
            if e.errno != errno.EROFS:
                raise
            # A read-only data directory still serves its disk tier (read-only); flock works
            # on a descriptor opened for reading: the LOCK file, or the directory itself.
            lock = data_dir / "LOCK"
            fd = os.open(lock if lock.exists() else data_dir, os.O_RDONLY)
    except OSError as e:
        raise ConfigError(f"data_dir: cannot use {data_dir}: {e.strerror or e}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise ConfigError(f"data_dir: {data_dir} is in use by another kvstore-server") from None
    return fd


def _check_socket(sock: Path) -> None:
    """Refuse a socket path that a live daemon answers on, or that is not a socket at all;
    a socket nobody answers on was left by a dead daemon, and `start` replaces it."""
    try:
        sock.parent.mkdir(parents=True, exist_ok=True)
        st = sock.lstat()
    except FileNotFoundError:
        st = None
    except OSError as e:
        raise ConfigError(f"socket: cannot use {sock}: {e.strerror or e}") from None
    if st is not None:
        if not stat.S_ISSOCK(st.st_mode):
            raise ConfigError(f"socket: {sock} exists and is not a socket; refusing to replace "
                              "it")
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(2.0)
            try:
                s.connect(str(sock))
            except (ConnectionRefusedError, FileNotFoundError):
                pass  # stale
            except OSError as e:
                raise ConfigError(f"socket: cannot check {sock}: {e.strerror or e}") from None
            else:
                raise ConfigError(f"socket: {sock} is in use: a running kvstore-server answers "
                                  "there (with another data_dir?); stop it or choose another "
                                  "--socket")
    try:  # a real probe: access(2) misses an ext4 turned read-only by an error
        with tempfile.TemporaryFile(dir=sock.parent):
            pass
    except OSError as e:
        raise ConfigError(f"socket: cannot create {sock}: {e.strerror or e}; set --socket to a "
                          "writable directory") from None


def _open_disk(directory: Path, config: ServerConfig) -> DiskTier | None:
    """The disk tier; a daemon whose disk cannot even be opened read-only (its directory
    cannot be created, its data file cannot be opened) runs without one rather than not at
    all: the host tier is the cache engines cannot do without."""
    try:
        return DiskTier(directory, config.disk_bytes, config.disk_sync,
                        fault_read_delay_s=config.fault_disk_read_delay_s)
    except OSError as e:
        log.error("disk tier unavailable: %s; running without it (host tier only) until a "
                  "restart finds %s usable", e, directory)
        return None


def _open_gpu(config: ServerConfig) -> GpuTier:
    """The gpu tier's slab (`gpu_bytes` on `gpu_device`). Unlike the disk tier, a slab that
    cannot be allocated stops start-up: the operator asked for HBM that is not there."""
    try:
        return GpuTier(config.gpu_bytes, config.gpu_device, shm_dir=config.shm_dir)
    except Exception as e:  # no torch, torch without CUDA, out of device memory
        raise ConfigError(f"gpu_bytes: cannot allocate {config.gpu_bytes} bytes on "
                          f"{config.gpu_device!r} (gpu_device): {e}") from None


def _log_shares(tiers: list[HostTier | GpuTier | DiskTier], tenants: set[str]) -> None:
    """Each tenant's share of each tier when all of them, and the unscoped callers, hold blocks
    there: the least it keeps (`tenant_weights`), so a share smaller than a block shows."""
    owners = {"(unscoped)": b"", **{t: owner_tag(t) for t in sorted(tenants)}}
    every = set(owners.values())
    for tier in tiers:
        log.info("%s tier shares with every tenant holding blocks: %s", tier.name, ", ".join(
            f"{name} {tier.policy.share_among(o, every) / 2**20:.1f} MiB"
            for name, o in owners.items()))


class Daemon:
    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.data_dir = Path(config.data_dir)
        # Read before anything is opened: a bad tokens file stops start-up, naming the option.
        self.tokens = self._token_table() if config.listen else None
        weights = owner_weights(parse_tenant_weights(config.tenant_weights),
                                self.tokens.tenants if self.tokens is not None else None)
        self._lock_fd = _lock_data_dir(self.data_dir)
        host: HostTier | None = None
        gpu: GpuTier | None = None
        disk: DiskTier | None = None
        try:  # whatever fails here, release what was opened: the arena above all
            _check_socket(config.socket_path)
            host = HostTier(config.host_bytes, config.shm_dir,  # first: it refuses fastest
                            adopt=config.host_handover_s > 0)
            # torch is imported here only: a daemon without a gpu tier starts without it.
            gpu = _open_gpu(config) if config.gpu_bytes > 0 else None
            disk = _open_disk(self.data_dir / "disk", config) if config.disk_bytes > 0 else None
            for tier in (gpu, host, disk):
                if tier is not None:
                    tier.use_eviction(config.eviction_policy)
                    tier.policy.set_weights(weights)
            remote = None
            if config.remote:
                remote = RemoteTier(config.remote, RemoteOptions(
                    ttl_s=config.remote_ttl_s, timeout_s=config.remote_timeout_s,
                    retry_s=config.remote_retry_s))
        except BaseException:
            for tier in (disk, gpu, host):
                if tier is not None:
                    tier.close()
            os.close(self._lock_fd)
            raise
        if weights:
            _log_shares([t for t in (gpu, host, disk) if t is not None],
                        self.tokens.tenants if self.tokens else set())
        self.store = TieredStore(host, disk, config.lease_timeout_s, remote=remote,
                                 remote_queue_blocks=config.remote_queue_blocks,
                                 fetch_window_bytes=config.fetch_window_bytes, gpu=gpu,
                                 write_fence_s=config.write_fence_s)
        if self.store.write_queue is not None:
            self.store.write_queue.set_weights(weights)
        if config.host_prefault == "background":
            host.start_prefault()
        self._rates_file = self.data_dir / "read_bandwidth.json"
        self.store.saved_read_bandwidth = load_rates(self._rates_file)
        if config.kv_events:
            self._start_events()
        self.metrics = Metrics(self.store, self.tokens.tenants if self.tokens else ())
        self.admission = Admission(config.max_concurrent_rpcs)  # shared by both listeners
        self.namespaces = NamespaceBook(  # shared by both listeners, for Inspect
            tenants=self.tokens.tenants if self.tokens else ())
        self.health = health.aio.HealthServicer()
        self.servers: list[grpc.aio.Server] = []
        self._stopping = asyncio.Event()
        self._writer: asyncio.Task[None] | None = None
        self._reloads: set[asyncio.Task[bool]] = set()  # SIGHUPs' (a reference keeps each)
        self._reload_lock = asyncio.Lock()  # one reload at a time, in the order they came
        self._reader: threading.Thread | None = None  # the last reload's reading

    def _start_events(self) -> None:
        # Imported here: pyzmq and msgspec are needed only with `kv_events` set.
        try:
            from kvstore.server.kv_events import EventTracker, ZmqEventPublisher
        except ImportError as e:
            self.store.close()
            os.close(self._lock_fd)
            raise ConfigError(f"kv_events needs the events extra ({e.name or e} is not "
                              f"installed): pip install 'kvstore-cache[events]'") from None

        cfg = self.config
        try:
            publisher = ZmqEventPublisher(cfg.kv_events, cfg.kv_events_replay,
                                          cfg.kv_events_topic, max_queue=cfg.kv_events_queue,
                                          log_level=cfg.log_level, log_format=cfg.log_format)
        except Exception as e:  # zmq.ZMQError: address in use, bad endpoint
            self.store.close()
            os.close(self._lock_fd)
            raise ConfigError(f"kv_events: cannot bind {cfg.kv_events}: {e}") from None
        meta = self.data_dir / "disk" / "kv_events.meta" if self.store.disk is not None else None
        self.store.events = EventTracker(publisher, self.store.tiers, meta)
        log.info("KV events on %s%s", publisher.endpoint,
                 f", replay on {publisher.replay_endpoint}" if publisher.replay_endpoint else "")

    def _make_server(self, interceptors: list[grpc.aio.ServerInterceptor],
                     options: list[tuple[str, int]] | None = None) -> grpc.aio.Server:
        # The limit that matters is the service's own (`Admission`: work is shed, lease ends
        # never are); gRPC's counts every call alike, so it is only a loose backstop here.
        server = grpc.aio.server(
            interceptors=interceptors, options=_grpc_options(self.config) + (options or []),
            maximum_concurrent_rpcs=4 * self.config.max_concurrent_rpcs + 64)
        service = KVStoreService(self.store, self.metrics, self.config.max_blocks_per_call,
                                 self.config.max_message_bytes, self.admission,
                                 self.namespaces)
        add_service(service, server)  # the generated registration, with tolerant decoding
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        self.servers.append(server)
        return server

    async def start(self) -> None:
        open_files = raise_open_file_limit()
        sock = self.config.socket_path
        sock.unlink(missing_ok=True)  # stale: `_check_socket` found nobody answering
        unix = self._make_server([])
        old_umask = os.umask(0o177)  # the socket is created 0600: no window where others connect
        try:
            unix.add_insecure_port(f"unix:{sock}")
        finally:
            os.umask(old_umask)
        await unix.start()
        os.chmod(sock, 0o600)
        if self.config.listen:
            if self.tokens is None:  # read in __init__ whenever `listen` is set
                raise ConfigError("listen: a TCP listener needs `token` or `tenant_tokens_file`")
            # gRPC closes connections past the limit as it accepts them (its connection
            # quota), before the token is read: a flood cannot take the daemon's descriptors.
            conns = tcp_connection_limit(self.config.max_tcp_connections, open_files)
            tcp = self._make_server([TokenInterceptor(self.tokens)],
                                    [("grpc.max_allowed_incoming_connections", conns),
                                     ("grpc.server_handshake_timeout_ms", HANDSHAKE_MS),
                                     # GOAWAY: a client reconnects at its next call.
                                     ("grpc.max_connection_idle_ms",
                                      int(self.config.tcp_idle_timeout_s * 1000))])
            try:
                tcp.add_insecure_port(self.config.listen)
            except RuntimeError:  # grpc says "Failed to bind", not why
                raise ConfigError(f"listen {self.config.listen}: cannot bind it (in use by "
                                  f"another process, or not an address of this machine)"
                                  ) from None
            await tcp.start()
        if self.config.metrics_port:
            try:
                self.metrics.serve(self.config.metrics_port, self.config.metrics_host)
            except OSError as e:
                raise ConfigError(f"metrics_port {self.config.metrics_port} on "
                                  f"{self.config.metrics_host}: cannot bind it: "
                                  f"{e.strerror or e}") from None
        for name in ("", SERVICE_NAME):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        gpu = self.store.gpu
        log.info("kvstore-server listening on unix:%s%s; %shost %d B, disk %d B, arena %s",
                 sock, f" and tcp:{self.config.listen}" if self.config.listen else "",
                 f"gpu {gpu.capacity_bytes} B on {gpu.device}, " if gpu is not None else "",
                 self.store.host.capacity_bytes,
                 self.store.disk.capacity_bytes if self.store.disk else 0,
                 self.store.host.arena.path)
        if self.store.remote is not None:
            log.info("remote tier %s (ttl %d s, timeout %.2f s, queue %d blocks)",
                     self.store.remote.url, self.config.remote_ttl_s,
                     self.config.remote_timeout_s, self.config.remote_queue_blocks)

    async def run(self, reload_pending: Callable[[], bool] = lambda: False) -> None:
        """Serve until SIGTERM or SIGINT. `reload_pending`: whether a SIGHUP came while the
        daemon was being made (the tokens files are then read again now)."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._stopping.set)
        loop.add_signal_handler(signal.SIGHUP, self._sighup)
        if reload_pending():
            self._sighup()
        try:
            await self.start()
        except BaseException:
            await self._abort_start()
            raise
        reaper = asyncio.create_task(self.store.reaper())
        watch = (asyncio.create_task(self.store.disk_watch(self.config.disk_recheck_s))
                 if self.store.disk is not None and self.config.disk_recheck_s > 0 else None)
        self._writer = asyncio.create_task(self.store.remote_writer())  # returns without remote
        # Start-up's garbage collected, its live objects frozen: they live as long as the
        # daemon, and later collections (`service._collect_soon`) skip them.
        gc.collect()
        gc.freeze()
        print(f"READY {self.config.socket_path}", flush=True)  # tests and scripts wait for this
        await self._stopping.wait()
        reaper.cancel()
        if watch is not None:
            watch.cancel()
        await self.drain()

    async def _abort_start(self) -> None:
        """A start that failed (a port in use): release what `__init__` and `start` took, the
        arena and the socket above all, as a clean stop would."""
        await asyncio.gather(*(s.stop(None) for s in self.servers), return_exceptions=True)
        self._release()

    def _token_table(self) -> TokenTable:
        """`token_file` and `tenant_tokens_file` read and checked (at start, and in a thread of
        its own at a reload); raises `ConfigError` naming what is wrong."""
        config = self.config
        return TokenTable(admin_token(config), load_tenant_tokens(config.tenant_tokens_file)
                          if config.tenant_tokens_file else None)

    def _sighup(self) -> None:
        """SIGHUP's handler, on the event loop: the reload runs in a task, which reads the
        files off the loop, so calls are served meanwhile whatever the files are."""
        task = asyncio.create_task(self.reload_tokens())
        self._reloads.add(task)
        task.add_done_callback(self._reloads.discard)

    async def _read_token_table(self) -> TokenTable:
        """`_token_table` in a thread, within `RELOAD_READ_TIMEOUT_S`. A daemon thread, not
        the loop's executor: a read hung for good (a dead mount) would hold an executor's
        thread, and with it the daemon's exit (`asyncio.run` joins the executor's threads).
        While such a read hangs, later reloads do not start another."""
        files = " and ".join(f for f in (self.config.token_file,
                                         self.config.tenant_tokens_file) if f)
        if self._reader is not None and self._reader.is_alive():
            raise ConfigError(f"a previous reload's reading of {files} has not returned yet "
                              "(a hung mount?); not read again until it does")
        loop = asyncio.get_running_loop()
        done: asyncio.Future[TokenTable] = loop.create_future()

        def read() -> None:
            try:
                outcome = functools.partial(done.set_result, self._token_table())
            except Exception as e:  # a ConfigError above all: handed to the reload
                outcome = functools.partial(done.set_exception, e)

            def settle() -> None:
                if not done.done():  # done: the reload gave up waiting
                    outcome()

            with contextlib.suppress(RuntimeError):  # the loop is closed: the daemon exited
                loop.call_soon_threadsafe(settle)

        self._reader = threading.Thread(target=read, name="kvstore-token-reload", daemon=True)
        self._reader.start()
        try:
            return await asyncio.wait_for(done, RELOAD_READ_TIMEOUT_S)
        except TimeoutError:
            raise ConfigError(f"reading {files} took over {RELOAD_READ_TIMEOUT_S:g} s (a hung "
                              "mount?)") from None

    async def reload_tokens(self) -> bool:
        """SIGHUP: read `token_file` and `tenant_tokens_file` again and check them as at start;
        calls from now on use the new tokens (a revoked one is refused at its next call).
        A file that fails a check, or whose reading errs or hangs, changes nothing: the tokens
        in use stay, and the log says why. True when reloaded."""
        if self.tokens is None:
            log.info("SIGHUP: nothing to reload (no `listen`, so no tokens)")
            return False
        async with self._reload_lock:  # else an older reading could land after a newer one
            try:
                table = await self._read_token_table()
            except ConfigError as e:
                log.error("SIGHUP: tokens not reloaded, the ones in use stay: %s", e)
                return False
            config = self.config
            # A weighted tenant removed from the file is revoked all the same: revocation must
            # not wait for a restart. (At start, weights naming unlisted tenants are refused.)
            weighted = parse_tenant_weights(config.tenant_weights)  # checked at start
            if unlisted := sorted(t for t in weighted if t and t not in table.tenants):
                log.warning("SIGHUP: tenant_weights names %s, which the tokens file no longer "
                            "lists: revoked all the same; take it out of tenant_weights before "
                            "the next restart, which refuses weights of unlisted tenants",
                            ", ".join(map(repr, unlisted)))
            before = self.tokens.tenants
            self.tokens.replace(table)
            self.metrics.names.add(table.tenants)
            self.namespaces.names.add(table.tenants)
            added, gone = sorted(table.tenants - before), sorted(before - table.tenants)
            log.info("SIGHUP: tokens reloaded: %d tokens, %d tenants%s%s", table.token_count,
                     len(table.tenants), f"; added {', '.join(added)}" if added else "",
                     f"; removed {', '.join(gone)} (their blocks stay until evicted)"
                     if gone else "")
        return True

    async def drain(self) -> None:
        log.info("draining: health NOT_SERVING, %.1f s grace", self.config.drain_grace_s)
        await self.health.enter_graceful_shutdown()
        await asyncio.gather(*(s.stop(self.config.drain_grace_s) for s in self.servers))
        writers = self.store.client_writers()  # before the leases go: who may still write
        for lease_id in list(self.store.leases):
            self.store.release(lease_id)
        try:
            flushed = await self.store.flush(self.config.shutdown_flush_s)
            if flushed:
                log.info("flushed %d blocks of the memory tiers to disk", flushed)
            if self.store.remote is not None:
                # Queued write-through gets its own budget: other daemons may want these.
                if not await self.store.drain_remote(self.config.shutdown_flush_s):
                    log.info("remote write-through queue not drained; %d blocks not shared",
                             len(self.store.write_queue or ()))
                if self._writer is not None:
                    self._writer.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await self._writer
                await self.store.close_remote()
            self._leave_arena(writers)
        except Exception:  # keeping blocks is best effort; releasing the arena is not
            log.exception("shutdown flush failed; closing anyway")
        finally:
            save_rates(self._rates_file, self.store.read_bandwidth())
            self._release()
        log.info("stopped")

    def _release(self) -> None:
        """The end of a stop, clean or a failed start: the KV events, the store (the arena
        removed, or left to the next daemon: `_leave_arena`), the socket, the directory lock."""
        if self.store.events is not None:  # host blocks go with the arena: say so
            self.store.events.close(host_gone=True)
            self.store.events.publisher.close()
        self.store.close()
        if self.store.host.hand_over:
            self._start_keeper()
        with contextlib.suppress(OSError):  # a read-only directory keeps a dead socket
            self.config.socket_path.unlink(missing_ok=True)
        os.close(self._lock_fd)

    def _leave_arena(self, writers: int) -> None:
        """Whether `store.close` leaves the host arena to the next daemon (`host_handover_s`):
        only where no client can write into it any more. A zero-copy publish still holding
        its reservation, or one fenced after its lease expired, might: its late bytes would
        land in the next daemon's blocks."""
        if self.config.host_handover_s <= 0 or self.store.host.arena.size == 0:
            return
        if writers:
            log.info("host arena freed, not left for the next daemon: %d same-node "
                     "publishes may still write into it", writers)
            return
        self.store.host.hand_over = True

    def _start_keeper(self) -> None:
        """Detached: frees the arena left behind if no daemon takes it in time. A keeper that
        does not start leaves nothing to free it before the next daemon in `shm_dir` (maybe
        none, after an uninstall): the arena is freed now instead."""
        path, token = str(self.store.host.arena.path), self.store.host.handover_token
        if arena_keeper.start(path, self.config.host_handover_s, token, keeper=str(KEEPER)):
            return
        freed = arena_keeper.free_if_left(path, token, lock_held=True)
        log.warning("the keeper of arena %s did not start; %s", path,
                    "arena freed now" if freed else "could not free it either")


def load_rates(path: Path) -> dict[str, float]:
    """Tier read bandwidths measured before the last clean shutdown, so that the first
    fetches after a restart are planned from measurements, not priors. A missing or
    malformed file is no measurement."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict):
        return {}
    return {str(k): float(v) for k, v in data.items()
            if isinstance(v, int | float) and math.isfinite(v) and v > 0}


def save_rates(path: Path, rates: dict[str, float]) -> None:
    tmp = path.with_suffix(".tmp")
    try:
        tmp.write_text(json.dumps(rates))
        os.replace(tmp, path)
    except OSError as e:
        log.warning("could not save measured read bandwidth: %s", e)
