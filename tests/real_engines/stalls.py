"""The machine's own stalls, seen from outside the processes under test.

On the project's virtual machines a CPU stops running anything now and then, for 0.1 to
11 s at a time, while the CPU vLLM of these checks starts and serves (and not under a
plain CPU or memory load): a process pinned to each CPU that sleeps 10 ms at a time saw
its wake-ups that late, and the daemons' own timestamps showed the same gaps, an agent
reading its router's cancel 2.45 s after the router wrote it on loopback. A timing that
a check judges is then the machine's, not the router's: the checks that judge one run
their scenario again when it failed during such a stall, and fail at once when it
failed without one.
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

    def during(self, since: float, until: float, least: float = 0.25) -> list[tuple[int, float]]:
        """(CPU, seconds) of each stall of `least` seconds or more that overlapped the
        span from `since` to `until` (time.monotonic())."""
        found = []
        for cpu, path in self.paths.items():
            for line in path.read_text().splitlines():
                began, ended = (float(x) for x in line.split())
                if ended - began >= least and began < until and ended > since:
                    found.append((cpu, round(ended - began, 2)))
        return found
