"""The shipped systemd unit, drop-ins and `numaserve systemd install`."""

from __future__ import annotations

import configparser
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner

from numaserve.cli.systemd_cmd import render_unit, systemd
from numaserve.config import Config
from numaserve.errors import UsageError

REPO = Path(__file__).resolve().parents[2]
UNIT = REPO / "systemd" / "numaserve.service"
DROPIN = REPO / "systemd" / "numaserve.service.d" / "10-example.conf"
EXAMPLES = REPO / "systemd" / "examples"
NUMASERVE = shutil.which("numaserve")
ANALYZE = shutil.which("systemd-analyze")

needs_analyze = pytest.mark.skipif(ANALYZE is None, reason="systemd-analyze not installed")
needs_numaserve = pytest.mark.skipif(NUMASERVE is None, reason="numaserve console script not on PATH")


def unit_settings(text: str) -> dict[str, list[str]]:
    """Service-section settings (repeatable keys keep every value)."""
    out: dict[str, list[str]] = {}
    section = ""
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("["):
            section = line.strip("[]")
            continue
        k, _, v = line.partition("=")
        out.setdefault(f"{section}.{k}", []).append(v)
    return out


def systemd_version() -> int:
    assert ANALYZE is not None
    out = subprocess.run([ANALYZE, "--version"], capture_output=True, text=True).stdout
    m = re.search(r"systemd (\d+)", out)
    return int(m.group(1)) if m else 0


def verify(unit_dir: Path) -> subprocess.CompletedProcess[str]:
    """systemd-analyze verify with drop-ins from ``unit_dir`` (rc 0 alone hides warnings)."""
    assert ANALYZE is not None
    env = dict(os.environ, SYSTEMD_UNIT_PATH=f"{unit_dir}:", SYSTEMD_LOG_LEVEL="notice")
    return subprocess.run([ANALYZE, "verify", str(unit_dir / "numaserve.service")], capture_output=True,
                          text=True, env=env, cwd=unit_dir, timeout=60)


def with_real_binary(text: str) -> str:
    assert NUMASERVE is not None
    return render_unit(text.replace("#ExecStartPre", "ExecStartPre").replace("#ExecStopPost", "ExecStopPost"),
                       exec_cmd=NUMASERVE, config_path="/etc/numaserve/numaserve.toml")


# ------------------------------------------------------------- unit content


def test_unit_has_the_lifecycle_settings() -> None:
    s = unit_settings(UNIT.read_text())
    assert s["Service.Type"] == ["notify"]
    assert s["Service.NotifyAccess"] == ["main"]
    assert s["Service.ExecStart"] == ["/usr/local/bin/numaserve start --config /etc/numaserve/numaserve.toml"]
    # synchronous: `systemctl reload` returns when the rolling reload ended (and fails when refused)
    assert s["Service.ExecReload"] == [
        "/usr/local/bin/numaserve reload --wait --no-json --timeout 30 --config /etc/numaserve/numaserve.toml"]
    assert s["Service.KillMode"] == ["mixed"]
    assert s["Service.Restart"] == ["on-failure"]
    assert s["Service.WatchdogSec"] == ["30"]
    assert s["Service.RuntimeDirectory"] == ["numaserve"]
    assert s["Service.RuntimeDirectoryMode"] == ["0700"]
    assert s["Service.LimitNOFILE"] == ["65536"]
    assert s["Service.OOMPolicy"] == ["continue"]   # a worker OOM kill must not stop the unit
    assert s["Install.WantedBy"] == ["multi-user.target"]
    # the stop timeout covers the graceful timeout plus the supervisor's 5 s kill escalation
    assert float(s["Service.TimeoutStopSec"][0]) > Config().server.graceful_timeout + 5


