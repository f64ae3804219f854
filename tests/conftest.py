from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.fleet import Fleet


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[Fleet]:
    f = Fleet(tmp_path)
    try:
        yield f
    finally:
        f.close()
