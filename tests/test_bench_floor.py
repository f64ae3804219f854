"""bench.floor: the router and agent that only carry requests answer as engines do,
whole and streamed, so that `bench.peers --peers trio-floor` measures a working pair."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import trio

from bench.peers import measure, start_trio_floor
from bench.procs import Procs, free_port

MODEL = "bench-model"  # the one bench.peers.measure asks for


def test_the_floor_carries_whole_and_streamed_answers() -> None:
    procs = Procs()
    try:
        engine = free_port()
        procs.sim(MODEL, engine)
        target = start_trio_floor(procs, engine)
        assert not target.missing, target.missing
        assert target.agent is not None  # its CPU is reported beside the router's
        for stream in (False, True):
            result = trio.run(measure, target, stream, 4, 0.5)  # None where it stalled
            assert result is not None and result.count > 0 and result.errors == 0, (
                stream,
                result.summary(),
            )
        # A stream's every event comes through, in order, to its [DONE].
        body = {"model": MODEL, "messages": [{"role": "user", "content": "a b c"}]}
        url = f"http://127.0.0.1:{target.port}/v1/chat/completions"
        streamed = {**body, "stream": True, "max_tokens": 16}
        with httpx.stream("POST", url, json=streamed, timeout=10) as r:
            events = [line for line in r.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]"
        tokens = [e for e in events[:-1] if json.loads(e[6:])["choices"][0]["delta"].get("content")]
        whole = httpx.post(url, timeout=10, json={**body, "max_tokens": 16}).json()
        assert (
            "".join(json.loads(e[6:])["choices"][0]["delta"]["content"] for e in tokens)
            == (whole["choices"][0]["message"]["content"])
        )
    finally:
        procs.close()


def test_bench_peers_runs_the_floor_beside_hivenet() -> None:
    # The documented command, shortened: every cell of the floor has figures.
    argv = [sys.executable, "-m", "bench.peers", "--duration", "0.4", "--concurrency", "2"]
    out = subprocess.run(
        [*argv, "--peers", "trio-floor"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
        cwd=Path(__file__).parents[1],
    ).stdout
    rows = [line for line in out.splitlines() if "| trio-floor |" in line]
    assert len(rows) == 2, out  # whole and streamed
    for row in rows:
        cpu = row.rstrip(" |").rsplit("|", 1)[1]
        assert "(+ agent " in cpu, row
