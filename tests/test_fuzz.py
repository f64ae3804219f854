"""Property-based fuzzing of everything that parses untrusted input.

The frame decoder, every link message type and the router's handling of them (the
hello above all), agent tokens, policy files and the HTTP API are each fed random and
near-valid input. The property is always the same: a result, or the module's own clear
error (ProtocolError, TokenError, ValueError naming a field, PolicyError, an HTTP error
with a JSON body), never another exception and never a hang.

Every test fixes `max_examples` (21,100 generated examples in all, plus the fixed
hostile cases) and runs without a per-example deadline, so the module stays bounded in
time (about 50 CPU seconds) on a loaded CI machine. The frame tests feed each example
several ways (whole, byte by byte, random cuts, three size limits): about 80,000
decoder runs. HIVENET_FUZZ_SCALE multiplies every count for a longer hunt.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import math
import os
import random
import struct
import time
from collections.abc import Callable
from typing import Any

import msgpack
import pytest
import trio
import trio.testing
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protocol import messages as m
from protocol.conversation import RequestState
from protocol.frames import HEADER, FrameDecoder, FrameError, encode_frame
from protocol.messages import ProtocolError, validate
from protocol.p2p import SessionClosed
from protocol.tokens import TokenError, issue_token, verify_token
from router.capacity import WaitQueue, try_acquire
from router.dispatch import Dispatcher
from router.http.app import RouterApp
from router.http.auth import AdminKeys
from router.http.client import ClientApi, ClientSettings
from router.http.server import HttpServer
from router.link import AgentLink, AgentResponse, AgentSession, LinkSettings, parse_metadata
from router.metrics import RouterMetrics
from router.peers import AgentMetadata, Peer, PeerTable
from router.policy.gates import evaluate
from router.policy.rank import STRATEGIES
from router.policy.schema import Policy, PolicyError, load_policy
from router.policy.store import PolicyStore
from router.session import RoutingSession, Slot
from router.tenants.keys import ClientKeys

SECRET = b"fuzz-secret-0123456789-abcdefghijklmnop"
PEER = "12D3KooWFuzzAgent"
ADMIN_KEY = "fuzz-admin-key"
# HIVENET_FUZZ_SCALE=10 runs ten times the examples (a longer local hunt).
SCALE = float(os.environ.get("HIVENET_FUZZ_SCALE", "1"))


def fuzz(examples: int) -> settings:
    return settings(
        max_examples=max(1, int(examples * SCALE)),
        deadline=None,
        suppress_health_check=list(HealthCheck),
    )


# --- value strategies -------------------------------------------------------------

INT64 = st.integers(-(2**63), 2**64 - 1)
scalars = st.one_of(
    st.none(),
    st.booleans(),
    INT64,
    st.floats(allow_nan=False),
    st.text(max_size=12),
    st.binary(max_size=12),
)
# Anything msgpack can carry (str keys, as the decoder's strict_map_key demands); kept
# small, because generating values is most of what these tests spend.
packable = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=5,
)
# Anything a Python caller could hand over, packable or not.
anything = st.recursive(
    scalars | st.integers() | st.floats() | st.tuples(st.integers()),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(scalars, inner, max_size=3),
    max_leaves=5,
)

TYPES = (
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
FIELDS = (
    "id",
    "token",
    "metadata",
    "heartbeat_interval",
    "reason",
    "ts",
    "method",
    "path",
    "headers",
    "body",
    "stream",
    "status",
    "data",
    "code",
    "message",
    "backend_healthy",
    "engine",
    "hardware",
    "router_peer_id",
    "version",
    "usage",
    "accepts",
)

ids = st.integers(0, 2**63 - 1)
headers = st.dictionaries(st.text(max_size=12), st.text(max_size=24), max_size=4)
numbers = st.integers(-(2**31), 2**31) | st.floats(allow_nan=False)
engine_values = st.dictionaries(
    st.sampled_from(
        (
            "kv_cache_utilization",
            "running_requests",
            "avg_ttft_seconds",
            "gpu_util_percent",
            "cpu_usage_percent",
            "age",
            "interval",
        )
    )
    | st.text(max_size=6),
    scalars | st.floats(),
    max_size=5,
)

# Heartbeats whose optional health and metric fields hold anything at all.
odd_heartbeats = st.builds(
    lambda ts, healthy, engine, hardware: {
        "type": m.HEARTBEAT,
        "ts": ts,
        "backend_healthy": healthy,
        "engine": engine,
        "hardware": hardware,
    },
    numbers,
    scalars,
    engine_values | packable,
    engine_values | packable,
)

# One well-formed message of each type, built with the constructors both daemons use.
valid_messages = st.one_of(
    st.builds(m.hello, st.text(max_size=60), st.dictionaries(st.text(max_size=8), packable)),
    st.builds(m.welcome, numbers, st.text(max_size=20)),
    st.builds(m.refusal, st.text(max_size=40)),
    st.builds(
        m.heartbeat,
        numbers,
        st.none() | st.booleans(),
        st.none() | engine_values,
        st.none() | engine_values,
    ),
    st.builds(
        m.request,
        ids,
        st.sampled_from(("GET", "POST")),
        st.text(max_size=30),
        headers,
        st.binary(max_size=200),
        st.booleans(),
    ),
    st.builds(m.response_head, ids, st.integers(100, 599), headers),
    st.builds(m.response_chunk, ids, st.binary(max_size=300)),
    st.builds(m.response_end, ids),
    st.builds(
        m.response,
        ids,
        st.integers(100, 599),
        headers,
        st.binary(max_size=300),
        st.none() | st.just({"prompt_tokens": 1, "completion_tokens": 2}),
    ),
    st.builds(m.error, ids, st.text(max_size=20), st.text(max_size=40), st.none() | INT64),
    st.builds(m.cancel, ids),
    st.builds(m.drain),
)


@st.composite
def mutated_messages(draw: st.DrawFn, values: st.SearchStrategy[Any] = packable) -> dict:
    """A valid message with fields removed, retyped or added, or a random map."""
    if draw(st.integers(0, 4)) == 0:
        msg = draw(st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=6), values))
        if draw(st.booleans()):
            msg["type"] = draw(st.sampled_from(TYPES) | values)
        return msg
    msg = dict(draw(valid_messages))
    for _ in range(draw(st.integers(0, 3))):
        action = draw(st.integers(0, 2))
        key = draw(st.sampled_from((*FIELDS, "type")))
        if action == 0:
            msg.pop(key, None)
        else:
            msg[key] = draw(values)
    return msg


# Required fields, restated independently of protocol.messages: (field, accepts).
def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: object) -> bool:
    return isinstance(v, int | float)


def _is_headers(v: object) -> bool:
    return isinstance(v, dict) and all(
        isinstance(key, str) and isinstance(value, str) for key, value in v.items()
    )


REQUIRED: dict[str, tuple[tuple[str, Callable[[object], bool]], ...]] = {
    m.HELLO: (("token", lambda v: isinstance(v, str)), ("metadata", lambda v: isinstance(v, dict))),
    m.WELCOME: (("heartbeat_interval", _is_num),),
    m.REFUSAL: (("reason", lambda v: isinstance(v, str)),),
    m.HEARTBEAT: (("ts", _is_num),),
    m.REQUEST: (
        ("id", _is_int),
        ("method", lambda v: isinstance(v, str)),
        ("path", lambda v: isinstance(v, str)),
        ("headers", _is_headers),
        ("body", lambda v: isinstance(v, bytes)),
        ("stream", lambda v: isinstance(v, bool)),
    ),
    m.RESPONSE_HEAD: (
        ("id", _is_int),
        ("status", _is_int),
        ("headers", _is_headers),
    ),
    m.RESPONSE_CHUNK: (("id", _is_int), ("data", lambda v: isinstance(v, bytes))),
    m.RESPONSE_END: (("id", _is_int),),
    m.RESPONSE: (
        ("id", _is_int),
        ("status", _is_int),
        ("headers", _is_headers),
        ("body", lambda v: isinstance(v, bytes)),
    ),
    m.ERROR: (
        ("id", _is_int),
        ("code", lambda v: isinstance(v, str)),
        ("message", lambda v: isinstance(v, str)),
    ),
    m.CANCEL: (("id", _is_int),),
    m.DRAIN: (),
}


OPTIONAL: dict[str, tuple[tuple[str, Callable[[object], bool]], ...]] = {
    m.HEARTBEAT: (
        ("backend_healthy", lambda v: isinstance(v, bool)),
        ("engine", lambda v: isinstance(v, dict)),
        ("hardware", lambda v: isinstance(v, dict)),
    ),
    m.WELCOME: (("liveness_interval", _is_num), ("accepts", lambda v: isinstance(v, list))),
    m.ERROR: (("status", _is_int),),
    m.RESPONSE_END: (("usage", lambda v: isinstance(v, dict)),),
    m.RESPONSE: (("usage", lambda v: isinstance(v, dict)),),
}


def well_formed(msg: dict) -> bool:
    kind = msg.get("type")
    if not isinstance(kind, str) or kind not in REQUIRED:
        return False
    return all(name in msg and ok(msg[name]) for name, ok in REQUIRED[kind]) and all(
        msg.get(name) is None or ok(msg[name]) for name, ok in OPTIONAL.get(kind, ())
    )


def same(a: object, b: object) -> bool:
    """Equal as msgpack sees them (NaN equals NaN)."""
    return msgpack.packb(a, use_bin_type=True) == msgpack.packb(b, use_bin_type=True)


def feed_in_pieces(decoder: FrameDecoder, data: bytes, cuts: list[int]) -> list[dict]:
    out: list[dict] = []
    start = 0
    for cut in [*sorted({c % (len(data) + 1) for c in cuts}), len(data)]:
        out += decoder.feed(data[start:cut])
        start = cut
    return out


def splits(data: bytes, seed: int, count: int = 6) -> list[list[int]]:
    """Ways to cut `data` into pieces: whole, byte by byte (short data), and random."""
    rng = random.Random(seed)
    ways: list[list[int]] = [[]]
    if len(data) <= 64:
        ways.append(list(range(len(data))))
    for _ in range(count):
        ways.append([rng.randrange(len(data) + 1) for _ in range(rng.randrange(1, 12))])
    return ways


# --- frames -----------------------------------------------------------------------
# Each example is fed in several ways (whole, byte by byte, random cuts), so the case
# count of these tests is a multiple of their examples.


@fuzz(4000)
@given(st.binary(max_size=3000), st.integers(0, 2**32))
def test_decoder_on_random_bytes_only_raises_frame_errors(data: bytes, seed: int) -> None:
    for limit in (64, 1024, 16 * 1024 * 1024):
        for cuts in splits(data, seed, 2):
            decoder = FrameDecoder(limit)
            try:
                messages = feed_in_pieces(decoder, data, cuts)
            except ProtocolError:
                continue
            assert all(well_formed(msg) for msg in messages)
            assert decoder.buffered <= len(data)


@fuzz(4000)
@given(st.binary(max_size=2000), st.integers(0, 2**32))
def test_decoder_on_random_payloads_with_correct_lengths(payload: bytes, seed: int) -> None:
    """Right length, random msgpack: the payload decoder itself is exercised."""
    data = HEADER.pack(len(payload)) + payload
    outcomes = set()
    for cuts in splits(data, seed, 3):
        decoder = FrameDecoder()
        try:
            messages = feed_in_pieces(decoder, data, cuts)
        except ProtocolError as exc:
            outcomes.add(str(exc))
            continue
        assert len(messages) == 1 and well_formed(messages[0])
        assert decoder.buffered == 0
        outcomes.add("ok")
    assert len(outcomes) == 1, outcomes  # however it arrives, the same verdict


@fuzz(1000)
@given(st.lists(valid_messages, min_size=1, max_size=8), st.integers(0, 2**32))
def test_valid_frames_survive_any_split(messages: list[dict], seed: int) -> None:
    data = b"".join(encode_frame(msg) for msg in messages)
    for cuts in splits(data, seed):
        decoder = FrameDecoder()
        assert same(feed_in_pieces(decoder, data, cuts), messages)
        assert decoder.buffered == 0


@fuzz(800)
@given(
    st.lists(valid_messages, min_size=1, max_size=6),
    st.lists(
        st.integers(0, 2**32 - 1)
        | st.integers(0, 300)
        | st.sampled_from((0, 1, 2**31, 16 * 1024 * 1024, 16 * 1024 * 1024 + 1)),
        min_size=1,
        max_size=4,
    ),
    st.integers(0, 2**32),
)
def test_corrupted_lengths_end_in_frame_errors_or_wait(
    messages: list[dict], lengths: list[int], seed: int
) -> None:
    rng = random.Random(seed)
    for length in lengths:
        frames = [bytearray(encode_frame(msg)) for msg in messages]
        index = rng.randrange(len(frames))
        frames[index][:4] = struct.pack(">I", length)
        stream = b"".join(frames)
        for cuts in splits(stream, seed, 2):
            decoder = FrameDecoder()
            started = time.monotonic()
            try:
                out = feed_in_pieces(decoder, stream, cuts)
            except ProtocolError as exc:
                assert str(exc)
                continue
            finally:
                assert time.monotonic() - started < 5
            # Frames before the corrupted one decode unchanged; what follows is a whole
            # message or bytes kept for a frame not yet complete.
            assert same(out[:index], messages[:index])
            assert all(well_formed(msg) for msg in out)
            assert decoder.buffered <= len(stream)


def test_decoder_limits_and_nesting() -> None:
    decoder = FrameDecoder(100)
    with pytest.raises(FrameError, match="oversized"):
        decoder.feed(struct.pack(">I", 101))
    # Deeply nested msgpack: the C decoder's own depth limit, reported as a FrameError.
    nested = b"\x91" * 100_000 + b"\xc0"
    with pytest.raises(FrameError):
        FrameDecoder().feed(HEADER.pack(len(nested)) + nested)
    # A huge declared array in a tiny payload is refused without allocating it.
    bogus = b"\xdd\xff\xff\xff\xff"
    with pytest.raises(FrameError):
        FrameDecoder().feed(HEADER.pack(len(bogus)) + bogus)
    with pytest.raises(FrameError):
        encode_frame({"type": "request", "body": b"x" * (16 * 1024 * 1024 + 1)})


# --- messages ---------------------------------------------------------------------


@fuzz(3000)
@given(mutated_messages() | mutated_messages(anything) | anything)
def test_every_message_type_validates_or_says_why(msg: Any) -> None:
    """validate() agrees with the field table restated above; a frame carrying the
    same map decodes to it exactly when it is valid."""
    try:
        validate(msg)
        valid = True
    except ProtocolError as exc:
        assert str(exc)
        valid = False
    assert valid == (isinstance(msg, dict) and well_formed(msg))
    try:
        frame = encode_frame(msg)
    except (TypeError, ValueError, OverflowError):
        return  # not representable in msgpack: no peer could send it
    try:
        [out] = FrameDecoder().feed(frame)
    except ProtocolError as exc:
        # A valid map may still use keys msgpack frames refuse (numbers, say).
        assert not valid or str(exc).startswith("malformed frame"), exc
        return
    # What arrives is checked as it arrives: a tuple msgpack sends as an array is a list
    # there, so a map invalid only for a tuple where a list belongs decodes as valid.
    assert same(out, msg) and well_formed(out)


# --- the router's side of a session: hello and every message after it -------------


class FakeStream:
    """The parts of FramedStream a router session uses, recording what it sends."""

    def __init__(self, on_send: Callable[[dict], None] | None = None) -> None:
        self.sent: list[dict] = []
        self.closed = trio.Event()
        self.close_reason = ""
        self.on_send = on_send

    def send_nowait(self, msg: dict) -> None:
        if self.closed.is_set():
            raise SessionClosed(self.close_reason)
        encode_frame(msg)  # whatever the router sends must be a valid frame
        validate(msg)
        self.sent.append(msg)
        if self.on_send is not None:
            self.on_send(msg)

    async def send(self, msg: dict) -> None:
        self.send_nowait(msg)

    def allow_frames(self, max_frame_bytes: int) -> None:
        pass

    def close(self, reason: str) -> None:
        self.close_reason = self.close_reason or reason
        self.closed.set()

    async def flush_and_close(self, reason: str) -> None:
        self.close(reason)


def new_link() -> AgentLink:
    settings_ = LinkSettings(
        secret=SECRET,
        heartbeat_interval=5.0,
        unhealthy_after=15.0,
        remove_after=30.0,
        router_peer_id="12D3KooWRouter",
    )
    return AgentLink(PeerTable(), RouterMetrics(), settings_)


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def signed(header: object, claims: object, secret: bytes = SECRET) -> str:
    """A JWT with any header and claims, HMAC-SHA256-signed with `secret` whatever the
    header says: what only a holder of the secret could present."""
    head = _b64(json.dumps(_jsonable(header, finite=False)).encode())
    body = _b64(json.dumps(_jsonable(claims, finite=False)).encode())
    mac = hmac.new(secret, f"{head}.{body}".encode(), hashlib.sha256).digest()
    return f"{head}.{body}.{_b64(mac)}"


tokens = st.one_of(
    st.just("valid"),
    st.text(max_size=80),
    st.text(alphabet="abcXYZ019-_.=", max_size=120),
    st.builds(
        lambda c, sub: issue_token(SECRET, sub, 60) if c else issue_token(b"x" * 40, PEER, 60),
        st.booleans(),
        st.sampled_from((PEER, "12D3KooWOther", "")),
    ),
    st.builds(
        signed,
        st.dictionaries(
            st.sampled_from(("alg", "typ", "kid", "crit", "b64", "x")), packable, max_size=3
        ),
        st.dictionaries(
            st.sampled_from(("sub", "exp", "nbf", "iat", "aud", "iss", "jti")),
            scalars | st.floats() | st.lists(scalars, max_size=2),
            max_size=5,
        )
        | packable,
    ),
)
metadata = st.one_of(
    st.fixed_dictionaries(
        {
            "model": st.just("m1") | packable,
            "capability": st.sampled_from(("llm", "embedding", "reranker", "LLM")) | packable,
            "capacity": st.integers(-2, 2**70) | packable,
        },
        optional={
            name: st.text(max_size=10) | packable
            for name in (
                "engine",
                "region",
                "organization",
                "machine",
                "gpu_model",
                "version",
                "tags",
            )
        },
    ),
    st.dictionaries(st.text(max_size=10), packable, max_size=6),
)


@fuzz(2000)
@given(metadata)
def test_hello_metadata_is_parsed_or_names_the_field(raw: dict) -> None:
    try:
        meta = parse_metadata(raw)
    except ValueError as exc:
        assert "metadata." in str(exc) or "capacity" in str(exc)
        return
    assert isinstance(meta, AgentMetadata)
    assert meta.capacity > 0 and meta.model and meta.capability in ("llm", "embedding", "reranker")


@fuzz(2000)
@given(tokens, st.sampled_from((PEER, "12D3KooWOther")))
def test_tokens_verify_or_say_why(token: str, peer: str) -> None:
    token = issue_token(SECRET, PEER, 60) if token == "valid" else token
    try:
        claims = verify_token(SECRET, token, peer)
    except TokenError as exc:
        assert str(exc)
        return
    assert claims["sub"] == peer


@fuzz(600)
@given(
    tokens,
    metadata,
    st.lists(mutated_messages() | valid_messages | odd_heartbeats, max_size=5),
)
def test_router_session_handles_any_hello_and_any_message_after(
    token: str, meta: dict, after: list[dict]
) -> None:
    """A session sees a hello, then anything validation lets through: each message is
    handled or ends the session with a ProtocolError, never another exception."""

    async def main() -> None:
        link = new_link()
        fs = FakeStream()
        session = AgentSession(link, fs, PEER)  # type: ignore[arg-type]
        hello = m.hello(issue_token(SECRET, PEER, 60) if token == "valid" else token, meta)
        for msg in [hello, *after]:
            try:
                validate(msg)
            except ProtocolError:
                break  # the decoder ends the session here
            try:
                session.on_message(msg)
            except ProtocolError:
                break
        if session.refused is not None:
            assert session.peer is None and fs.sent[0]["type"] == m.REFUSAL
            assert link.table.get(PEER) is None
        elif session.peer is not None:
            assert fs.sent[0]["type"] == m.WELCOME
            assert link.table.get(PEER) is session.peer
            assert session.peer.metadata.capacity > 0
        link._closed(session, "done")
        assert not session.pending

    trio.run(main)


# --- policies ---------------------------------------------------------------------

YAMLISH = st.lists(
    st.sampled_from(
        (
            "routing_policy",
            "fallback_chain",
            "fallback_provider",
            "strategy",
            "least-loaded",
            "round-robin",
            "match",
            "exclude_if",
            "max_tries",
            "name",
            "region",
            "tags",
            "engine",
            "openai",
            "model",
            "kv_cache_utilization",
            "success_rate",
            "gt",
            "lte",
            "0.5",
            "-1",
            "1e400",
            ".nan",
            "null",
            "~",
            "yes",
            "NO",
            ":",
            ": ",
            "- ",
            "-",
            " ",
            "  ",
            "\n",
            "\t",
            "{",
            "}",
            "[",
            "]",
            ",",
            "&a ",
            "*a",
            "&b ",
            "*b",
            "<<: ",
            "!!str ",
            "!!int ",
            "!!binary ",
            "!!python/object:os.system ",
            "!!set ",
            "? ",
            "|",
            ">",
            "'",
            '"',
            "#",
            "%YAML 1.1\n",
            "---\n",
            "...\n",
            "\\",
            "\x00",
            "\ufeff",
        )
    )
    | st.text(max_size=3),
    max_size=60,
).map("".join)

step_like = st.fixed_dictionaries(
    {},
    optional={
        "name": st.text(max_size=8) | packable,
        "strategy": st.sampled_from((*STRATEGIES, "round-robin", "")) | packable,
        "match": st.dictionaries(
            st.sampled_from(("region", "engine", "tags", "gpu_model", "bogus")),
            st.text(max_size=8) | st.lists(st.text(max_size=5), max_size=3) | packable,
            max_size=3,
        )
        | packable,
        "exclude_if": st.dictionaries(
            st.sampled_from(("kv_cache_utilization", "srtt", "success_rate", "gpu_util")),
            st.dictionaries(
                st.sampled_from(("gt", "gte", "lt", "lte", "eq")),
                st.floats() | st.integers() | packable,
                max_size=2,
            )
            | packable,
            max_size=3,
        )
        | packable,
        "max_tries": st.integers(-5, 2**70) | packable,
    },
)
policy_like = st.fixed_dictionaries(
    {"routing_policy": step_like | packable},
    optional={
        "fallback_chain": st.lists(step_like | packable, max_size=3) | packable,
        "fallback_provider": st.fixed_dictionaries(
            {},
            optional={
                "engine": st.sampled_from(("openai", "anthropic", "x")) | packable,
                "model": st.text(max_size=8) | packable,
            },
        )
        | packable,
        "extra": packable,
    },
)


def check_policy_text(text: str) -> None:
    started = time.monotonic()
    try:
        policy = load_policy(text)
    except PolicyError as exc:
        assert exc.errors and all(isinstance(e, str) and e for e in exc.errors)
        return
    finally:
        assert time.monotonic() - started < 5, "policy validation took too long"
    assert isinstance(policy, Policy)
    assert policy.source == text
    assert all(step.strategy in STRATEGIES for step in policy.steps)
    # A policy that loads must also evaluate: the compiled gates run on a small pool.
    pool = [
        Peer("12D3KooWa", AgentMetadata("m1", "llm", "vllm", 4, region="eu"), None, 0.0, 0.0),  # type: ignore[arg-type]
        Peer("12D3KooWb", AgentMetadata("m1", "llm", "sim", 1, tags=("x",)), None, 0.0, 0.0),  # type: ignore[arg-type]
    ]
    for step in policy.steps:
        result = evaluate(pool, step, "llm", set(), 1.0)
        assert result.best is not None or result.drain


@fuzz(2500)
@given(st.text(max_size=200) | YAMLISH)
def test_policy_text_loads_or_lists_errors(text: str) -> None:
    check_policy_text(text)


@fuzz(1200)
@given(policy_like | packable, st.booleans())
def test_policy_structures_load_or_list_errors(document: Any, flow: bool) -> None:
    try:
        text = yaml.safe_dump(document, default_flow_style=flow, allow_unicode=True)
    except yaml.YAMLError:
        return
    check_policy_text(text)


@pytest.mark.parametrize(
    "text",
    [
        "[" * 5000,
        "[" * 3000 + "]" * 3000,
        "{a: " * 3000 + "1" + "}" * 3000,
        "- " * 3000 + "x",
        "&a [*a]",
        "&a {routing_policy: *a}",
        "routing_policy: &a {strategy: least-loaded, match: *a}",
        # A "billion laughs": nine to the tenth leaves from a few hundred bytes.
        "a: &a [x,x,x,x,x,x,x,x,x]\n"
        + "".join(
            f"{n}: &{n} [{', '.join([f'*{p}'] * 9)}]\n"
            for p, n in zip("abcdefghi", "bcdefghij", strict=True)
        ),
        "routing_policy: {strategy: least-loaded, max_tries: 99999999999999999999999}",
        "routing_policy: {strategy: least-loaded, exclude_if: {srtt: {gt: .inf}}}",
        "routing_policy: !!set {a, b}",
        "routing_policy: {strategy: 2001-12-14}",
        "!!python/object/apply:os.system ['true']",
        # PyYAML's own constructors fail with plain exceptions on these.
        "!!int",
        "!!float x",
        "!!bool",
        "!!timestamp",
        "routing_policy: {max_tries: !!int 0x}",
        "routing_policy: {strategy: !!timestamp 2001-99-99}",
    ],
    ids=[
        "deep-flow",
        "deep-flow-closed",
        "deep-map",
        "deep-block",
        "recursive-list",
        "recursive-top",
        "recursive-match",
        "alias-bomb",
        "huge-int",
        "infinite-threshold",
        "set",
        "date",
        "python-tag",
        "empty-int",
        "bad-float",
        "empty-bool",
        "empty-timestamp",
        "bad-hex",
        "bad-date",
    ],
)
def test_hostile_policies_fail_fast_and_clearly(text: str) -> None:
    check_policy_text(text)


# --- the HTTP API, in process -----------------------------------------------------

PATHS = (
    "/v1/chat/completions",
    "/v1/messages",
    "/v1/embeddings",
    "/v1/rerank",
    "/v1/models",
    "/v1/models/m1",
    "/v1/models/%2e%2e",
    "/health",
    "/admin/health",
    "/admin/routing-table",
    "/admin/models",
    "/admin/models/m1",
    "/admin/policy",
    "/",
    "/v1/",
    "/admin/",
)
ENDPOINT_PROTOCOL = {"/v1/messages": "anthropic"}

# What the fake agent answers with, one step per element: ("head", status, headers),
# ("chunk", bytes), ("end",), ("error", code), ("gone",) or ("stall",).
head_step = st.tuples(
    st.just("head"),
    st.sampled_from((200, 200, 200, 201, 204, 400, 404, 413, 422, 429, 500, 502, 503))
    | st.integers(200, 599),
    st.dictionaries(
        st.sampled_from(("content-type", "content-length", "x-a", "Set-Cookie", "Date"))
        | st.text(max_size=6),
        st.text(max_size=12),
        max_size=3,
    )
    # Rarely, a map no agent should send: the router must end that session cleanly.
    | st.dictionaries(scalars, scalars, min_size=1, max_size=2),
)
chunk_step = st.tuples(
    st.just("chunk"),
    st.binary(max_size=50)
    | st.sampled_from(
        (
            b'{"error":{"message":"maximum context length exceeded"}}',
            b'data: {"x":1}\n\n',
            b"not json",
        )
    ),
)
end_step = st.one_of(
    st.tuples(st.just("end")),
    st.tuples(
        st.just("error"),
        st.sampled_from(("backend_unavailable", "backend_error", "invalid_parameter", "weird"))
        | st.text(max_size=8),
    ),
    st.tuples(st.just("gone")),
    st.tuples(st.just("stall")),
)
# Mostly the shape a real agent sends (a head, chunks, one ending), sometimes anything.
agent_script = st.one_of(
    st.tuples(head_step, st.lists(chunk_step, max_size=3), end_step).map(
        lambda t: [t[0], *t[1], t[2]]
    ),
    st.lists(head_step | chunk_step | end_step, max_size=6),
)


@st.composite
def http_requests(draw: st.DrawFn) -> dict:
    path = draw(st.sampled_from(PATHS) | st.text(max_size=20).map(lambda s: "/" + s))
    method = draw(
        st.sampled_from(("POST", "POST", "GET", "PUT", "DELETE", "OPTIONS")) | st.text(max_size=5)
    )
    body_kind = draw(st.integers(0, 4))
    if body_kind == 0:
        body = draw(st.binary(max_size=300))
    elif body_kind == 1:
        body = draw(YAMLISH).encode("utf-8", "surrogatepass")
    elif body_kind == 2:
        body = json.dumps(draw(packable.map(_jsonable))).encode()
    else:
        payload = draw(
            st.fixed_dictionaries(
                {"model": st.just("m1") | st.sampled_from(("m2", "")) | packable.map(_jsonable)},
                optional={
                    "stream": st.booleans() | packable.map(_jsonable),
                    "messages": st.just([{"role": "user", "content": "hi"}])
                    | packable.map(_jsonable),
                    "max_tokens": st.integers(-1, 5) | packable.map(_jsonable),
                    "input": st.text(max_size=10),
                },
            )
        )
        body = json.dumps(payload).encode()
    if draw(st.integers(0, 20)) == 0:
        body = b"[" * 50_000  # nested beyond the JSON parser's recursion limit
    if draw(st.integers(0, 30)) == 0:
        body = b" " * 5000  # over the fuzz app's body limit
    header_list: list[tuple[bytes, bytes]] = []
    for name in draw(
        st.lists(
            st.sampled_from(
                (
                    "content-type",
                    "content-length",
                    "authorization",
                    "x-api-key",
                    "x-request-id",
                    "accept",
                    "anthropic-version",
                )
            )
            | st.text(max_size=8),
            max_size=5,
        )
    ):
        value = draw(
            st.sampled_from(
                (
                    "application/json",
                    f"Bearer {ADMIN_KEY}",
                    "Bearer ck",
                    "ck",
                    "bearer ",
                    "12345678-1234-5678-1234-567812345678",
                    "99999999999999999999",
                    "-1",
                    "\u00b2",  # a digit to str.isdigit, not to int()
                    str(len(body)),
                )
            )
            | st.text(st.characters(max_codepoint=255), max_size=20)
        )
        header_list.append(
            (name.lower().encode("latin-1", "replace"), value.encode("latin-1", "replace"))
        )
    pieces = draw(st.integers(1, 3))
    return {
        "path": path,
        "method": method,
        "headers": header_list,
        "body": body,
        "pieces": pieces,
        "script": draw(st.lists(agent_script, min_size=1, max_size=2)),
        "disconnect_early": draw(st.integers(0, 15)) == 0,
    }


def _jsonable(value: Any, finite: bool = True) -> Any:
    """`value` with bytes as text (and, when `finite`, no NaN or infinity): JSON."""
    if isinstance(value, bytes):
        return value.decode("latin-1")
    if isinstance(value, list):
        return [_jsonable(v, finite) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v, finite) for k, v in value.items()}
    if finite and isinstance(value, float) and not math.isfinite(value):
        return 0.0
    return value


class ScriptedAgent:
    """One agent session on the router, answering each forward from a script."""

    def __init__(self, link: AgentLink, nursery: trio.Nursery, scripts: list[list[tuple]]) -> None:
        self.link = link
        self.nursery = nursery
        self.scripts = scripts
        self.forwards = 0
        self.fs = FakeStream(self._on_send)
        self.session = AgentSession(link, self.fs, PEER)  # type: ignore[arg-type]
        meta = {"model": "m1", "capability": "llm", "engine": "sim", "capacity": 2}
        self.session.on_message(m.hello(issue_token(SECRET, PEER, 60), meta))
        assert self.session.peer is not None
        self.session.on_message(m.heartbeat(time.time(), True, {}, {}))

    def _deliver(self, msg: dict) -> bool:
        """Hand `msg` to the session as the reader would; False when it ends it."""
        try:
            validate(msg)
        except ProtocolError:
            self.fs.close("protocol error")
            self.link._closed(self.session, "protocol error")
            return False
        self.session.on_message(msg)
        return True

    def _on_send(self, msg: dict) -> None:
        if msg["type"] == m.REQUEST:
            script = self.scripts[self.forwards % len(self.scripts)]
            self.forwards += 1
            self.nursery.start_soon(self._play, msg["id"], script)

    async def _play(self, req_id: int, script: list[tuple]) -> None:
        for step in script:
            await trio.sleep(0.01)
            if req_id not in self.session.pending:
                return  # cancelled or finished: the agent stops as it would on cancel
            kind = step[0]
            if kind == "head":
                delivered = self._deliver(m.response_head(req_id, step[1], step[2]))
            elif kind == "chunk":
                delivered = self._deliver(m.response_chunk(req_id, step[1]))
            elif kind == "end":
                delivered = self._deliver(m.response_end(req_id))
            elif kind == "error":
                delivered = self._deliver(m.error(req_id, step[1], "scripted failure"))
            if kind in ("head", "chunk", "end", "error"):
                if not delivered:
                    return
            elif kind == "gone":
                self.fs.close("agent killed")
                self.link._closed(self.session, "agent killed")
                return
            else:
                return  # stall: the deadline must end it


def build_app(client_keys: str = "") -> tuple[RouterApp, AgentLink, PeerTable, WaitQueue]:
    metrics = RouterMetrics()
    table = PeerTable()
    queue = WaitQueue(4)
    table.on_change(queue.notify)
    store = PolicyStore(metrics)
    link = AgentLink(table, metrics, new_link().settings)
    session = RoutingSession(
        table, queue, metrics, link.forward, 2, lambda peer: queue.notify(peer.metadata.model)
    )
    dispatcher = Dispatcher(table, session, store, metrics)
    client = ClientApi(
        dispatcher, table, metrics, ClientSettings(max_request_bytes=4096, request_timeout=5.0)
    )
    app = RouterApp(
        client,
        table,
        queue,
        store,
        metrics,
        AdminKeys([ADMIN_KEY], insecure=False),
        ClientKeys(client_keys),
    )
    return app, link, table, queue


def check_error_body(path: str, status: int, body: bytes) -> None:
    payload = json.loads(body)
    if path == "/admin/policy" and status == 400:
        # A refused write: upstream's flat `{"error": "<message>"}`, reasons beside it.
        assert isinstance(payload["error"], str) and payload["errors"], payload
        return
    if ENDPOINT_PROTOCOL.get(path) == "anthropic":
        assert payload["type"] == "error", payload
    error = payload["error"]
    assert isinstance(error["code"], str) and error["code"], payload
    assert isinstance(error["message"], str), payload
    assert error["type"] and error["source"] in ("router", "backend"), payload


def is_sse_error(protocol: str, tail: bytes) -> bool:
    if protocol == "anthropic":
        if not tail.startswith(b"event: error\ndata: "):
            return False
        tail = tail[len(b"event: error\n") :]
    if not tail.startswith(b"data: ") or not tail.endswith(b"\n\n"):
        return False
    payload = json.loads(tail[len(b"data: ") : -2])
    return isinstance(payload["error"]["code"], str)


async def call_app(app: RouterApp, req: dict) -> tuple[list[dict], bool]:
    """One request through the ASGI app; the messages sent and whether the response
    ended. The fake server reports a disconnect only after the response, unless the
    request says the client leaves early."""
    sent: list[dict] = []
    complete = trio.Event()
    body = req["body"]
    n = req["pieces"]
    size = -(-len(body) // n) if body else 0
    parts = [body[i * size : (i + 1) * size] for i in range(n)] if body else [b""]
    incoming = [
        {"type": "http.request", "body": p, "more_body": i < len(parts) - 1}
        for i, p in enumerate(parts)
    ]

    async def receive() -> dict:
        if incoming:
            return incoming.pop(0)
        if not req["disconnect_early"]:
            await complete.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        assert not complete.is_set(), "message after the end of the response"
        sent.append(message)
        if message["type"] == "http.response.body" and not message.get("more_body"):
            complete.set()

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": req["method"],
        "scheme": "http",
        "path": req["path"],
        "raw_path": req["path"].encode("utf-8", "surrogatepass"),
        "query_string": b"",
        "headers": req["headers"],
        "client": ("127.0.0.1", 5000),
        "server": ("127.0.0.1", 8080),
    }
    await app(scope, receive, send)
    return sent, complete.is_set()


def check_response(req: dict, sent: list[dict], complete: bool) -> None:
    if not sent:
        assert req["disconnect_early"], "no response at all"
        return
    start, *bodies = sent
    assert start["type"] == "http.response.start"
    status = start["status"]
    assert isinstance(status, int) and 200 <= status <= 599
    assert status != 500, "internal router error: an exception reached the app"
    for key, value in start["headers"]:
        assert isinstance(key, bytes) and isinstance(value, bytes)
    assert bodies and all(b["type"] == "http.response.body" for b in bodies)
    if not complete:
        assert req["disconnect_early"], "response never ended"
        return
    content = b"".join(b.get("body", b"") for b in bodies)
    head = dict(start["headers"])
    if status >= 400:
        check_error_body(req["path"], status, content)
    elif b"content-length" in head:
        assert int(head[b"content-length"]) == len(content)


@fuzz(500)
@given(st.lists(http_requests(), min_size=1, max_size=4), st.sampled_from(("", "ck:acme")))
def test_http_api_always_answers_a_well_formed_response(
    requests: list[dict], client_keys: str
) -> None:
    """Up to four requests at once against one app with one scripted agent (capacity 2,
    queue depth 4): each gets a well-formed answer, and nothing is left held after."""

    async def main() -> None:
        app, link, table, queue = build_app(client_keys)
        results: dict[int, tuple[list[dict], bool]] = {}

        async def one(i: int, req: dict) -> None:
            results[i] = await call_app(app, req)

        async with trio.open_nursery() as nursery:
            scripts = [script for req in requests for script in req["script"]]
            agent = ScriptedAgent(link, nursery, scripts)
            async with trio.open_nursery() as clients:
                for i, req in enumerate(requests):
                    clients.start_soon(one, i, req)
            nursery.cancel_scope.cancel()
        # No slot, queue place or pending request outlives the requests.
        assert all(p.active == 0 for p in table.all()), "slot leaked"
        assert queue.lengths() == {}
        assert not agent.session.pending
        assert app.inflight == 0
        for i, req in enumerate(requests):
            check_response(req, *results[i])

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def hostile(path: str, body: bytes, *headers: tuple[str, str], method: str = "POST") -> dict:
    return {
        "path": path,
        "method": method,
        "headers": [(k.encode("latin-1"), v.encode("latin-1")) for k, v in headers],
        "body": body,
        "pieces": 1,
        "disconnect_early": False,
    }


CHAT = "/v1/chat/completions"
OK_BODY = json.dumps({"model": "m1", "messages": [{"role": "user", "content": "hi"}]}).encode()
ADMIN = ("authorization", f"Bearer {ADMIN_KEY}")


@pytest.mark.parametrize(
    "req",
    [
        hostile(CHAT, b"[" * 3000),
        hostile("/v1/messages", b'{"model": ' * 1000),
        hostile(CHAT, b"{" * 2000 + b"}" * 2000),
        hostile(CHAT, OK_BODY, ("content-length", "\u00b2")),
        hostile(CHAT, OK_BODY, ("content-length", "\u00b9\u00b2\u00b3")),
        hostile(CHAT, OK_BODY, ("content-length", "9" * 400)),
        hostile(CHAT, OK_BODY, ("content-length", "-5")),
        hostile(CHAT, b"\xff\xfe\x00"),
        hostile(CHAT, b'"\\ud800"'),
        hostile(CHAT, b'{"model": "\\ud800"}'),
        hostile(CHAT, b'{"model": "m1", "stream": "yes"}'),
        hostile(CHAT, b"NaN"),
        hostile(CHAT, b'{"model": 1e999}'),
        hostile("/v1/models/%00", b"", method="GET"),
        hostile("/v1/models/\u00ff\u0100", b"", method="GET"),
        hostile("/admin/policy", b"[" * 3000, ADMIN, method="PUT"),
        hostile("/admin/policy", b"!!int", ADMIN, method="PUT"),
        hostile("/admin/policy", b"\xff\xfe", ADMIN, method="PUT"),
        hostile(CHAT, OK_BODY, ("authorization", "Bearer \u00ff")),
        hostile(CHAT, OK_BODY, ("x-request-id", "\u00ff" * 100)),
    ],
    ids=[
        "deep-json-list",
        "deep-json-open",
        "deep-json-object",
        "content-length-superscript",
        "content-length-superscripts",
        "content-length-huge",
        "content-length-negative",
        "binary-body",
        "lone-surrogate-string",
        "lone-surrogate-model",
        "stream-not-bool",
        "nan-body",
        "infinite-model",
        "nul-model-path",
        "latin1-model-path",
        "deep-policy",
        "policy-empty-int",
        "policy-not-utf8",
        "latin1-api-key",
        "latin1-request-id",
    ],
)
def test_hostile_http_requests_get_clear_answers(req: dict) -> None:
    async def main() -> None:
        app, link, table, _ = build_app()
        async with trio.open_nursery() as nursery:
            ScriptedAgent(link, nursery, [[("head", 200, {}), ("chunk", b"{}"), ("end",)]])
            sent, complete = await call_app(app, req)
            nursery.cancel_scope.cancel()
        assert complete and all(p.active == 0 for p in table.all())
        check_response(req, sent, complete)

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


@pytest.mark.parametrize("whole", [True, False], ids=["body-ready", "body-late"])
def test_a_body_that_stops_arriving_ends_at_the_request_timeout(whole: bool) -> None:
    """Through the real HTTP server: a body all in its first read is served with no
    deadline of its own (BODY_READY), one that stops part way gets request_timeout
    once the request's 5 s are up, and the agent is never asked."""
    body = json.dumps({"model": "m1", "messages": [{"role": "user", "content": "hi"}]})
    head = (
        "POST /v1/chat/completions HTTP/1.1\r\nHost: r\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    sent = head + body.encode() if whole else head + body.encode()[:10]

    async def main() -> None:
        app, link, table, _ = build_app()
        client, server_side = trio.testing.memory_stream_pair()
        async with trio.open_nursery() as nursery:
            agent = ScriptedAgent(link, nursery, [[("head", 200, {}), ("chunk", b"{}"), ("end",)]])
            nursery.start_soon(HttpServer(app).run_connection, server_side)
            began = trio.current_time()
            await client.send_all(sent)
            answer = b""
            with trio.fail_after(60):  # a body read with no deadline would wait forever
                while b"\r\n\r\n" not in answer or not answer.endswith((b"}", b"}\n")):
                    answer += await client.receive_some(65536)
            took = trio.current_time() - began
            await client.aclose()
            nursery.cancel_scope.cancel()
        status = int(answer.split(b" ", 2)[1])
        if whole:
            assert status == 200, answer
            assert took < 5.0
        else:
            assert status == 504, answer
            assert b'"request_timeout"' in answer
            assert took >= 5.0
            assert not agent.forwards
        assert all(p.active == 0 for p in table.all())

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


@fuzz(500)
@given(
    st.sampled_from(("/v1/chat/completions", "/v1/messages")),
    st.booleans(),
    st.lists(st.binary(min_size=1, max_size=40), max_size=5),
    st.sampled_from(("end", "error", "gone", "stall")),
)
def test_relayed_answers_end_with_the_answer_or_an_error(
    path: str, stream: bool, chunks: list[bytes], ending: str
) -> None:
    """A 200 from the agent is relayed; if it breaks off, the client is told so."""
    script = [("head", 200, {"content-type": "text/event-stream"})]
    script += [("chunk", c) for c in chunks]
    script.append((ending, "backend_error") if ending == "error" else (ending,))
    payload = {"model": "m1", "stream": stream, "max_tokens": 5, "messages": []}

    async def main() -> None:
        app, link, table, _ = build_app("")
        sent: list[dict] = []
        complete = trio.Event()
        incoming = [{"type": "http.request", "body": json.dumps(payload).encode()}]

        async def receive() -> dict:
            if incoming:
                return incoming.pop(0)
            await complete.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict) -> None:
            sent.append(message)
            if message["type"] == "http.response.body" and not message.get("more_body"):
                complete.set()

        scope = {"type": "http", "method": "POST", "path": path, "headers": []}
        async with trio.open_nursery() as nursery:
            ScriptedAgent(link, nursery, [script])
            await app(scope, receive, send)
            nursery.cancel_scope.cancel()
        assert complete.is_set()
        assert all(p.active == 0 for p in table.all())
        status = sent[0]["status"]
        content = b"".join(b.get("body", b"") for b in sent[1:])
        protocol = ENDPOINT_PROTOCOL.get(path, "openai")
        answer = b"".join(chunks)
        if ending == "end":
            assert (status, content) == (200, answer)
        elif stream:
            # The head went out at once: the answer so far, then an error event.
            assert status == 200 and content.startswith(answer)
            assert is_sse_error(protocol, content[len(answer) :]), content
        else:
            assert status in (502, 503, 504)
            check_error_body(path, status, content)

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


