"""Graceful shutdown with real processes: SIGTERM on a router, SIGTERM on an agent.

Router: /health fails at once while new requests are still served for --drain-delay;
then the HTTP listener closes (new connections refused) and in-flight requests finish,
up to --drain-timeout; streams that outlive it end with an error event, never a cut
connection. Agent: the router stops routing to it at once, it finishes what it holds,
then leaves, and no request of a steady client load is lost.
"""

from __future__ import annotations

import json
import re
import signal
from dataclasses import dataclass, field

import httpx
import trio

from tests.fleet import Fleet, wait_until

STREAMS = 50


@dataclass
class StreamOutcome:
    status: int = 0
    started: bool = False
    content: str = ""
    done: bool = False  # saw `data: [DONE]`
    error: dict | None = None  # the error event's `error` object
    exception: str | None = None  # the connection broke (what must never happen)
    events: list[str] = field(default_factory=list)


def chat(content: str, stream: bool) -> dict:
    return {"model": "m1", "stream": stream, "messages": [{"role": "user", "content": content}]}


async def read_stream(
    client: httpx.AsyncClient, words: str, started: trio.Semaphore | None = None
) -> StreamOutcome:
    out = StreamOutcome()
    try:
        async with client.stream("POST", "/v1/chat/completions", json=chat(words, True)) as r:
            out.status = r.status_code
            if r.status_code != 200:
                await r.aread()
                out.error = r.json().get("error")
                return out
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: ") :]
                out.events.append(data)
                if data == "[DONE]":
                    out.done = True
                    continue
                event = json.loads(data)
                if "error" in event:
                    out.error = event["error"]
                    continue
                delta = event["choices"][0]["delta"].get("content")
                if delta:
                    out.content += delta
                    if not out.started:
                        out.started = True
                        if started is not None:
                            started.release()
    except httpx.HTTPError as exc:
        out.exception = f"{type(exc).__name__}: {exc}"
    return out


async def test_sigterm_router_with_50_streams_in_flight(fleet: Fleet) -> None:
    delay, drain = 2.0, 3.0
    router = fleet.router("--drain-delay", f"{delay:g}s", "--drain-timeout", f"{drain:g}s")
    fleet.agent(router, "m1", "--capacity", "64", "--sim-token-latency", "150ms")
    # 6 to 60 tokens, 150 ms apart: the short ones end well inside the delay plus the
    # drain (5 s from the signal), the long ones well after it.
    texts = {i: " ".join(f"w{i}.{k}" for k in range(5 + (i % 10) * 6)) for i in range(STREAMS)}
    outcomes: dict[int, StreamOutcome] = {}
    late: list[StreamOutcome | httpx.Response] = []
    started = trio.Semaphore(0)

    async def one(client: httpx.AsyncClient, i: int) -> None:
        outcomes[i] = await read_stream(client, texts[i], started)

    async def fresh(method: str, path: str, **kw: object) -> httpx.Response:
        # A new connection each time: what a load balancer's check or new client sees.
        async with httpx.AsyncClient(base_url=router.url, timeout=10) as c:
            return await c.request(method, path, **kw)  # type: ignore[arg-type]

    limits = httpx.Limits(max_connections=STREAMS + 10)
    timeout = httpx.Timeout(60, connect=10)
    with trio.fail_after(60):  # none hangs
        async with (
            httpx.AsyncClient(base_url=router.url, timeout=timeout, limits=limits) as client,
            trio.open_nursery() as nursery,
        ):
            for i in range(STREAMS):
                nursery.start_soon(one, client, i)
            for _ in range(STREAMS):  # every stream has its first token
                await started.acquire()
            router.send_signal(signal.SIGTERM)
            signalled = trio.current_time()
            # Load balancers see the drain on /health within a second...
            while (health := await fresh("GET", "/health")).status_code == 200:  # noqa: ASYNC110
                await trio.sleep(0.02)
            health_after = trio.current_time() - signalled
            # ...while new requests are still answered, streaming or not, through the delay.
            late.append(await fresh("POST", "/v1/chat/completions", json=chat("late", False)))
            async with httpx.AsyncClient(base_url=router.url, timeout=timeout) as c:
                late.append(await read_stream(c, "late stream"))
            assert trio.current_time() - signalled < delay, "the late requests took too long"
            # Then the listener closes: a new connection is refused, never answered 503.
            await trio.to_thread.run_sync(lambda: router.wait_log("router_http_closed", 10))
            closed_after = trio.current_time() - signalled
            try:
                refused = await fresh("GET", "/health")
            except httpx.ConnectError as exc:
                refused = exc
    assert health_after < 1.0, health_after
    assert health.status_code == 503
    assert health.json() == {"status": "draining"}
    plain, streamed = late
    assert isinstance(plain, httpx.Response) and plain.status_code == 200, plain
    assert plain.json()["choices"][0]["message"]["content"] == "Echo: late"
    assert isinstance(streamed, StreamOutcome)
    assert streamed.done and streamed.content == "Echo: late stream", streamed
    assert closed_after >= delay, closed_after
    assert isinstance(refused, httpx.ConnectError), refused

    completed = errored = 0
    for i, out in sorted(outcomes.items()):
        assert out.exception is None, (i, out.exception, out.content[-40:])
        assert out.status == 200, (i, out)
        if out.done:
            assert out.error is None, (i, out.error)
            assert out.content == f"Echo: {texts[i]}", i
            completed += 1
        else:
            assert out.error is not None, (i, "stream ended with neither [DONE] nor an error")
            assert out.events[-1].startswith('{"error"'), (i, out.events[-3:])
            assert out.error["code"] == "agent_disconnected", out.error
            assert "shutting down" in out.error["message"], out.error
            errored += 1
    assert completed + errored == STREAMS
    assert completed >= 10, completed  # the short ones finished inside the window
    assert errored >= 10, errored  # the long ones outlived it and were told so

    wait_until(lambda: not router.alive(), drain + 10, "the router to exit")
    assert router.popen is not None and router.popen.returncode == 0
    log = router.log()
    assert "router_drain_timeout" in log
    assert "router_stopped" in log


