"""Remote tier addresses: parse `redis://` and `redis+cluster://` URLs, and redact them.

    redis://[[user]:password@]host:port[/db]           one server (or a proxy in front of many)
    rediss://...                                       the same over TLS
    redis+cluster://[[user]:password@]host:port,host:port,...   a Redis/Valkey Cluster: any
                                                       reachable node lets the client discover
                                                       the rest (more seeds survive one down)
    rediss+cluster://...                               a Cluster over TLS
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import unquote

from kvstore.errors import ConfigError

_SCHEMES = {"redis": (False, False), "rediss": (False, True),
            "redis+cluster": (True, False), "rediss+cluster": (True, True)}


@dataclass(frozen=True)
class RemoteTarget:
    cluster: bool
    tls: bool
    nodes: tuple[tuple[str, int], ...]
    db: int = 0
    username: str | None = None
    password: str | None = None


def parse_remote_url(url: str) -> RemoteTarget:
    """Parse a remote tier URL; raises `ConfigError` naming what is wrong."""
    scheme, sep, rest = url.partition("://")
    if not sep or scheme not in _SCHEMES:
        raise ConfigError(f"remote: expected redis://host:port/db or redis+cluster://host:port,"
                          f"host:port, got {redact_url(url)!r}")
    cluster, tls = _SCHEMES[scheme]
    netloc, _, path = rest.partition("/")
    username = password = None
    if "@" in netloc:
        userinfo, _, netloc = netloc.rpartition("@")
        user, has_pw, pw = userinfo.partition(":")
        username = unquote(user) or None
        password = unquote(pw) if has_pw else None
    nodes = tuple(_host_port(part) for part in netloc.split(",") if part)
    if not nodes:
        raise ConfigError("remote: no host:port in the URL")
    if not cluster and len(nodes) > 1:
        raise ConfigError("remote: several hosts need redis+cluster://")
    db_text = path.split("?", 1)[0].strip("/")
    if db_text and not db_text.isdigit():
        raise ConfigError(f"remote: database must be a number, got {db_text!r}")
    db = int(db_text or 0)
    if cluster and db:
        raise ConfigError("remote: a Redis Cluster has only database 0")
    return RemoteTarget(cluster, tls, nodes, db, username, password)


def _host_port(part: str) -> tuple[str, int]:
    host, sep, port = part.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"remote: expected host:port, got {part!r}")
    return host.strip("[]"), int(port)


def redact_url(url: str) -> str:
    """The URL with its password replaced, for logs, stats and `--print-config`."""
    scheme, sep, rest = url.partition("://")
    netloc, slash, path = rest.partition("/")
    if not sep or "@" not in netloc:
        return url
    userinfo, _, hosts = netloc.rpartition("@")
    user, has_pw, _ = userinfo.partition(":")
    return f"{scheme}://{user}{':***' if has_pw else ''}@{hosts}{slash}{path}"
