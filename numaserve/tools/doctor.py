"""`numaserve doctor`: host settings that silently undo what numaserve does.

Each check is a pure function of the Topology (kernel, sysctls, THP,
irqbalance, NICs, allowed CPUs — all read by discovery) and the Config, plus
small injectable readers for things discovery does not carry (the open-file
limit).  Each returns a ``Check`` with a verdict and, when something is
wrong, the exact fix.

Verdicts: "ok", "info" (worth knowing, nothing to do), "warn" (works, but
worse than it could), "fail" (numaserve's promises do not hold: the CLI
exits 1).
"""

from __future__ import annotations

import re
import resource
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Literal, Sequence

from numaserve.config import Config
from numaserve.cpulist import format_list
from numaserve.errors import UsageError
from numaserve.net.irq import IrqSettings, irqbalance_fixes, plan_irqs
from numaserve.topology.model import Topology

__all__ = ["Check", "Readers", "run_checks", "kernel_version", "NOFILE_MIN", "VERDICTS"]

Verdict = Literal["ok", "warn", "fail", "info"]
VERDICTS = ("fail", "warn", "info", "ok")
NOFILE_MIN = 65536
NOFILE_APP_MARGIN = 64


@dataclass(frozen=True)
class Check:
    id: str
    verdict: Verdict
    summary: str
    detail: str = ""
    fix: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "verdict": self.verdict, "summary": self.summary, "detail": self.detail,
                "fix": self.fix}


def _getrlimit_nofile() -> tuple[int, int]:
    return resource.getrlimit(resource.RLIMIT_NOFILE)


UNIT_PATHS = ("/etc/systemd/system/numaserve.service", "/lib/systemd/system/numaserve.service",
              "/usr/lib/systemd/system/numaserve.service")


def parse_limit_nofile(text: str) -> int | None:
    """The soft value of a unit's ``LimitNOFILE=`` (``N``, ``SOFT:HARD`` or ``infinity``); last one wins."""
    value: int | None = None
    for line in text.splitlines():
        line = line.strip()
        if not line.startswith("LimitNOFILE="):
            continue
        soft = line.split("=", 1)[1].strip().split(":")[0].strip()
        if soft == "infinity":
            value = resource.RLIM_INFINITY
        elif soft.isdigit():
            value = int(soft)
    return value


def _unit_limit_nofile() -> tuple[str, int] | None:
    """``LimitNOFILE=`` of the installed unit (drop-ins override), or None when no unit sets it."""
    import glob
    import os

    found: tuple[str, int] | None = None
    for unit in UNIT_PATHS:
        if not os.path.isfile(unit):
            continue
        for path in [unit, *sorted(glob.glob(unit + ".d/*.conf"))]:
            try:
                with open(path) as f:
                    v = parse_limit_nofile(f.read())
            except OSError:
                continue
            if v is not None:
                found = (path, v)
        break
    return found


@dataclass(frozen=True)
class Readers:
    """Things not in the Topology, injectable for tests."""

    rlimit_nofile: Callable[[], tuple[int, int]] = field(default=_getrlimit_nofile)
    unit_limit_nofile: Callable[[], tuple[str, int] | None] = field(default=_unit_limit_nofile)


def kernel_version(release: str | None) -> tuple[int, int, int] | None:
    """"6.1.0-57-amd64" → (6, 1, 0); None when it does not parse."""
    m = re.match(r"^(\d+)\.(\d+)(?:\.(\d+))?", (release or "").strip())
    if not m:
        return None
    return int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)


def _sysctl_int(topo: Topology, name: str) -> int | None:
    v = topo.system.sysctls.get(name)
    if v is None:
        return None
    try:
        return int(str(v).strip())
    except ValueError:
        return None


def _persist(line: str) -> str:
    key = line.split("=")[0]
    return f"sysctl -w {line}; persist: echo '{line}' > /etc/sysctl.d/90-numaserve-{key.split('.')[-1]}.conf"


# --- checks -------------------------------------------------------------------------------------


