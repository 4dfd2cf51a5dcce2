"""`numaserve exec`: run a command bound to one NUMA node (a numactl equivalent).

``numaserve exec --node 1 -- CMD`` ≈ ``numactl --cpunodebind=1 --membind=1 CMD``
but with the node's CPUs taken from discovery (∩ what this process may use,
cpuset included), the memory node from a declared topology when one maps a
pretend node onto a real one, and static node ids (MPOL_F_STATIC_NODES).
The binding is done in this process, then it ``execvp``s CMD: exec replaces
the whole process with its one calling thread, which carries the binding, so
nothing started earlier by this interpreter can escape it.
"""

from __future__ import annotations

from typing import Any

import click

from numaserve.cpulist import ListSyntaxError, format_list, parse_list
from numaserve.errors import NumaserveError, UsageError

MEMPOLICIES = ("bind", "preferred", "interleave", "local")


def _discover(root: str, declared: str | None) -> Any:
    """numaserve.topology.discover, imported late (the CLI stays fast)."""
    try:
        from numaserve.topology import discover
    except ImportError as e:  # pragma: no cover - only while topology is being built
        raise NumaserveError(f"exec: topology discovery unavailable: {e}") from None
    return discover(root, declared=declared)


def resolve(
    topo: Any, node_id: int, cpus_text: str | None, mempolicy: str, mem_nodes_text: str | None
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(cpus, memory nodes) for ``--node``/``--cpus``/``--mem-nodes``; UsageError when impossible."""
    usable = [n for n in topo.nodes if n.usable_cpus]
    usable_ids = format_list(n.id for n in usable) or "none"
    try:
        node = topo.node(node_id)
    except KeyError:
        raise UsageError(f"exec: no NUMA node {node_id} (usable nodes: {usable_ids})") from None
    if not node.usable_cpus:
        why = "has no CPUs" if not node.cpus else "has no CPU this process may use (affinity/cpuset)"
        raise UsageError(f"exec: node {node_id} {why} (usable nodes: {usable_ids})")
    cpus = tuple(node.usable_cpus)
    if cpus_text is not None:
        try:
            want = parse_list(cpus_text)
        except ListSyntaxError as e:
            raise UsageError(f"exec: --cpus: {e}") from None
        if not want:
            raise UsageError("exec: --cpus is empty")
        outside = sorted(set(want) - set(cpus))
        if outside:
            raise UsageError(
                f"exec: --cpus {format_list(outside)} not usable on node {node_id} "
                f"(usable CPUs: {format_list(cpus)})"
            )
        cpus = want
    if mempolicy == "local":
        return cpus, ()
    if mem_nodes_text is not None:
        try:
            mem_nodes = parse_list(mem_nodes_text)
        except ListSyntaxError as e:
            raise UsageError(f"exec: --mem-nodes: {e}") from None
        if not mem_nodes:
            raise UsageError("exec: --mem-nodes is empty")
        bad = [m for m in mem_nodes if m not in topo.allowed_mems]
        if bad:
            raise UsageError(
                f"exec: --mem-nodes {format_list(bad)} not allowed "
                f"(allowed memory nodes: {format_list(topo.allowed_mems) or 'none'})"
            )
        return cpus, mem_nodes
    mem = node.bind_node
    if node.memory_node is None and (not node.has_memory or not node.memory_allowed):
        why = "has no memory" if not node.has_memory else "memory is not allowed by the cpuset"
        raise UsageError(
            f"exec: node {node_id} {why}; use --mempolicy local or --mem-nodes "
            f"(allowed memory nodes: {format_list(topo.allowed_mems) or 'none'})"
        )
    return cpus, (mem,)


@click.command("exec", context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@click.option("--node", "node_id", type=int, required=True, help="NUMA node to run on (CPUs and memory).")
@click.option("--cpus", "cpus_text", default=None, metavar="LIST", help="Subset of the node's usable CPUs.")
@click.option(
    "--mempolicy",
    type=click.Choice(MEMPOLICIES),
    default="bind",
    show_default=True,
    help="bind = numactl --membind; preferred = --preferred; interleave = --interleave; local = --localalloc.",
)
@click.option("--mem-nodes", "mem_nodes_text", default=None, metavar="LIST",
              help="Memory nodes instead of the node's own (e.g. interleave over 0-1).")
@click.option("--no-static", is_flag=True, help="Do not use static node ids (MPOL_F_STATIC_NODES).")
@click.option("--root", default="/", show_default=True, help="sysfs/procfs root to discover from.")
@click.option("--declared", default=None, type=click.Path(dir_okay=False), help="Declared topology file.")
@click.option("--dry-run", is_flag=True, help="Print what would be applied and exit.")
@click.argument("command", nargs=-1, type=click.UNPROCESSED)
def exec_(
    node_id: int,
    cpus_text: str | None,
    mempolicy: str,
    mem_nodes_text: str | None,
    no_static: bool,
    root: str,
    declared: str | None,
    dry_run: bool,
    command: tuple[str, ...],
) -> None:
    """Run COMMAND bound to NUMA node NODE: `numaserve exec --node 1 -- CMD ARGS...`."""
    from numaserve.bind import launch

    argv = list(command)
    if argv and argv[0] == "--":
        argv = argv[1:]
    if not argv:
        raise UsageError("exec: no command given (numaserve exec --node N -- CMD ARGS...)")
    topo = _discover(root, declared)
    cpus, mem_nodes = resolve(topo, node_id, cpus_text, mempolicy, mem_nodes_text)
    if dry_run:
        click.echo(
            f"cpus={format_list(cpus)} mempolicy={mempolicy} "
            f"nodes={format_list(mem_nodes) or '-'} static={not no_static} command={argv!r}"
        )
        return
    try:
        launch.bind(cpus, mempolicy, mem_nodes, static=not no_static)
        launch.restore_signals()
        launch.exec_program(argv)
    except launch.LaunchError as e:
        raise NumaserveError(str(e), exit_code=e.exit_code) from None