def test_unit_hardening_keeps_numa_and_irq_work_possible() -> None:
    s = unit_settings(UNIT.read_text())
    assert s["Service.ProtectSystem"] == ["strict"]
    assert s["Service.NoNewPrivileges"] == ["yes"]
    assert s["Service.PrivateTmp"] == ["yes"]
    assert s["Service.ProtectHome"] == ["yes"]
    # the main process stays unprivileged: IRQ writes are "+" steps (exempt from sandboxing)
    assert s["Service.User"] == ["numaserve"]
    assert "Service.AmbientCapabilities" not in s
    assert "@system-service" in s["Service.SystemCallFilter"][0]
    assert "Service.PrivateDevices" not in s            # GPUs
    assert "Service.MemoryDenyWriteExecute" not in s    # JITs
    assert "Service.NUMAPolicy" not in s and "Service.CPUAffinity" not in s
    text = UNIT.read_text()
    assert "#ExecStartPre=-+/usr/local/bin/numaserve irq apply" in text
    assert "#ExecStopPost=-+/usr/local/bin/numaserve irq restore" in text
    # the in-supervisor IRQ variant turns off what would block /proc/irq writes
    irq = unit_settings((EXAMPLES / "irq-in-supervisor.conf").read_text())
    assert irq["Service.ProtectKernelTunables"] == ["no"] and irq["Service.User"] == ["root"]


def test_syscall_filter_allows_numa_binding() -> None:
    if ANALYZE is None:
        pytest.skip("systemd-analyze not installed")

    def expand(group: str, seen: set[str]) -> set[str]:
        out = subprocess.run([ANALYZE, "syscall-filter", group], capture_output=True, text=True).stdout
        calls: set[str] = set()
        for line in out.splitlines()[1:]:
            item = line.strip()
            if not item or item.startswith("#"):
                continue
            if item.startswith("@"):
                if item not in seen:
                    seen.add(item)
                    calls |= expand(item, seen)
            else:
                calls.add(item)
        return calls

    allowed = expand("@system-service", {"@system-service"})
    for call in ("set_mempolicy", "mbind", "get_mempolicy", "sched_setaffinity", "setsockopt", "prctl",
                 "getsockopt", "socket", "bind", "listen", "accept4", "execve", "clone"):
        assert call in allowed, f"@system-service lacks {call}"


def test_example_dropins_parse() -> None:
    for path in [DROPIN, *EXAMPLES.glob("*.conf")]:
        cp = configparser.ConfigParser(strict=False, interpolation=None)
        cp.optionxform = str  # type: ignore[assignment,method-assign]
        cp.read_string(path.read_text())
        assert cp.sections() == ["Service"], path
    s = unit_settings(DROPIN.read_text())
    assert s["Service.AllowedCPUs"] and s["Service.AllowedMemoryNodes"]
    assert all(v.startswith("NUMASERVE_") for v in s["Service.Environment"])
    nr = unit_settings((EXAMPLES / "notify-reload.conf").read_text())
    assert nr["Service.Type"] == ["notify-reload"] and nr["Service.ExecReload"] == [""]


def test_dropin_environment_names_real_config_keys() -> None:
    from numaserve.config import SECTIONS, _field_types

    for v in unit_settings(DROPIN.read_text())["Service.Environment"]:
        name = v.split("=", 1)[0][len("NUMASERVE_"):].lower()
        section = next(s for s in sorted(SECTIONS, key=len, reverse=True) if name.startswith(s + "_"))
        assert name[len(section) + 1:] in _field_types(section), v


# -------------------------------------------------------- systemd-analyze


