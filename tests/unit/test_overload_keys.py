"""Issue 32: one overload model with few keys; the keys it removed fail with a reason."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from numaserve.config import Config, ConfigError, load_config
from numaserve.loops.admission import AdmissionSettings
from numaserve.loops.supervisor_limits import LimitsSettings

#: The sections that tune overload, and the most keys they may have together.
OVERLOAD_SECTIONS = ("admission", "limits")
MAX_OVERLOAD_KEYS = 40


def test_overload_keys_stay_few() -> None:
    sections = {f.name: f.type for f in msgspec.structs.fields(Config)}
    assert sections["admission"] is AdmissionSettings and sections["limits"] is LimitsSettings
    assert "gradient" not in sections
    n = sum(len(msgspec.structs.fields(sections[s])) for s in OVERLOAD_SECTIONS)
    assert n <= MAX_OVERLOAD_KEYS, n


@pytest.mark.parametrize("text, fragment", [
    ("[gradient]\nwindow_s = 1.0\n", "section [gradient] was removed: the gradient (L1) limiter is gone"),
    ("[admission]\nlimiter = \"gradient\"\n", "admission.limiter was removed: the CPU gate is the only limiter"),
    ("[admission]\nsupervisor_shed = true\n", "admission.supervisor_shed was removed: the worker's sentinel"),
    ("[admission]\nprobe_min_s = 0.002\n", "admission.probe_min_s was removed: now a fixed constant"),
    ("[limits]\nvegas_scaled = false\n", "limits.vegas_scaled was removed: Vegas always scales"),
    ("[limits]\nslo_backoff = 0.5\n", "limits.slo_backoff was removed: now a fixed constant"),
])
def test_a_removed_overload_key_fails_with_its_reason(tmp_path: Path, text: str, fragment: str) -> None:
    p = tmp_path / "numaserve.toml"
    p.write_text(text)
    with pytest.raises(ConfigError) as e:
        load_config(p, environ={})
    assert fragment in str(e.value)


def test_tuning_constants_are_read_where_the_settings_are_but_are_not_keys() -> None:
    s = AdmissionSettings()
    assert s.probe_min_s == 0.001 and s.busy_threshold == 0.95
    with pytest.raises(TypeError):
        AdmissionSettings(probe_min_s=0.002)  # type: ignore[call-arg]
    assert LimitsSettings().node_floor == 5
