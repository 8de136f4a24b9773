"""The daemon's typed, validated configuration.

Every option is a field of `ServerConfig` with its documentation, unit and bounds in the field's
metadata; `docs/CONFIG.md` is generated from them. Sources, lowest precedence first: defaults,
a TOML file (`--config`), `KVSTORE_*` environment variables, command-line flags. Only entry
points read files and the environment (`load_config`); library code takes a `ServerConfig`.
"""

from __future__ import annotations

import dataclasses
import datetime
import difflib
import math
import os
import re
import stat
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Any

from kvstore.errors import ConfigError
from kvstore.eviction import DEFAULT_POLICY, POLICIES
from kvstore.remote_url import parse_remote_url, redact_url

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9,
          "gb": 10**9, "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30,
          "tib": 2**40}
_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")
MIN_TOKEN_CHARS = 16  # as for tenant tokens (`server.tenancy`): no guessable admin secret
# The largest `token_file` or `tenant_tokens_file` read: thousands of tokens fit, and a file
# swapped for a huge one (or a link to /dev/zero) cannot take the daemon's memory.
MAX_SECRET_FILE_BYTES = 1 << 20


def parse_size(value: int | float | str, option: str = "size") -> int:
    """Bytes from `1048576`, `"64GiB"`, `"512 MiB"` or `"1.5GB"`; raises `ConfigError`. A
    number of bytes must be whole (`1073741824.5` is refused); a size with a unit is rounded
    down to whole bytes (`"1.3GiB"`)."""
    if isinstance(value, bool):
        raise ConfigError(f"{option}: expected a size, got {value!r}")
    if isinstance(value, int | float):
        if not math.isfinite(value):  # TOML has inf and nan; int() of them is not a ConfigError
            raise ConfigError(f"{option}: a size must be finite, got {value!r}")
        if value < 0:
            raise ConfigError(f"{option}: a size cannot be negative ({value})")
        exact, unit = Fraction(value), ""
    else:
        m = _SIZE_RE.match(str(value))
        unit = m.group(2).lower() if m else ""
        if not m or unit not in _UNITS:
            raise ConfigError(f"{option}: cannot parse size {value!r} (try 1048576, 512MiB or "
                              "64GiB)")
        exact = Fraction(m.group(1)) * _UNITS[unit]  # exact: "4.35KB" is 4350, not 4349
    if exact.denominator != 1:
        if _UNITS[unit] > 1:  # "1.3GiB": whole bytes are not what its writer thinks in
            return math.floor(exact)
        raise ConfigError(f"{option}: a size must be a whole number of bytes, got {value!r}"
                          + (f"; {math.floor(exact)} would do" if exact >= 1 else ""))
    return int(exact)


# In `tenant_weights`, the unscoped callers: no tenant is named so (`@` is outside tenant names),
# and unlike `-` a command line takes it as a value.
UNSCOPED_WEIGHT_NAME = "@unscoped"
MIN_TENANT_WEIGHT, MAX_TENANT_WEIGHT = 1e-6, 1e6


def parse_tenant_weights(text: str) -> dict[str, float]:
    """Tenant -> weight from `tenant_weights` (`alpha=3,bravo=0.5,@unscoped=2`; "" for the
    unscoped callers); raises `ConfigError` naming the pair that is wrong."""
    out: dict[str, float] = {}
    for pair in text.split(","):
        if not pair.strip():
            continue
        name, eq, value = (part.strip() for part in pair.partition("="))
        if not eq or not name:
            raise ConfigError(f"tenant_weights: expected TENANT=WEIGHT, got {pair.strip()!r}")
        try:
            weight = float(value)
        except ValueError:
            weight = math.nan
        if not MIN_TENANT_WEIGHT <= weight <= MAX_TENANT_WEIGHT:  # nan and inf fail it too
            raise ConfigError(f"tenant_weights: the weight of {name!r} must be a number from "
                              f"{MIN_TENANT_WEIGHT:g} to {MAX_TENANT_WEIGHT:g}, got {value!r}")
        tenant = "" if name == UNSCOPED_WEIGHT_NAME else name
        if tenant in out:
            raise ConfigError(f"tenant_weights: {name!r} is given twice")
        out[tenant] = weight
    return out


