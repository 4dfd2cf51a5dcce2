"""The worker channel's fan-out on real ZeroMQ sockets: one pass of sends, every Ack awaited together."""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import zmq
import zmq.asyncio

from numaserve.control import messages as m
from numaserve.supervisor.channel import RECV_BATCH, WorkerChannel


class Handler:
    def __init__(self, channel: WorkerChannel) -> None:
        self.channel = channel
        self.seen: list[Any] = []
        self.bad = 0

    def count_bad(self, channel: str, why: str) -> None:
        self.bad += 1

    def handle_worker_msg(self, identity: bytes, msg: Any, peer: Any = None) -> None:
        self.seen.append(msg)
        if isinstance(msg, m.Ack):
            self.channel.resolve(msg)


def _bound() -> tuple[str, zmq.asyncio.Context, zmq.asyncio.Socket, WorkerChannel, Handler]:
    """A private dir, a ROUTER bound in it, the channel on that socket, and its message handler."""
    d = tempfile.mkdtemp(prefix="nsc-")
    ctx = zmq.asyncio.Context()
    router = ctx.socket(zmq.ROUTER)
    router.bind(f"ipc://{Path(d) / 'c.sock'}")
    channel = WorkerChannel({})
    channel.sock = router
    return d, ctx, router, channel, Handler(channel)


def _dealer(ctx: zmq.asyncio.Context, d: str, identity: bytes) -> zmq.asyncio.Socket:
    """A worker's end of the channel."""
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.IDENTITY, identity)
    s.connect(f"ipc://{Path(d) / 'c.sock'}")
    return s


def _close(d: str, ctx: zmq.asyncio.Context, router: zmq.asyncio.Socket, serve: asyncio.Task[None],
           *dealers: zmq.asyncio.Socket) -> None:
    """Stop the receive loop, close every socket, remove the private dir."""
    serve.cancel()
    for s in dealers:
        s.close(0)
    router.close(0)
    ctx.term()
    shutil.rmtree(d, ignore_errors=True)


def test_command_each_collects_every_ack_and_reports_the_silent_and_the_unconnected() -> None:
    async def main() -> None:
        d, ctx, router, channel, handler = _bound()
        serve = asyncio.create_task(channel.serve(handler))
        dealers = []
        for i in range(5):
            s = _dealer(ctx, d, f"w{i}".encode())
            dealers.append(s)
        # a first message from each worker, so the ROUTER knows the identities
        for s in dealers:
            await s.send(m.encode(m.Ready(slot=0, generation=1)))
        while len(handler.seen) < 5:
            await asyncio.sleep(0.01)

        async def answer(i: int, s: zmq.asyncio.Socket) -> None:
            cmd = m.decode_from_supervisor(await s.recv())
            assert isinstance(cmd, m.Command) and cmd.args == {"n": i}
            if i != 3:  # worker 3 stays silent
                await s.send(m.encode(m.Ack(slot=i, generation=1, ref=cmd.id, detail=f"did {i}")))

        answers = [asyncio.create_task(answer(i, s)) for i, s in enumerate(dealers)]
        workers = [SimpleNamespace(identity=f"w{i}".encode(), generation=1) for i in range(5)]
        workers.append(SimpleNamespace(identity=None, generation=1))     # no Hello yet
        targets = [(i, w, {"n": i}) for i, w in enumerate(workers)]
        res = await channel.command_each(targets, "set_limits", timeout=0.5)
        assert [r["ok"] for r in res] == [True, True, True, False, True, False]
        assert res[0]["detail"] == "did 0" and res[3]["detail"] == "no ack within 0.5s"
        assert res[5]["detail"].startswith("not sent")
        assert channel._acks == {}                        # nothing left waiting
        await asyncio.gather(*answers)
        _close(d, ctx, router, serve, *dealers)

    asyncio.run(main())


def test_a_burst_is_taken_in_batches_and_nothing_is_lost() -> None:
    async def main() -> None:
        d, ctx, router, channel, handler = _bound()
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(f"ipc://{Path(d) / 'c.sock'}")
        n = RECV_BATCH * 3 + 5
        for i in range(n):
            await dealer.send(m.encode(m.Heartbeat(slot=0, generation=1, loop_lag=0.0, mono=float(i))))
        await asyncio.sleep(0.2)          # all queued before the loop starts
        serve = asyncio.create_task(channel.serve(handler))
        while len(handler.seen) < n:
            await asyncio.sleep(0.01)
        assert [x.mono for x in handler.seen] == [float(i) for i in range(n)]
        await dealer.send(b"\x00garbage")  # after a drained burst, the awaited receive still wakes
        while handler.bad < 1:
            await asyncio.sleep(0.01)
        _close(d, ctx, router, serve, dealer)

    asyncio.run(main())


