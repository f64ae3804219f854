"""Chunks that arrive together leave together (router/link.py `AgentResponse.parts`).

One socket read from an agent often brings several response frames; the task relaying
them runs once after the read, so the body frames already queued are joined into one
part (one write to the client), and a queued end lets the relay end its answer in that
same write. Pure: a real `_Pending` queue, no libp2p.
"""

from __future__ import annotations

import trio
import trio.testing

from protocol.conversation import RequestState
from router.link import AgentResponse, _Pending


class _Session:
    peer = None

    def __init__(self) -> None:
        self.finished: list[tuple[int, bool]] = []

    def finish(self, req_id: int, cancel: bool) -> None:
        self.finished.append((req_id, cancel))


class _Slot:
    released = 0

    def release(self) -> None:
        self.released += 1


def _response() -> tuple[AgentResponse, _Pending, _Session, _Slot]:
    pending, session, slot = _Pending(7), _Session(), _Slot()
    pending.state = RequestState.BODY
    response = AgentResponse(session, 7, pending, 200, {}, slot)  # type: ignore[arg-type]
    return response, pending, session, slot


def _chunk(data: bytes) -> tuple[RequestState, dict]:
    return (RequestState.BODY, {"type": "response_chunk", "id": 7, "data": data})


_END = (RequestState.DONE, {"type": "response_end", "id": 7})


async def test_queued_chunks_and_their_end_make_one_last_part() -> None:
    response, pending, session, slot = _response()
    for data in (b"a", b"bc", b"d"):
        pending.put(_chunk(data))
    pending.put(_END)
    parts = [part async for part in response.parts()]
    assert parts == [(b"abcd", True)]
    assert session.finished == [(7, False)] and slot.released == 1 and response.done


async def test_chunks_that_arrive_apart_leave_apart() -> None:
    response, pending, _, _ = _response()
    parts: list[tuple[bytes, bool]] = []

    async def relay() -> None:
        async for part in response.parts():
            parts.append(part)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(relay)
        pending.put(_chunk(b"one"))
        await trio.testing.wait_all_tasks_blocked()
        pending.put(_chunk(b"two"))
        pending.put(_chunk(b"three"))
        await trio.testing.wait_all_tasks_blocked()
        pending.put(_END)
    assert parts == [(b"one", False), (b"twothree", False)]
    assert response.done