def check_irqbalance(topo: Topology, irq: IrqSettings) -> Check:
    running = topo.system.irqbalance_running
    if running is None:
        return Check("irqbalance", "info", "could not tell whether irqbalance runs")
    if not running:
        return Check("irqbalance", "ok", "irqbalance is not running")
    pids = ", ".join(map(str, topo.system.irqbalance_pids)) or "?"
    try:
        plan = plan_irqs(topo, irq)
        irqs = [e.irq for e in plan.entries]
        cpus = sorted({c for e in plan.entries for c in e.target})
    except UsageError:
        irqs, cpus = [], []
    fix = "; ".join(irqbalance_fixes(irqs, cpus))
    detail = ("irqbalance rewrites IRQ affinities every 10 s, moving NIC queue interrupts off their "
              "NUMA node and undoing `numaserve irq apply`. numaserve never stops it.")
    if irq.apply_at_start and irq.irqbalance == "refuse":
        return Check("irqbalance", "fail",
                     f"irqbalance is running (pid {pids}) and [irq] apply_at_start is set with "
                     f"irqbalance = \"refuse\": IRQ steering will refuse at start",
                     detail, fix + ' (or set [irq] irqbalance = "warn")')
    return Check("irqbalance", "warn", f"irqbalance is running (pid {pids}): it will overwrite NIC IRQ steering",
                 detail, fix)


def check_numa_balancing(topo: Topology, config: Config) -> Check:
    v = _sysctl_int(topo, "kernel.numa_balancing")
    pol = config.placement.mempolicy
    if v is None:
        return Check("numa_balancing", "info", "kernel.numa_balancing unknown (not readable or not built in)")
    if v == 0:
        return Check("numa_balancing", "ok", "kernel.numa_balancing = 0")
    detail = ("Automatic NUMA balancing unmaps pages to catch NUMA hinting faults and migrates pages toward "
              "the CPU that touches them. ")
    if pol == "bind":
        return Check(
            "numa_balancing", "warn",
            f"kernel.numa_balancing = {v} with mempolicy = bind: scanning cost, no benefit",
            detail + "Under a bind policy a page can only move within the bound node set (one node per "
            "worker: nowhere), so workers pay the hinting faults for nothing. tuned's network-latency "
            "profile sets it to 0.",
            _persist("kernel.numa_balancing=0"),
        )
    return Check("numa_balancing", "info", f"kernel.numa_balancing = {v} (mempolicy = {pol})",
                 detail + "With a non-bind policy it may move pages across nodes; set 0 for steadier latency.")


def _thp_mode(text: str | None) -> str | None:
    if text is None:
        return None
    m = re.search(r"\[(\w+)\]", text)
    return m.group(1) if m else text.strip() or None


def check_thp(topo: Topology) -> Check:
    mode = _thp_mode(topo.system.thp)
    if mode is None:
        return Check("thp", "info", "transparent huge pages mode unknown")
    if mode == "always":
        return Check(
            "thp", "warn", "transparent huge pages = always",
            "With THP always, page faults may compact memory and zero 2 MiB pages, and khugepaged collapses "
            "pages in the background: latency spikes for request serving, and RSS that jumps in 2 MiB steps "
            "(which also confuses leak detection). madvise keeps huge pages for programs that ask.",
            "echo madvise > /sys/kernel/mm/transparent_hugepage/enabled "
            "(persist: transparent_hugepage=madvise on the kernel command line)",
        )
    return Check("thp", "ok", f"transparent huge pages = {mode}")