@needs_analyze
@needs_numaserve
def test_systemd_analyze_verify_unit(tmp_path: Path) -> None:
    (tmp_path / "numaserve.service").write_text(with_real_binary(UNIT.read_text()))
    r = verify(tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stderr.strip() == "" and r.stdout.strip() == "", r.stderr + r.stdout


@needs_analyze
@needs_numaserve
def test_systemd_analyze_verify_with_dropins(tmp_path: Path) -> None:
    (tmp_path / "numaserve.service").write_text(with_real_binary(UNIT.read_text()))
    d = tmp_path / "numaserve.service.d"
    d.mkdir()
    (d / "10-example.conf").write_text(with_real_binary(DROPIN.read_text()))
    (d / "30-irq.conf").write_text((EXAMPLES / "irq-in-supervisor.conf").read_text())
    r = verify(tmp_path)
    assert r.returncode == 0 and r.stderr.strip() == "", r.stderr


@needs_analyze
@needs_numaserve
def test_notify_reload_variant(tmp_path: Path) -> None:
    (tmp_path / "numaserve.service").write_text(with_real_binary(UNIT.read_text()))
    d = tmp_path / "numaserve.service.d"
    d.mkdir()
    (d / "20-notify-reload.conf").write_text((EXAMPLES / "notify-reload.conf").read_text())
    r = verify(tmp_path)
    assert r.returncode == 0, r.stderr
    if systemd_version() >= 253:
        assert r.stderr.strip() == "", r.stderr
    else:  # 252 ignores the type (and ReloadSignal=) and keeps Type=notify, as documented
        lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
        assert lines and all("notify-reload" in ln or "ReloadSignal" in ln for ln in lines), r.stderr


@needs_analyze
def test_verify_catches_a_missing_binary(tmp_path: Path) -> None:
    """Guards the test above: verify really checks ExecStart."""
    (tmp_path / "numaserve.service").write_text(UNIT.read_text().replace("/usr/local/bin/numaserve",
                                                                         "/nonexistent/numaserve"))
    r = verify(tmp_path)
    assert r.returncode != 0 and "nonexistent" in r.stderr


# ------------------------------------------------------------------ install


def run_install(*args: str) -> dict:
    r = CliRunner().invoke(systemd, ["install", "--json", *args], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


@needs_numaserve
def test_install_into_prefix(tmp_path: Path) -> None:
    out = run_install("--prefix", str(tmp_path))
    unit = tmp_path / "etc/systemd/system/numaserve.service"
    cfg = tmp_path / "etc/numaserve/numaserve.toml"
    users = tmp_path / "etc/sysusers.d/numaserve.conf"
    assert {f["path"]: f["action"] for f in out["files"]} == {
        str(unit): "create", str(cfg): "create", str(users): "create"}
    s = unit_settings(unit.read_text())
    exec_start = s["Service.ExecStart"][0]
    assert exec_start.split()[0] == os.path.abspath(NUMASERVE or "")
    assert exec_start.endswith("start --config /etc/numaserve/numaserve.toml")
    assert "/usr/local/bin/numaserve" not in unit.read_text()
    assert oct(unit.stat().st_mode & 0o777) == "0o644"
    assert cfg.read_text() == (REPO / "config" / "numaserve.toml").read_text()
    assert out["next_steps"][-1] == "systemctl daemon-reload && systemctl enable --now numaserve"
    assert "systemd-sysusers" in out["next_steps"]
    if ANALYZE:
        d = tmp_path / "verify"
        d.mkdir()
        shutil.copy(unit, d / "numaserve.service")
        r = verify(d)
        assert r.returncode == 0 and r.stderr.strip() == "", r.stderr


@needs_numaserve
def test_install_again_keeps_config_and_updates_unit(tmp_path: Path) -> None:
    run_install("--prefix", str(tmp_path))
    cfg = tmp_path / "etc/numaserve/numaserve.toml"
    cfg.write_text("[server]\nbind = [\"127.0.0.1:9000\"]\n")
    unit = tmp_path / "etc/systemd/system/numaserve.service"
    out = run_install("--prefix", str(tmp_path))
    actions = {Path(f["path"]).name: f["action"] for f in out["files"]}
    assert actions == {"numaserve.service": "unchanged", "numaserve.toml": "keep", "numaserve.conf": "unchanged"}
    assert "9000" in cfg.read_text()
    unit.write_text("edited by hand\n")
    out = run_install("--prefix", str(tmp_path))
    assert {Path(f["path"]).name: f["action"] for f in out["files"]}["numaserve.service"] == "update"
    assert "Type=notify" in unit.read_text()


def test_install_custom_config_path_and_exec(tmp_path: Path) -> None:
    out = run_install("--prefix", str(tmp_path), "--config-path", "/srv/ns/prod.toml",
                      "--exec", "/opt/numaserve/bin/numaserve")
    text = (tmp_path / "etc/systemd/system/numaserve.service").read_text()
    s = unit_settings(text)
    assert s["Service.ExecStart"] == ["/opt/numaserve/bin/numaserve start --config /srv/ns/prod.toml"]
    assert "#ExecStartPre=-+/opt/numaserve/bin/numaserve irq apply --config /srv/ns/prod.toml" in text
    assert (tmp_path / "srv/ns/prod.toml").is_file()
    assert s["Service.ProtectHome"] == ["yes"] and out["warnings"] == []


def test_install_from_a_home_directory_relaxes_protecthome(tmp_path: Path) -> None:
    out = run_install("--prefix", str(tmp_path), "--exec", "/home/ops/venv/bin/numaserve")
    s = unit_settings((tmp_path / "etc/systemd/system/numaserve.service").read_text())
    assert s["Service.ProtectHome"] == ["read-only"]
    assert out["warnings"] and "/home/ops/venv/bin/numaserve" in out["warnings"][0]


def test_install_dry_run_writes_nothing(tmp_path: Path) -> None:
    out = run_install("--prefix", str(tmp_path), "--dry-run")
    assert out["dry_run"] is True
    assert [f["action"] for f in out["files"]] == ["create", "create", "create"]
    assert list(tmp_path.iterdir()) == []


def test_install_text_output_and_enable_guard(tmp_path: Path) -> None:
    r = CliRunner().invoke(systemd, ["install", "--no-json", "--prefix", str(tmp_path)])
    assert r.exit_code == 0
    assert "systemctl daemon-reload && systemctl enable --now numaserve" in r.output
    r = CliRunner().invoke(systemd, ["install", "--prefix", str(tmp_path), "--enable"])
    assert isinstance(r.exception, UsageError) and "--enable needs --prefix /" in str(r.exception)
    r = CliRunner().invoke(systemd, ["install", "--prefix", str(tmp_path), "--config-path", "rel.toml"])
    assert isinstance(r.exception, UsageError) and "absolute path" in str(r.exception)


def test_unit_command_prints_the_rendered_unit() -> None:
    r = CliRunner().invoke(systemd, ["unit", "--exec", "/opt/x/numaserve"], catch_exceptions=False)
    assert r.exit_code == 0
    assert "ExecStart=/opt/x/numaserve start --config /etc/numaserve/numaserve.toml" in r.output


def test_exec_start_is_the_numaserve_of_this_installation(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`/opt/numaserve/bin/numaserve systemd install` puts that venv in ExecStart, whatever $PATH says."""
    from numaserve.cli.systemd_cmd import numaserve_command

    venv = tmp_path / "venv" / "bin"
    other = tmp_path / "other" / "bin"
    for d in (venv, other):
        d.mkdir(parents=True)
        (d / "numaserve").write_text("#!/bin/sh\n")
        (d / "numaserve").chmod(0o755)
        (d / "python3").write_text("")
    monkeypatch.setenv("PATH", str(other))
    assert numaserve_command(str(venv / "numaserve"), str(other / "python3")) == str(venv / "numaserve")
    # run as `python -m numaserve`: the console script beside the interpreter
    assert numaserve_command("/x/numaserve/__main__.py", str(venv / "python3")) == str(venv / "numaserve")
    (venv / "numaserve").unlink()
    assert numaserve_command("-m", str(venv / "python3")) == str(other / "numaserve")  # then $PATH
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert numaserve_command("-m", str(venv / "python3")) == f"{venv / 'python3'} -m numaserve"


def test_ops_commands_reach_the_supervisor_despite_a_broken_config(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """ExecReload=numaserve reload --config FILE with FILE now broken: the command must still
    find the supervisor (which refuses the reload with the reason), not die on the file."""
    from numaserve.cli.ops_cmd import _runtime
    from numaserve.runtime import resolve_runtime_dir

    monkeypatch.setenv("RUNTIME_DIRECTORY", str(tmp_path / "rt"))
    bad = tmp_path / "bad.toml"
    bad.write_text('[server]\ngraceful_timeout = "soon"\n')
    assert _runtime(str(bad), None) == resolve_runtime_dir("") == tmp_path / "rt"
    good = tmp_path / "good.toml"
    good.write_text(f'[supervisor]\nruntime_dir = "{tmp_path / "own"}"\n')
    assert _runtime(str(good), None) == tmp_path / "own"
