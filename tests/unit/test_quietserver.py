"""The mixin both uvicorn servers use: setting should_exit wakes the main loop at once."""

from __future__ import annotations

import asyncio

from numaserve.quietserver import QuietServerMixin


class _Base:
    def __init__(self, config: object) -> None:
        self.config = config


class _Server(QuietServerMixin, _Base):
    def __init__(self) -> None:
        super().__init__("cfg")
        self.ticks: list[int] = []

    async def on_tick(self, counter: int) -> bool:
        self.ticks.append(counter)
        return self.should_exit


def test_setting_should_exit_ends_the_main_loop_without_waiting_for_the_next_tick() -> None:
    async def main() -> _Server:
        srv = _Server()
        task = asyncio.create_task(srv.main_loop())
        await asyncio.sleep(0)
        srv.should_exit = True
        for _ in range(20):                 # a few passes of the loop, far less than the 1 s tick
            if task.done():
                break
            await asyncio.sleep(0)
        assert task.done()                  # woken by the event, not by the next tick
        await task
        return srv

    srv = asyncio.run(main())
    assert srv.config == "cfg"          # the base's __init__ still ran
    assert srv.ticks == [0, 10]         # the first tick, then one more when woken to exit
    srv.should_exit = False
    assert srv.should_exit is False


def test_signal_hooks_install_nothing() -> None:
    srv = _Server()
    with srv.capture_signals():
        pass
    assert srv.install_signal_handlers() is None
