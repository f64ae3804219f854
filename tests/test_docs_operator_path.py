"""The operator's path of docs/getting-started/index.md, run as written (issue 50).

Every ```bash block after a `<!-- test: operator-path -->` marker is run, in order, in
one bash process from the repository root, against real daemons (router, two agents,
two simulated engines): install (`scripts/setup`), a router, a first agent and a
request, a second agent joining, a policy change through the admin API, a key for a
team, a dashboard's JSON and series, and the stop. The ports the page names (8080,
2112, 9000, 8000, 8001) are swapped for free loopback ports; nothing else is changed.
Each ```text block after `<!-- test: expect -->` must appear, line by line, in the
output. The systemd units the first-fleet page installs pass `systemd-analyze verify`
(as tests/test_systemd.py checks them; they are not started under systemd here).

Not run: the first-fleet page's root steps (useradd, /opt/hivenet, /etc/hivenet,
systemctl), which need systemd as PID 1; tests/test_systemd.py runs its units'
ExecStart lines instead.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
from pathlib import Path

from tests.fleet import free_ports
from tests.test_systemd import assert_units_verify

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "getting-started" / "index.md"
FIRST_FLEET = ROOT / "docs" / "getting-started" / "first-fleet.md"
PORTS = ("8080", "2112", "9000", "8000", "8001")


def marked_blocks(text: str, marker: str, language: str) -> list[str]:
    pattern = rf"<!-- test: {marker} -->\n```{language}\n(.*?)```"
    return re.findall(pattern, text, flags=re.S)


def test_the_page_marks_its_blocks() -> None:
    text = PAGE.read_text()
    blocks = marked_blocks(text, "operator-path", "bash")
    assert len(blocks) >= 8 and blocks[0].strip() == "scripts/setup"
    assert marked_blocks(text, "expect", "text")
    # A marker must sit right above its block: a moved one would silently skip a step.
    assert text.count("<!-- test: operator-path -->") == len(blocks)
    assert text.count("<!-- test: expect -->") == len(marked_blocks(text, "expect", "text"))


def test_the_operator_path_runs_as_written() -> None:
    text = PAGE.read_text()
    script = "\n".join(marked_blocks(text, "operator-path", "bash"))
    first = free_ports(len(PORTS))
    ports = {port: str(first + i) for i, port in enumerate(PORTS)}
    script = re.sub(r"(?<![\d.])(" + "|".join(PORTS) + r")(?!\d)", lambda m: ports[m[1]], script)
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("HIVENET_", "GOLOG_", "OTEL_"))
        and k not in ("HTTP_PROXY", "HTTPS_PROXY")
    }
    proc = subprocess.Popen(
        ["bash", "-e", "-o", "pipefail", "-c", script],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        out = ""
        proc.kill()
    finally:
        # Whatever the script left running (it stops its daemons itself on success).
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert proc.returncode == 0, f"the page's commands failed ({proc.returncode}):\n{out[-6000:]}"
    lines = out.splitlines()
    for block in marked_blocks(text, "expect", "text"):
        for line in block.strip().splitlines():
            assert line in lines, f"{line!r} not in the output:\n{out[-6000:]}"


def test_the_units_the_first_fleet_page_installs_verify(tmp_path: Path) -> None:
    installed = re.findall(r"/opt/hivenet/systemd/(\S+\.service)", FIRST_FLEET.read_text())
    assert set(installed) == {"hivenet-router.service", "hivenet-agent@.service"}
    assert_units_verify(tmp_path, "hivenet-router.service", "hivenet-agent@llama-8b.service")