# Options whose minimum has a reason worth telling, in place of "is below the minimum".
_BELOW_MIN = {
    "host_bytes": "host_bytes: must be positive, got {value}: every block lands in host first "
                  "(a publish, a promotion from disk or the remote tier), so a daemon without "
                  "host space stores nothing",
}


def _opt(default: Any, doc: str, *, unit: str = "", lo: float | None = None,
         hi: float | None = None, choices: tuple[str, ...] = (), secret: bool = False) -> Any:
    meta = {"doc": doc, "unit": unit, "min": lo, "max": hi, "choices": choices, "secret": secret}
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class ServerConfig:
    """Options of `kvstore-server`. Sizes accept units (`64GiB`)."""

    data_dir: str = _opt(".data/kvstore", "Directory for the disk tier and runtime files.")
    socket: str = _opt("", "Unix socket path to listen on (mode 0600). Default: DATA_DIR/kv.sock.")
    listen: str = _opt("", "TCP HOST:PORT to listen on as well; requires `token` or "
                       "`tenant_tokens_file`. Empty: none.")
    token: str = _opt("", "Admin secret TCP clients may present (bearer token): full, unscoped "
                      "access, as on the Unix socket. At least 16 characters. Prefer "
                      "`token_file` or `KVSTORE_TOKEN`: a `--token` flag is readable by every "
                      "local user in /proc (the daemon warns).", secret=True)
    token_file: str = _opt("", "File holding the admin `token` (mode 0600, one line; "
                           "surrounding whitespace ignored; a regular file, or a symlink to "
                           "one, of at most 1 MiB); read again at SIGHUP. Empty: none.")
    tenant_tokens_file: str = _opt("", "File of `TENANT TOKEN` lines (mode 0600; a regular file, "
                                   "or a symlink to one, of at most 1 MiB): a TCP client "
                                   "presenting a tenant's token is confined to that tenant's "
                                   "blocks, whatever its requests say. Read again at SIGHUP "
                                   "(a file that fails a check, or takes over 5 s to read, "
                                   "changes nothing). Empty: no tenants.")
    tenant_weights: str = _opt("", "Each tenant's weight in the tiers, as `TENANT=WEIGHT` "
                               "pairs separated by commas (`alpha=3,bravo=1`); `@unscoped` "
                               "names the unscoped callers (the Unix socket, the admin token). "
                               "A tenant's share of a full tier, which no other tenant's blocks "
                               "can evict it from, is the tier's capacity times its weight over "
                               "the weights of the tenants holding space there (blocks, a "
                               "read's scratch space) and its own. Unnamed: 1, so equal shares "
                               "by default. A tenant whose share is smaller than one of its "
                               "blocks stores none in that tier while the others hold no more "
                               "than theirs. The write-through queue (`remote`) is shared by "
                               "the same weights. Needs `listen` and `tenant_tokens_file`, "
                               "which must list every tenant named.")
    host_bytes: int = _opt(1 << 30, "Host RAM tier capacity (shared-memory arena). Must be "
                           "positive: every block lands in host first (a publish, a promotion "
                           "from disk or the remote tier).", unit="bytes", lo=1, hi=1 << 44)
    gpu_bytes: int = _opt(0, "GPU HBM tier capacity: a device slab above the host tier (victims "
                          "demoted to host, fetched blocks promoted into it). 0: no GPU tier, "
                          "the default: on an H100 the same HBM saved ~16x more per GiB in the "
                          "engine's own KV cache, and a host-tier hit is at its floor "
                          "(docs/ARCHITECTURE.md). Needs torch, imported only when this is set.",
                          unit="bytes", lo=0, hi=1 << 44)
    gpu_device: str = _opt("cuda", "Device of the GPU tier's slab (`gpu_bytes`): `cuda`, "
                           "`cuda:N`, or `cpu` (tests: the same code on host memory, the slab "
                           "a file in `shm_dir`). Same-node clients map the slab (CUDA IPC) "
                           "and read every block it holds in place (device to device, not "
                           "host's copy across the bus); `KVCLIENT_SLAB=0` in a client's "
                           "environment makes it read them through host instead.")
    disk_bytes: int = _opt(8 << 30, "Disk tier capacity: payload bytes in the data file.",
                           unit="bytes", lo=0, hi=1 << 50)
    disk_sync: str = _opt("always", "When disk writes are made durable: `always` (fdatasync "
                          "before the index entry), `never` (leave it to the OS).",
                          choices=("always", "never"))
    disk_recheck_s: float = _opt(30.0, "How often a degraded disk tier (disk full, "
                                 "read-only, I/O errors) checks whether the disk takes writes "
                                 "again, and if so takes them again itself: free space (256 "
                                 "MiB, or what its data file still needs and 4 MiB for the "
                                 "index if less) and a synced write. A tier that degrades "
                                 "again soon after waits twice as long each time before its "
                                 "first check, up to 32 periods. 0: it stays degraded until "
                                 "a restart.",
                                 unit="seconds", lo=0, hi=86400)
    shm_dir: str = _opt("/dev/shm", "Directory holding the host arena file clients map (made, "
                        "mode 0700, if missing). Several daemons on one host: one each.")
    host_prefault: str = _opt("background", "`background`: back the host arena's pages in a "
                              "thread at the lowest CPU priority after start-up, so the "
                              "kernel's first touch of each page (zeroing it) is not paid "
                              "inside the first disk reads and saves into it (Stats "
                              "`host_prefaulted_bytes`). `off`: pages are backed as they are "
                              "first written.", choices=("background", "off"))
    host_handover_s: float = _opt(30.0, "At a clean shutdown with no client writing into it, "
                                  "the host arena's memory (not its blocks) is left in "
                                  "`shm_dir` for the next daemon there, for this long: a "
                                  "restart then neither zeroes nor faults its pages again, and "
                                  "same-node clients keep their mapping (docs/OPERATIONS.md). "
                                  "A detached keeper process frees it if no daemon of the same "
                                  "`host_bytes` takes it by then. 0: freed at shutdown.",
                                  unit="seconds", lo=0, hi=86400)
    eviction_policy: str = _opt(DEFAULT_POLICY, "Which blocks the host and disk tiers give up "
                                "first: `prefix` (leaves first, valued by a reuse-gap model "
                                "learned online per class of block), `lru`, `arc` or `s3fifo`. "
                                "Hit rates of each in docs/SCALE.md.",
                                choices=tuple(POLICIES))
    metrics_port: int = _opt(0, "Prometheus metrics HTTP port; 0 disables.", lo=0, hi=65535)
    metrics_host: str = _opt("127.0.0.1", "Address the metrics port binds (loopback by default; "
                             "0.0.0.0 inside a container network).")
    max_message_bytes: int = _opt(64 << 20, "Largest gRPC message accepted or sent.",
                                  unit="bytes", lo=1 << 20, hi=1 << 30)
    max_concurrent_rpcs: int = _opt(256, "Concurrent calls that create work (Lookup, Fetch, "
                                    "Publish, Reserve, Clear, Inspect) before "
                                    "RESOURCE_EXHAUSTED; "
                                    "Release, Commit, Info, Stats and health are always served. "
                                    "One tenant holds at most half of them, the tenants "
                                    "together three quarters.",
                                    lo=1, hi=100_000)
    max_tcp_connections: int = _opt(1024, "TCP connections the `listen` port holds at once; "
                                    "more are closed as they arrive, before any token is "
                                    "read. Bounds the file descriptors a flood of connections "
                                    "can take, so same-node engines (the Unix socket) and the "
                                    "disk tier keep theirs. At most half the open-file limit, "
                                    "which the daemon raises to its hard limit at start.",
                                    lo=1, hi=1_000_000)
    tcp_idle_timeout_s: float = _opt(300.0, "A TCP connection with no call for this long is "
                                     "closed (GOAWAY; a client reconnects at its next call), "
                                     "so connections abandoned or held open without a call (no "
                                     "token is needed to open one) give their slot of "
                                     "`max_tcp_connections` back.", unit="seconds", lo=1,
                                     hi=86400)
    fetch_window_bytes: int = _opt(64 << 20, "Bytes one fetch reads from disk or the remote "
                                   "tier before it answers; the client asks for the rest at "
                                   "once and copies meanwhile, so reads overlap copies. Of a "
                                   "prompt larger than the host tier, host keeps the tier's "
                                   "size less two windows; the rest is served without "
                                   "promotion. 0: no limit.", unit="bytes", lo=0, hi=1 << 40)
    lease_timeout_s: float = _opt(30.0, "A fetch or publish lease not released in this time is "
                                  "reclaimed.", unit="seconds", lo=0.1, hi=3600)
    write_fence_s: float = _opt(600.0, "A same-node publish whose lease expired while its "
                                "process lives (frozen, swapped out) may still be copying into "
                                "its slots: they stay out of use until it ends the lease or "
                                "exits, for at most this long. 0: reused at expiry.",
                                unit="seconds", lo=0, hi=86400)
    max_blocks_per_call: int = _opt(4096, "Most keys one Lookup/Fetch/Publish may name.", lo=1,
                                    hi=1 << 20)
    drain_grace_s: float = _opt(5.0, "On SIGTERM, how long in-flight calls may finish.",
                                unit="seconds", lo=0, hi=600)
    shutdown_flush_s: float = _opt(10.0, "On SIGTERM, seconds spent writing the blocks only "
                                   "memory holds (host, gpu) to disk (recent prompts first, each "
                                   "from its start) so a restart keeps them; 0 disables. "
                                   "What does not fit is lost (oldest first): allow host_bytes "
                                   "at the disk's write rate, and as long before SIGKILL.",
                                   unit="seconds", lo=0, hi=3600)
    remote: str = _opt("", "Shared remote tier: `redis://HOST:PORT/DB` or `redis+cluster://HOST:"
                       "PORT,HOST:PORT` (`rediss` for TLS, `redis://:PASSWORD@...`). Empty: none.")
    remote_ttl_s: int = _opt(86_400, "Seconds a block lives in the remote tier after its last "
                             "write; 0: no expiry (the Cluster's maxmemory policy evicts).",
                             unit="seconds", lo=0, hi=365 * 86_400)
    remote_timeout_s: float = _opt(0.5, "Deadline of each remote call's round trip; a call "
                                   "moving blocks gets their bytes at 50 MiB/s on top. Past "
                                   "it the call is a miss and the breaker opens.",
                                   unit="seconds", lo=0.01, hi=60)
    remote_retry_s: float = _opt(1.0, "After a remote failure, seconds the remote tier is "
                                 "skipped (instant misses) before one call probes it; doubles "
                                 "while it keeps failing, up to 8x.", unit="seconds", lo=0.05,
                                 hi=600)
    remote_queue_blocks: int = _opt(256, "Blocks waiting for write-through to the remote tier; "
                                    "past it new writes are shed (counted), never waited for.",
                                    lo=1, hi=1 << 20)
    kv_events: str = _opt("", "Publish what enters and leaves each tier as vLLM KV events "
                          "(msgpack `KVEventBatch` over ZMQ PUB, vLLM's wire format) on this "
                          "endpoint, e.g. `tcp://127.0.0.1:5557` (bound by the daemon). Only "
                          "blocks whose client described their engine blocks appear. Empty: "
                          "off.")
    kv_events_replay: str = _opt("", "ZMQ ROUTER endpoint answering replay requests for missed "
                                 "sequence numbers, as vLLM's `replay_endpoint`. Empty: none.")
    kv_events_topic: str = _opt("", "Topic frame of every KV event message.")
    kv_events_queue: int = _opt(10_000, "Event batches waiting for the publisher thread; past "
                                "it batches are dropped (counted), never waited for.", lo=1,
                                hi=1 << 24)
    fault_disk_read_delay_s: float = _opt(0.0, "Testing only (fault injection): every disk read "
                                          "first sleeps this long, as a stalled disk would. "
                                          "Never set it in production.", unit="seconds", lo=0,
                                          hi=60)
    log_level: str = _opt("info", "Log level.", choices=("debug", "info", "warning", "error"))
    log_format: str = _opt("text", "Log line format.", choices=("text", "json"))

    def __post_init__(self) -> None:
        """Check every option; one `ConfigError` lists every problem found, one a line."""
        errors: list[str] = []
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            meta = f.metadata
            if meta["choices"] and value not in meta["choices"]:
                errors.append(f"{f.name}: {value!r} is not one of {list(meta['choices'])}")
            elif isinstance(value, float) and math.isnan(value):  # passes every bound check
                errors.append(f"{f.name}: expected a number, got nan")
            elif meta["min"] is not None and value < meta["min"]:
                errors.append(_BELOW_MIN.get(f.name, "{name}: {value} is below the minimum "
                                             "{min}").format(name=f.name, value=value,
                                                              min=meta["min"]))
            elif meta["max"] is not None and value > meta["max"]:
                errors.append(f"{f.name}: {value} is above the maximum {meta['max']}")
        for check in (self._check_listen, self._check_tokens, self._check_gpu_device,
                      self._check_remote, self._check_kv_events):
            try:
                check()
            except ConfigError as e:
                errors.append(str(e))
        if errors:
            raise ConfigError("\n".join(errors))

    def _check_listen(self) -> None:
        if self.listen:
            host, _, port = self.listen.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ConfigError(f"listen: expected HOST:PORT, got {self.listen!r}")
            if not self.token and not self.token_file and not self.tenant_tokens_file:
                raise ConfigError("listen: a TCP listener requires `token`, `token_file` or "
                                  "`tenant_tokens_file` (clients authenticate)")

    def _check_tokens(self) -> None:
        if self.tenant_weights:
            parse_tenant_weights(self.tenant_weights)  # raises a ConfigError naming the pair
            if not self.tenant_tokens_file:
                raise ConfigError("tenant_weights: needs `tenant_tokens_file` (the tenants "
                                  "they weigh)")
        if self.token and self.token_file:
            raise ConfigError("token_file: `token` is set as well; give the admin token one "
                              "way, not both")

    def _check_gpu_device(self) -> None:
        if not re.fullmatch(r"cuda(:[0-9]+)?|cpu", self.gpu_device):
            raise ConfigError(f"gpu_device: expected cuda, cuda:N or cpu, got {self.gpu_device!r}")

    def _check_remote(self) -> None:
        if self.remote:
            parse_remote_url(self.remote)  # raises a ConfigError naming what is wrong

    def _check_kv_events(self) -> None:
        for name in ("kv_events", "kv_events_replay"):
            endpoint = getattr(self, name)
            if endpoint and not endpoint.startswith(("tcp://", "ipc://")):
                raise ConfigError(f"{name}: expected tcp://HOST:PORT or ipc://PATH, "
                                  f"got {endpoint!r}")
        if self.kv_events_replay and not self.kv_events:
            raise ConfigError("kv_events_replay: needs `kv_events` (the PUB endpoint)")

    @property
    def socket_path(self) -> Path:
        return Path(self.socket) if self.socket else Path(self.data_dir) / "kv.sock"

    def redacted(self) -> dict[str, Any]:
        """The effective configuration, secrets replaced, for `--print-config` and logs."""
        out = dataclasses.asdict(self)
        for f in dataclasses.fields(self):
            if f.metadata["secret"] and out[f.name]:
                out[f.name] = "***"
        out["remote"] = redact_url(self.remote)  # keep the address, hide a password
        return out