async def test_sigterm_router_idle_exits_at_once(fleet: Fleet) -> None:
    router = fleet.router("--drain-timeout", "30s")
    fleet.agent(router, "m1")
    started = trio.current_time()
    router.send_signal(signal.SIGTERM)
    await trio.to_thread.run_sync(lambda: wait_until(lambda: not router.alive(), 10, "exit"))
    # Nothing in flight: no waiting for the drain timeout.
    assert trio.current_time() - started < 8
    assert router.popen is not None and router.popen.returncode == 0


async def test_sigterm_agent_under_load_loses_no_request(fleet: Fleet) -> None:
    router = fleet.router("--heartbeat-interval", "1s")
    flags = ("--capacity", "16", "--sim-token-latency", "20ms", "--heartbeat-interval", "1s")
    leaving = fleet.agent(router, "m1", *flags, wait=False)
    staying = fleet.agent(router, "m1", *flags, wait=False)
    fleet.join(leaving, staying)
    results: list[tuple[int, int, str, str]] = []  # (worker, status, streamed?, outcome)
    stop = trio.Event()

    async def worker(client: httpx.AsyncClient, w: int) -> None:
        n = 0
        while not stop.is_set():
            n += 1
            words = " ".join(f"x{w}.{n}.{k}" for k in range(10 + (n * 7 + w) % 25))
            if n % 2:
                out = await read_stream(client, words)
                ok = out.done and out.error is None and out.content == f"Echo: {words}"
                results.append((w, out.status, "stream", "ok" if ok else repr(out)))
            else:
                try:
                    r = await client.post("/v1/chat/completions", json=chat(words, False))
                except httpx.HTTPError as exc:
                    results.append((w, 0, "plain", repr(exc)))
                    continue
                ok = r.status_code == 200 and (
                    r.json()["choices"][0]["message"]["content"] == f"Echo: {words}"
                )
                results.append((w, r.status_code, "plain", "ok" if ok else r.text))

    timeout = httpx.Timeout(60, connect=10)
    with trio.fail_after(90):
        async with (
            httpx.AsyncClient(base_url=router.url, timeout=timeout) as client,
            trio.open_nursery() as nursery,
        ):
            for w in range(12):
                nursery.start_soon(worker, client, w)
            # A steady load: answers coming back, both agents busy.
            await trio.to_thread.run_sync(
                lambda: wait_until(
                    lambda: (
                        len(results) >= 12
                        and all(a["status"]["active_requests"] > 0 for a in router.agents())
                    ),
                    30,
                    "both agents busy",
                )
            )
            before = len(results)
            # Slow the leaving agent's engine down, so its drain lasts seconds.
            await trio.to_thread.run_sync(lambda: leaving.sim_state(token_latency=0.2))
            leaving.send_signal(signal.SIGTERM)
            await trio.to_thread.run_sync(
                lambda: router.wait_log(f"agent_draining peer={leaving.peer_id}", 5)
            )
            # From here the router sends it nothing new, though it is still finishing.
            try:
                first = await trio.to_thread.run_sync(leaving.sim_state)
                await trio.sleep(1)
                then = await trio.to_thread.run_sync(leaving.sim_state)
            except httpx.HTTPError:  # it finished within the second: nothing to compare
                first = then = {"requests_total": 0}
            assert then["requests_total"] == first["requests_total"], (first, then)
            await trio.to_thread.run_sync(
                lambda: wait_until(lambda: not leaving.alive(), 30, "the agent to leave")
            )
            left = len(results)
            # Keep the load on the remaining agent for a while.
            await trio.sleep(2)
            stop.set()
    assert leaving.popen is not None and leaving.popen.returncode == 0
    drain = re.search(r"agent_drain inflight=(\d+)", leaving.log())
    assert drain is not None and int(drain.group(1)) > 0  # it had work in flight
    assert "agent_stopped" in leaving.log()
    failures = [r for r in results if r[1] != 200 or r[3] != "ok"]
    assert not failures, failures[:5]
    assert before > 0 and left > before and len(results) > left
    # The drained agent had work in flight when told to stop; the other took over.
    assert router.agent(staying.peer_id) is not None
    assert router.agent(staying.peer_id)["status"]["healthy"]
