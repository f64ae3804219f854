"""The machine's own stalls, seen from outside the processes under test or measured.

A process pinned to each CPU sleeps 10 ms at a time and notes every wake-up later than
0.1 s: a span in which that CPU ran other work, or nothing, and every process under test
may have waited as long. Seen here: a CPU vLLM started in a session of its own (setsid)
under load kept the real-engine checks' processes off both CPUs for 0.3 to 12.5 s at a
time (the kernel's autogroup scheduling gives each session a group; an agent read its
router's cancel 2.45 s after the router wrote it on loopback). The checks now start
engines in their own session, and the real-engine checks that judge a time run their
scenario again only when it went wrong during a stall (tests/real_engines/test_vllm.py);
`bench.real_engine` reports the seconds each of its runs lost to them.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

# A wake-up later than this is a stall (the monitor asks for 10 ms).
STALL = 0.1
# The monitor, one per CPU: each late wake-up as "<slept since> <woke at>", in the
# system's monotonic clock, which every process of the host shares.
_MONITOR = f"""
import os, sys, time
os.sched_setaffinity(0, {{int(sys.argv[1])}})
out = open(sys.argv[2], "a", buffering=1)
before = time.monotonic()
while True:
    time.sleep(0.01)
    now = time.monotonic()
    if now - before > {STALL}:
        out.write(f"{{before:.6f}} {{now:.6f}}\\n")
    before = now
"""


class Stalls:
    """A monitor process pinned to each CPU this test may use, until `close`."""

    def __init__(self, directory: Path) -> None:
        self.paths: dict[int, Path] = {}
        self.processes: list[subprocess.Popen] = []
        for cpu in sorted(os.sched_getaffinity(0)):
            path = directory / f"stalls-cpu{cpu}.txt"
            path.touch()
            self.paths[cpu] = path
            self.processes.append(
                subprocess.Popen([sys.executable, "-c", _MONITOR, str(cpu), str(path)])
            )

    def close(self) -> None:
        for process in self.processes:
            process.kill()
            process.wait(10)

    def _spans(self) -> list[tuple[int, float, float]]:
        spans = []
        for cpu, path in self.paths.items():
            for line in path.read_text().splitlines():
                began, ended = (float(x) for x in line.split())
                spans.append((cpu, began, ended))
        return spans

    def lost(self, since: float, until: float) -> float:
        """CPU-seconds of stalls within the span from `since` to `until`, all CPUs."""
        return sum(
            max(0.0, min(ended, until) - max(began, since)) for _, began, ended in self._spans()
        )

    def during(self, since: float, until: float, least: float = 0.25) -> list[tuple[int, float]]:
        """(CPU, seconds) of each stall of `least` seconds or more that overlapped the
        span from `since` to `until` (time.monotonic())."""
        return [
            (cpu, round(ended - began, 2))
            for cpu, began, ended in self._spans()
            if ended - began >= least and began < until and ended > since
        ]