def check_thp_defrag(topo: Topology, config: Config) -> Check:
    """THP defrag settings that stall or move a worker's pages (``enabled`` itself is ``check_thp``)."""
    enabled = _thp_mode(topo.system.thp)
    defrag, khugepaged = topo.system.thp_defrag, topo.system.thp_khugepaged_defrag
    if enabled is None or defrag is None:
        return Check("thp_defrag", "info", "transparent huge pages defrag settings unknown")
    if enabled == "never":
        return Check("thp_defrag", "ok", "transparent huge pages off: no defrag or collapse")
    if defrag == "always":
        return Check(
            "thp_defrag", "warn", "transparent_hugepage/defrag = always: page faults stall in direct compaction",
            "A fault that finds no free 2 MiB page compacts memory first. Under mempolicy = bind the only "
            "place it may look is the worker's node, so a fragmented node turns into request-latency stalls.",
            "echo defer+madvise > /sys/kernel/mm/transparent_hugepage/defrag",
        )
    if enabled == "always" and khugepaged == 1:
        bind = config.placement.mempolicy == "bind"
        return Check(
            "thp_defrag", "info" if bind else "warn",
            "khugepaged collapses every anonymous range (enabled = always, khugepaged/defrag = 1)",
            "khugepaged copies 4 KiB pages into a new 2 MiB page on the node that holds most of them: a range "
            "whose pages sit on two nodes ends up whole on one of them. With mempolicy = bind every page is "
            "on the worker's node already; with other policies pages move across nodes in the background.",
            "echo madvise > /sys/kernel/mm/transparent_hugepage/enabled",
        )
    return Check("thp_defrag", "ok", f"transparent huge pages defrag = {defrag}, khugepaged/defrag = {khugepaged}")


def check_isolated_cpus(topo: Topology) -> Check:
    """isolcpus / nohz_full CPUs: placement leaves isolated CPUs to whatever they were isolated for."""
    facts = topo.cpu_facts
    if not facts.isolated and not facts.nohz_full:
        return Check("isolated_cpus", "ok", "no isolated (isolcpus) or nohz_full CPUs")
    parts = []
    if facts.isolated:
        parts.append(f"CPUs {format_list(facts.isolated)} are isolated (isolcpus): no worker is placed there")
    if facts.nohz_full:
        parts.append(f"CPUs {format_list(facts.nohz_full)} are nohz_full: their tick stops only while one task "
                     "runs, and a worker has several threads")
    return Check(
        "isolated_cpus", "info", "; ".join(parts),
        "The scheduler does not balance load onto isolated CPUs, so a worker whose affinity includes them "
        "would crowd its threads on the first CPU it lands on. They are kept for the latency-critical task "
        "they were isolated for.",
    )


def check_sub_numa(topo: Topology) -> Check:
    """Several nodes in one socket (sub-NUMA clustering, multi-die packages): a node is a slice of a socket."""
    by_pkg: dict[int, set[int]] = {}
    # real memory nodes: pretend nodes of a declared topology that share one are not clusters
    mem_of = {c: n.bind_node for n in topo.nodes for c in n.cpus}
    for cpu, pkg in topo.cpu_facts.packages.items():
        if cpu in mem_of:
            by_pkg.setdefault(pkg, set()).add(mem_of[cpu])
    if not by_pkg:
        return Check("sub_numa", "info", "socket of each CPU unknown (no physical_package_id)")
    split = {p: sorted(n) for p, n in sorted(by_pkg.items()) if len(n) > 1}
    if not split:
        return Check("sub_numa", "ok", f"one NUMA node per socket ({len(by_pkg)} socket(s))")
    where = "; ".join(f"socket {p}: nodes {format_list(n)}" for p, n in split.items())
    pairs = []
    real = {n.id: n for n in topo.nodes}
    for nodes in split.values():
        a, b = nodes[0], nodes[1]
        d = real[a].distances.get(b) if a in real else None
        if d is not None:
            pairs.append(f"node {a} -> {b}: {d}")
    return Check(
        "sub_numa", "warn", f"several NUMA nodes per socket (sub-NUMA clustering or multi-die): {where}",
        "Each node is a slice of a socket with its own memory controllers. A worker bound to one node gets "
        "only that slice's memory bandwidth, and a remote access to the sibling node is cheaper than one to "
        "another socket" + (f" (distance {', '.join(pairs)})" if pairs else "") + ". Placement is per node "
        "either way; this is why per-node bandwidth looks low.",
        "keep it for latency-bound serving; for bandwidth-bound workers turn sub-NUMA clustering off in the "
        "firmware (one node per socket), or use mempolicy = \"interleave\" over the socket's nodes",
    )


