"""A small, honest HTTP/1.1 load generator for operators and benchmark scripts.

Two modes:

- **closed loop** (``concurrency=C``): C clients, each with one connection,
  send a request as soon as the previous answer arrived.  Simple, but the
  offered load drops when the server slows down (coordinated omission), so
  its tail latencies flatter the server.
- **open loop** (``rate=R``): requests are *scheduled* at R per second
  (Poisson or evenly spaced arrivals) whatever the server does, on a pool of
  at most ``connections`` connections, and latency is measured from the
  scheduled send time.  A server stall therefore shows up in every request
  that should have been sent during it, as it would for real users.

Responses are parsed by ``httptools.HttpResponseParser`` (llhttp); latencies
go into an HDR-style log-linear histogram (<1 % relative error) so a long
run costs constant memory.  Every run is bounded by ``duration`` (plus at
most one request ``timeout`` for the answers still in flight) and optionally
by a request count.

Only loopback or this host's own addresses are accepted unless
``allow_remote`` is set: a load test pointed at the wrong host on a shared
network is a denial of service against somebody else.

Use from scripts::

    from numaserve.tools.loadtest import LoadConfig, run_load
    res = run_load(LoadConfig("http://127.0.0.1:8000/", rate=500, duration=10))
    print(res.rate, res.latency["p99"], res.errors)

``arun_load`` is the same as a coroutine for callers already in an event loop.
"""

from __future__ import annotations

import asyncio
import errno
import ipaddress
import math
import random
import re
import socket
import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator, Sequence
from urllib.parse import urlsplit

import httptools

from numaserve import __version__
from numaserve.errors import UsageError

__all__ = [
    "ERROR_KINDS",
    "MAX_BACKLOG",
    "LatencyRecorder",
    "LoadConfig",
    "LoadConfigError",
    "LoadResult",
    "Target",
    "arun_load",
    "build_request",
    "parse_duration",
    "parse_header",
    "parse_url",
    "percentiles_of",
    "resolve_target",
    "run_load",
]

#: Error kinds, in the order they are reported.
ERROR_KINDS: tuple[str, ...] = ("connect", "read", "timeout", "reset")

#: Open loop: most requests outstanding in the client (a far-too-high rate
#: must not grow memory without bound); arrivals beyond it count as timeouts.
MAX_BACKLOG = 50_000

_PERCENTILES: tuple[tuple[str, float], ...] = (
    ("p50", 0.50), ("p75", 0.75), ("p90", 0.90), ("p99", 0.99), ("p99.9", 0.999),
)
_USER_AGENT = f"numaserve-loadtest/{__version__}"


class LoadConfigError(UsageError, ValueError):
    """A load-test parameter is wrong (CLI exit status 2; a ValueError for scripts)."""


# ----------------------------------------------------------------- config


@dataclass(frozen=True)
class LoadConfig:
    """What to send, how hard and for how long (validated by ``validate()``)."""

    url: str
    concurrency: int | None = None          # closed loop (default 10 when rate is None)
    rate: float | None = None               # open loop, requests per second
    duration: float = 10.0                  # seconds of sending
    requests: int | None = None             # stop after this many requests (either mode)
    method: str = "GET"
    headers: tuple[tuple[str, str], ...] = ()
    body: bytes = b""
    keepalive: bool = True
    timeout: float = 5.0                    # per request, from its (scheduled) start
    connections: int | None = None          # open-loop pool bound (default 128)
    arrivals: str = "poisson"               # open loop: "poisson" or "uniform"
    allow_remote: bool = False
    seed: int | None = None

    @property
    def mode(self) -> str:
        return "open" if self.rate is not None else "closed"

    @property
    def clients(self) -> int:
        """Closed loop: clients; open loop: the connection pool bound."""
        if self.rate is not None:
            return self.connections or 128
        return self.concurrency or 10

    def validate(self) -> "LoadConfig":
        """Raise ``LoadConfigError`` naming the first bad parameter; return self."""
        if self.rate is not None and self.concurrency is not None:
            raise LoadConfigError("give --rate (open loop) or --concurrency (closed loop), not both")
        if self.rate is not None and not (0 < self.rate <= 1_000_000 and math.isfinite(self.rate)):
            raise LoadConfigError(f"--rate must be in (0, 1000000] requests/s, not {self.rate:g}")
        if self.concurrency is not None and not 1 <= self.concurrency <= 10_000:
            raise LoadConfigError(f"--concurrency must be in 1..10000, not {self.concurrency}")
        if self.connections is not None:
            if self.rate is None:
                raise LoadConfigError("--connections bounds the open-loop pool (--rate); "
                                      "with --concurrency each client has its own connection")
            if not 1 <= self.connections <= 10_000:
                raise LoadConfigError(f"--connections must be in 1..10000, not {self.connections}")
        if not (0 < self.duration <= 86_400 and math.isfinite(self.duration)):
            raise LoadConfigError(f"--duration must be in (0, 24h], not {self.duration:g}s")
        if self.requests is not None and self.requests < 1:
            raise LoadConfigError(f"--requests must be at least 1, not {self.requests}")
        if not (0 < self.timeout <= 3600 and math.isfinite(self.timeout)):
            raise LoadConfigError(f"--timeout must be in (0, 1h], not {self.timeout:g}s")
        if self.arrivals not in ("poisson", "uniform"):
            raise LoadConfigError(f"--arrivals must be poisson or uniform, not {self.arrivals!r}")
        if not re.fullmatch(r"[A-Z]{1,20}", self.method):
            raise LoadConfigError(f"bad method {self.method!r} (expected an upper-case token like GET)")
        for name, value in self.headers:
            _check_header(name, value)
        parse_url(self.url)
        _check_fd_budget(self.clients)
        return self


