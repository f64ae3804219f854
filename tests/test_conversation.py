"""The link's message order (protocol/conversation.py), with no trio and no libp2p."""

from __future__ import annotations

import pytest

from protocol import messages as m
from protocol.conversation import (
    PER_REQUEST,
    REQUEST_TRANSITIONS,
    SESSION_END,
    SESSION_TRANSITIONS,
    ProtocolError,
    RequestState,
    Role,
    SessionState,
    next_request_state,
    next_session_state,
    open_request,
)

ROUTER, AGENT = Role.ROUTER, Role.AGENT
S = SessionState
R = RequestState
ALL_KINDS = (
    m.HELLO,
    m.WELCOME,
    m.REFUSAL,
    m.HEARTBEAT,
    m.REQUEST,
    m.RESPONSE_HEAD,
    m.RESPONSE_CHUNK,
    m.RESPONSE_END,
    m.RESPONSE,
    m.ERROR,
    m.CANCEL,
    m.DRAIN,
)


def run_request(*moves: tuple[Role, str]) -> RequestState:
    state = open_request(None)
    for sender, kind in moves:
        state = next_request_state(sender, state, kind)
    return state


def test_a_streamed_answer_ends_done() -> None:
    chunks = [(AGENT, m.RESPONSE_CHUNK)] * 5
    assert run_request((AGENT, m.RESPONSE_HEAD), *chunks, (AGENT, m.RESPONSE_END)) is R.DONE


def test_an_error_before_or_after_the_head_fails_the_request() -> None:
    assert run_request((AGENT, m.ERROR)) is R.FAILED
    assert run_request((AGENT, m.RESPONSE_HEAD), (AGENT, m.RESPONSE_CHUNK), (AGENT, m.ERROR)) is (
        R.FAILED
    )


def test_the_session_ending_fails_an_unfinished_request_only() -> None:
    assert run_request((AGENT, SESSION_END)) is R.FAILED
    assert run_request((AGENT, m.RESPONSE_HEAD), (AGENT, SESSION_END)) is R.FAILED
    done = ((AGENT, m.RESPONSE_HEAD), (AGENT, m.RESPONSE_END))
    assert run_request(*done, (AGENT, SESSION_END)) is R.DONE
    assert run_request((AGENT, m.ERROR), (AGENT, SESSION_END)) is R.FAILED


@pytest.mark.parametrize(
    ("moves", "message"),
    [
        (
            [(AGENT, m.RESPONSE_HEAD), (AGENT, m.RESPONSE_HEAD)],
            "can't handle response_head in state BODY",
        ),
        ([(AGENT, m.RESPONSE_CHUNK)], "can't handle response_chunk in state AWAITING_HEAD"),
        ([(AGENT, m.RESPONSE_END)], "can't handle response_end in state AWAITING_HEAD"),
        (
            [(AGENT, m.RESPONSE_HEAD), (AGENT, m.RESPONSE_END), (AGENT, m.RESPONSE_CHUNK)],
            "can't handle response_chunk in state DONE",
        ),
        ([(AGENT, m.ERROR), (AGENT, m.ERROR)], "can't handle error in state FAILED"),
        ([(ROUTER, m.RESPONSE_HEAD)], "can't handle response_head in state AWAITING_HEAD"),
        ([(AGENT, m.CANCEL)], "can't handle cancel in state AWAITING_HEAD"),
    ],
)
def test_out_of_order_answers_are_protocol_errors(
    moves: list[tuple[Role, str]], message: str
) -> None:
    with pytest.raises(ProtocolError) as caught:
        run_request(*moves)
    assert str(caught.value) == message


def test_frames_after_a_cancel_are_taken_and_change_nothing() -> None:
    state = run_request((AGENT, m.RESPONSE_HEAD), (ROUTER, m.CANCEL))
    assert state is R.CANCELLED
    for kind in (m.RESPONSE_CHUNK, m.RESPONSE_HEAD, m.RESPONSE_END, m.ERROR, SESSION_END):
        assert next_request_state(AGENT, state, kind) is R.CANCELLED
    # A cancel that crosses the end on the wire leaves the end standing.
    done = run_request((AGENT, m.RESPONSE_HEAD), (AGENT, m.RESPONSE_END))
    assert next_request_state(ROUTER, done, m.CANCEL) is R.DONE


@pytest.mark.parametrize("live", list(RequestState))
def test_a_request_for_a_live_id_is_refused_in_every_state(live: RequestState) -> None:
    with pytest.raises(ProtocolError, match=f"can't handle request in state {live.name}"):
        open_request(live)
    assert open_request(None) is R.AWAITING_HEAD


def test_a_session_joins_with_hello_then_welcome() -> None:
    state = next_session_state(AGENT, S.AWAITING_HELLO, m.HELLO)
    assert state is S.AWAITING_WELCOME
    assert next_session_state(ROUTER, state, m.WELCOME) is S.JOINED
    assert next_session_state(ROUTER, state, m.REFUSAL) is S.REFUSED


def test_only_a_joined_session_carries_requests_and_heartbeats() -> None:
    for sender in Role:
        for kind in (*PER_REQUEST[sender], m.HEARTBEAT):
            assert next_session_state(sender, S.JOINED, kind) is S.JOINED
            for state in (S.AWAITING_HELLO, S.AWAITING_WELCOME, S.REFUSED):
                with pytest.raises(ProtocolError, match=f"session state {state.name}"):
                    next_session_state(sender, state, kind)


@pytest.mark.parametrize(
    ("sender", "state", "kind"),
    [
        (AGENT, S.JOINED, m.HELLO),  # a second hello
        (AGENT, S.AWAITING_WELCOME, m.HELLO),
        (AGENT, S.REFUSED, m.HELLO),  # no second try on a refused session
        (ROUTER, S.AWAITING_HELLO, m.WELCOME),
        (ROUTER, S.JOINED, m.WELCOME),
        (AGENT, S.AWAITING_HELLO, m.HEARTBEAT),
        (ROUTER, S.JOINED, m.DRAIN),  # only an agent drains
        (ROUTER, S.JOINED, m.RESPONSE_CHUNK),  # answers come from the agent
        (AGENT, S.JOINED, m.REQUEST),  # requests from the router
        (AGENT, S.JOINED, "nonsense"),
    ],
)
def test_session_messages_out_of_order_are_protocol_errors(
    sender: Role, state: SessionState, kind: str
) -> None:
    with pytest.raises(ProtocolError, match=f"can't handle {kind} from the {sender.value}"):
        next_session_state(sender, state, kind)


def test_the_tables_name_only_known_messages_and_states() -> None:
    for sender, by_state in SESSION_TRANSITIONS.items():
        for state, moves in by_state.items():
            assert isinstance(state, SessionState)
            assert set(moves) <= set(ALL_KINDS), (sender, state)
            assert all(isinstance(n, SessionState) for n in moves.values())
    for sender, by_state in REQUEST_TRANSITIONS.items():
        for state, moves in by_state.items():
            assert set(moves) <= PER_REQUEST[sender] | {SESSION_END}, (sender, state)
            assert all(isinstance(n, RequestState) for n in moves.values())
    # The router's requests are the only way into a request: no state takes one.
    assert all(m.REQUEST not in moves for moves in REQUEST_TRANSITIONS[ROUTER].values())
