"""`numaserve irq plan|apply|restore`: NIC queue interrupts onto their NUMA node.

``plan`` is a dry run (the default thing to look at); ``apply`` writes
``/proc/irq/N/smp_affinity_list`` after saving the originals; ``restore``
puts them back.  Exit status: 0 all good, 1 some IRQs failed (listed), 2
usage errors.  ``--root`` points everything at a fake tree (tests).
"""

from __future__ import annotations

from typing import Any

import click
import msgspec

from numaserve.cli.common import config_from_flags, config_option, echo_json, output_option, want_json
from numaserve.config import Config
from numaserve.cpulist import format_list
from numaserve.errors import NumaserveError
from numaserve.net.irq import (
    ApplyResult,
    IrqPlan,
    IrqSettings,
    RestoreResult,
    apply_plan,
    default_state_file,
    plan_irqs,
    restore,
)
from numaserve.topology.model import Topology


def _discover(root: str, declared: str | None) -> Topology:
    """Topology from ``root`` (late import: discovery lives in another module)."""
    try:
        from numaserve.topology import discover  # type: ignore[attr-defined]
    except ImportError:
        raise NumaserveError("irq: topology discovery (numaserve.topology.discover) is not available") from None
    return discover(root, declared=declared)


def irq_settings(cfg: Config) -> IrqSettings:
    """The ``[irq]`` section, or defaults while it is not wired into Config."""
    s = getattr(cfg, "irq", None)
    return s if isinstance(s, IrqSettings) else IrqSettings()


def _reserved(topo: Topology, settings: IrqSettings, cfg: Config) -> dict[int, tuple[int, ...]] | None:
    if settings.policy != "reserved" or cfg.placement.reserve_irq_cpus <= 0:
        return None
    try:
        from numaserve.bind.placement import reserved_irq_cpus  # type: ignore[attr-defined]
    except ImportError:
        raise NumaserveError("irq: policy \"reserved\" needs numaserve.bind.placement.reserved_irq_cpus") from None
    k = cfg.placement.reserve_irq_cpus
    return {n.id: tuple(reserved_irq_cpus(topo, n.id, k)) for n in topo.nodes if n.cpus}


def _load(
    config_path: str | None, root: str | None, declared: str | None, overrides: dict[str, Any]
) -> tuple[Config, IrqSettings, str, Topology]:
    cfg = config_from_flags(config_path)
    settings = irq_settings(cfg)
    ov = {k: v for k, v in overrides.items() if v is not None}
    if ov:
        settings = msgspec.structs.replace(settings, **ov)
    root = root or cfg.placement.sysfs_root or "/"
    declared = declared or cfg.placement.topology_file or None
    return cfg, settings, root, _discover(root, declared)


def _state_path(cfg: Config, settings: IrqSettings, flag: str | None) -> str:
    return flag or default_state_file(settings, cfg.supervisor.runtime_dir)


def _print_plan(plan: IrqPlan) -> None:
    if plan.entries:
        click.echo(f"{'IRQ':>5}  {'NIC':<10} {'Q':>3}  {'NAME':<24} {'CURRENT':<10} {'TARGET':<7} ACTION")
        for e in plan.entries:
            cur = "?" if e.current is None else format_list(e.current)
            q = "-" if e.queue is None else str(e.queue)
            click.echo(f"{e.irq:>5}  {e.nic:<10} {q:>3}  {(e.name or '?'):<24} {cur:<10} "
                       f"{format_list(e.target):<7} {'change' if e.changed else 'keep'}")
    for q in plan.queue_files:
        click.echo(f"{q.kind}: {q.path} = {q.mask} (CPUs {format_list(q.cpus)})")
    for s in plan.skipped:
        what = f"irq {s.irq} {s.name or ''}".strip() if s.irq is not None else "all IRQs"
        click.echo(f"skip  {s.nic}: {what}: {s.reason}")
    for w in plan.warnings:
        click.echo(f"warning: {w}", err=True)
    if plan.irqbalance_running:
        pids = ", ".join(map(str, plan.irqbalance_pids)) or "?"
        click.echo(f"warning: irqbalance is running (pid {pids}); `irq apply` will "
                   f"{'refuse' if plan.irqbalance_mode == 'refuse' else 'warn'}", err=True)
    n = len(plan.changes)
    click.echo(f"{n} IRQ(s) to change, {len(plan.entries) - n} already in place (dry run)")


