"""scripts/fleet-roll against fake hosts: tiny HTTP servers answering /readyz
with a status a file decides, a restart hook that flips it, and HAProxy
`show stat` output from a file.  (The real thing, numaserve instances behind
a real HAProxy, is tests/integration/test_lb_haproxy.py.)"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Iterator

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "fleet-roll"


def load_module():
    loader = importlib.machinery.SourceFileLoader("fleet_roll", str(SCRIPT))
    spec = importlib.util.spec_from_loader("fleet_roll", loader)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["fleet_roll"] = mod   # dataclasses look their module up
    loader.exec_module(mod)
    return mod


fr = load_module()

STAT_HEADER = "# pxname,svname,qcur,qmax,scur,smax,slim,stot,bin,bout,dreq,dresp,ereq,econ,eresp,wretr,wredis,status,"


def stat_csv(states: dict[str, str], backend: str = "numaserve") -> str:
    rows = [STAT_HEADER, f"{backend},FRONTEND,,,0,0,2000,0,0,0,0,0,0,,,,,OPEN,"]
    rows += [f"{backend},{n},0,0,0,0,,0,0,0,,0,,0,0,0,0,{st}," for n, st in states.items()]
    rows += [f"{backend},BACKEND,0,0,0,0,200,0,0,0,0,0,,0,0,0,0,UP,", "other,x,0,0,0,0,,0,0,0,,0,,0,0,0,0,DOWN,"]
    return "\n".join(rows) + "\n"


# ------------------------------------------------------------------- pure parts


def test_parse_host() -> None:
    h = fr.parse_host("numa-a=10.0.0.11", 9180)
    assert (h.name, h.host, h.admin_port, h.readyz_url) == ("numa-a", "10.0.0.11", 9180, "http://10.0.0.11:9180/readyz")
    h = fr.parse_host("10.0.0.12:9999", 9180)
    assert (h.name, h.host, h.admin_port) == ("10.0.0.12", "10.0.0.12", 9999)
    h = fr.parse_host("v6=[fd00::1]:9181", 9180)
    assert (h.host, h.admin_port, h.readyz_url) == ("fd00::1", 9181, "http://[fd00::1]:9181/readyz")
    for bad in ("a=", "h:port", "h:0", "[fd00::1", "a=h:70000"):
        with pytest.raises(ValueError):
            fr.parse_host(bad, 9180)


def test_parse_show_stat_and_service_states() -> None:
    text = stat_csv({"numa-a": "UP", "numa-b": "DOWN", "numa-c": "UP 1/2"})
    assert fr.parse_show_stat(text, "numaserve") == {"numa-a": "UP", "numa-b": "DOWN", "numa-c": "UP 1/2"}
    with pytest.raises(ValueError):
        fr.parse_show_stat("Unknown command\n", "numaserve")
    assert fr.lb_in_service("UP") and fr.lb_in_service("UP 30%")          # slowstart ramp
    for st in ("UP 1/2", "DOWN", "DOWN 1/2", "MAINT", "DRAIN", "NOLB", "", None):
        assert not fr.lb_in_service(st), st


# --------------------------------------------------------------- fake fleet


class FakeHost:
    """/readyz answers the status written in ``<dir>/<name>.state`` (default 200)."""

    def __init__(self, name: str, d: Path) -> None:
        self.name, self.state = name, d / f"{name}.state"
        self.state.write_text("200")
        state = self.state

        class H(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                code = int(state.read_text().strip() or 200)
                self.send_response(code)
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *a: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    @property
    def spec(self) -> str:
        return f"{self.name}=127.0.0.1:{self.port}"


@pytest.fixture()
def fleet(tmp_path: Path) -> Iterator[list[FakeHost]]:
    hosts = [FakeHost(n, tmp_path) for n in ("a", "b", "c")]
    yield hosts
    for h in hosts:
        h.server.shutdown()
        h.server.server_close()


def hook(d: Path, body: str) -> str:
    """A restart command: logs the host, then runs ``body`` (sh, $1 = name, $D = dir)."""
    (d / "hook.sh").write_text(f'D="{d}"\necho "$1" >> "$D/restarted"\n{body}\n')
    return f"sh {d / 'hook.sh'} {{name}}"


RESTART_OK = 'echo 503 > "$D/$1.state"; sleep 0.4; echo 200 > "$D/$1.state"'


def roll(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout)


def restarted(d: Path) -> list[str]:
    p = d / "restarted"
    return p.read_text().split() if p.exists() else []


def test_rolls_every_host_in_order(fleet: list[FakeHost], tmp_path: Path) -> None:
    r = roll("--restart-cmd", hook(tmp_path, RESTART_OK), "--settle", "0", "--json", *[h.spec for h in fleet])
    assert r.returncode == 0, r.stderr
    assert restarted(tmp_path) == ["a", "b", "c"]
    rep = json.loads(r.stdout)
    assert [x["result"] for x in rep] == ["rolled"] * 3 and all(x["saw_readyz_503"] for x in rep), rep
    assert "done: 3 host(s) rolled" in r.stderr


def test_a_failing_restart_aborts_and_leaves_the_rest(fleet: list[FakeHost], tmp_path: Path) -> None:
    cmd = hook(tmp_path, '[ "$1" = b ] && { echo "unit failed" >&2; exit 1; }\n' + RESTART_OK)
    r = roll("--restart-cmd", cmd, "--settle", "0", *[h.spec for h in fleet])
    assert r.returncode == 1
    assert restarted(tmp_path) == ["a", "b"]
    assert "ABORTED at b: b: restart command failed (exit 1): unit failed" in r.stderr
    assert "not touched: ['c']" in r.stderr


def test_a_host_that_does_not_come_back_aborts(fleet: list[FakeHost], tmp_path: Path) -> None:
    cmd = hook(tmp_path, 'echo 503 > "$D/$1.state"; [ "$1" = a ] && echo 200 > "$D/$1.state"; true')
    r = roll("--restart-cmd", cmd, "--settle", "0", "--ready-timeout", "1.5", *[h.spec for h in fleet])
    assert r.returncode == 1
    assert restarted(tmp_path) == ["a", "b"]
    assert "b: /readyz not 200 within 1.5s after the restart (last: 503)" in r.stderr


def test_a_degraded_fleet_is_not_rolled(fleet: list[FakeHost], tmp_path: Path) -> None:
    fleet[2].state.write_text("503")
    r = roll("--restart-cmd", hook(tmp_path, RESTART_OK), "--settle", "0", *[h.spec for h in fleet])
    assert r.returncode == 1 and restarted(tmp_path) == []
    assert "fleet not fully serving" in r.stderr and "c: /readyz 503" in r.stderr


def test_waits_for_the_balancer_and_warns_when_it_never_took_a_host_out(fleet: list[FakeHost], tmp_path: Path) -> None:
    names = [h.name for h in fleet]
    (tmp_path / "stat-UP.csv").write_text(stat_csv({n: "UP" for n in names}))
    for down in names:
        (tmp_path / f"stat-{down}-DOWN.csv").write_text(stat_csv({n: "DOWN" if n == down else "UP" for n in names}))
    stat = tmp_path / "stat.csv"
    stat.write_text((tmp_path / "stat-UP.csv").read_text())
    # the hook takes a and b out of the "balancer" while they restart, not c
    body = ('[ "$1" != c ] && cp "$D/stat-$1-DOWN.csv" "$D/stat.csv"\n' + RESTART_OK
            + '\nsleep 0.3; cp "$D/stat-UP.csv" "$D/stat.csv"')
    r = roll("--restart-cmd", hook(tmp_path, body), "--haproxy-stat-cmd", f"cat {stat}", "--json",
             *[h.spec for h in fleet])
    assert r.returncode == 0, r.stderr
    rep = {x["name"]: x for x in json.loads(r.stdout)}
    assert rep["a"]["left_lb"] and rep["b"]["left_lb"] and rep["a"]["back_in_lb_s"] is not None
    assert rep["c"]["left_lb"] is False and "never took this host out" in rep["c"]["warnings"][0]
    assert "c: WARNING: the balancer never took this host out" in r.stderr


def test_unknown_server_name_in_the_balancer(fleet: list[FakeHost], tmp_path: Path) -> None:
    stat = tmp_path / "stat.csv"
    stat.write_text(stat_csv({"a": "UP", "b": "UP"}))
    r = roll("--restart-cmd", hook(tmp_path, RESTART_OK), "--haproxy-stat-cmd", f"cat {stat}",
             *[h.spec for h in fleet])
    assert r.returncode == 1 and restarted(tmp_path) == []
    assert "c: no server of that name in HAProxy backend 'numaserve' (servers: a, b)" in r.stderr


def test_dry_run_changes_nothing(fleet: list[FakeHost], tmp_path: Path) -> None:
    r = roll("--dry-run", "--restart-cmd", hook(tmp_path, RESTART_OK), *[h.spec for h in fleet])
    assert r.returncode == 0, r.stderr
    assert restarted(tmp_path) == [] and "would restart a: sh " in r.stderr and "every host serving" in r.stderr


@pytest.mark.parametrize("args, msg", [
    (["bad:port"], "bad HOST"),
    (["a=127.0.0.1", "a=127.0.0.2"], "host named more than once: a"),
    (["--restart-cmd", "ssh {hostname}", "h"], "bad placeholder"),
    (["--haproxy-socket", "/x", "--haproxy-stat-cmd", "cat", "h"], "not both"),
    (["--ready-timeout", "0", "h"], "--ready-timeout must be > 0"),
])
def test_bad_arguments_exit_2_with_the_reason(args: list[str], msg: str) -> None:
    r = roll(*args)
    assert r.returncode == 2 and msg in r.stderr, r.stderr