def problems(error: ConfigError) -> str:
    """A `ConfigError` as printed after "invalid configuration: ": its problem, or, when it
    lists several (`load_config`), how many and then each on an indented line of its own."""
    lines = str(error).splitlines()
    if len(lines) < 2:
        return str(error)
    return f"{len(lines)} problems:" + "".join(f"\n  {line}" for line in lines)


def _file_kind(mode: int) -> str:
    for test, kind in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return kind
    return "a special file"


def _check_secret_file(p: Path, st: os.stat_result, option: str) -> None:
    if not stat.S_ISREG(st.st_mode):
        raise ConfigError(f"{option}: {p} is {_file_kind(st.st_mode)}, not a regular file")
    if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ConfigError(f"{option}: {p} is accessible by group or others (mode "
                          f"{stat.S_IMODE(st.st_mode):04o}); chmod 600 it")
    if st.st_size > MAX_SECRET_FILE_BYTES:
        raise ConfigError(f"{option}: {p} is larger than {MAX_SECRET_FILE_BYTES >> 20} MiB "
                          f"({st.st_size} bytes); is it the right file?")


def read_secret_file(path: str | Path, option: str) -> str:
    """The text of a secret file (`token_file`, `tenant_tokens_file`), checked before any of it
    is read: a regular file (a symlink to one is fine: Kubernetes mounts secrets so), readable
    by its owner only, at most `MAX_SECRET_FILE_BYTES`. Raises `ConfigError` naming `option`.

    A FIFO or device in its place is refused, never read: opening a FIFO waits for a writer and
    /dev/zero never ends, and at a reload (SIGHUP) either froze the daemon. The checks are made
    again on the opened descriptor, as the path may be swapped after the first; it is opened
    non-blocking, so a FIFO swapped in meanwhile does not block the open either."""
    p = Path(path)
    try:
        _check_secret_file(p, os.stat(p), option)  # a device is refused before it is opened
        fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
        with open(fd, "rb") as f:  # closes fd
            _check_secret_file(p, os.fstat(fd), option)  # what was opened
            data = f.read(MAX_SECRET_FILE_BYTES + 1)
    except OSError as e:
        raise ConfigError(f"{option}: cannot read {p}: {e.strerror or e}") from None
    if len(data) > MAX_SECRET_FILE_BYTES:  # it grew after the fstat
        raise ConfigError(f"{option}: {p} is larger than {MAX_SECRET_FILE_BYTES >> 20} MiB; is "
                          "it the right file?")
    try:
        return data.decode()
    except UnicodeDecodeError:
        raise ConfigError(f"{option}: {p} is not UTF-8 text") from None


