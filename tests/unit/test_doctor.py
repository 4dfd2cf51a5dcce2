"""`numaserve doctor`: every check's verdicts on crafted Topology/Config, and the CLI."""

from __future__ import annotations

import importlib.util
import json
import resource
from pathlib import Path

import msgspec
import pytest
from click.testing import CliRunner

import numaserve.cli as cli_pkg
from numaserve.cli import doctor_cmd
from numaserve.config import Config, PlacementConfig, ServerConfig
from numaserve.tools.doctor import Check, Readers, kernel_version, run_checks
from numaserve.net.irq import IrqSettings
from numaserve.topology.model import Node, Unknown

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "irq"
_spec = importlib.util.spec_from_file_location("numaserve_irq_fixture_topos", FIX / "topos.py")
topos = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(topos)

GOOD_NOFILE = Readers(rlimit_nofile=lambda: (1 << 20, 1 << 20))


def cfg(backlog: int = 2048, mempolicy: str = "bind", nodes: str = "all") -> Config:
    return Config(server=ServerConfig(backlog=backlog), placement=PlacementConfig(mempolicy=mempolicy, nodes=nodes))


def by_id(checks: list[Check]) -> dict[str, Check]:
    return {c.id: c for c in checks}


def run(topo=None, config=None, **kw) -> dict[str, Check]:
    kw.setdefault("readers", GOOD_NOFILE)
    return by_id(run_checks(topo or topos.vm2n(), config or cfg(), **kw))


def good_vm():
    return topos.vm2n(sysctls={"kernel.numa_balancing": 0, "net.core.somaxconn": 4096,
                               "net.ipv4.tcp_migrate_req": 1, "net.ipv4.tcp_tw_reuse": 1}, kernel="6.18.44")


def test_all_good() -> None:
    checks = run(good_vm())
    assert {c.verdict for c in checks.values()} <= {"ok", "info"}, {k: c.verdict for k, c in checks.items()}
    assert checks["kernel"].verdict == "info" and "6.18.44" in checks["kernel"].summary
    assert all(isinstance(c.to_json()["fix"], str) for c in checks.values())


def test_irqbalance_verdicts() -> None:
    topo = topos.smt2n()
    c = run(topo, irq=IrqSettings(apply_at_start=True, irqbalance="refuse"))["irqbalance"]
    assert c.verdict == "fail" and "4242" in c.summary
    assert "--banirq=50" in c.fix and "restart irqbalance" in c.fix
    c = run(topo, irq=IrqSettings(apply_at_start=True, irqbalance="warn"))["irqbalance"]
    assert c.verdict == "warn" and "--banirq=55" in c.fix
    c = run(topo)["irqbalance"]  # apply_at_start False
    assert c.verdict == "warn" and "IRQBALANCE_BANNED_CPULIST=2-3,6-7" in c.fix
    assert run(topos.vm2n())["irqbalance"].verdict == "ok"
    assert run(topos.vm2n(irqbalance_running=None))["irqbalance"].verdict == "info"
    # interfaces naming a NIC that is not there: still a verdict, no exception
    c = run(topo, irq=IrqSettings(interfaces=["nope"]))["irqbalance"]
    assert c.verdict == "warn"


def test_numa_balancing() -> None:
    c = run(topos.vm2n())["numa_balancing"]
    assert c.verdict == "warn" and "bind" in c.summary and "within the bound node set" in c.detail
    assert "kernel.numa_balancing=0" in c.fix
    assert run(topos.vm2n(), cfg(mempolicy="interleave"))["numa_balancing"].verdict == "info"
    assert run(good_vm())["numa_balancing"].verdict == "ok"
    assert run(topos.vm2n(sysctls={}))["numa_balancing"].verdict == "info"


def test_thp() -> None:
    for raw in ("always", "[always] madvise never"):
        c = run(topos.vm2n(thp=raw))["thp"]
        assert c.verdict == "warn" and c.fix.startswith("echo madvise > /sys/kernel/mm/transparent_hugepage/enabled")
    assert run(topos.vm2n(thp="always [madvise] never"))["thp"].verdict == "ok"
    assert run(topos.vm2n(thp="never"))["thp"].verdict == "ok"
    assert run(topos.vm2n(thp=None))["thp"].verdict == "info"