def check_memory_nodes(topo: Topology) -> Check:
    """Nodes with CPUs but no memory (every access remote) and memory-only nodes (GPU/CXL/HBM memory)."""
    memless = [n.id for n in topo.nodes if n.cpus and not n.has_memory]
    cpuless = [n.id for n in topo.nodes if not n.cpus]
    if memless:
        return Check(
            "memory_nodes", "warn",
            f"node(s) {format_list(memless)} have CPUs but no memory: every memory access from there is remote",
            "Placement skips such a node under mempolicy bind/preferred (its memory node has nothing to bind "
            "to)." + (f" Memory-only node(s) {format_list(cpuless)} get no worker." if cpuless else ""),
            "use mempolicy = \"local\" or \"interleave\" to run workers there, or declare the node's "
            "memory_node in a declared topology",
        )
    if cpuless:
        return Check("memory_nodes", "info",
                     f"memory-only node(s) {format_list(cpuless)} (no CPUs: GPU, CXL or HBM memory): no worker "
                     "is placed there and bind never names them")
    return Check("memory_nodes", "ok", "every node has CPUs and memory")


def check_placement(topo: Topology, config: Config, requested_nodes: Iterable[int] | None = None) -> Check:
    """The plan `start` would make: refused (fail), or which CPUs get no worker and why.

    The reasons are ``plan --explain``'s own; an SMT sibling left out by the
    cpuset is a warning (another process shares the core with a worker).
    """
    from numaserve.bind.explain import cpu_findings, group_cpus
    from numaserve.bind.placement import make_plan

    shape = config.placement.slots
    try:
        plan = make_plan(topo, config.placement, nodes=None if requested_nodes is None else list(requested_nodes))
    except UsageError as e:
        return Check("placement", "fail", f"start would refuse this placement: {e}", "",
                     "numaserve plan --explain shows the nodes and CPUs; fix [placement] or the flags")
    idle = [f for f in group_cpus(cpu_findings(topo, plan)) if f.verdict == "skipped"]
    head = f"{len(plan.slots)} slot(s) (slots = {shape}) on node(s) {format_list(plan.nodes)}"
    if not idle:
        return Check("placement", "ok", f"{head}; every usable CPU has a slot")
    detail = "\n".join(f"{f.subject}: {f.reason}" for f in idle)
    smt = [f.subject for f in idle if f.reason.startswith("SMT sibling")]
    if smt:
        return Check("placement", "warn",
                     f"{head}; {', '.join(smt)} left out of half-allowed cores: another process shares those "
                     "cores with a worker", detail,
                     "allow whole cores in the cpuset (both hardware threads), e.g. systemd AllowedCPUs=")
    return Check("placement", "info", f"{head}; CPUs without a worker: " + "; ".join(
        f"{f.subject} ({f.reason.split(':')[0]})" for f in idle), detail)


def check_somaxconn(topo: Topology, config: Config) -> Check:
    v = _sysctl_int(topo, "net.core.somaxconn")
    backlog = config.server.backlog
    if v is None:
        return Check("somaxconn", "info", f"net.core.somaxconn unknown; server.backlog = {backlog}")
    if v < backlog:
        return Check(
            "somaxconn", "fail",
            f"net.core.somaxconn = {v} < server.backlog = {backlog}: the kernel silently caps the backlog",
            "listen() never fails for a too-large backlog; the accept queue is just capped at somaxconn, so "
            "bursts overflow it and SYNs are dropped.  It is per network namespace.",
            _persist(f"net.core.somaxconn={backlog}"),
        )
    return Check("somaxconn", "ok", f"net.core.somaxconn = {v} >= server.backlog = {backlog}")


