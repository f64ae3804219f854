"""The documentation site builds with `mkdocs build --strict` (issue 50): a broken link,
a page missing from the nav's files or a bad anchor fails the suite, not the reader."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_docs_site_builds_strict(tmp_path: Path) -> None:
    site = tmp_path / "site"
    run = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert run.returncode == 0, run.stderr[-4000:]
    assert (site / "index.html").is_file()
    # No web font or other remote asset is fetched while building or reading the site.
    assert "fonts.googleapis.com" not in (site / "index.html").read_text()
