"""``numaserve loadtest``: drive a local endpoint and print a wrk-style summary.

The engine is ``numaserve.tools.loadtest``; this module only turns flags into a
``LoadConfig`` and a ``LoadResult`` into text or JSON.  Every argument
problem is one ``numaserve: error:`` line with exit status 2; a run with any
error (or no response at all) exits 1 after printing its summary.
"""

from __future__ import annotations

import math
import sys

import click

from numaserve.cli.common import FiniteFloat, echo_json, output_option, want_json
from numaserve.errors import UsageError
from numaserve.tools.loadtest import ERROR_KINDS, LoadConfig, LoadResult, parse_duration, parse_header, run_load


class _OneLineErrors(click.Command):
    """Click's usage errors as one ``numaserve: error:`` line (exit 2), like our own."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        try:
            return super().parse_args(ctx, args)
        except click.UsageError as e:
            raise UsageError(f"loadtest: {e.format_message()}") from None


def _duration(_ctx: click.Context, param: click.Parameter, value: str | None) -> float | None:
    if value is None:
        return None
    try:
        seconds = parse_duration(value)
    except ValueError as e:
        raise UsageError(f"--{param.name}: {e}") from None
    if not math.isfinite(seconds):
        raise UsageError(f"--{param.name}: {value!r}: expected a finite duration")
    return seconds


@click.command("loadtest", cls=_OneLineErrors)
@click.argument("url")
@click.option("-r", "--rate", type=FiniteFloat(0.0, 1e9, min_open=True), default=None,
              help="Open loop: schedule this many requests/s; latency counts from the scheduled time.")
@click.option("-c", "--concurrency", type=int, default=None,
              help="Closed loop: this many clients, one request each at a time (default 10).")
@click.option("-d", "--duration", default="10s", show_default=True, callback=_duration, metavar="DURATION",
              help="How long to send (10s, 500ms, 2m).")
@click.option("-n", "--requests", type=int, default=None, help="Stop after this many requests.")
@click.option("--connections", type=int, default=None,
              help="Open loop: at most this many connections (default 128).")
@click.option("--arrivals", type=click.Choice(["poisson", "uniform"]), default="poisson", show_default=True,
              help="Open loop: request spacing.")
@click.option("--keepalive/--no-keepalive", default=True, show_default=True,
              help="Reuse connections, or open one per request.")
@click.option("-m", "--method", default="GET", show_default=True)
@click.option("-b", "--body", default=None, help="Request body (text).")
@click.option("--body-file", type=click.Path(dir_okay=False, allow_dash=True), default=None,
              help="Request body from a file ('-' for stdin).")
@click.option("-H", "--header", "headers", multiple=True, help="Extra header 'Name: value' (repeatable).")
@click.option("--timeout", default="5s", show_default=True, callback=_duration, metavar="DURATION",
              help="Per request; a later answer counts as a timeout.")
@click.option("--seed", type=int, default=None, help="Seed for Poisson arrivals (repeatable runs).")
@click.option("--allow-remote", is_flag=True,
              help="Allow a non-local target (off by default: load on a shared network hurts others).")
@click.option("--histogram", is_flag=True, help="Also print the latency histogram.")
@output_option
def loadtest(url: str, rate: float | None, concurrency: int | None, duration: float, requests: int | None,
             connections: int | None, arrivals: str, keepalive: bool, method: str, body: str | None,
             body_file: str | None, headers: tuple[str, ...], timeout: float, seed: int | None,
             allow_remote: bool, histogram: bool, as_json: bool | None) -> None:
    """Send HTTP load to URL (loopback/local only) and summarize latency and errors.

    \b
    Closed loop:  numaserve loadtest http://127.0.0.1:8000/ -c 16 -d 10s
    Open loop:    numaserve loadtest http://127.0.0.1:8000/v1/completions -r 200 -d 30s \\
                    -m POST -H 'Content-Type: application/json' -b '{"max_tokens": 8}'
    """
    if body is not None and body_file is not None:
        raise UsageError("give --body or --body-file, not both")
    cfg = LoadConfig(
        url=url, rate=rate, concurrency=concurrency, duration=duration, requests=requests,
        connections=connections, arrivals=arrivals, keepalive=keepalive, method=method.upper(),
        body=_read_body(body, body_file), headers=tuple(parse_header(h) for h in headers),
        timeout=timeout, seed=seed, allow_remote=allow_remote,
    ).validate()
    result = run_load(cfg, stop_on_sigint=True)
    if want_json(as_json):
        echo_json(result.to_dict())
    else:
        click.echo(format_summary(result, cfg, histogram=histogram))
    if not result.ok:
        raise click.exceptions.Exit(1)


def _read_body(body: str | None, body_file: str | None) -> bytes:
    if body is not None:
        return body.encode()
    if body_file is None:
        return b""
    try:
        if body_file == "-":
            return sys.stdin.buffer.read()
        with open(body_file, "rb") as f:
            return f.read()
    except OSError as e:
        raise UsageError(f"--body-file: cannot read {body_file}: {e.strerror}") from None


# ---------------------------------------------------------------- summary


def fmt_ms(ms: float) -> str:
    """wrk's unit style: 812.00us, 1.25ms, 2.10s."""
    if ms < 1.0:
        return f"{ms * 1000:.2f}us"
    if ms < 1000.0:
        return f"{ms:.2f}ms"
    return f"{ms / 1000:.2f}s"


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.2f}{unit}"
        n /= 1024
    return f"{n:.2f}GB"  # pragma: no cover


