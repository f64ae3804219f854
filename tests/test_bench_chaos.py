"""`python -m bench.chaos` runs end to end: a short soak kills and restarts processes
under load and prints what issue 49 item 6 asks for (the figures are the bench's; this
only checks that it runs and that no request was answered twice)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_a_short_chaos_soak_prints_its_tally() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "bench.chaos", "--minutes", "0.2", "--seed", "7", "--clients", "2"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    text = out.stdout

    def figure(label: str) -> int:
        found = re.search(rf"^{label}:\s+(\d+)$", text, re.M)
        assert found is not None, text
        return int(found.group(1))

    assert figure("requests sent") > 0
    assert figure("answered") > 0
    assert figure("answered twice") == 0
    assert figure("failed") >= 0
    kills = re.findall(r"^\s+\d+\s+(\S+) SIG(KILL|TERM)$", text, re.M)
    assert kills, text
    memory = re.findall(
        r"^\s+(redis|router-\d|agent-\d\S*)\s+([\d.]+)\s+([\d.]+)\s+\d+$", text, re.M
    )
    assert {m[0] for m in memory} == {
        "redis", "router-0", "router-1", "agent-0", "agent-1", "agent-2-lossy"
    }, text  # fmt: skip
    assert all(float(start) > 0 and float(end) > 0 for _, start, end in memory), text