def read_token_file(path: str | Path, option: str = "token_file") -> str:
    """The token in a secret file (`read_secret_file`'s checks): at least `MIN_TOKEN_CHARS`
    characters. Raises `ConfigError` naming `option` (and never quoting the token)."""
    text = read_secret_file(path, option).strip()
    check_token(text, option)
    return text


def check_token(token: str, option: str = "token") -> None:
    if len(token) < MIN_TOKEN_CHARS or any(c.isspace() for c in token):
        raise ConfigError(f"{option}: the admin token must be at least {MIN_TOKEN_CHARS} "
                          "characters, without spaces (e.g. `openssl rand -hex 32`)")


def admin_token(config: ServerConfig) -> str:
    """The admin token, from `token` or `token_file` ("" when neither is set), checked."""
    if config.token_file:
        return read_token_file(config.token_file)
    if config.token:
        check_token(config.token)
    return config.token


def _shown(raw: Any) -> str:
    """A value for a message, as TOML writes it (`true`, not Python's `True`), at most 40
    characters."""
    if isinstance(raw, bool):
        return str(raw).lower()
    if isinstance(raw, dict):
        return "a table"
    if isinstance(raw, list):
        return "an array"
    if isinstance(raw, datetime.date | datetime.time):
        return f"a date or time ({raw.isoformat()})"
    text = repr(raw)
    return text if len(text) <= 40 else f"{text[:37]}..."


