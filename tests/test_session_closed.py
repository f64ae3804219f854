"""A session being closed refuses new frames with SessionClosed, the error its
callers expect, in the moment between close() and the end of run()."""

from __future__ import annotations

import pytest

from protocol.p2p import FramedStream, SessionClosed


def test_send_after_close_before_run_ends_is_session_closed() -> None:
    """Seen on a real path: SIGTERM during a black hole closed the session, the
    heartbeat task's next send raised trio.ClosedResourceError, and the agent exited
    with a traceback instead of draining."""
    fs = FramedStream(stream=None)
    fs.close("agent stopping")
    assert not fs.closed.is_set()
    with pytest.raises(SessionClosed, match="agent stopping"):
        fs.send_nowait({"type": "heartbeat"})
