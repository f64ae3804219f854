"""Three routers behind a real HAProxy, rolled one by one under load (issue 49, items 1-2).

HAProxy runs deploy/haproxy/haproxy.cfg as it is (the addresses come from the
environment), health-checking each router's `GET /health` every 500 ms. Four simulated
agents are each joined to all three routers, and the routers share a real redis-server
(`--state-url`). Clients are the official SDKs (openai and anthropic, default retries),
streaming and not, counting every raw HTTP answer through an httpx event hook.

Under that load every router is restarted with SIGTERM, one at a time, then every
agent: no client request may fail, none be answered twice (each saw exactly one HTTP
answer, so nothing was retried, and HAProxy retried nothing either), no 5xx reaches a
client even before the SDKs' retries. Then one router is SIGKILLed: only the requests in
flight on it may fail, and the test says how many did.
"""

from __future__ import annotations

import csv
import io
import os
import shutil
import signal
import statistics
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import anthropic
import httpx
import httpx2
import openai
import pytest
import trio

from tests.fleet import Agent, Fleet, Proc, Router, free_port, wait_until
from tests.redis_server import RedisServer

CONFIG = Path(__file__).parent.parent / "deploy" / "haproxy" / "haproxy.cfg"
SERVERS = ("router-a", "router-b", "router-c")
WORKERS = 16  # concurrent clients: about what two shared cores carry here
DRAIN_DELAY = "3s"  # 2 failed checks 500 ms apart take a router out in about 1 s


class HAProxy(Proc):
    def __init__(self, fleet: Fleet, routers: list[Router]) -> None:
        binary = shutil.which("haproxy")
        if binary is None:
            reason = "haproxy is not installed: run scripts/setup (Debian's haproxy package)"
            if os.environ.get("CI"):
                pytest.fail(reason)
            pytest.skip(reason)
        self.routers = routers
        self.port = free_port()
        self.stats_port = free_port()
        env = {
            **fleet.env,
            "HIVENET_LB_BIND": f"127.0.0.1:{self.port}",
            "HIVENET_LB_STATS_BIND": f"127.0.0.1:{self.stats_port}",
        }
        for name, router in zip("ABC", routers, strict=True):
            env[f"HIVENET_ROUTER_{name}"] = f"127.0.0.1:{router.http_port}"
        super().__init__("haproxy", [binary, "-db", "-f", str(CONFIG)], env, fleet.dir / "lb.log")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stats(self) -> dict[str, dict[str, str]]:
        """The backend's servers, by name, as HAProxy's CSV page gives them."""
        text = httpx.get(f"http://127.0.0.1:{self.stats_port}/stats;csv", timeout=5).text
        rows = csv.DictReader(io.StringIO(text.lstrip("# ")))
        return {r["svname"]: r for r in rows if r["pxname"] == "hivenet_routers"}

    def status(self, server: str) -> str:
        return self.stats()[server]["status"]

    def retries(self) -> int:
        """Requests HAProxy sent again (to the same router or another) since it started."""
        servers = self.stats()
        return sum(int(servers[s]["wretr"] or 0) + int(servers[s]["wredis"] or 0) for s in SERVERS)


@dataclass
class Outcome:
    kind: str
    phase: str
    started: float
    ended: float = 0.0
    ok: bool = False
    error: str = ""


@dataclass
class Load:
    """The clients' record: every logical request, and every raw HTTP answer by request."""

    phase: str = "before"
    outcomes: dict[str, Outcome] = field(default_factory=dict)
    answers: dict[str, list[int]] = field(default_factory=dict)
    served_by: dict[str, str] = field(default_factory=dict)
    stop: trio.Event = field(default_factory=trio.Event)

    async def on_response(self, response: httpx2.Response) -> None:
        rid = response.request.headers.get("x-test-id", "")
        self.answers.setdefault(rid, []).append(response.status_code)
        self.served_by[rid] = response.headers.get("x-hivenet-router", "")

    def five_hundreds(self, phase: str) -> list[tuple[str, list[int]]]:
        return [
            (rid, codes)
            for rid, codes in self.answers.items()
            if self.outcomes[rid].phase == phase and any(c >= 500 for c in codes)
        ]

    def p99(self, phase: str) -> tuple[int, float, float]:
        took = sorted(
            o.ended - o.started for o in self.outcomes.values() if o.phase == phase and o.ok
        )
        if len(took) < 2:
            return len(took), 0.0, 0.0
        return len(took), statistics.median(took), statistics.quantiles(took, n=100)[98]