def check_tcp_migrate_req(topo: Topology) -> Check:
    v = _sysctl_int(topo, "net.ipv4.tcp_migrate_req")
    kv = kernel_version(topo.system.kernel)
    if v is None:
        if kv is not None and kv < (5, 14):
            return Check("tcp_migrate_req", "warn",
                         f"net.ipv4.tcp_migrate_req not available (kernel {topo.system.kernel} < 5.14)",
                         "Closing a slot's listener on scale-down resets connections queued on it.",
                         "upgrade to Linux >= 5.14 for tcp_migrate_req")
        return Check("tcp_migrate_req", "info", "net.ipv4.tcp_migrate_req unknown")
    if v == 0:
        return Check(
            "tcp_migrate_req", "warn",
            "net.ipv4.tcp_migrate_req = 0: closing a slot listener on scale-down resets its queued connections",
            "With 1, the kernel moves handshaking and queued connections of a closed SO_REUSEPORT listener "
            "to a live one of the group (Linux >= 5.14). It is per network namespace: set it in the "
            "namespace numaserve's listeners live in.",
            "sysctl -w net.ipv4.tcp_migrate_req=1 (Linux >= 5.14; per netns; persist in /etc/sysctl.d/)",
        )
    return Check("tcp_migrate_req", "ok", "net.ipv4.tcp_migrate_req = 1")


def check_kernel(topo: Topology) -> Check:
    rel = topo.system.kernel
    kv = kernel_version(rel)
    if kv is None:
        return Check("kernel", "info", "running kernel unknown", "cannot tell which listener features exist")

    def has(v: tuple[int, int]) -> str:
        return "yes" if kv[:2] >= v else "no"

    lines = [
        f"SO_ATTACH_REUSEPORT_CBPF (CPU → node listener steering, Linux >= 4.5): {has((4, 5))}",
        f"net.ipv4.tcp_migrate_req (listener migration, Linux >= 5.14): {has((5, 14))}",
        "listener-migration wake-up fix (\"tcp: call sk_data_ready() after listener migration\", upstream "
        "3864c6b): not tellable from the version; without it accept()/epoll waiters on the target listener "
        "can stay asleep - check your kernel's changelog",
        f"SO_INCOMING_CPU selection inside reuseport groups fixed (Linux >= 6.2): {has((6, 2))}",
    ]
    verdict: Verdict = "info"
    summary = f"kernel {rel}"
    if kv[:2] < (4, 5):
        verdict, summary = "warn", f"kernel {rel} < 4.5: no CBPF reuseport steering (kernel hash only)"
    return Check("kernel", verdict, summary, "\n".join(lines),
                 "" if verdict == "info" else "upgrade the kernel (>= 5.14 recommended)")


def nofile_needed(config: Config) -> tuple[int, str]:
    """Descriptors one worker may need: its accept queue, its connections, and a margin for the app."""
    backlog = config.server.backlog
    conns = config.server.max_connections or backlog
    need = backlog + conns + NOFILE_APP_MARGIN
    how = (f"server.backlog {backlog} + {'server.max_connections' if config.server.max_connections else 'as many'}"
           f" connections {conns} + {NOFILE_APP_MARGIN} for the app")
    return need, how


def check_nofile(readers: Readers, config: Config | None = None) -> Check:
    try:
        soft, hard = readers.rlimit_nofile()
    except (OSError, ValueError) as e:
        return Check("nofile", "info", f"open-file limit unknown ({e})")
    inf = resource.RLIM_INFINITY

    def fmt(v: int) -> str:
        return "unlimited" if v == inf else str(v)

    need, how = nofile_needed(config) if config is not None else (NOFILE_MIN, "")
    want = max(NOFILE_MIN, need)
    why = ("Each connection is a file descriptor in a worker; at the limit accept() fails with EMFILE and the "
           "event loop resets new connections without a word (numaserve logs accept_failed and shows the slot "
           "\"degraded (fd limit)\"). The supervisor raises its own soft limit to the hard one at start; "
           "workers keep the soft limit." + (f" Needed per worker: {need} ({how})." if how else ""))
    unit = None
    try:
        unit = readers.unit_limit_nofile()
    except (OSError, ValueError):
        unit = None
    if unit is not None and unit[1] != inf and unit[1] < need:
        return Check("nofile", "warn", f"LimitNOFILE={unit[1]} in {unit[0]} < {need} needed per worker",
                     why, f"LimitNOFILE={want} in {unit[0]} (or `systemctl edit numaserve`)")
    if soft != inf and soft < want:
        fix = f"LimitNOFILE={want} in the systemd unit ([Service]), or `ulimit -n {want}` before start"
        if hard != inf and hard < want:
            fix += f" (the hard limit {hard} must be raised too: needs root / the unit)"
        below = f"{want}" if want == NOFILE_MIN else f"{want} needed per worker"
        return Check("nofile", "warn", f"open-file limit (RLIMIT_NOFILE) soft = {fmt(soft)} < {below}", why, fix)
    detail = why + (f" Unit: LimitNOFILE={fmt(unit[1])} in {unit[0]}." if unit else "")
    return Check("nofile", "ok", f"open-file limit soft = {fmt(soft)}, hard = {fmt(hard)}", detail)


