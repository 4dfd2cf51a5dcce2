"""`numaserve topology`: what discovery sees on this machine (or a dump).

Tables, or the stable ``Topology.to_json()`` document with ``--json``.  ``--root``/``--declared`` default to the config's
``placement.sysfs_root`` / ``placement.topology_file``.
"""

from __future__ import annotations

import click

from numaserve.cli.common import config_from_flags, config_option, echo_json, output_option, want_json


@click.command("topology")
@click.option("--root", default=None, metavar="DIR",
              help="Read sysfs/procfs under DIR instead of / (a dump). Default: placement.sysfs_root.")
@click.option("--declared", default=None, metavar="FILE",
              help="Declared topology TOML that replaces or corrects sysfs. Default: placement.topology_file.")
@output_option
@config_option
def topology(root: str | None, declared: str | None, as_json: bool | None, config_path: str | None) -> None:
    """Show NUMA nodes, CPUs, memory, distances, NICs with their IRQs, GPUs and host facts."""
    from numaserve.topology import discover  # lazy: keep `numaserve --help` fast

    cfg = config_from_flags(config_path, {"placement": {"sysfs_root": root, "topology_file": declared}})
    topo = discover(cfg.placement.sysfs_root or "/", declared=cfg.placement.topology_file or None)
    if want_json(as_json):
        echo_json(topo.to_json())
        return
    from numaserve.topology.render import render

    render(topo)
