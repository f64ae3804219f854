"""Safe client retries: the same Idempotency-Key (or client X-Request-ID) gets the same
answer, generated once; the table's window and bounds with a mock clock."""

from __future__ import annotations

import threading
import uuid
from pathlib import Path

import anthropic
import httpx
import openai
import pytest
import trio
import trio.testing

from router import idempotency
from router.idempotency import Conflict, EntryState, IdempotencyTable, Join
from tests.fleet import Agent, Fleet, wait_until

MESSAGES = [{"role": "user", "content": "a b c d e f g h"}]


def _generations(agent: Agent) -> int:
    return agent.sim_state()["requests_total"]


def test_retries_with_one_key_are_answered_once(fleet: Fleet) -> None:
    router = fleet.router()
    agent = fleet.agent(router, "m1", "--sim-token-latency", "50ms")
    client = openai.OpenAI(base_url=router.url + "/v1", api_key="key-a", max_retries=0)
    key = {"Idempotency-Key": str(uuid.uuid4())}

    async def stream(out: list[tuple[set[str], str]]) -> None:
        async_client = openai.AsyncOpenAI(base_url=router.url + "/v1", api_key="key-a")
        chunks = await async_client.chat.completions.create(
            model="m1", messages=MESSAGES, stream=True, extra_headers=key
        )
        ids, text = set(), ""
        async for chunk in chunks:
            ids.add(chunk.id)
            text += "".join(c.delta.content or "" for c in chunk.choices)
        out.append((ids, text))
        await async_client.close()

    async def two_at_once() -> list[tuple[set[str], str]]:
        out: list[tuple[set[str], str]] = []
        async with trio.open_nursery() as nursery:
            nursery.start_soon(stream, out)
            await trio.sleep(0.2)  # the second joins the running stream part way
            nursery.start_soon(stream, out)
        return out

    before = _generations(agent)
    first, second = trio.run(two_at_once)
    assert first == second and len(first[0]) == 1 and first[1] == "Echo: a b c d e f g h"
    assert _generations(agent) == before + 1
    # After it finished: replayed, same id and text, marked as a replay.
    raw = client.chat.completions.with_raw_response.create(
        model="m1", messages=MESSAGES, stream=True, extra_headers=key
    )
    assert raw.headers["idempotent-replayed"] == "true"
    replay = list(raw.parse())
    assert {c.id for c in replay} == first[0]
    assert "".join(c.choices[0].delta.content or "" for c in replay if c.choices) == first[1]
    assert _generations(agent) == before + 1

    # Another body under the key: 409 in each caller's protocol.
    with pytest.raises(openai.ConflictError) as conflict:
        client.chat.completions.create(
            model="m1", messages=[{"role": "user", "content": "other"}], extra_headers=key
        )
    assert conflict.value.body["code"] == "idempotency_conflict"  # type: ignore[index]
    messages = anthropic.Anthropic(base_url=router.url, api_key="key-a", max_retries=0)
    one = messages.messages.create(
        model="m1", max_tokens=20, messages=MESSAGES, extra_headers=key
    )  # another path: its own answer
    again = messages.messages.create(
        model="m1", max_tokens=20, messages=MESSAGES, extra_headers=key
    )
    assert again.id == one.id
    with pytest.raises(anthropic.ConflictError):
        messages.messages.create(model="m1", max_tokens=5, messages=MESSAGES, extra_headers=key)
    generated = _generations(agent)

    # Another client key never gets this one's answer.
    other = openai.OpenAI(base_url=router.url + "/v1", api_key="key-b", max_retries=0)
    theirs = other.chat.completions.with_raw_response.create(
        model="m1", messages=MESSAGES, stream=True, extra_headers=key
    )
    assert "idempotent-replayed" not in theirs.headers
    assert {c.id for c in theirs.parse()} != first[0]
    assert _generations(agent) == generated + 1

    # A client's own X-Request-ID is a key too; a failed answer is not kept.
    rid = {"X-Request-ID": str(uuid.uuid4())}
    a = client.chat.completions.create(model="m1", messages=MESSAGES, extra_headers=rid)
    b = client.chat.completions.create(model="m1", messages=MESSAGES, extra_headers=rid)
    assert a.id == b.id and _generations(agent) == generated + 2
    too_long = {"Idempotency-Key": str(uuid.uuid4())}
    for _ in range(2):
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(
                model="m1", messages=MESSAGES, max_tokens=5000, extra_headers=too_long
            )
    assert _generations(agent) == generated + 4
    # A hostile key (over 255 characters) is no key: the request is served as usual.
    huge = httpx.post(
        router.url + "/v1/chat/completions",
        json={"model": "m1", "messages": MESSAGES},
        headers={"Idempotency-Key": "k" * 10_000},
        timeout=10,
    )
    assert huge.status_code == 200 and "idempotent-replayed" not in huge.headers
    assert "idempotent_replay of=" in router.log()


