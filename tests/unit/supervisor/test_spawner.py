"""The spawn seam (``Spawner``) with a fake channel and fake templates: no process is started.

What one spawn hands the fork path (plan, worker spec, environment, listeners, token), what it
records on the ``WorkerProc``, and that the control endpoint is the runtime directory's, computed
once for every spawn.
"""

from __future__ import annotations

import socket
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from numaserve.bind.placement import SlotPlan
from numaserve.config import Config
from numaserve.control import workerauth
from numaserve.net.listeners import Listener, ListenerSet
from numaserve.runtime import CONTROL_SOCKET, PROGRESS_DIR, RuntimeDir
from numaserve.supervisor.spawner import Spawner


class CountingRuntime(RuntimeDir):
    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.endpoints: list[str] = []

    def endpoint(self, name: str) -> str:
        self.endpoints.append(name)
        return super().endpoint(name)


class FakeChannel:
    def __init__(self) -> None:
        self.holds: list[bool] = []

    def hold(self, on: bool) -> None:
        self.holds.append(on)


class FakeTemplates:
    """The node templates' fork hook: records each request and returns a stand-in process."""

    def __init__(self) -> None:
        self.forks: list[tuple[Any, ...]] = []

    def forker(self) -> Any:
        return self.fork

    def fork(self, plan: SlotPlan, spec: Any, env: Any, listeners: Any, token: str | None) -> Any:
        self.forks.append((plan, spec, dict(env), list(listeners), token))
        return SimpleNamespace(pid=43210 + len(self.forks), poll=lambda: None)


def test_a_spawn_forks_through_the_templates_with_the_slot_s_spec_env_and_token(tmp_path: Path) -> None:
    runtime = CountingRuntime(tmp_path)
    channel = FakeChannel()
    topology = SimpleNamespace(gpus=(), node=lambda n: SimpleNamespace(cpus=(3, 2, 1, 0)))
    spawner = Spawner(runtime, channel, topology=topology)  # type: ignore[arg-type]
    templates = FakeTemplates()
    spawner.templates = templates  # type: ignore[assignment]
    sock = socket.socket()
    fd = sock.fileno()
    try:
        listener = Listener(1, "127.0.0.1", 8000, socket.AF_INET, sock)
        spawner.open(ListenerSet(by_slot={1: [listener]}))
        plan = SlotPlan(slot=1, node=0, index=1, cpus=(2, 3), mempolicy="bind", memory_nodes=(0,))
        w = spawner(Config(), plan, 4, now=12.5)
        w2 = spawner(Config(), plan, 5, now=13.0)
    finally:
        sock.close()

    assert channel.holds == [False, False]      # Hello and Ready are read as they come
    control = f"ipc://{tmp_path / CONTROL_SOCKET}"
    assert runtime.endpoints == [CONTROL_SOCKET]  # once, at construction, for every spawn
    (p, spec, env, listeners, token), (_, spec2, _, _, token2) = templates.forks
    assert p is plan and listeners == [listener]
    assert spec.control == spec2.control == control
    assert (spec.slot, spec.node, spec.generation, spec.cpus, spec.fd) == (1, 0, 4, [2, 3], fd)
    assert spec.node_cpus == [0, 1, 2, 3] and spec2.generation == 5
    assert isinstance(token, str) and len(token) == 2 * workerauth.TOKEN_BYTES and token != token2
    assert (env["NUMASERVE_SLOT"], env["NUMASERVE_GENERATION"], env["NUMASERVE_CPUS"],
            env["NUMASERVE_MEMPOLICY"]) == ("1", "4", "2-3", "bind:0")

    assert (w.generation, w.started, w.popen.pid, w.external, w.token) == (4, 12.5, 43211, False, token)
    assert w.progress_path == str(tmp_path / PROGRESS_DIR / "slot1-gen4.json")
    assert w.env["NUMASERVE_SLOT"] == "1" and "PYTHONUNBUFFERED" not in w.env   # what numaserve set, not all
    assert w2.token == token2 and w2.progress_path.endswith("slot1-gen5.json")


def test_node_cpus_follow_the_topology_and_are_empty_without_one(tmp_path: Path) -> None:
    def node(n: int) -> Any:
        if n != 0:
            raise KeyError(n)
        return SimpleNamespace(cpus=(0, 1))

    spawner = Spawner(RuntimeDir(tmp_path), FakeChannel(), topology=SimpleNamespace(gpus=(), node=node))  # type: ignore[arg-type]
    assert spawner.node_cpus(0) == (0, 1) and spawner.node_cpus(7) == ()
    spawner.topology = None
    assert spawner.node_cpus(0) == ()


def test_the_fork_path_builds_no_exec_command(tmp_path: Path, monkeypatch: Any) -> None:
    from numaserve.supervisor import spawn

    def no_exec(*a: Any, **kw: Any) -> list[str]:
        raise AssertionError("build_launch_argv on the fork path")

    monkeypatch.setattr(spawn, "build_launch_argv", no_exec)
    spawner = Spawner(RuntimeDir(tmp_path), FakeChannel(), topology=None)  # type: ignore[arg-type]
    templates = FakeTemplates()
    spawner.templates = templates  # type: ignore[assignment]
    sock = socket.socket()
    try:
        spawner.open(ListenerSet(by_slot={0: [Listener(0, "127.0.0.1", 8000, socket.AF_INET, sock)]}))
        w = spawner(Config(), SlotPlan(slot=0, node=0, index=0, cpus=(0,), mempolicy="local", memory_nodes=()), 1, 0.0)
    finally:
        sock.close()
    assert len(templates.forks) == 1 and w.popen.pid == 43211