def _print_result(res: ApplyResult, verb: str) -> None:
    for r in res.irqs:
        label = f"irq {r.irq}" + (f" {r.nic}" if r.nic else "") + (f" {r.name}" if r.name else "")
        line = f"{label}: {r.before or '?'} -> {r.after or '?'}  {r.status}"
        if r.error:
            line += f" ({r.error})"
        if r.note:
            line += f"; {r.note}"
        click.echo(line, err=r.failed)
    for f in res.files:
        line = f"{f.path}: {f.before or '-'} -> {f.after or '-'}  {f.status}"
        click.echo(line + (f" ({f.error})" if f.error else ""), err=f.failed)
    for w in res.warnings:
        click.echo(f"warning: {w}", err=True)
    counts: dict[str, int] = {}
    for r in [*res.irqs, *res.files]:
        counts[r.status] = counts.get(r.status, 0) + 1
    summary = ", ".join(f"{v} {k}" for k, v in sorted(counts.items())) or "nothing to do"
    click.echo(f"{verb}: {summary}")
    if res.failed:
        click.echo(f"{len(res.failed)} failed: " + ", ".join(
            f"irq {r.irq}" if hasattr(r, "irq") else r.path for r in res.failed), err=True)


_common = [
    click.option("--root", default=None, help="sysfs/procfs root (default: placement.sysfs_root, /)."),
    config_option,
    output_option,
]


def _opts(f: Any) -> Any:
    for o in reversed(_common):
        f = o(f)
    return f


@click.group("irq")
def irq() -> None:
    """Steer NIC queue interrupts to CPUs of the NIC's NUMA node."""


def _plan_options(f: Any) -> Any:
    opts = [
        click.option("--iface", default=None, help="Only this interface."),
        click.option("--declared", default=None, type=click.Path(dir_okay=False, exists=True),
                     help="Declared topology file (e.g. [nic.eth0] node = 1)."),
        click.option("--policy", type=click.Choice(["shared", "reserved"]), default=None,
                     help="Override irq.policy."),
        click.option("--rps/--no-rps", default=None, help="Override irq.rps."),
        click.option("--xps/--no-xps", default=None, help="Override irq.xps."),
    ]
    for o in reversed(opts):
        f = o(f)
    return f


@irq.command("plan")
@_plan_options
@_opts
@click.pass_context
def plan_cmd(ctx: click.Context, iface: str | None, declared: str | None, policy: str | None,
             rps: bool | None, xps: bool | None, root: str | None, config_path: str | None,
             as_json: bool | None) -> None:
    """Show where each queue IRQ would go (dry run; writes nothing)."""
    cfg, settings, root, topo = _load(config_path, root, declared, {"policy": policy, "rps": rps, "xps": xps})
    plan = plan_irqs(topo, settings, iface=iface, reserved=_reserved(topo, settings, cfg))
    if want_json(as_json):
        echo_json({"root": root, **plan.to_json()})
    else:
        _print_plan(plan)
    ctx.exit(0)


@irq.command("apply")
@_plan_options
@click.option("--state-file", default=None, help="Where original affinities are saved.")
@click.option("--force-with-irqbalance", is_flag=True, help="Apply even though irqbalance runs (it will undo it).")
@_opts
@click.pass_context
def apply_cmd(ctx: click.Context, iface: str | None, declared: str | None, policy: str | None,
              rps: bool | None, xps: bool | None, state_file: str | None, force_with_irqbalance: bool,
              root: str | None, config_path: str | None, as_json: bool | None) -> None:
    """Write the plan, saving every original affinity first (idempotent)."""
    cfg, settings, root, topo = _load(config_path, root, declared, {"policy": policy, "rps": rps, "xps": xps})
    plan = plan_irqs(topo, settings, iface=iface, reserved=_reserved(topo, settings, cfg))
    res = apply_plan(plan, root, _state_path(cfg, settings, state_file), force=force_with_irqbalance)
    if want_json(as_json):
        echo_json(res.to_json())
    else:
        _print_result(res, "applied")
    ctx.exit(res.exit_code)


@irq.command("restore")
@click.option("--state-file", default=None, help="The state file written by `irq apply`.")
@_opts
@click.pass_context
def restore_cmd(ctx: click.Context, state_file: str | None, root: str | None, config_path: str | None,
                as_json: bool | None) -> None:
    """Put every saved affinity back exactly, then remove the state file."""
    cfg = config_from_flags(config_path)
    settings = irq_settings(cfg)
    root = root or cfg.placement.sysfs_root or "/"
    res: RestoreResult = restore(root, _state_path(cfg, settings, state_file))
    if want_json(as_json):
        echo_json(res.to_json())
    else:
        _print_result(res, "restored")
        if res.state_removed and not res.nothing_saved:
            click.echo(f"removed {res.state_file}")
    ctx.exit(res.exit_code)


__all__ = ["irq", "irq_settings"]