async def client(load: Load, url: str, w: int) -> None:
    # The SDKs' own HTTP package (httpx2), with a hook that sees every raw answer,
    # those the SDKs' retries would hide included.
    http = httpx2.AsyncClient(event_hooks={"response": [load.on_response]}, timeout=60)
    oai = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", http_client=http)
    ant = anthropic.AsyncAnthropic(base_url=url, api_key="unused", http_client=http)
    n = 0
    async with http:
        while not load.stop.is_set():
            n += 1
            rid = f"w{w}.{n}"
            words = " ".join(f"{rid}.{k}" for k in range(4 + (n + w) % 8))
            kind = ("openai", "openai-stream", "anthropic", "anthropic-stream")[(n + w) % 4]
            out = load.outcomes[rid] = Outcome(kind, load.phase, time.monotonic())
            messages = [{"role": "user", "content": words}]
            headers = {"x-test-id": rid}
            text = ""
            try:
                if kind == "openai":
                    r = await oai.chat.completions.create(
                        model="m1", messages=messages, extra_headers=headers
                    )
                    text = r.choices[0].message.content or ""
                elif kind == "openai-stream":
                    stream = await oai.chat.completions.create(
                        model="m1", messages=messages, stream=True, extra_headers=headers
                    )
                    async for chunk in stream:
                        if chunk.choices and chunk.choices[0].delta.content:
                            text += chunk.choices[0].delta.content
                elif kind == "anthropic":
                    m = await ant.messages.create(
                        model="m1", max_tokens=64, messages=messages, extra_headers=headers
                    )
                    text = m.content[0].text
                else:
                    s = await ant.messages.create(
                        model="m1",
                        max_tokens=64,
                        messages=messages,
                        stream=True,
                        extra_headers=headers,
                    )
                    async for event in s:
                        if event.type == "content_block_delta" and event.delta.type == "text_delta":
                            text += event.delta.text
                out.ok = text == f"Echo: {words}"
                if not out.ok:
                    out.error = f"wrong answer {text!r}"
            except Exception as exc:  # a failed request, whatever the SDK raised
                out.error = f"{type(exc).__name__}: {exc}"
            out.ended = time.monotonic()


async def in_thread(fn, *args):
    return await trio.to_thread.run_sync(fn, *args)


def serving(lb: HAProxy, router: Router, agents: list[Agent]) -> None:
    """`router` holds every agent and HAProxy has it back in the pool."""
    for a in agents:
        router.wait_agent(a.peer_id, timeout=30)
    name = SERVERS[lb.routers.index(router)]
    wait_until(lambda: lb.status(name) == "UP", 15, f"HAProxy: {name} UP")


def test_health_min_agents_keeps_a_router_out_until_an_agent_joins(fleet: Fleet) -> None:
    router = fleet.router("--health-min-agents", "1")
    r = httpx.get(router.url + "/health", timeout=5)
    assert r.status_code == 503 and r.json()["status"] == "no_agents", r.text
    fleet.agent(router, "m1")
    assert httpx.get(router.url + "/health", timeout=5).json()["status"] == "ok"