def _coerce(name: str, raw: Any) -> Any:
    """`raw` (a TOML value, or the text of an environment variable or flag) as option `name`
    holds it. A TOML value of another type is refused, not converted: `3.9` is no int (int()
    made it 3), `true` no number (it made 1), `[1, 2]` no path (it made "[1, 2]"). Text is
    parsed, as a variable's or a flag's must be."""
    f = {f.name: f for f in dataclasses.fields(ServerConfig)}.get(name)
    if f is None:
        raise ConfigError(f"unknown option {name!r}{_did_you_mean(name)}")
    if f.metadata["unit"] == "bytes":
        if isinstance(raw, bool) or not isinstance(raw, int | float | str):
            raise ConfigError(f"{name}: expected a size, got {_shown(raw)}")
        return parse_size(raw, name)
    kind: type = type(f.default)  # str, int or float: the field's declared type
    if kind is str:
        if not isinstance(raw, str):
            raise ConfigError(f"{name}: expected str, got {_shown(raw)}")
        if "\0" in raw:  # no path or address holds one; open() would raise ValueError
            raise ConfigError(f"{name}: contains a NUL character")
        return raw
    # A float field takes an int (`30`); an int field no float, not even `4.0`: int() would
    # round `3.9` down (and `inf` raise OverflowError) where the writer meant something else.
    allowed: tuple[type, ...] = (str, int) if kind is int else (str, int, float)
    if isinstance(raw, bool) or not isinstance(raw, allowed):
        raise ConfigError(f"{name}: expected {kind.__name__}, got {_shown(raw)}")
    try:
        return kind(raw)
    except ValueError:  # text: "3.9" or "inf" for an int, "soon"
        raise ConfigError(f"{name}: expected {kind.__name__}, got {_shown(raw)}") from None
    except OverflowError:  # an int too large for a float
        raise ConfigError(f"{name}: {_shown(raw)} is out of range") from None