def _check_fd_budget(n: int) -> None:
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (ImportError, OSError, ValueError):
        return
    if soft != resource.RLIM_INFINITY and n + 32 > soft:
        raise LoadConfigError(f"{n} connections need more file descriptors than the limit of {soft} "
                              f"(raise it with `ulimit -n`)")


_DURATION_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*(ms|s|m|h)?\s*$")
_UNIT = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}


def parse_duration(text: str | float) -> float:
    """Seconds from ``"10s"``, ``"500ms"``, ``"2m"``, ``"1h"`` or a bare number (seconds)."""
    if isinstance(text, (int, float)):
        return float(text)
    m = _DURATION_RE.match(text)
    if not m:
        raise LoadConfigError(f"bad duration {text!r} (examples: 10s, 500ms, 2m)")
    return float(m.group(1)) * _UNIT[m.group(2)]


_TOKEN_RE = re.compile(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]+$")
_GENERATED = {"content-length", "transfer-encoding"}


def _check_header(name: str, value: str) -> None:
    if not _TOKEN_RE.match(name):
        raise LoadConfigError(f"bad header name {name!r}")
    if "\r" in value or "\n" in value or "\0" in value:
        raise LoadConfigError(f"header {name} has a line break in its value")
    if name.lower() in _GENERATED:
        raise LoadConfigError(f"{name} is computed from the body; do not set it")


def parse_header(text: str) -> tuple[str, str]:
    """``"Name: value"`` (as given to ``-H``) to a pair, checked."""
    name, sep, value = text.partition(":")
    if not sep or not name.strip():
        raise LoadConfigError(f"bad header {text!r} (expected 'Name: value')")
    pair = (name.strip(), value.strip())
    _check_header(*pair)
    return pair


# ----------------------------------------------------------------- target


@dataclass(frozen=True)
class Target:
    host: str          # as written in the URL (brackets stripped)
    port: int
    path: str          # path + query, as sent on the request line
    host_header: str   # Host: value


def parse_url(url: str) -> Target:
    """Split an ``http://`` URL; raise ``LoadConfigError`` for anything else."""
    try:
        u = urlsplit(url)
        port = u.port
    except ValueError as e:
        raise LoadConfigError(f"bad URL {url!r}: {e}") from None
    if u.scheme != "http":
        raise LoadConfigError(f"bad URL {url!r}: only http:// is supported (no TLS)")
    if not u.hostname:
        raise LoadConfigError(f"bad URL {url!r}: no host")
    if u.username or u.password:
        raise LoadConfigError(f"bad URL {url!r}: credentials in URLs are not supported")
    if any(c in url for c in "\r\n\t "):
        raise LoadConfigError(f"bad URL {url!r}: whitespace")
    path = (u.path or "/") + (f"?{u.query}" if u.query else "")
    host_header = u.netloc.rpartition("@")[2]
    return Target(u.hostname, port or 80, path, host_header)