def test_somaxconn() -> None:
    c = run(topos.smt2n())["somaxconn"]
    assert c.verdict == "fail" and "silently caps" in c.summary and "net.core.somaxconn=2048" in c.fix
    assert run(topos.vm2n(), cfg(backlog=4096))["somaxconn"].verdict == "ok"
    c = run(topos.vm2n(), cfg(backlog=8192))["somaxconn"]
    assert c.verdict == "fail" and "net.core.somaxconn=8192" in c.fix


def test_tcp_migrate_req() -> None:
    c = run(topos.vm2n())["tcp_migrate_req"]
    assert c.verdict == "warn" and "reset" in c.summary
    assert "sysctl -w net.ipv4.tcp_migrate_req=1" in c.fix and "5.14" in c.fix and "netns" in c.fix
    assert run(good_vm())["tcp_migrate_req"].verdict == "ok"
    c = run(topos.vm2n(sysctls={}, kernel="5.10.0"))["tcp_migrate_req"]
    assert c.verdict == "warn" and "5.14" in c.summary
    assert run(topos.vm2n(sysctls={}, kernel="6.1.0"))["tcp_migrate_req"].verdict == "info"


def test_kernel_features() -> None:
    assert kernel_version("6.1.0-57-amd64") == (6, 1, 0)
    assert kernel_version("4.4") == (4, 4, 0)
    assert kernel_version("garbage") is None
    c = run(topos.vm2n(kernel="6.1.0-57-amd64"))["kernel"]
    assert c.verdict == "info" and "6.1.0-57-amd64" in c.summary
    assert "Linux >= 4.5): yes" in c.detail and "Linux >= 5.14): yes" in c.detail
    assert "Linux >= 6.2): no" in c.detail and "3864c6b" in c.detail
    c = run(topos.vm2n(kernel="4.4.0"))["kernel"]
    assert c.verdict == "warn" and "CBPF" in c.summary
    assert run(topos.vm2n(kernel=None))["kernel"].verdict == "info"


def test_nofile() -> None:
    c = run(readers=Readers(rlimit_nofile=lambda: (1024, 4096)))["nofile"]
    assert c.verdict == "warn" and "LimitNOFILE=65536" in c.fix and "hard limit 4096" in c.fix
    c = run(readers=Readers(rlimit_nofile=lambda: (1024, resource.RLIM_INFINITY)))["nofile"]
    assert c.verdict == "warn" and "hard" not in c.fix
    assert run(readers=Readers(rlimit_nofile=lambda: (65536, 65536)))["nofile"].verdict == "ok"
    assert run(readers=Readers(rlimit_nofile=lambda: (resource.RLIM_INFINITY,) * 2))["nofile"].verdict == "ok"

    def boom() -> tuple[int, int]:
        raise OSError("nope")

    assert run(readers=Readers(rlimit_nofile=boom))["nofile"].verdict == "info"


def test_cpuset() -> None:
    assert run(topos.vm2n())["cpuset"].verdict == "ok"
    topo = topos.vm2n()
    topo.allowed_cpus = (0, 1)
    topo.nodes[1].usable_cpus = ()
    c = run(topo)["cpuset"]
    assert c.verdict == "fail" and "node 1 has no usable CPU" in c.summary and "AllowedCPUs=" in c.fix
    # only node 0 requested: narrower than online is a warning
    c = run(topo, requested_nodes=[0])["cpuset"]
    assert c.verdict == "warn" and "narrower" in c.summary
    c = run(topo, cfg(nodes="0"))["cpuset"]
    assert c.verdict == "warn"
    assert run(topos.vm2n(), requested_nodes=[5])["cpuset"].verdict == "fail"
    topo = topos.vm2n()
    topo.nodes.append(Node(2, (), (), None, None))
    assert run(topo, requested_nodes=[2])["cpuset"].verdict == "fail"  # memory-only node
    topo = topos.vm2n()
    topo.nodes[1].memory_allowed = False
    c = run(topo)["cpuset"]
    assert c.verdict == "fail" and "cpuset.mems" in c.summary


