"""Numbers on the command line: finite and in range, or exit 2 naming the option."""

from __future__ import annotations

import click
import pytest
from click.testing import CliRunner

from numaserve.cli.common import SECONDS, FiniteFloat
from numaserve.cli.ratelimit_cmd import parse_limit


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "1e999", "-1", "604801", "x"])
def test_bad_seconds_exit_2_naming_the_option(value: str) -> None:
    @click.command()
    @click.option("--drain-timeout", type=SECONDS)
    def cmd(drain_timeout: float) -> None:
        click.echo(repr(drain_timeout))

    r = CliRunner().invoke(cmd, ["--drain-timeout", value])
    assert r.exit_code == 2 and "--drain-timeout" in r.output, r.output


def test_good_numbers_pass() -> None:
    assert FiniteFloat(0.0, 10.0).convert("2.5", None, None) == 2.5
    assert FiniteFloat(0.0, min_open=True).convert(1e6, None, None) == 1e6
    with pytest.raises(click.BadParameter):
        FiniteFloat(0.0, min_open=True).convert("0", None, None)


def test_ratelimit_values() -> None:
    assert parse_limit("32") == {"concurrency": 32}
    assert parse_limit("200/s") == {"rate": 200.0}
    for bad in ("9" * 400 + "/s", "0/s", "0", "nan/s", "inf/s", str(1 << 40)):
        with pytest.raises(click.BadParameter):
            parse_limit(bad)
