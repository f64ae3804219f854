"""The Redis client for `--state-url`: one Redis (`redis://`, `rediss://`, `unix://`,
redis-py's own URL forms) or a primary that Sentinel fails over
(`redis+sentinel://[:PASSWORD@]HOST:PORT[,HOST:PORT…]/MASTER_NAME[?db=N]`).

With Sentinel every new connection asks the sentinels, in turn, which Redis is the
primary now; a connection to a primary that died fails, the router counts alone for
the moment (router/tenants/shared.py), and its next call (the watch pings every second)
connects to whichever replica Sentinel promoted. A demoted primary that is still up
answers writes READONLY, which redis-py turns into a reconnection. The password, when
given, is the data nodes' (`requirepass`/`masterauth`); sentinels are asked without one.

Every client has short socket timeouts and no retries of its own: a caller that gets
no answer within its budget falls back rather than waits (the callers run in
`trio.to_thread`, redis-py's client being synchronous).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs, unquote

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry
from redis.sentinel import Sentinel

SENTINEL_SCHEME = "redis+sentinel"
DEFAULT_SENTINEL_PORT = 26379


@dataclass(frozen=True)
class SentinelUrl:
    sentinels: tuple[tuple[str, int], ...]
    master: str
    db: int = 0
    password: str | None = None


def parse_sentinel_url(url: str) -> SentinelUrl:
    """A `redis+sentinel://` URL's parts; ValueError saying what is wrong."""
    form = "redis+sentinel://HOST:PORT[,HOST:PORT…]/MASTER_NAME"
    scheme, sep, rest = url.partition("://")
    if scheme != SENTINEL_SCHEME or not sep:
        raise ValueError(f"not a Sentinel URL: expected {form}")
    rest, _, query = rest.partition("?")
    hosts, _, master = rest.partition("/")
    credentials, at, hosts = hosts.rpartition("@")
    password = unquote(credentials.partition(":")[2] or credentials) if at else None
    master = unquote(master.strip("/"))
    if not master or "/" in master:
        raise ValueError(f"{url!r} names no master: expected {form}")
    sentinels: list[tuple[str, int]] = []
    for part in hosts.split(","):
        host, colon, port = part.strip().rpartition(":")
        if not colon:
            host, port = part.strip(), str(DEFAULT_SENTINEL_PORT)
        host = host.strip("[]")  # an IPv6 address in brackets
        # ASCII digits, at most five: `isdigit` alone is true of `²`, which `int` refuses.
        if not host or not _digits(port, 5) or not 0 < int(port) < 65536:
            raise ValueError(f"sentinel address {part!r} is not HOST:PORT (in {form})")
        sentinels.append((host, int(port)))
    db = parse_qs(query).get("db", ["0"])[-1]
    if not _digits(db, 5):
        raise ValueError(f"db={db!r} is not a database number")
    return SentinelUrl(tuple(sentinels), master, int(db), password or None)


def _digits(text: str, most: int) -> bool:
    return 0 < len(text) <= most and text.isascii() and text.isdigit()


def connect(url: str, timeout: float, **options: Any) -> redis.Redis:
    """A client for `url` with `timeout` on every socket and no retries; ValueError
    for a URL that is not one (at start-up: exit 2)."""
    common: dict[str, Any] = {
        "socket_timeout": timeout,
        "socket_connect_timeout": timeout,
        "retry": Retry(NoBackoff(), 0),
        "health_check_interval": 0,
        **options,
    }
    if not url.startswith(SENTINEL_SCHEME + "://"):
        return redis.Redis.from_url(url, **common)
    parts = parse_sentinel_url(url)
    # The sentinels' clients too: redis-py's default is 10 retries with backoff, which
    # held a request 12 s when every sentinel was gone (tests/test_fleet_failover.py).
    sentinel = Sentinel(
        list(parts.sentinels),
        sentinel_kwargs={
            "socket_timeout": timeout,
            "socket_connect_timeout": timeout,
            "retry": Retry(NoBackoff(), 0),
            "health_check_interval": 0,
        },
    )
    return sentinel.master_for(parts.master, db=parts.db, password=parts.password, **common)


def reason(exc: Exception) -> str:
    """`exc` for a log line: redis-py's MasterNotFoundError carries the repr of a client
    per sentinel (3 KiB for three), of which the first clause says it all."""
    return f"{type(exc).__name__}: {str(exc).split(' : <', 1)[0][:300]}"