def _local_addresses() -> set[str]:
    try:
        import psutil

        return {a.address.split("%")[0] for addrs in psutil.net_if_addrs().values() for a in addrs
                if a.family in (socket.AF_INET, socket.AF_INET6)}
    except Exception:  # pragma: no cover - psutil is a dependency; be safe anyway
        return set()


def resolve_target(target: Target, allow_remote: bool = False) -> list[tuple[int, Any]]:
    """(family, sockaddr) for the target; refuse non-local hosts unless ``allow_remote``.

    "Local" is loopback, the unspecified address, or an address assigned to an
    interface of this host: traffic to them never leaves the machine.
    """
    try:
        infos = socket.getaddrinfo(target.host, target.port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise LoadConfigError(f"cannot resolve {target.host!r}: {e.strerror}") from None
    out: list[tuple[int, Any]] = []
    for family, _, _, _, sockaddr in infos:
        if (family, sockaddr) not in out:
            out.append((family, sockaddr))
    if not allow_remote:
        local = None
        for _, sockaddr in out:
            ip = ipaddress.ip_address(sockaddr[0].split("%")[0])
            if ip.is_loopback or ip.is_unspecified:
                continue
            local = _local_addresses() if local is None else local
            if str(ip) not in local:
                raise LoadConfigError(
                    f"refusing to load-test {target.host} ({ip}): not a loopback or local address of this "
                    f"host; pass --allow-remote if you mean it (load on a shared network hurts other services)")
    return out


def build_request(cfg: LoadConfig, target: Target) -> bytes:
    """The request bytes, built once and sent as-is for every request."""
    names = {n.lower() for n, _ in cfg.headers}
    lines = [f"{cfg.method} {target.path} HTTP/1.1"]
    if "host" not in names:
        lines.append(f"Host: {target.host_header}")
    if "user-agent" not in names:
        lines.append(f"User-Agent: {_USER_AGENT}")
    if "accept" not in names:
        lines.append("Accept: */*")
    lines.extend(f"{n}: {v}" for n, v in cfg.headers)
    if cfg.body or cfg.method in ("POST", "PUT", "PATCH"):
        lines.append(f"Content-Length: {len(cfg.body)}")
    if not cfg.keepalive and "connection" not in names:
        lines.append("Connection: close")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + cfg.body


# --------------------------------------------------------------- histogram


class LatencyRecorder:
    """HDR-style histogram of microsecond values: exact below 2**k µs, then
    2**(k-1) linear sub-buckets per power of two (relative error < 2**(1-k)).

    Percentiles report the highest value equivalent to the bucket (as HDR
    does), clamped to the observed min/max, so they never understate.
    """

    def __init__(self, precision_bits: int = 8) -> None:
        if not 2 <= precision_bits <= 16:
            raise ValueError("precision_bits must be in 2..16")
        self.k = precision_bits
        self._half = 1 << (precision_bits - 1)
        self.counts: list[int] = []
        self.count = 0
        self.sum_us = 0.0
        self.sumsq_us = 0.0
        self.min_us = 0
        self.max_us = 0

    def _index(self, v: int) -> int:
        shift = v.bit_length() - self.k
        if shift <= 0:
            return v
        return (v >> shift) + shift * self._half

    def bounds(self, idx: int) -> tuple[int, int]:
        """Lowest and highest microsecond value counted in bucket ``idx``."""
        if idx < 2 * self._half:
            return idx, idx
        shift = idx // self._half - 1
        top = idx - shift * self._half
        return top << shift, ((top + 1) << shift) - 1

    def record(self, seconds: float) -> None:
        """Count one latency given in seconds."""
        v = int(seconds * 1e6 + 0.5)
        if v < 0:
            v = 0
        i = self._index(v)
        counts = self.counts
        if i >= len(counts):
            counts.extend([0] * (i + 1 - len(counts)))
        counts[i] += 1
        if self.count == 0 or v < self.min_us:
            self.min_us = v
        if v > self.max_us:
            self.max_us = v
        self.count += 1
        self.sum_us += v
        self.sumsq_us += float(v) * v

    def merge(self, other: "LatencyRecorder") -> None:
        """Add another recorder's counts (same precision), e.g. from several processes."""
        if other.k != self.k:
            raise ValueError("cannot merge recorders of different precision")
        if len(other.counts) > len(self.counts):
            self.counts.extend([0] * (len(other.counts) - len(self.counts)))
        for i, c in enumerate(other.counts):
            self.counts[i] += c
        if other.count:
            self.min_us = other.min_us if not self.count else min(self.min_us, other.min_us)
            self.max_us = max(self.max_us, other.max_us)
        self.count += other.count
        self.sum_us += other.sum_us
        self.sumsq_us += other.sumsq_us

    def buckets(self) -> Iterator[tuple[int, int, int]]:
        """Non-empty buckets as (low_us, high_us, count)."""
        for i, c in enumerate(self.counts):
            if c:
                lo, hi = self.bounds(i)
                yield lo, hi, c

    def percentile_us(self, q: float) -> int:
        """Nearest-rank q-quantile (0 <= q <= 1) in microseconds (0 when empty)."""
        if not self.count:
            return 0
        rank = max(1, math.ceil(q * self.count - 1e-9))
        cum = 0
        for i, c in enumerate(self.counts):
            cum += c
            if cum >= rank:
                return max(self.min_us, min(self.bounds(i)[1], self.max_us))
        return self.max_us

    @property
    def mean_us(self) -> float:
        return self.sum_us / self.count if self.count else 0.0

    @property
    def stdev_us(self) -> float:
        if self.count < 2:
            return 0.0
        var = self.sumsq_us / self.count - self.mean_us ** 2
        return math.sqrt(max(0.0, var))

    def within_stdev(self) -> float:
        """Percent of values within one standard deviation of the mean (wrk's ``+/- Stdev``)."""
        if not self.count:
            return 0.0
        lo, hi = self.mean_us - self.stdev_us, self.mean_us + self.stdev_us
        n = sum(c for blo, bhi, c in self.buckets() if lo <= (blo + bhi) / 2 <= hi)
        return 100.0 * n / self.count

    def summary_ms(self) -> dict[str, float]:
        """min/p50/p75/p90/p99/p99.9/max/mean/stdev in milliseconds."""
        out = {"min": self.min_us / 1000.0}
        for name, q in _PERCENTILES:
            out[name] = self.percentile_us(q) / 1000.0
        out["max"] = self.max_us / 1000.0
        out["mean"] = round(self.mean_us / 1000.0, 3)
        out["stdev"] = round(self.stdev_us / 1000.0, 3)
        return out

    def coarse(self, upper_ms: Sequence[float]) -> list[int]:
        """Counts re-binned on coarser bounds (inclusive upper, ms), e.g. the
        workers' ``BUCKET_UPPER_MS`` so client and server views line up."""
        import bisect

        out = [0] * len(upper_ms)
        for lo, hi, c in self.buckets():
            j = min(bisect.bisect_left(upper_ms, (lo + hi) / 2000.0), len(upper_ms) - 1)
            out[j] += c
        return out


# ------------------------------------------------------------------ result


@dataclass
class LoadResult:
    """Outcome of one run.  ``requests`` counts complete responses (any status);
    failed attempts are in ``errors`` by kind and are not in the latency histogram."""

    url: str
    mode: str
    concurrency: int | None
    rate_target: float | None
    arrivals: str | None
    connections_max: int
    loop: str
    duration_s: float = 0.0
    requests: int = 0
    status_counts: dict[int, int] = field(default_factory=dict)
    errors: dict[str, int] = field(default_factory=lambda: {k: 0 for k in ERROR_KINDS})
    error_samples: dict[str, str] = field(default_factory=dict)
    latency_hist: LatencyRecorder = field(default_factory=LatencyRecorder)
    send_lag_hist: LatencyRecorder = field(default_factory=LatencyRecorder)
    bytes_read: int = 0
    bytes_written: int = 0
    connects: int = 0
    peak_connections: int = 0
    retries: int = 0
    client_cpu_s: float = 0.0
    aborted: str | None = None
    interrupted: bool = False       # ``stop`` was set before the duration ran out
    pool_timeouts: int = 0          # open loop: timed out still waiting for a free connection
    backlog_drops: int = 0          # open loop: arrivals over MAX_BACKLOG, counted as timeouts

    @property
    def error_count(self) -> int:
        return sum(self.errors.values())

    @property
    def non_2xx(self) -> int:
        return sum(c for s, c in self.status_counts.items() if not 200 <= s < 300)

    @property
    def rate(self) -> float:
        """Achieved responses per second."""
        return self.requests / self.duration_s if self.duration_s > 0 else 0.0

    @property
    def latency(self) -> dict[str, float]:
        return self.latency_hist.summary_ms()

    @property
    def ok(self) -> bool:
        """At least one response and no errors of any kind."""
        return self.requests > 0 and self.error_count == 0 and self.aborted is None

    def record_error(self, kind: str, message: str) -> None:
        self.errors[kind] += 1
        self.error_samples.setdefault(kind, message)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready view (stable keys for scripts)."""
        from numaserve.worker.stats import BUCKET_SCHEMA, BUCKET_UPPER_MS

        coarse = self.latency_hist.coarse(BUCKET_UPPER_MS)
        lag = self.send_lag_hist
        return {
            "url": self.url,
            "mode": self.mode,
            "concurrency": self.concurrency,
            "rate_target": self.rate_target,
            "arrivals": self.arrivals,
            "connections_max": self.connections_max,
            "loop": self.loop,
            "duration_s": round(self.duration_s, 4),
            "requests": self.requests,
            "rate": round(self.rate, 2),
            "status_counts": {str(k): v for k, v in sorted(self.status_counts.items())},
            "non_2xx": self.non_2xx,
            "errors": dict(self.errors),
            "error_count": self.error_count,
            "error_samples": dict(self.error_samples),
            "latency_ms": self.latency,
            "within_stdev_pct": round(self.latency_hist.within_stdev(), 2),
            "histogram": {
                "schema": BUCKET_SCHEMA,
                "buckets": [[_json_ms(BUCKET_UPPER_MS[i]), c] for i, c in enumerate(coarse) if c],
            },
            "send_lag_ms": None if not lag.count else {
                "p50": lag.percentile_us(0.5) / 1000.0, "p99": lag.percentile_us(0.99) / 1000.0,
                "max": lag.max_us / 1000.0},
            "bytes_read": self.bytes_read,
            "bytes_written": self.bytes_written,
            "transfer_per_s": round(self.bytes_read / self.duration_s, 1) if self.duration_s > 0 else 0.0,
            "connects": self.connects,
            "peak_connections": self.peak_connections,
            "retries": self.retries,
            "pool_timeouts": self.pool_timeouts,
            "backlog_drops": self.backlog_drops,
            "client_cpu_s": round(self.client_cpu_s, 3),
            "client_cpu_pct": round(100.0 * self.client_cpu_s / self.duration_s, 1) if self.duration_s else 0.0,
            "aborted": self.aborted,
            "interrupted": self.interrupted,
            "ok": self.ok,
        }


def _json_ms(v: float) -> float | str:
    return "+Inf" if math.isinf(v) else round(v, 4)


# ---------------------------------------------------------------- protocol


class _Fail(Exception):
    """A failed request attempt; ``kind`` is one of ERROR_KINDS or "stale"."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


_CLOSED_EARLY = "connection closed before a complete response"


class _Conn(asyncio.Protocol):
    """One client connection; one outstanding request at a time (no pipelining)."""

    def __init__(self, run: "_Run") -> None:
        self.run = run
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.uses = 0
        self._fut: asyncio.Future[tuple[int, bool]] | None = None
        self._parser: Any = None
        self._head = False
        self._status = 0
        self._nread = 0
        self._headers_done = False
        self._framed = False
        self.counted = False

    # -- asyncio callbacks
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        if self.closed:
            return
        self.closed = True
        if self.counted:
            self.counted = False
            self.run.open_connections(-1)
        fut, self._fut = self._fut, None
        if fut is None or fut.done():
            return
        if self._headers_done and not self._framed and not self._head:
            fut.set_result((self._status, False))    # body delimited by the close
        elif self.uses > 1 and self._nread == 0:
            fut.set_exception(_Fail("stale", "reused connection closed by the server"))
        elif isinstance(exc, (ConnectionResetError, BrokenPipeError)):
            fut.set_exception(_Fail("reset", f"connection reset by peer ({exc})"))
        elif exc is not None:
            fut.set_exception(_Fail("read", f"{type(exc).__name__}: {exc}"))
        else:
            fut.set_exception(_Fail("read", _CLOSED_EARLY))

    def data_received(self, data: bytes) -> None:
        self.run.result.bytes_read += len(data)
        self._nread += len(data)
        parser = self._parser
        if parser is None:
            self.close()              # bytes nobody asked for: cannot trust this connection
            return
        try:
            parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._finish(keep=False)
        except httptools.HttpParserError as e:
            fut, self._fut = self._fut, None
            if fut is not None and not fut.done():
                fut.set_exception(_Fail("read", f"bad HTTP response: {e}"))
            self.close()

    # -- httptools callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        n = name.lower()
        if n == b"content-length" or n == b"transfer-encoding":
            self._framed = True

    def on_headers_complete(self) -> None:
        self._headers_done = True
        self._status = self._parser.get_status_code()
        if self._status in (204, 304) or 100 <= self._status < 200:
            self._framed = True
        if self._head:
            self._finish(keep=bool(self._parser.should_keep_alive()))

    def on_message_complete(self) -> None:
        self._finish(keep=bool(self._parser.should_keep_alive()))

    def _finish(self, keep: bool) -> None:
        fut, self._fut = self._fut, None
        self._parser = None
        if fut is not None and not fut.done():
            fut.set_result((self._status, keep))

    # -- used by _Run
    def send(self, data: bytes, head: bool) -> "asyncio.Future[tuple[int, bool]]":
        fut: asyncio.Future[tuple[int, bool]] = self.run.loop.create_future()
        if self.closed or self.transport is None:
            fut.set_exception(_Fail("stale" if self.uses else "read", "connection already closed"))
            return fut
        self._fut = fut
        self._parser = httptools.HttpResponseParser(self)
        self._head = head
        self._status = 0
        self._nread = 0
        self._headers_done = False
        self._framed = False
        self.uses += 1
        self.transport.write(data)
        self.run.result.bytes_written += len(data)
        return fut

    def close(self) -> None:
        if self.transport is not None and not self.closed:
            if self.counted:              # gone for us now, even if the loop finalizes it later
                self.counted = False
                self.run.open_connections(-1)
            self.transport.close()


class _Pool:
    """At most ``size`` connections in use; idle ones reused newest first so a
    low rate keeps few connections warm instead of cycling through all."""

    def __init__(self, size: int) -> None:
        self.sem = asyncio.Semaphore(size)
        self.idle: list[_Conn] = []

    def take_idle(self) -> _Conn | None:
        while self.idle:
            c = self.idle.pop()
            if not c.closed:
                return c
        return None

    def give_back(self, conn: _Conn | None, reusable: bool) -> None:
        if conn is not None:
            if reusable and not conn.closed:
                self.idle.append(conn)
            else:
                conn.close()

    def close(self) -> None:
        for c in self.idle:
            c.close()
        self.idle.clear()


class _Run:
    """State shared by every client of one run."""

    def __init__(self, cfg: LoadConfig, target: Target, addrs: list[tuple[int, Any]],
                 result: LoadResult) -> None:
        self.cfg = cfg
        self.target = target
        self.addrs = addrs
        self.result = result
        self.loop = asyncio.get_running_loop()
        self.req = build_request(cfg, target)
        self.head = cfg.method == "HEAD"
        self.idempotent = cfg.method in ("GET", "HEAD", "OPTIONS", "TRACE", "PUT", "DELETE")
        self.keepalive = cfg.keepalive
        self.timeout = cfg.timeout
        self._open = 0
        self.sent = 0
        self.end = 0.0   # perf_counter time when sending stops

    def open_connections(self, delta: int) -> None:
        self._open += delta
        if self._open > self.result.peak_connections:
            self.result.peak_connections = self._open

    async def connect(self) -> _Conn:
        """A new connection to the first address that accepts (``addrs`` is
        reordered so later connects go straight to it)."""
        last: OSError | None = None
        for i, (family, sockaddr) in enumerate(self.addrs):
            try:
                _, conn = await self.loop.create_connection(
                    lambda: _Conn(self), host=sockaddr[0], port=sockaddr[1], family=family)
            except OSError as e:
                last = e
                continue
            if i:
                self.addrs.insert(0, self.addrs.pop(i))
            self.result.connects += 1
            if not conn.closed:        # counted only once really ours (a cancelled connect is not)
                conn.counted = True
                self.open_connections(+1)
            return conn  # type: ignore[return-value]
        err = last.strerror if last is not None and last.strerror else str(last)
        raise _Fail("connect", f"cannot connect to {self.target.host}:{self.target.port}: {err}")

    async def request(self, pool: _Pool, t0: float) -> str | None:
        """One request whose clock starts at ``t0``; records the outcome and
        returns the error kind (None on a response)."""
        clock = time.perf_counter
        res = self.result
        phase = "wait"
        conn: _Conn | None = None
        reusable = False
        acquired = False
        try:
            async with asyncio.timeout(t0 + self.timeout - clock()):
                await pool.sem.acquire()
                acquired = True
                for attempt in (0, 1):
                    conn = pool.take_idle() if self.keepalive and attempt == 0 else None
                    if conn is None:
                        phase = "connect"
                        conn = await self.connect()
                    phase = "send"
                    if attempt == 0:
                        lag = clock() - t0
                        if self.cfg.rate is not None:
                            res.send_lag_hist.record(lag)
                    try:
                        status, keep = await conn.send(self.req, self.head)
                    except _Fail as e:
                        if e.kind == "stale" and attempt == 0 and self.idempotent:
                            # the server closed an idle keep-alive connection as we sent: it saw
                            # nothing, so resend once (RFC 9110 9.2.2: idempotent methods only)
                            res.retries += 1
                            conn = None
                            continue
                        raise
                    break
        except TimeoutError:
            if phase == "wait":
                res.pool_timeouts += 1
                res.record_error("timeout", f"no free connection within {self.timeout:g}s "
                                            f"(all {self.cfg.clients} busy)")
                return "timeout"
            kind = "connect" if phase == "connect" else "timeout"
            msg = ("connect timed out" if kind == "connect" else
                   f"no complete response within {self.timeout:g}s")
            res.record_error(kind, msg)
            return kind
        except _Fail as e:
            kind = "read" if e.kind == "stale" else e.kind
            res.record_error(kind, str(e))
            return kind
        except OSError as e:  # pragma: no cover - write errors surface via connection_lost
            kind = "reset" if e.errno in (errno.ECONNRESET, errno.EPIPE) else "read"
            res.record_error(kind, str(e))
            return kind
        else:
            res.latency_hist.record(clock() - t0)
            res.requests += 1
            res.status_counts[status] = res.status_counts.get(status, 0) + 1
            reusable = keep and self.keepalive
            return None
        finally:
            pool.give_back(conn, reusable)
            if acquired:
                pool.sem.release()

    # -- modes
    async def closed_client(self) -> None:
        pool = _Pool(1)
        try:
            while True:
                now = time.perf_counter()
                if now >= self.end or (self.cfg.requests is not None and self.sent >= self.cfg.requests):
                    return
                self.sent += 1
                if await self.request(pool, now) == "connect":
                    await asyncio.sleep(0.02)   # do not spin on a target that refuses
        finally:
            pool.close()

    async def open_scheduler(self, start: float) -> None:
        pool = _Pool(self.cfg.clients)
        rng = random.Random(self.cfg.seed)
        rate = float(self.cfg.rate or 1.0)
        poisson = self.cfg.arrivals == "poisson"
        limit = self.cfg.requests if self.cfg.requests is not None else math.inf
        tasks: set[asyncio.Task[Any]] = set()
        nxt = start
        try:
            while self.sent < limit and nxt < self.end:
                now = time.perf_counter()
                while nxt <= now and self.sent < limit and nxt < self.end:
                    if len(tasks) < MAX_BACKLOG:
                        t = self.loop.create_task(self.request(pool, nxt))
                        tasks.add(t)
                        t.add_done_callback(tasks.discard)
                    else:
                        self.result.backlog_drops += 1
                        self.result.record_error("timeout", f"client backlog of {MAX_BACKLOG} requests full "
                                                            "(the target cannot keep up with the rate)")
                    self.sent += 1
                    # uniform: computed, not summed, so rate x duration arrivals exactly
                    nxt = nxt + rng.expovariate(rate) if poisson else start + self.sent / rate
                # uvloop timers tick in whole ms: below half a tick yield instead of
                # oversleeping, trading some CPU for sends close to their schedule
                delay = nxt - time.perf_counter()
                await asyncio.sleep(delay if delay > 0.0005 else 0)
            if tasks:
                await asyncio.gather(*tasks)
        finally:
            for t in tasks:
                t.cancel()
            pool.close()


def _loop_name() -> str:
    loop = asyncio.get_running_loop()
    return "uvloop" if type(loop).__module__.startswith("uvloop") else "asyncio"


async def arun_load(config: LoadConfig, *, stop: asyncio.Event | None = None) -> LoadResult:
    """Run one load test in the running event loop.

    Raises ``LoadConfigError`` for a bad config or a refused target (non-local
    without ``allow_remote``).  Setting ``stop`` ends the run early, like the
    duration running out.  Connection problems never raise: they are counted
    in ``errors``; when not even one connection can be opened the run stops at
    once with ``aborted`` set.
    """
    cfg = config.validate()
    target = parse_url(cfg.url)
    addrs = await asyncio.get_running_loop().run_in_executor(None, resolve_target, target, cfg.allow_remote)
    result = LoadResult(url=cfg.url, mode=cfg.mode, concurrency=cfg.clients if cfg.rate is None else None,
                        rate_target=cfg.rate, arrivals=cfg.arrivals if cfg.rate is not None else None,
                        connections_max=cfg.clients, loop=_loop_name())
    run = _Run(cfg, target, addrs, result)
    cpu0 = time.process_time()
    # preflight: a target that refuses gets one clear error, not seconds of spinning
    try:
        first = await asyncio.wait_for(run.connect(), cfg.timeout)
    except (_Fail, TimeoutError) as e:
        msg = str(e) if isinstance(e, _Fail) else f"connect to {target.host}:{target.port} timed out"
        result.record_error("connect", msg)
        result.aborted = msg
        result.client_cpu_s = time.process_time() - cpu0
        return result
    first.close()
    start = time.perf_counter()
    run.end = start + cfg.duration
    if cfg.rate is None:
        main: Any = asyncio.gather(*(run.closed_client() for _ in range(cfg.clients)))
    else:
        main = run.open_scheduler(start)
    main_task = asyncio.ensure_future(main)
    waiters: list[asyncio.Future[Any]] = [main_task]
    if stop is not None:
        waiters.append(asyncio.ensure_future(stop.wait()))
    # hard bound: duration + one timeout for the last answers + slack
    done, _ = await asyncio.wait(waiters, timeout=cfg.duration + cfg.timeout + 5.0,
                                 return_when=asyncio.FIRST_COMPLETED)
    if main_task not in done:
        if stop is not None and stop.is_set():
            result.interrupted = True
            run.end = time.perf_counter()  # clients stop sending; answers in flight may finish
            await asyncio.wait([main_task], timeout=cfg.timeout + 1.0)
        if not main_task.done():
            main_task.cancel()
            result.aborted = result.aborted or "stopped before the in-flight requests finished"
        await asyncio.gather(main_task, return_exceptions=True)
    else:
        main_task.result()
    for w in waiters[1:]:
        w.cancel()
    result.duration_s = time.perf_counter() - start
    result.client_cpu_s = time.process_time() - cpu0
    return result


def run_load(config: LoadConfig, *, stop_on_sigint: bool = False) -> LoadResult:
    """Blocking ``arun_load`` on a fresh event loop (uvloop when installed).

    With ``stop_on_sigint`` Ctrl-C ends the run early and still returns the
    result so far (for the CLI); otherwise KeyboardInterrupt propagates.
    """
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        pass
    else:
        raise RuntimeError("run_load() called from a running event loop; await arun_load() instead")
    try:
        import uvloop

        factory: Any = uvloop.new_event_loop
    except ImportError:  # pragma: no cover - uvloop is a dependency
        factory = None

    async def main() -> LoadResult:
        stop = asyncio.Event()
        if stop_on_sigint:
            import signal

            asyncio.get_running_loop().add_signal_handler(signal.SIGINT, stop.set)
        return await arun_load(config, stop=stop)

    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(main())


def percentiles_of(values: Iterable[float], precision_bits: int = 8) -> dict[str, float]:
    """Summary (ms) of latencies given in seconds: the same estimator as a run uses."""
    rec = LatencyRecorder(precision_bits)
    for v in values:
        rec.record(v)
    return rec.summary_ms()
