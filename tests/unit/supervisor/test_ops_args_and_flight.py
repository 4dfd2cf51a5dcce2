"""Ops numbers have a meaningful floor and ceiling (one checker, CLI and supervisor), and the in-flight bounds.

``ratelimit set 5e-324/s`` used to pass "finite and > 0" and turn every
request into a 400; ``cache purge --ack-timeout 604800`` held an ops request
for a week.  Each is refused now with an error naming the argument.
"""

from __future__ import annotations

import asyncio
from typing import Any

import click
import pytest
from click.testing import CliRunner

from numaserve.cli import cli as cli_main
from numaserve.cli.ratelimit_cmd import parse_limit
from numaserve.supervisor.ops import MUTATING, OpsArgError
from numaserve.supervisor.opsflight import InFlight, stale_by


def _run(verb: str, args: dict[str, Any]) -> None:
    asyncio.run(MUTATING[verb](None, args))  # type: ignore[arg-type]   # refused before the target is touched


@pytest.mark.parametrize("rate", [5e-324, 1e-300, 0.0009, 2e6, float("nan"), float("inf"), -1.0, True, "5"])
def test_ratelimit_set_refuses_a_rate_outside_the_meaningful_range(rate: Any) -> None:
    with pytest.raises(OpsArgError) as e:
        _run("ratelimit_set", {"rate": rate, "all": True})
    assert "'rate'" in str(e.value) and "0.001" in str(e.value) and "requests/s" in str(e.value)


@pytest.mark.parametrize("verb", ["cache_purge", "cache_bump"])
@pytest.mark.parametrize("timeout", [604800.0, 121.0, 5e-324, 0.0, float("nan")])
def test_ack_waits_are_bounded(verb: str, timeout: float) -> None:
    with pytest.raises(OpsArgError) as e:
        _run(verb, {"timeout": timeout})
    assert "'timeout'" in str(e.value) and "120" in str(e.value)


def test_drain_timeouts_refuse_denormals_but_take_zero() -> None:
    from numaserve.supervisor.opsapi import arg_timeout

    assert arg_timeout({"timeout": 0}, "timeout", None) == 0.0
    assert arg_timeout({"timeout": 3600}, "timeout", None) == 3600.0
    with pytest.raises(OpsArgError, match="'timeout'"):
        arg_timeout({"timeout": 5e-324}, "timeout", None)


def test_the_cli_refuses_the_same_numbers_before_sending() -> None:
    for bad in ("0.0001/s", "5000000/s"):
        with pytest.raises(click.BadParameter, match="0.001"):
            parse_limit(bad)
    assert parse_limit("0.001/s") == {"rate": 0.001}
    r = CliRunner().invoke(cli_main, ["cache", "purge", "--ack-timeout", "604800", "--runtime-dir", "/nonexistent"])
    assert r.exit_code == 2 and "--ack-timeout" in r.output and "120" in r.output, r.output


def test_stale_by_only_when_the_client_said_its_deadline() -> None:
    assert stale_by(5.0, 100.0, 104.0) is None
    assert stale_by(5.0, 100.0, 106.5) == pytest.approx(1.5)
    for timeout, sent in ((0.0, 100.0), (5.0, 0.0), (float("nan"), 100.0), (5.0, float("inf")), ("5", 100.0)):
        assert stale_by(timeout, sent, 1e12) is None


def test_in_flight_refuses_past_the_per_peer_and_total_bounds_and_frees_on_completion() -> None:
    async def go() -> None:
        flight = InFlight(per_peer=2, total=3)
        gate = asyncio.Event()
        assert flight.refusal("a") is None
        flight.start("a", gate.wait())
        flight.start("a", gate.wait())
        assert "from this client" in (flight.refusal("a") or "")
        assert flight.refusal("b") is None
        flight.start("b", gate.wait())
        assert "ops requests are running" in (flight.refusal("c") or "")
        gate.set()
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert len(flight) == 0 and flight.refusal("a") is None and flight.busy_refused == 2
        flight.start("a", asyncio.sleep(3600))
        await flight.cancel_all()
        assert len(flight) == 0

    asyncio.run(go())