def _requested(topo: Topology, config: Config, requested_nodes: Iterable[int] | None) -> list[int]:
    if requested_nodes is not None:
        return sorted(set(requested_nodes))
    from numaserve.cpulist import parse_node_spec

    try:
        spec = parse_node_spec(config.placement.nodes)
    except ValueError:
        spec = None
    if spec is None:
        return [n.id for n in topo.nodes if n.cpus]
    return list(spec)


def check_cpuset(topo: Topology, config: Config, requested_nodes: Iterable[int] | None) -> Check:
    nodes = _requested(topo, config, requested_nodes)
    problems: list[str] = []
    for nid in nodes:
        try:
            node = topo.node(nid)
        except KeyError:
            problems.append(f"node {nid} does not exist (nodes: {format_list(topo.node_ids) or 'none'})")
            continue
        if node.cpu_less:
            problems.append(f"node {nid} has no CPUs (memory-only node)")
        elif not node.usable_cpus:
            problems.append(f"node {nid} has no usable CPU: its CPUs {format_list(node.cpus)} are outside "
                            f"this process's affinity/cgroup cpuset (allowed: {format_list(topo.allowed_cpus)})")
        if not node.memory_allowed:
            problems.append(f"node {nid}'s memory is not allowed by the cgroup cpuset.mems "
                            f"(allowed: {format_list(topo.allowed_mems)})")
    fix_cpuset = ("widen the cpuset: systemd AllowedCPUs=/AllowedMemoryNodes= (or CPUAffinity=), "
                  "Kubernetes: a Guaranteed pod with the static CPU manager; or request only usable nodes "
                  "(--nodes / placement.nodes)")
    if problems:
        return Check("cpuset", "fail", "requested node(s) cannot run workers: " + "; ".join(problems),
                     f"requested nodes: {format_list(nodes) or 'none'}", fix_cpuset)
    online, allowed = set(topo.online_cpus), set(topo.allowed_cpus)
    if allowed and allowed < online:
        return Check("cpuset", "warn",
                     f"allowed CPUs {format_list(allowed)} are narrower than online CPUs {format_list(online)}",
                     "A cgroup cpuset or an inherited affinity mask limits numaserve; workers get only the "
                     "allowed CPUs of each node.", fix_cpuset)
    return Check("cpuset", "ok", f"requested node(s) {format_list(nodes) or 'none'}: all have usable CPUs")


def check_tw_reuse(topo: Topology) -> Check:
    v = _sysctl_int(topo, "net.ipv4.tcp_tw_reuse")
    old = "net.ipv4.tcp_tw_recycle" in topo.system.sysctls
    note = (" This pre-4.12 kernel still has the old TIME_WAIT recycle knob: leave it at 0 (it breaks clients "
            "behind NAT; Linux 4.12 removed it).") if old else ""
    base = ("tcp_tw_reuse lets new outbound connections reuse TIME_WAIT ports (safe: uses TCP timestamps). "
            "It matters for loopback clients and workers making many outbound connections.")
    if v is None:
        return Check("tcp_tw_reuse", "info", "net.ipv4.tcp_tw_reuse unknown", base + note)
    if v == 1:
        return Check("tcp_tw_reuse", "ok", "net.ipv4.tcp_tw_reuse = 1", base + note)
    if v == 2:
        return Check("tcp_tw_reuse", "info", "net.ipv4.tcp_tw_reuse = 2 (loopback only, the default)",
                     base + " Set 1 when workers open many outbound connections (upstream APIs, databases)."
                     + note, _persist("net.ipv4.tcp_tw_reuse=1") + " (outbound-heavy setups)")
    return Check("tcp_tw_reuse", "warn", f"net.ipv4.tcp_tw_reuse = {v}: TIME_WAIT ports are never reused",
                 base + note, _persist("net.ipv4.tcp_tw_reuse=1"))


