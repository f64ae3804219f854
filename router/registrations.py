"""The registration feed behind `GET /admin/registration-stream`.

An external scheduler follows the fleet through it: `registered` when an agent's hello
is accepted, `unregistered` when that agent's session ends. The link publishes without
waiting; each subscriber has its own bounded buffer, and one that falls
SUBSCRIBER_BUFFER events behind is dropped (its stream ends with a `subscriber_dropped`
event) rather than holding up the link's reader or growing without bound. A dropped
subscriber resynchronises from `/admin/routing-table`, as a new one does.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass

import trio

from router.peers import Peer

# A fleet of 1,000 agents that all rejoin after a router restart publishes 1,000
# events in a few seconds; a reader that keeps up drains far faster than that, so 256
# only drops readers that have stopped.
SUBSCRIBER_BUFFER = 256
# Upstream's period for the comment that keeps idle proxies from closing the stream.
KEEPALIVE_SECONDS = 25.0
# More simultaneous followers than any scheduler setup needs; each costs a buffer.
MAX_SUBSCRIBERS = 64


@dataclass(frozen=True)
class Registration:
    event_type: str
    agent_id: str
    model: str
    deployment_id: str
    replica_id: str
    timestamp: str

    def sse(self) -> bytes:
        return b"data: " + json.dumps(asdict(self), separators=(",", ":")).encode() + b"\n\n"


def _rfc3339(at: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(at)) + f".{int(at % 1 * 1000):03d}Z"


def registration(event_type: str, peer: Peer) -> Registration:
    meta = peer.metadata
    return Registration(
        event_type=event_type,
        agent_id=peer.peer_id,
        model=meta.model,
        deployment_id=meta.deployment_id,
        replica_id=meta.replica_id,
        timestamp=_rfc3339(time.time()),
    )


class Subscriber:
    """One follower's buffer; `dropped` once it fell too far behind."""

    def __init__(self, buffer: int) -> None:
        self.send, self.receive = trio.open_memory_channel[Registration](buffer)
        self.dropped = False

    def __repr__(self) -> str:
        stats = self.send.statistics()
        state = "dropped" if self.dropped else "following"
        return f"<Subscriber {state}, {stats.current_buffer_used}/{stats.max_buffer_size} queued>"


class TooManySubscribers(Exception):
    pass


class RegistrationFeed:
    def __init__(self, buffer: int = SUBSCRIBER_BUFFER, limit: int = MAX_SUBSCRIBERS) -> None:
        self.buffer = buffer
        self.limit = limit
        self._subscribers: set[Subscriber] = set()

    def __repr__(self) -> str:
        return f"<RegistrationFeed {len(self._subscribers)} subscribers>"

    def publish(self, event: Registration) -> None:
        """Hand `event` to every subscriber now; never waits."""
        for sub in list(self._subscribers):
            try:
                sub.send.send_nowait(event)
            except trio.WouldBlock:
                sub.dropped = True
                self._subscribers.discard(sub)
                sub.send.close()

    def subscribe(self) -> Subscriber:
        if len(self._subscribers) >= self.limit:
            raise TooManySubscribers(f"at most {self.limit} registration-stream subscribers")
        sub = Subscriber(self.buffer)
        self._subscribers.add(sub)
        return sub

    def unsubscribe(self, sub: Subscriber) -> None:
        self._subscribers.discard(sub)
        sub.send.close()
        sub.receive.close()

    @property
    def subscribers(self) -> int:
        return len(self._subscribers)
