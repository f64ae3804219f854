"""Reading an operator's file (a secret, a key list, a policy) without trusting what it
is: the daemons re-read them on SIGHUP, on their one thread."""

from __future__ import annotations

import os
import stat
from pathlib import Path


def read_regular(path: str | Path, limit: int) -> bytes:
    """The file's bytes. OSError for what is no regular file (a FIFO would block until
    a writer came, /dev/zero never end) or holds more than `limit` bytes."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    with os.fdopen(fd, "rb") as file:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(f"{path} is not a regular file")
        data = file.read(limit + 1)
    if len(data) > limit:
        raise OSError(f"{path} is larger than {limit} bytes")
    return data