def check_nic_numa(topo: Topology) -> Check:
    if not topo.nics:
        return Check("nic_numa", "info", "no physical NIC found")
    unknown = [n.name for n in topo.nics if n.numa_node is None]
    if unknown:
        names = ", ".join(unknown)
        fix = "; ".join(f"[nic.{n}] node = N" for n in unknown)
        if len([n for n in topo.nodes if n.cpus]) <= 1:
            return Check("nic_numa", "info", f"NUMA node unknown for NIC(s) {names} (one node: nothing to steer)",
                         "sysfs numa_node is -1; on a multi-node machine declare it.",
                         f"only on multi-node machines: {fix} in a declared topology file")
        return Check("nic_numa", "warn", f"NUMA node unknown for NIC(s) {names}: their IRQs are not steered",
                     "sysfs numa_node is -1 and local_cpulist covers every CPU (common on VMs and some "
                     "firmware). numaserve will not guess.",
                     f"declare it in a declared topology file (--declared / placement.topology_file): {fix}")
    return Check("nic_numa", "ok", ", ".join(f"{n.name} on node {n.numa_node}" for n in topo.nics))


def check_single_node(topo: Topology) -> Check:
    cpu_nodes = [n.id for n in topo.nodes if n.cpus]
    if len(cpu_nodes) <= 1:
        return Check("single_node", "info",
                     f"{len(cpu_nodes)} NUMA node with CPUs: NUMA binding, IRQ steering and CBPF steering are "
                     f"no-ops here", "numaserve still supervises workers; a declared topology can split this "
                     "machine into pretend nodes for testing.")
    return Check("single_node", "ok", f"{len(cpu_nodes)} NUMA nodes with CPUs ({format_list(cpu_nodes)})")


def check_unknowns(topo: Topology) -> Check | None:
    if not topo.unknowns:
        return None
    return Check("discovery", "info", f"{len(topo.unknowns)} value(s) could not be read",
                 "\n".join(f"{u.what}: {u.reason}" for u in topo.unknowns))


def run_checks(
    topo: Topology,
    config: Config,
    *,
    requested_nodes: Sequence[int] | None = None,
    readers: Readers | None = None,
    irq: IrqSettings | None = None,
) -> list[Check]:
    """Every doctor check, in a stable order.  Pure apart from ``readers``.

    ``irq``: the IRQ settings; default ``config.irq`` (the ``[irq]`` section)
    when the Config has one, else ``IrqSettings()``.
    """
    readers = readers or Readers()
    if irq is None:
        irq = getattr(config, "irq", None)
    if not isinstance(irq, IrqSettings):
        irq = IrqSettings()
    checks = [
        check_single_node(topo),
        check_cpuset(topo, config, requested_nodes),
        check_irqbalance(topo, irq),
        check_nic_numa(topo),
        check_numa_balancing(topo, config),
        check_thp(topo),
        check_thp_defrag(topo, config),
        check_isolated_cpus(topo),
        check_sub_numa(topo),
        check_memory_nodes(topo),
        check_placement(topo, config, requested_nodes),
        check_somaxconn(topo, config),
        check_tcp_migrate_req(topo),
        check_kernel(topo),
        check_nofile(readers, config),
        check_tw_reuse(topo),
    ]
    u = check_unknowns(topo)
    if u is not None:
        checks.append(u)
    return checks
