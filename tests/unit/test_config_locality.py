"""[placement] locality_interval / repair / repair_threshold / repair_hold: defaults and one-line errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from numaserve.config import ConfigError, load_config


def load(tmp_path: Path, body: str):
    p = tmp_path / "c.toml"
    p.write_text("[placement]\n" + body)
    return load_config(p, environ={}, use_default_path=False)


def test_defaults_measure_and_do_not_repair(tmp_path: Path) -> None:
    c = load(tmp_path, "")
    assert (c.placement.locality_interval, c.placement.repair, c.placement.repair_threshold,
            c.placement.repair_hold) == (10.0, "off", 0.9, 3)
    c = load(tmp_path, 'repair = "migrate"\nrepair_threshold = 0.95\nrepair_hold = 5\n')
    assert (c.placement.repair, c.placement.repair_threshold, c.placement.repair_hold) == ("migrate", 0.95, 5)


@pytest.mark.parametrize("body, want", [
    ('repair = "move"\n', "placement.repair"),
    ("repair_threshold = 1.5\n", r"placement.repair_threshold = 1.5: expected a share of anonymous memory in \(0, 1\]"),
    ("repair_threshold = 0\n", "placement.repair_threshold = 0"),
    ("repair_hold = 0\n", "placement.repair_hold = 0: expected an integer > 0"),
    ("locality_interval = -1.0\n", "placement.locality_interval = -1.0: expected a number >= 0"),
    ('repair = "recycle"\nlocality_interval = 0.0\n',
     'placement.repair = "recycle": expected "off" while placement.locality_interval = 0'),
])
def test_bad_values_are_one_line_naming_the_key(tmp_path: Path, body: str, want: str) -> None:
    with pytest.raises(ConfigError, match=want) as e:
        load(tmp_path, body)
    assert "\n" not in str(e.value) and str(tmp_path / "c.toml") in str(e.value)
