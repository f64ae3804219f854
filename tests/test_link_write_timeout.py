"""The link's write timeout (`--stream-write-timeout`): a peer that stops reading ends
the session once one write has waited that long; writes that each finish in time never
do, however long they add up to; and 0 turns the limit off, as for the Go agent."""

from __future__ import annotations

import math

import trio
import trio.testing

from agent.engine_http import EnginePool, EngineTimeouts
from agent.link import RouterSession
from protocol import messages as m
from protocol.p2p import FramedStream


class _SlowPeer:
    """A stream whose reads wait forever and whose writes each take `write_takes`."""

    def __init__(self, write_takes: float) -> None:
        self.write_takes = write_takes
        self.writes = 0

    async def read(self, max_bytes: int) -> bytes:
        await trio.sleep_forever()
        return b""

    async def write(self, data: bytes) -> None:
        await trio.sleep(self.write_takes)
        self.writes += 1

    async def reset(self) -> None:
        pass


async def _run_for(fs: FramedStream, seconds: float, frames: int) -> str | None:
    """Send `frames` frames and run the session for `seconds`: why it ended, if it did."""
    for _ in range(frames):
        fs.send_nowait(m.heartbeat(1.0))
    with trio.move_on_after(seconds):
        return await fs.run(lambda msg: None)
    return None


async def test_a_write_that_waits_past_the_timeout_ends_the_session(
    autojump_clock: trio.testing.MockClock,
) -> None:
    fs = FramedStream(_SlowPeer(math.inf), write_timeout=4.0)
    began = trio.current_time()
    reason = await _run_for(fs, 60.0, 1)
    assert reason == "write timed out after 4 s"
    # Found within a quarter of the timeout more, not at once.
    assert 4.0 < trio.current_time() - began <= 5.0 + 1e-9
    assert fs.closed.is_set()


async def test_writes_that_each_finish_in_time_never_end_it(
    autojump_clock: trio.testing.MockClock,
) -> None:
    peer = _SlowPeer(3.0)
    fs = FramedStream(peer, write_timeout=4.0)

    async def trickle() -> None:
        for _ in range(10):
            fs.send_nowait(m.heartbeat(1.0))
            await trio.sleep(3.0)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(trickle)
        assert await _run_for(fs, 40.0, 0) is None
    assert peer.writes >= 9  # thirty seconds of writes, none past the limit


async def test_a_zero_stream_write_timeout_turns_the_limit_off(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """`--stream-write-timeout 0`: a write may wait as long as it takes; before, a zero
    limit failed every write that had to wait at all."""
    engine = EnginePool("http://engine", EngineTimeouts(5.0, 5.0), 1)
    session = RouterSession(_SlowPeer(math.inf), m.hello("t", {}), None, engine, 5.0, 0)  # type: ignore[arg-type]
    assert await _run_for(session.fs, 3600.0, 1) is None  # still writing an hour on