def test_beats_arriving_together_are_read_in_one_wake_up_and_commands_are_not_held() -> None:
    async def main() -> None:
        d, ctx, router, channel, handler = _bound()
        channel.coalesce_s = 30.0            # a pause far longer than the test: only a command may end it
        serve = asyncio.create_task(channel.serve(handler))
        dealer = _dealer(ctx, d, b"w0")
        await dealer.send(m.encode(m.Ready(slot=0, generation=1)))
        while len(handler.seen) < 1:
            await asyncio.sleep(0.01)
        assert channel.wakeups == 1          # ... and now it pauses
        for i in range(10):                  # one interval's beats, spread over a few ms
            await dealer.send(m.encode(m.Heartbeat(slot=0, generation=1, loop_lag=0.0, mono=float(i))))
            await asyncio.sleep(0.002)
        await asyncio.sleep(0.05)
        assert len(handler.seen) == 1        # held in the socket, not read one wake-up each

        async def answer() -> None:
            cmd = m.decode_from_supervisor((await dealer.recv_multipart())[-1])
            await dealer.send(m.encode(m.Ack(slot=0, generation=1, ref=cmd.id)))

        responder = asyncio.create_task(answer())
        w = SimpleNamespace(identity=b"w0", generation=1)
        [res] = await channel.command_each([(0, w, {})], "ping", timeout=5.0)   # far less than the pause
        assert res["ok"], res
        await responder
        beats = [x for x in handler.seen if isinstance(x, m.Heartbeat)]
        assert [b.mono for b in beats] == [float(i) for i in range(10)]      # nothing lost, in order
        assert channel.wakeups in (2, 3)     # the ten beats in one read; the Ack with them or in its own
        _close(d, ctx, router, serve, dealer)

    asyncio.run(main())


def test_drain_reads_what_is_queued_during_the_coalescing_pause() -> None:
    """A worker's last message (Goodbye) sent while the receive loop pauses is read by drain() at once."""
    async def main() -> None:
        d, ctx, router, channel, handler = _bound()
        channel.coalesce_s = 30.0          # the loop reads one pass, then pauses for good
        serve = asyncio.create_task(channel.serve(handler))
        s = _dealer(ctx, d, b"w0")
        await s.send(m.encode(m.Ready(slot=0, generation=1)))
        while len(handler.seen) < 1:
            await asyncio.sleep(0.01)
        await s.send(m.encode(m.Goodbye(slot=0, generation=1, reason="lifespan startup failed: boom")))
        got = 0
        for _ in range(100):               # the pause holds the loop; only drain() can read it
            got += channel.drain(handler)
            if got:
                break
            await asyncio.sleep(0.01)
        assert got == 1
        assert isinstance(handler.seen[-1], m.Goodbye) and handler.seen[-1].reason.endswith("boom")
        assert channel.drain(handler) == 0   # nothing queued: no wait, nothing handled
        _close(d, ctx, router, serve, s)

    asyncio.run(main())


def test_messages_are_handled_in_the_order_a_worker_sent_them_while_the_tick_drains() -> None:
    """Hello before Ready, always: the tick's drain() must not overtake a message the loop already took.

    Found by the full suite: a worker's Ready was refused as "before hello" (and its slot waited for
    the ready timeout) when the receive loop had its Hello in hand but not yet handled, and drain()
    in the arbiter's tick read and handled the Ready behind it first.
    """
    async def main() -> None:
        d, ctx, router, channel, handler = _bound()
        channel.coalesce_s = 0.0
        serve = asyncio.create_task(channel.serve(handler))
        stop = False

        # The arbiter's tick wakes on an event (a child exit, an ops request ...) that can be seen in the
        # same pass of the event loop as the worker socket's readability, just before it.
        loop = asyncio.get_running_loop()
        r, w = os.pipe()
        due = asyncio.Event()
        loop.add_reader(r, lambda: (os.read(r, 1), due.set()))

        async def tick() -> None:
            while not stop:
                await due.wait()
                due.clear()
                channel.drain(handler)

        ticker = asyncio.create_task(tick())
        s = _dealer(ctx, d, b"w0")
        sent = 0
        for burst in range(10):
            os.write(w, b"x")               # the tick's wake-up first ...
            for _ in range(2):              # ... then a worker's Hello and Ready
                sent += 1
                s.send(m.encode(m.Heartbeat(slot=0, generation=sent, loop_lag=0.0, mono=0.0)), zmq.DONTWAIT)
            time.sleep(0.02)                # the loop busy (a spawn): both fds ready in one pass
            await asyncio.sleep(0.02)
        loop.remove_reader(r)
        os.close(r)
        os.close(w)
        for _ in range(300):
            if len(handler.seen) >= sent:
                break
            await asyncio.sleep(0.01)
        stop = True
        due.set()
        await ticker
        got = [msg.generation for msg in handler.seen]
        assert got == list(range(1, sent + 1)), got
        _close(d, ctx, router, serve, s)

    asyncio.run(main())