def _did_you_mean(name: str, env: bool = False) -> str:
    """"; did you mean 'host_bytes'?" for an unknown option close to one (`env`: as its
    variable, `KVSTORE_HOST_BYTES`), else ""."""
    close = difflib.get_close_matches(name, [f.name for f in dataclasses.fields(ServerConfig)],
                                      n=1)
    if not close:
        return ""
    option = f"KVSTORE_{close[0].upper()}" if env else close[0]
    return f"; did you mean {option!r}?"


OTHER_ENV = {
    "KVSTORE_CONFIG": "the daemon's TOML file (`--config`)",
    "KVSTORE_TARGET": "the `kvstore` CLI's daemon address",
    "KVSTORE_SAVE_NICE": "the engine connectors' save priority",
    "KVSTORE_MALLOC_TUNING": "0: leave glibc's malloc thresholds alone (daemon and clients)",
    "KVSTORE_NATIVE_COPY": "0: copy vLLM CPU caches with torch ops, not the C routine",
    "KVSTORE_CACHE_DIR": "where the C copy routine is built",
}
"""`KVSTORE_*` variables that are not daemon options: read by other parts of kvstore (the
CLI, clients, engine connectors) or by the daemon apart from its options. One environment
often starts the daemon beside them (a compose file, a shell), so its option loader skips
them; any other unknown `KVSTORE_*` name stops start-up, naming the variable."""