def _scope(key: str, auth: bytes = b"Bearer a") -> dict:
    headers = [(b"idempotency-key", key.encode()), (b"authorization", auth)]
    return {"headers": headers, "path": "/v1/chat/completions"}


def _with_request_id(rid: str) -> dict:
    return {"headers": [(b"x-request-id", rid.encode())], "path": "/v1/chat/completions"}


async def test_a_request_id_reused_for_another_body_is_another_request() -> None:
    """The seeds correlate logs by resending one X-Request-ID: with the same body it is
    a retry (replayed); with another body a new request, never 409. An Idempotency-Key
    of the same text is a key of its own."""
    table = IdempotencyTable(window=60)
    rid = "8b9e4a6d-dfb4-4b95-bada-319e7e5b878a"  # the seeds' example
    path = "/v1/chat/completions"
    first = table.claim(_with_request_id(rid), "t", path, b'{"a":1}')
    await _record(table, first, b"answer")
    assert isinstance(table.claim(_with_request_id(rid), "t", path, b'{"a":1}'), Join)
    assert table.claim(_with_request_id(rid), "t", path, b'{"b":2}') is None
    # The first answer is still kept for its own retries.
    assert isinstance(table.claim(_with_request_id(rid), "t", path, b'{"a":1}'), Join)
    assert isinstance(table.claim(_scope(rid), "t", path, b'{"b":2}'), idempotency.Entry)
    assert isinstance(table.claim(_scope(rid), "t", path, b'{"c":3}'), Conflict)


async def _record(table: IdempotencyTable, entry: object, body: bytes, status: int = 200) -> None:
    assert isinstance(entry, idempotency.Entry)

    async def sink(message: dict) -> None:
        pass

    send = table.recorder(entry, sink)
    await send({"type": "http.response.start", "status": status, "headers": []})
    await send({"type": "http.response.body", "body": body})
    table.finish(entry, status)