def test_drain_before_the_socket_is_bound_is_a_no_op() -> None:
    channel = WorkerChannel({})
    assert channel.drain(Handler(channel)) == 0


def test_held_channel_leaves_beats_for_the_tick_and_never_watches_the_fd_meanwhile() -> None:
    """While held (every slot settled, every beat in), worker messages wake nothing: the fd is not in the
    loop's selector, the tick's drain() reads them; a command's Acks and hold(False) end the hold."""
    async def main() -> None:
        d, ctx, router, channel, handler = _bound()
        serve = asyncio.create_task(channel.serve(handler))
        dealer = _dealer(ctx, d, b"w0")
        await dealer.send(m.encode(m.Ready(slot=0, generation=1)))
        while len(handler.seen) < 1:
            await asyncio.sleep(0.01)
        channel.hold(True)
        await asyncio.sleep(0.05)             # the coalescing pause ends: from now on the hold
        fd = channel._sync_sock().get(zmq.FD)
        selector = asyncio.get_running_loop()._selector  # type: ignore[attr-defined]
        for i in range(5):
            await dealer.send(m.encode(m.Heartbeat(slot=0, generation=1, loop_lag=0.0, mono=float(i))))
        await asyncio.sleep(0.1)
        assert len(handler.seen) == 1 and channel.wakeups == 1
        assert fd not in selector.get_map()   # nothing can wake the loop for this socket
        assert channel.drain(handler) == 5    # the tick reads them, in order
        assert [x.mono for x in handler.seen[1:]] == [0.0, 1.0, 2.0, 3.0, 4.0]

        async def answer() -> None:
            cmd = m.decode_from_supervisor((await dealer.recv_multipart())[-1])
            await dealer.send(m.encode(m.Ack(slot=0, generation=1, ref=cmd.id)))

        responder = asyncio.create_task(answer())
        w = SimpleNamespace(identity=b"w0", generation=1)
        [res] = await channel.command_each([(0, w, {})], "ping", timeout=5.0)   # Acks are read as they come
        assert res["ok"], res
        await responder
        await dealer.send(m.encode(m.Goodbye(slot=0, generation=1, reason="bye")))
        await asyncio.sleep(0.1)
        channel.hold(False)                   # released: what is queued is read at once
        for _ in range(100):
            if isinstance(handler.seen[-1], m.Goodbye):
                break
            await asyncio.sleep(0.01)
        assert isinstance(handler.seen[-1], m.Goodbye)
        _close(d, ctx, router, serve, dealer)

    asyncio.run(main())


def test_a_message_that_comes_while_the_supervisor_sends_is_still_read_at_once() -> None:
    """Every send processes libzmq's pending commands and so can take the fd's edge of a message that
    came meanwhile: the receive loop, watching the fd, must still read it (not at the next tick)."""
    async def main() -> None:
        d, ctx, router, channel, handler = _bound()
        channel.coalesce_s = 0.0
        serve = asyncio.create_task(channel.serve(handler))
        dealer = _dealer(ctx, d, b"w0")
        await dealer.send(m.encode(m.Ready(slot=0, generation=1)))
        while len(handler.seen) < 1:
            await asyncio.sleep(0.01)
        w = SimpleNamespace(identity=b"w0", generation=1, external=False, popen=SimpleNamespace(poll=lambda: None))
        for i in range(20):
            await asyncio.sleep(0.01)                 # the loop watches the fd
            await dealer.send(m.encode(m.Heartbeat(slot=0, generation=1, loop_lag=0.0, mono=float(i))))
            time.sleep(0.02)                          # the beat is in, unseen by the loop
            channel.send_command(w, "ping", {})       # ... and this send takes the edge
            for _ in range(50):
                if len(handler.seen) == i + 2:
                    break
                await asyncio.sleep(0.01)
            assert len(handler.seen) == i + 2, i
        _close(d, ctx, router, serve, dealer)

    asyncio.run(main())
