"""`numaserve plan`: show which worker slots `start` would create and how each is bound.

Discovery (sysfs, or a declared topology) feeds ``placement.make_plan``; the
result is a table on a terminal and stable JSON otherwise, so operators can
check a placement before starting anything and scripts can diff it.
"""

from __future__ import annotations

from typing import Any

import click

from numaserve.cli.common import config_from_flags, config_option, echo_json, output_option, want_json
from numaserve.cpulist import format_list
from numaserve.bind.placement import Plan, format_nodes, make_plan


def _workers_flag(text: str | None) -> int | str | None:
    """Flag text → int when it is one, else the text (the config check names the flag)."""
    if text is None:
        return None
    s = text.strip()
    try:
        return int(s)
    except ValueError:
        return s.lower() if s.lower() == "auto" else s


def _memory(mempolicy: str, nodes: tuple[int, ...]) -> str:
    return f"{mempolicy}:{format_nodes(nodes)}" if nodes else mempolicy


def _shape(plan: Plan) -> str:
    per = {"core": "physical core", "l3": "L3 cache group", "gpu": "GPU"}
    if plan.shape in per:
        return f"slots={plan.shape}: one per {per[plan.shape]}"
    return f"workers_per_node={plan.workers_per_node}"


def format_plan(plan: Plan) -> str:
    """The plan as a readable table, then IRQ CPUs, skipped nodes and notes."""
    header = ("SLOT", "NODE", "IDX", "CPUS", "MEMORY", "GPUS")
    rows = [
        (
            str(s.slot),
            str(s.node),
            str(s.index),
            format_list(s.cpus),
            _memory(s.mempolicy, s.memory_nodes),
            ",".join(s.gpus) or "-",
        )
        for s in plan.slots
    ]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = [
        f"{len(plan.slots)} slot(s) on node(s) {format_nodes(plan.nodes)} "
        f"({_shape(plan)}, cpu_split={plan.cpu_split}, mempolicy={plan.mempolicy})",
        "",
    ]
    for r in [header, *rows]:
        lines.append("  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip())
    if plan.irq_cpus:
        lines.append("")
        lines.append("reserved for NIC IRQs:")
        lines.extend(f"  node {n}: cpus {format_list(c)}" for n, c in sorted(plan.irq_cpus.items()))
    if plan.skipped:
        lines.append("")
        lines.append("skipped:")
        lines.extend(f"  node {s.node}: {s.reason}" for s in plan.skipped)
    if plan.notes:
        lines.append("")
        lines.append("notes:")
        lines.extend(f"  {n}" for n in plan.notes)
    return "\n".join(lines)


def format_explain(findings: list[Any]) -> str:
    """``plan --explain`` text: CPUs and nodes, then what works against the binding."""
    from numaserve.bind.explain import format_findings

    placed = [f for f in findings if f.verdict in ("used", "skipped")]
    against = [f for f in findings if f.verdict not in ("used", "skipped")]
    text = "why each CPU and node is used or skipped:\n" + format_findings(placed)
    if against:
        text += "\n\nworks against the binding (see `numaserve doctor`):\n" + format_findings(against)
    return text


def plan_json(plan: Plan, topology_root: str, declared: str | None,
              envs: dict[int, dict[str, str]] | None = None) -> dict[str, Any]:
    """``Plan.to_json`` plus where the topology came from and each slot's environment."""
    out = {"root": topology_root, "declared": declared, **plan.to_json()}
    for s in out["slots"]:
        if envs is not None and s["slot"] in envs:
            s["env"] = envs[s["slot"]]
    return out


def slot_envs(cfg: Any, plan: Plan, topo: Any) -> dict[int, dict[str, str]]:
    """What numaserve would set in each worker's environment (thread pools, GPUs, [env])."""
    import os

    from numaserve.supervisor.spawn import numaserve_env

    return {s.slot: numaserve_env(cfg, os.environ, s, 1, topo.gpus) for s in plan.slots}


@click.command("plan")
@config_option
@click.option("--root", type=click.Path(file_okay=False), default=None,
              help="sysfs/procfs root to read (default: placement.sysfs_root, \"/\").")
@click.option("--declared", type=click.Path(dir_okay=False), default=None,
              help="Declared topology file (default: placement.topology_file).")
@click.option("--nodes", default=None, metavar="SPEC", help='Nodes to place workers on: "all" or a list like 0,2-3.')
@click.option("--workers-per-node", "workers_per_node", default=None, metavar="N|auto",
              help='Workers per node: an integer >= 1, or "auto" (GPUs, else physical cores).')
@output_option
@click.option("--slots", "slots", default=None, type=click.Choice(["node", "core", "l3", "gpu"]),
              help="Slot shape: one worker per node (workers_per_node), physical core, L3 cache group or GPU.")
@click.option("--explain", is_flag=True, default=False,
              help="Also say why each CPU and node is used or skipped, and what works against the binding.")
def plan(
    config_path: str | None,
    root: str | None,
    declared: str | None,
    nodes: str | None,
    workers_per_node: str | None,
    slots: str | None,
    explain: bool,
    as_json: bool | None,
) -> None:
    """Show the worker slots: node, CPUs, memory policy and GPUs of each."""
    cfg = config_from_flags(
        config_path,
        {
            "placement": {
                "nodes": nodes,
                "workers_per_node": _workers_flag(workers_per_node),
                "sysfs_root": root,
                "topology_file": declared,
                "slots": slots,
            }
        },
    )
    from numaserve.topology import discover  # heavy-ish; only when the command runs

    p = cfg.placement
    topo = discover(p.sysfs_root or "/", declared=p.topology_file or None)
    result = make_plan(topo, p)
    envs = slot_envs(cfg, result, topo)
    findings = None
    if explain:
        from numaserve.tools.explain import explain as explain_plan

        findings = explain_plan(topo, result, cfg)
    if want_json(as_json):
        out = plan_json(result, topo.root, topo.declared, envs)
        if findings is not None:
            out["explain"] = [f.to_json() for f in findings]
        echo_json(out)
    else:
        click.echo(format_plan(result))
        if findings is not None:
            click.echo("\n" + format_explain(findings))
        shown = ("OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "ZE_AFFINITY_MASK")
        lines = []
        for slot, env in envs.items():
            keys = [k for k in env if k in shown or not k.startswith(("NUMASERVE_", "MKL_", "OPENBLAS_", "NUMEXPR_",
                                                                      "VECLIB_", "BLIS_", "CUDA_DEVICE_ORDER"))]
            if keys:
                lines.append(f"  slot {slot}: " + " ".join(f"{k}={env[k]}" for k in keys))
        if lines:
            click.echo("\nworker environment (thread pools sized to the slot; GPUs of its node):")
            click.echo("\n".join(lines))
