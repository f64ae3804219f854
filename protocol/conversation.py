"""The order of the agent link's messages, as data: a pure state machine, no I/O.

Shaped like h11's `_state.py`. Rule 1: everything that decides whether a message may
come next lives in this file. Rule 2: this file knows nothing of trio, libp2p or which
daemon it runs in; both daemons feed it the messages they send and receive, keyed by
the role of the sender.

A session: the agent says `hello`, the router answers `welcome` or `refusal`; only a
joined session carries heartbeats, requests and their answers. A request, from the
router's `request` on: `response_head`, `response_chunk`*, then `response_end` or
`error` from the agent; an `error` may also come before the head (`agent_full`: the
agent's capacity is taken by other routers' requests, so it refuses before starting). The router may
`cancel` an unfinished request, and the session ending fails every unfinished one.
A message with no transition from the current state raises ProtocolError.
"""

from __future__ import annotations

from enum import Enum

from protocol import messages as m
from protocol.messages import ProtocolError

__all__ = [
    "PER_REQUEST",
    "REQUEST_TRANSITIONS",
    "SESSION_END",
    "SESSION_TRANSITIONS",
    "ProtocolError",
    "RequestState",
    "Role",
    "SessionState",
    "next_request_state",
    "next_session_state",
    "open_request",
    "request_error",
    "session_error",
]


class Role(Enum):
    """Who sends a message: the router or the agent."""

    ROUTER = "router"
    AGENT = "agent"


class SessionState(Enum):
    # Members are singletons: hashed by identity, in C. Enum's own hash, of the name,
    # is a Python call on every table lookup (one per frame on both daemons).
    __hash__ = object.__hash__

    AWAITING_HELLO = "awaiting_hello"
    AWAITING_WELCOME = "awaiting_welcome"
    JOINED = "joined"
    REFUSED = "refused"


class RequestState(Enum):
    __hash__ = object.__hash__  # as SessionState's

    AWAITING_HEAD = "awaiting_head"
    BODY = "body"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"


ROUTER, AGENT = Role.ROUTER, Role.AGENT
AWAITING_HELLO = SessionState.AWAITING_HELLO
AWAITING_WELCOME = SessionState.AWAITING_WELCOME
JOINED = SessionState.JOINED
REFUSED = SessionState.REFUSED
AWAITING_HEAD = RequestState.AWAITING_HEAD
BODY = RequestState.BODY
DONE = RequestState.DONE
FAILED = RequestState.FAILED
CANCELLED = RequestState.CANCELLED

# Not a wire message: the session a request rides on has ended.
SESSION_END = "session_end"

# Messages that belong to one request (they carry its `id`), by sender.
PER_REQUEST: dict[Role, frozenset[str]] = {
    ROUTER: frozenset({m.REQUEST, m.CANCEL}),
    AGENT: frozenset({m.RESPONSE_HEAD, m.RESPONSE_CHUNK, m.RESPONSE_END, m.RESPONSE, m.ERROR}),
}

# SESSION_TRANSITIONS[sender][state][message type] -> next state. Nested dicts, not
# tuple keys: a lookup on each frame allocates nothing.
SESSION_TRANSITIONS: dict[Role, dict[SessionState, dict[str, SessionState]]] = {
    AGENT: {
        AWAITING_HELLO: {m.HELLO: AWAITING_WELCOME},
        JOINED: {
            m.HEARTBEAT: JOINED,
            m.DRAIN: JOINED,
            **dict.fromkeys(PER_REQUEST[AGENT], JOINED),
        },
    },
    ROUTER: {
        AWAITING_WELCOME: {m.WELCOME: JOINED, m.REFUSAL: REFUSED},
        JOINED: {m.HEARTBEAT: JOINED, **dict.fromkeys(PER_REQUEST[ROUTER], JOINED)},
    },
}

_AGENT_ANSWERS = (m.RESPONSE_HEAD, m.RESPONSE_CHUNK, m.RESPONSE_END, m.RESPONSE, m.ERROR)

# REQUEST_TRANSITIONS[sender][state][message type] -> next state. A request starts in
# AWAITING_HEAD with the router's `request`; no state takes a second `request`, so an
# id reused while its request is live is refused (`open_request`). SESSION_END is
# filed under the agent: its side of the session went away. Frames the agent sent
# before it saw a cancel still arrive after it: a cancelled request takes them and
# stays cancelled; a cancel that crosses the end on the wire changes nothing.
REQUEST_TRANSITIONS: dict[Role, dict[RequestState, dict[str, RequestState]]] = {
    ROUTER: {
        AWAITING_HEAD: {m.CANCEL: CANCELLED},
        BODY: {m.CANCEL: CANCELLED},
        DONE: {m.CANCEL: DONE},
        FAILED: {m.CANCEL: FAILED},
        CANCELLED: {m.CANCEL: CANCELLED},
    },
    AGENT: {
        AWAITING_HEAD: {
            m.RESPONSE_HEAD: BODY,
            m.RESPONSE: DONE,  # the whole answer at once
            m.ERROR: FAILED,
            SESSION_END: FAILED,
        },
        BODY: {
            m.RESPONSE_CHUNK: BODY,
            m.RESPONSE_END: DONE,
            m.ERROR: FAILED,
            SESSION_END: FAILED,
        },
        DONE: {SESSION_END: DONE},
        FAILED: {SESSION_END: FAILED},
        CANCELLED: dict.fromkeys((*_AGENT_ANSWERS, SESSION_END), CANCELLED),
    },
}


def next_session_state(sender: Role, state: SessionState, kind: str) -> SessionState:
    """The session's state after `sender` sends a message of type `kind`."""
    try:
        return SESSION_TRANSITIONS[sender][state][kind]
    except KeyError:
        raise session_error(sender, state, kind) from None


def next_request_state(sender: Role, state: RequestState, kind: str) -> RequestState:
    """The request's state after `sender` sends a message of type `kind` for it."""
    try:
        return REQUEST_TRANSITIONS[sender][state][kind]
    except KeyError:
        raise request_error(state, kind) from None


# A daemon on its hot path may look the tables up itself (one dict lookup, no call);
# these name what a missing key means.
def session_error(sender: Role, state: SessionState, kind: str) -> ProtocolError:
    return ProtocolError(
        f"can't handle {kind} from the {sender.value} in session state {state.name}"
    )


def request_error(state: RequestState, kind: str) -> ProtocolError:
    return ProtocolError(f"can't handle {kind} in state {state.name}")


def open_request(live: RequestState | None) -> RequestState:
    """The state of a new request whose id is held by a request in state `live`
    (None: the id is free)."""
    if live is None:
        return AWAITING_HEAD
    raise ProtocolError(f"can't handle {m.REQUEST} in state {live.name}: its id is live")