def load_config(
    file: str | Path | None = None,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> ServerConfig:
    """Merge defaults < TOML file < `KVSTORE_*` environment < `overrides` (flags).

    Every bad value is reported, not just the first: one `ConfigError`, one line each."""
    values: dict[str, Any] = {}
    errors: list[str] = []

    def take(name: str, raw: Any, where: str = "") -> None:
        try:
            values[name] = _coerce(name, raw)
        except ConfigError as e:
            errors.append(f"{e}{where}")

    if file:
        try:
            data = tomllib.loads(Path(file).read_text(encoding="utf-8"))
        except UnicodeDecodeError as e:
            raise ConfigError(f"config file {file}: not UTF-8 text (byte {e.start})") from None
        except (OSError, ValueError) as e:  # ValueError: TOMLDecodeError, an int of 5000 digits
            raise ConfigError(f"config file {file}: {e}") from None
        server = data.get("server", data)
        if not isinstance(server, dict):  # `server = 1`: as unusable as a file that won't parse
            raise ConfigError(f"config file {file}: server: expected a table of options "
                              f"([server]), got {_shown(server)}")
        if server is not data:  # keys beside [server] would be ignored: say so
            errors.extend(f"config file {file}: {k!r} is outside [server] (options go inside "
                          "it, or the file has no [server] table at all)"
                          for k in data if k != "server")
        for k, v in server.items():
            take(k.replace("-", "_"), v)
    for k, v in (env or {}).items():
        if k.startswith("KVSTORE_") and k not in OTHER_ENV:
            name = k.removeprefix("KVSTORE_").lower()
            if not any(f.name == name for f in dataclasses.fields(ServerConfig)):
                errors.append(f"unknown option {name!r} (environment variable {k})"
                              f"{_did_you_mean(name, env=True)}")
                continue
            take(name, v, f" (environment variable {k})")
    for k, v in (overrides or {}).items():
        if v is not None:
            take(k, v)
    try:
        config = ServerConfig(**values)
    except ConfigError as e:  # the values that parsed, checked: their problems too
        errors.append(str(e))
    if errors:
        raise ConfigError("\n".join(errors))
    return config
