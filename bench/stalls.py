"""The machine's own stalls, seen from outside the processes under test or measured.

On the project's virtual machines a CPU stops running anything now and then, for 0.1 to
12 s at a time, while a CPU vLLM serves a load (and not under a plain CPU or memory
load): a process pinned to each CPU that sleeps 10 ms at a time saw its wake-ups that
late, and the daemons' own timestamps showed the same gaps, an agent reading its
router's cancel 2.45 s after the router wrote it on loopback. A timing taken then is the
machine's, not the router's: the real-engine checks that judge one run their scenario
again when it failed during such a stall (tests/real_engines/test_vllm.py), and
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