def format_summary(res: LoadResult, cfg: LoadConfig | None = None, *, histogram: bool = False) -> str:
    """The wrk-like text report of a run."""
    lat = res.latency
    out = [f"Running {res.duration_s:.2f}s test @ {res.url}"]
    if res.mode == "open":
        out.append(f"  1 thread ({res.loop}), open loop at {res.rate_target:g} req/s ({res.arrivals}), "
                   f"up to {res.connections_max} connections (peak {res.peak_connections})")
    else:
        out.append(f"  1 thread ({res.loop}), {res.connections_max} connections, closed loop")
    if cfg is not None and not cfg.keepalive:
        out.append("  new connection per request (--no-keepalive)")
    if res.requests:
        out += [
            "  Thread Stats   Avg      Stdev     Max   +/- Stdev",
            f"    Latency   {fmt_ms(lat['mean']):>8} {fmt_ms(lat['stdev']):>9} {fmt_ms(lat['max']):>8}"
            f" {res.latency_hist.within_stdev():7.2f}%",
            "  Latency Distribution",
        ]
        for name in ("p50", "p75", "p90", "p99", "p99.9"):
            out.append(f"  {name[1:] + '%':>7}  {fmt_ms(lat[name]):>9}")
        if res.mode == "open" and res.send_lag_hist.count:
            lag = res.send_lag_hist
            p99 = lag.percentile_us(0.99) / 1000.0
            note = ("client kept up" if p99 < 5.0 else
                    "sends waited for the client, the pool or a new connection: latencies include it")
            out.append(f"  Send lag behind schedule: p50 {fmt_ms(lag.percentile_us(0.5) / 1000.0)}, "
                       f"p99 {fmt_ms(p99)}, max {fmt_ms(lag.max_us / 1000.0)} ({note})")
        if histogram:
            from numaserve.tools.latency_view import histogram_lines
            from numaserve.worker.stats import BUCKET_UPPER_MS

            out.append("  Latency Histogram")
            out += ["    " + line for line in histogram_lines(res.latency_hist.coarse(BUCKET_UPPER_MS))]
    out.append(f"  {res.requests} requests in {res.duration_s:.2f}s, {fmt_bytes(res.bytes_read)} read")
    if res.non_2xx:
        codes = ", ".join(f"{s}: {n}" for s, n in sorted(res.status_counts.items()) if not 200 <= s < 300)
        out.append(f"  Non-2xx responses: {res.non_2xx} ({codes})")
    if not res.error_count:
        out.append("  Socket errors: none")
    else:
        out.append("  Socket errors: " + ", ".join(f"{k} {res.errors[k]}" for k in ERROR_KINDS))
        for k in ERROR_KINDS:
            if k in res.error_samples:
                out.append(f"    {k}: {res.error_samples[k]}")
        if res.pool_timeouts or res.backlog_drops:
            out.append(f"    {res.pool_timeouts + res.backlog_drops} timeouts never got a connection: "
                       f"raise --connections (now {res.connections_max}) or lower --rate")
    if res.retries:
        out.append(f"  Retried on a fresh connection (idle keep-alive closed by server): {res.retries}")
    if res.aborted:
        out.append(f"  Aborted: {res.aborted}")
    if res.interrupted:
        planned = f" of {cfg.duration:g}s" if cfg is not None else ""
        out.append(f"  Interrupted after {res.duration_s:.2f}s{planned}")
    rps = res.rate
    out.append(f"Requests/sec: {rps:>10.2f}")
    tps = res.bytes_read / res.duration_s if res.duration_s > 0 else 0.0
    out.append(f"Transfer/sec: {fmt_bytes(tps):>10}")
    if res.duration_s > 0:
        out.append(f"Client CPU:   {100.0 * res.client_cpu_s / res.duration_s:>9.1f}% of one core")
    return "\n".join(out)