@pytest.mark.parametrize("first", [("chunk", b"{}"), ("end",)])
def test_answer_frames_before_the_head_cost_the_try_not_the_request(first: tuple) -> None:
    """An agent that sends a chunk or the end before its response head is out of step
    with the protocol: that try fails as backend_error (502 here, one agent), never 500."""
    payload = {"model": "m1", "max_tokens": 5, "messages": []}
    req = {
        "path": "/v1/chat/completions",
        "method": "POST",
        "headers": [(b"content-type", b"application/json")],
        "body": json.dumps(payload).encode(),
        "pieces": 1,
        "disconnect_early": False,
    }

    async def main() -> None:
        app, link, table, _ = build_app("")
        async with trio.open_nursery() as nursery:
            agent = ScriptedAgent(link, nursery, [[first]])
            sent, complete = await call_app(app, req)
            nursery.cancel_scope.cancel()
        assert complete and sent[0]["status"] == 502
        content = b"".join(b.get("body", b"") for b in sent[1:])
        assert json.loads(content)["error"]["code"] == "backend_error"
        assert all(p.active == 0 for p in table.all())
        assert not agent.session.pending

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_an_end_that_arrived_before_the_client_left_still_brings_its_usage() -> None:
    """An SDK leaves at `[DONE]`; the agent's end (with the engine's usage) may already
    be queued behind it, unread by the relay: closing the answer takes it, and sends
    no cancel for an answer that is complete."""

    async def main() -> None:
        _, link, _, _ = build_app("")
        async with trio.open_nursery() as nursery:
            agent = ScriptedAgent(link, nursery, [[]])
            session, peer = agent.session, agent.session.peer
            assert peer is not None and try_acquire(peer)
            req_id, pending = session.open()
            pending.state = RequestState.BODY  # its head was taken by the forward
            response = AgentResponse(session, req_id, pending, 200, {}, Slot(peer, lambda p: None))
            usage = {"prompt_tokens": 3, "completion_tokens": 4}
            session.on_message(m.response_chunk(req_id, b"data: [DONE]\n\n"))
            session.on_message(m.response_end(req_id, usage))
            response.close()
            nursery.cancel_scope.cancel()
        assert response.usage == usage
        assert peer.active == 0 and not session.pending
        assert not [f for f in agent.fs.sent if f["type"] == m.CANCEL]

    trio.run(main)