def test_tw_reuse_and_never_recommends_recycle() -> None:
    assert run(good_vm())["tcp_tw_reuse"].verdict == "ok"
    c = run(topos.vm2n())["tcp_tw_reuse"]  # 2 = loopback only
    assert c.verdict == "info" and "net.ipv4.tcp_tw_reuse=1" in c.fix
    c = run(topos.smt2n())["tcp_tw_reuse"]
    assert c.verdict == "warn" and "net.ipv4.tcp_tw_reuse=1" in c.fix
    # an old kernel still listing the recycle knob: mentioned only to say leave it off
    old = topos.vm2n(kernel="4.9.0", sysctls={"net.ipv4.tcp_tw_reuse": 0, "net.ipv4.tcp_tw_recycle": 1})
    c = run(old)["tcp_tw_reuse"]
    assert "4.12" in c.detail and "leave it at 0" in c.detail
    for topo in (topos.vm2n(), topos.smt2n(), old, good_vm(), topos.vm2n(sysctls={})):
        for check in run_checks(topo, cfg(), readers=Readers(rlimit_nofile=lambda: (1, 1))):
            assert "tcp_tw_recycle" not in check.fix
            assert "tcp_tw_recycle" not in check.summary


def test_nic_numa_unknown() -> None:
    c = run(topos.smt2n())["nic_numa"]
    assert c.verdict == "warn" and "eth1" in c.summary and "[nic.eth1] node = N" in c.fix
    assert run(topos.vm2n())["nic_numa"].verdict == "ok"
    topo = topos.vm2n()
    topo.nics = []
    assert run(topo)["nic_numa"].verdict == "info"


def test_single_node() -> None:
    topo = topos.vm2n()
    topo.nodes = topo.nodes[:1]
    topo.nics[0].numa_node = None
    checks = run(topo, requested_nodes=[0])
    assert checks["single_node"].verdict == "info" and "no-ops" in checks["single_node"].summary
    assert checks["nic_numa"].verdict == "info"  # nothing to steer on one node
    assert run(topos.vm2n())["single_node"].verdict == "ok"


def test_discovery_unknowns_reported() -> None:
    topo = topos.vm2n()
    assert "discovery" not in run(topo)
    topo.unknowns.append(Unknown("thp", "missing"))
    c = run(topo)["discovery"]
    assert c.verdict == "info" and "thp: missing" in c.detail


def test_config_irq_section_is_read_when_wired() -> None:
    """Once the lead adds ``irq: IrqSettings`` to Config, run_checks uses it without the irq= argument."""

    class WiredConfig(Config, kw_only=True):
        irq: IrqSettings = msgspec.field(default_factory=IrqSettings)

    wired = WiredConfig(irq=IrqSettings(apply_at_start=True))
    assert run(topos.smt2n(), wired)["irqbalance"].verdict == "fail"


# --- CLI -------------------------------------------------------------------------------------


@pytest.fixture
def env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    for k in list(__import__("os").environ):
        if k.startswith("NUMASERVE_"):
            monkeypatch.delenv(k)
    c = tmp_path / "numaserve.toml"
    c.write_text("")
    monkeypatch.setitem(cli_pkg.COMMANDS, "doctor", "numaserve.cli.doctor_cmd:doctor")
    monkeypatch.setattr(doctor_cmd, "run_checks",
                        lambda topo, config, **kw: run_checks(topo, config, readers=GOOD_NOFILE, **kw))
    return tmp_path, c


def run_main(args: list[str], capsys) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as ei:
        cli_pkg.main(args)
    out, err = capsys.readouterr()
    return int(ei.value.code or 0), out, err


