"""The spawn seam: one slot plan + generation -> a running, bound worker (exec'd, or forked from
its node's template), with its spawn token, progress file and listener fds.

The slot table calls it (``lifecycle.SpawnWorker``); nothing else starts workers.
"""

from __future__ import annotations

import structlog

from numaserve.bind.placement import SlotPlan
from numaserve.config import Config
from numaserve.net.listeners import ListenerSet
from numaserve.runtime import CONTROL_SOCKET, PROGRESS_DIR, RuntimeDir
from numaserve.supervisor import slots as S
from numaserve.control import workerauth
from numaserve.supervisor.channel import WorkerChannel
from numaserve.supervisor.spawn import spawn
from numaserve.supervisor.templates import TemplateManager
from numaserve.topology.model import Topology

__all__ = ["Spawner", "progress_file"]

log = structlog.get_logger("numaserve.supervisor")


def progress_file(runtime: RuntimeDir, name: str) -> str:
    """A loading process's ``numaserve.progress`` file, in the runtime directory's ``progress/``."""
    d = runtime.path / PROGRESS_DIR
    d.mkdir(mode=0o700, exist_ok=True)
    path = d / f"{name}.json"
    path.unlink(missing_ok=True)  # a file left by an earlier supervisor must not look like progress
    return str(path)


class Spawner:
    """Starts one worker for the slot table (``lifecycle.SpawnWorker``).

    ``topology`` follows reloads (GPUs, node CPUs); ``templates`` is the node templates' fork
    path (set once they exist: they read the slot table, which spawns through this);
    ``open`` gives it the listeners (and the overload page maker) before any worker starts.
    """

    def __init__(self, runtime: RuntimeDir, channel: WorkerChannel, *, topology: Topology | None) -> None:
        self.runtime = runtime
        self.control = runtime.endpoint(CONTROL_SOCKET)   # where every worker connects: fixed with the runtime dir
        self.channel = channel
        self.topology = topology
        self.templates: TemplateManager | None = None
        self.listeners = ListenerSet()

    def open(self, listeners: ListenerSet) -> None:
        self.listeners = listeners

    def __call__(self, cfg: Config, plan: SlotPlan, generation: int, now: float) -> S.WorkerProc:
        """Raises OSError/NumaserveError when the worker cannot start."""
        fds = self.listeners.for_slot(plan.slot)
        self.channel.hold(False)   # a new worker's Hello and Ready are read as they come, not at the next tick
        token = workerauth.new_token()
        progress = progress_file(self.runtime, f"slot{plan.slot}-gen{generation}")
        popen, external, env = spawn(
            cfg, plan, generation, fds, self.control,
            all_gpus=self.topology.gpus if self.topology else (),
            node_cpus=self.node_cpus(plan.node), token=token,
            forker=self.templates.forker() if self.templates is not None else None,
            progress_file=progress,
        )
        w = S.WorkerProc(generation=generation, popen=popen, started=now, external=external, env=env,
                         token=None if external else token, progress_path=None if external else progress)
        log.info(
            "spawn",
            slot=plan.slot,
            node=plan.node,
            generation=generation,
            pid=popen.pid,
            cpus=list(plan.cpus),
            mempolicy=plan.mempolicy,
            memory_nodes=list(plan.memory_nodes),
            external=external,
            start=TemplateManager.worker_start(popen)["mode"],
        )
        return w

    def node_cpus(self, node: int) -> tuple[int, ...]:
        if self.topology is None:
            return ()
        try:
            return self.topology.node(node).cpus
        except KeyError:
            return ()