@pytest.mark.slow  # about 90 s on two shared cores: each restart takes seconds of CPU
async def test_rolling_every_router_and_agent_behind_haproxy_fails_no_request(
    fleet: Fleet,
) -> None:
    redis = RedisServer(fleet.dir, fleet.env)
    fleet.procs.append(redis)
    await in_thread(redis.start)
    flags = [
        "--state-url",
        redis.url,
        "--drain-delay",
        DRAIN_DELAY,
        "--drain-timeout",
        "20s",
        "--health-min-agents",
        "1",
        "--heartbeat-interval",
        "1s",
    ]
    routers = [fleet.router(*flags, start=False) for _ in SERVERS]
    async with trio.open_nursery() as starting:  # side by side: a start takes seconds here
        for router in routers:
            starting.start_soon(in_thread, router.start)
    agent_flags = ("--capacity", "32", "--sim-token-latency", "5ms", "--heartbeat-interval", "1s")
    agents = [
        await in_thread(lambda: fleet.agent(routers, "m1", *agent_flags, wait=False))
        for _ in range(4)
    ]
    await in_thread(fleet.join, *agents)
    lb = HAProxy(fleet, routers)
    fleet.procs.append(lb)
    lb.start()
    await in_thread(
        lambda: wait_until(
            lambda: all(lb.status(s) == "UP" for s in SERVERS), 15, "HAProxy: every router UP"
        )
    )

    load = Load()
    timings: dict[str, float] = {}
    killed: dict[str, float] = {}
    with trio.fail_after(150):
        async with trio.open_nursery() as nursery:
            for w in range(WORKERS):
                nursery.start_soon(client, load, lb.url, w)
            await trio.sleep(5)
            load.phase = "roll"
            retries_before = await in_thread(lb.retries)
            began = time.monotonic()
            for router in routers:
                assert await in_thread(lambda r=router: r.stop(signal.SIGTERM, 40)) == 0
                await in_thread(router.start)
                await in_thread(serving, lb, router, agents)
            timings["routers"] = time.monotonic() - began
            began = time.monotonic()
            for agent in agents:
                assert await in_thread(lambda a=agent: a.stop(signal.SIGTERM, 40)) == 0
                await in_thread(agent.start)
                await in_thread(fleet.join, agent)
            timings["agents"] = time.monotonic() - began
            retries_roll = await in_thread(lb.retries) - retries_before
            load.phase = "kill"
            await trio.sleep(1)
            killed["at"] = time.monotonic()
            routers[0].stop(signal.SIGKILL)
            await trio.sleep(4)
            load.stop.set()

    sent = Counter(o.phase for o in load.outcomes.values())
    failed = {p: [o for o in load.outcomes.values() if o.phase == p and not o.ok] for p in sent}
    n0, p50_0, p99_0 = load.p99("before")
    n1, p50_1, p99_1 = load.p99("roll")
    roll_seconds = timings["routers"] + timings["agents"]
    print(
        f"\nbefore the roll: {n0} requests in 5 s, p50 {p50_0 * 1000:.0f} ms,"
        f" p99 {p99_0 * 1000:.0f} ms"
        f"\nduring the roll: {n1} requests in {roll_seconds:.0f} s (routers"
        f" {timings['routers']:.0f} s, agents {timings['agents']:.0f} s),"
        f" p50 {p50_1 * 1000:.0f} ms, p99 {p99_1 * 1000:.0f} ms,"
        f" failed {len(failed['before']) + len(failed['roll'])},"
        f" 5xx seen {len(load.five_hundreds('before')) + len(load.five_hundreds('roll'))},"
        f" HAProxy retries {retries_roll}"
    )
    for phase in ("before", "roll"):
        assert not failed[phase], [(o.kind, o.error) for o in failed[phase][:5]]
        assert not load.five_hundreds(phase), load.five_hundreds(phase)[:5]
        # Answered once: each request saw exactly one HTTP answer (no SDK retry).
        twice = [
            (rid, codes)
            for rid, codes in load.answers.items()
            if load.outcomes[rid].phase == phase and len(codes) != 1
        ]
        assert not twice, twice[:5]
    # ...and HAProxy sent nothing again either (a retry of a request a router had
    # taken could generate it twice).
    assert retries_roll == 0, retries_roll
    assert n0 > 0 and n1 > n0

    # SIGKILL: what fails was in flight on the killed router when it died.
    lost = {rid: o for rid, o in load.outcomes.items() if o.phase == "kill" and not o.ok}
    print(
        f"SIGKILL of router-a: {sent['kill']} requests in the phase, {len(lost)} failed"
        f" (in flight on it), {Counter(o.kind for o in lost.values())},"
        f" 5xx seen {len(load.five_hundreds('kill'))}"
    )
    for rid, o in lost.items():
        # In flight when it died, and answered (its head at least) by it or by no one.
        assert o.started < killed["at"] <= o.ended, (rid, o)
        assert load.served_by.get(rid, "") in ("router-a", ""), (rid, load.served_by.get(rid))
    assert sent["kill"] > len(lost)