def test_cli_json_and_exit_codes(env, monkeypatch, capsys) -> None:
    tmp, c = env
    monkeypatch.setattr(doctor_cmd, "_discover", lambda root, declared: topos.smt2n())
    code, out, _ = run_main(["doctor", "--config", str(c), "--json"], capsys)
    data = json.loads(out)
    assert code == 1 and data["ok"] is False
    assert {x["id"]: x["verdict"] for x in data["checks"]}["somaxconn"] == "fail"
    monkeypatch.setattr(doctor_cmd, "_discover", lambda root, declared: good_vm())
    code, out, _ = run_main(["doctor", "--config", str(c), "--json"], capsys)
    assert code == 0 and json.loads(out)["ok"] is True
    code, _, err = run_main(["doctor", "--config", str(c), "--nodes", "x-y"], capsys)
    assert code == 2 and "--nodes" in err
    code, _, _ = run_main(["doctor", "--bogus"], capsys)
    assert code == 2


def test_cli_table(env, monkeypatch) -> None:
    tmp, c = env
    monkeypatch.setattr(doctor_cmd, "_discover", lambda root, declared: topos.smt2n())
    r = CliRunner().invoke(doctor_cmd.doctor, ["--config", str(c), "--no-json", "-v"])
    assert r.exit_code == 1, r.output
    lines = r.output.splitlines()
    assert lines[0].split() == ["VERDICT", "CHECK", "SUMMARY", "/", "FIX"]
    assert any(line.startswith("FAIL") and "somaxconn" in line for line in lines)
    assert "fix: sysctl -w net.core.somaxconn=2048" in r.output
    assert lines[-1].startswith("1 fail")


def test_cli_on_fixture_root_with_real_discovery(env, capsys) -> None:
    from numaserve import topology

    if not hasattr(topology, "discover"):
        pytest.skip("numaserve.topology.discover not written yet")
    tmp, c = env
    code, out, _ = run_main(["doctor", "--config", str(c), "--root", str(FIX / "vm2n"), "--json"], capsys)
    checks = {x["id"]: x for x in json.loads(out)["checks"]}
    assert code == 0
    assert checks["tcp_migrate_req"]["verdict"] == "warn"
    assert checks["numa_balancing"]["verdict"] == "warn"
    assert checks["nic_numa"]["verdict"] == "ok"
    code, out, _ = run_main(["doctor", "--config", str(c), "--root", str(FIX / "smt2n"), "--json"], capsys)
    checks = {x["id"]: x for x in json.loads(out)["checks"]}
    assert code == 1 and checks["somaxconn"]["verdict"] == "fail" and checks["thp"]["verdict"] == "warn"
    assert checks["irqbalance"]["verdict"] == "warn" and "4242" in checks["irqbalance"]["summary"]


def test_nofile_against_backlog_connections_and_the_unit() -> None:
    from numaserve.config import ServerConfig
    from numaserve.tools.doctor import parse_limit_nofile

    big = Config(server=ServerConfig(backlog=65535, max_connections=100000))
    c = run(config=big, readers=Readers(rlimit_nofile=lambda: (65536, 1 << 20)))["nofile"]
    assert c.verdict == "warn" and "165599" in c.summary and "LimitNOFILE=165599" in c.fix
    assert "server.backlog 65535" in c.detail and "server.max_connections" in c.detail
    unit = Readers(rlimit_nofile=lambda: (1 << 20, 1 << 20),
                   unit_limit_nofile=lambda: ("/etc/systemd/system/numaserve.service", 1024))
    c = run(readers=unit)["nofile"]
    assert c.verdict == "warn" and "LimitNOFILE=1024 in /etc/systemd/system/numaserve.service" in c.summary
    ok = Readers(rlimit_nofile=lambda: (1 << 20, 1 << 20), unit_limit_nofile=lambda: ("u", 65536))
    c = run(readers=ok)["nofile"]
    assert c.verdict == "ok" and "LimitNOFILE=65536 in u" in c.detail
    assert parse_limit_nofile("[Service]\nLimitNOFILE=1024:524288\n") == 1024
    assert parse_limit_nofile("LimitNOFILE=65536\nLimitNOFILE=infinity\n") == resource.RLIM_INFINITY
    assert parse_limit_nofile("# LimitNOFILE=5\n") is None