async def test_answers_are_kept_for_the_window_and_within_the_bounds(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    table = IdempotencyTable(window=60)
    entry = table.claim(_scope("k1"), "t", "/v1/chat/completions", b"{}")
    await _record(table, entry, b"answer")
    assert isinstance(table.claim(_scope("k1"), "t", "/v1/chat/completions", b"{}"), Join)
    assert isinstance(table.claim(_scope("k1"), "t", "/v1/chat/completions", b"{1}"), Conflict)
    # Scoped: another tenant or credentials is another key.
    assert isinstance(
        table.claim(_scope("k1"), "u", "/v1/chat/completions", b"{}"), idempotency.Entry
    )
    other = table.claim(_scope("k1", b"Bearer b"), "t", "/v1/chat/completions", b"{}")
    assert isinstance(other, idempotency.Entry)
    await trio.sleep(61)
    fresh = table.claim(_scope("k1"), "t", "/v1/chat/completions", b"{}")
    assert isinstance(fresh, idempotency.Entry)  # expired: generated again
    # Failures and oversize answers are not kept.
    await _record(table, fresh, b"boom", status=500)
    assert isinstance(
        table.claim(_scope("k1"), "t", "/v1/chat/completions", b"{}"), idempotency.Entry
    )
    big = table.claim(_scope("k2"), "t", "/v1/chat/completions", b"{}")
    await _record(table, big, b"x" * (idempotency.MAX_ANSWER_BYTES + 1))
    assert isinstance(big, idempotency.Entry) and big.state is EntryState.DROPPED
    # Past the entry bound the oldest finished answers go first.
    # (Three entries above are still running: they are never dropped.)
    monkeypatch.setattr(idempotency, "MAX_ENTRIES", 5)
    for i in range(5):
        await _record(table, table.claim(_scope(f"n{i}"), "t", "/p", b"{}"), b"a")
    assert len(table.entries) == 5
    assert isinstance(table.claim(_scope("n4"), "t", "/p", b"{}"), Join)
    assert isinstance(table.claim(_scope("n0"), "t", "/p", b"{}"), idempotency.Entry)
    off = IdempotencyTable(window=0)
    assert off.claim(_scope("k1"), "t", "/p", b"{}") is None


def test_a_retry_joins_the_first_without_taking_admission_room(
    fleet: Fleet, tmp_path: Path
) -> None:
    """A retry generates nothing: it must not take the pool's room (B2) that the first
    request holds, or a full pool would refuse the very retry it should answer."""
    policy = tmp_path / "policy.yaml"
    policy.write_text("max_inflight: 1\nrouting_policy:\n  strategy: least-loaded\n")
    env = {"HIVENET_ROUTER_ADMIT_PARK_TIMEOUT": "0s", "GOLOG_LOG_LEVEL": "http=debug"}
    router = fleet.router("--policy-file", str(policy), env=env)
    agent = fleet.agent(router, "m1")
    agent.sim_state(hold=True)
    key = {"Idempotency-Key": str(uuid.uuid4())}
    answers: list[httpx.Response] = []

    def post() -> None:
        answers.append(
            httpx.post(
                router.url + "/v1/chat/completions",
                json={"model": "m1", "messages": MESSAGES},
                headers=key,
                timeout=30,
            )
        )

    first = threading.Thread(target=post)
    first.start()
    inflight = "hivenet_router_admission_inflight_requests"
    wait_until(lambda: router.metric(inflight, model="m1") == 1, what="the first in flight")
    retry = threading.Thread(target=post)
    retry.start()
    router.wait_log("idempotent_join of=running")
    agent.sim_state(hold=False)
    first.join(30)
    retry.join(30)
    assert [a.status_code for a in answers] == [200, 200], answers[-1].text
    assert answers[0].json()["id"] == answers[1].json()["id"]
    assert _generations(agent) == 1
    assert router.metric("hivenet_router_admission_rejections_total", reason="b2") == 0
    wait_until(lambda: router.metric(inflight, model="m1") == 0, what="nothing held")


async def test_a_stream_with_an_error_event_behind_its_content_is_not_kept() -> None:
    """The link joins the frames that arrive together into one part: an engine's error
    event can follow content events in it, and the stream failed all the same."""
    table = IdempotencyTable(window=60)
    content = b'data: {"choices":[{"index":0,"delta":{"content":"data: {\\"error\\""}}]}\n\n'
    parts = {
        "openai": content + b'data: {"error":{"message":"engine died"}}\n\n',
        "anthropic": b'event: ping\ndata: {"type":"ping"}\n\nevent: error\ndata: {}\n\n',
    }
    for name, part in parts.items():
        entry = table.claim(_scope(name), "t", "/v1/chat/completions", b"{}")
        await _record(table, entry, part)
        assert isinstance(entry, idempotency.Entry) and entry.state is EntryState.DROPPED
    # Text that only reads like an error event is an answer like any other.
    kept = table.claim(_scope("text"), "t", "/v1/chat/completions", b"{}")
    await _record(table, kept, content)
    assert isinstance(kept, idempotency.Entry) and kept.state is EntryState.DONE


def test_a_stream_its_client_left_gives_back_its_room_and_its_key(
    fleet: Fleet, tmp_path: Path
) -> None:
    """A client gone mid-stream: its admission room comes back and its key is forgotten
    (the answer was not whole), so the retry generates anew."""
    policy = tmp_path / "policy.yaml"
    policy.write_text("max_inflight: 4\nrouting_policy:\n  strategy: least-loaded\n")
    router = fleet.router("--policy-file", str(policy))
    agent = fleet.agent(router, "m1", "--sim-token-latency", "200ms")
    key = {"Idempotency-Key": str(uuid.uuid4())}
    body = {"model": "m1", "messages": MESSAGES, "stream": True}
    inflight = "hivenet_router_admission_inflight_requests"
    with httpx.stream(
        "POST", router.url + "/v1/chat/completions", json=body, headers=key, timeout=30
    ) as first:
        next(first.iter_bytes())
    router.wait_log("client_disconnected")
    wait_until(lambda: router.metric(inflight, model="m1") == 0, what="the room given back")
    agent.sim_state(token_latency=0.0)
    retry = httpx.post(router.url + "/v1/chat/completions", json=body, headers=key, timeout=30)
    assert retry.status_code == 200 and "idempotent-replayed" not in retry.headers
    assert b"[DONE]" in retry.content and _generations(agent) == 2
    wait_until(lambda: router.metric(inflight, model="m1") == 0, what="nothing held")
