"""Messages of the agent link and their validation.

Every message is a msgpack map with a `type`; per-request messages carry an integer
`id` chosen by the router. Validation checks the fields each type needs, so a daemon
never acts on a half-formed message.
"""

from __future__ import annotations

PROTOCOL_ID = "/hivenet/agent/1.0.0"
VERSION = "0.1.0"

HELLO = "hello"
WELCOME = "welcome"
REFUSAL = "refusal"
HEARTBEAT = "heartbeat"
REQUEST = "request"
RESPONSE_HEAD = "response_head"
RESPONSE_CHUNK = "response_chunk"
RESPONSE_END = "response_end"
# A whole answer (head, body and end) in one message, sent only to a router whose
# welcome `accepts` it: per answer the router decodes, checks and queues one frame
# instead of three.
RESPONSE = "response"
ERROR = "error"
CANCEL = "cancel"
DRAIN = "drain"


# A refusal's reason, as sent and as either side logs it, is cut to this many
# characters: it may quote the peer's own text (a token's header, a model's name).
MAX_REFUSAL = 300


class ProtocolError(Exception):
    """A message that breaks the link protocol."""


_NUM = (int, float)
_OPT_DICT = (dict, type(None))

# type -> ((field, accepted types), ...)
_REQUIRED: dict[str, tuple[tuple[str, type | tuple[type, ...]], ...]] = {
    HELLO: (("token", str), ("metadata", dict)),
    WELCOME: (("heartbeat_interval", _NUM),),
    REFUSAL: (("reason", str),),
    HEARTBEAT: (("ts", _NUM),),
    REQUEST: (
        ("id", int),
        ("method", str),
        ("path", str),
        ("headers", dict),
        ("body", bytes),
        ("stream", bool),
    ),
    RESPONSE_HEAD: (("id", int), ("status", int), ("headers", dict)),
    RESPONSE_CHUNK: (("id", int), ("data", bytes)),
    RESPONSE_END: (("id", int),),
    RESPONSE: (("id", int), ("status", int), ("headers", dict), ("body", bytes)),
    ERROR: (("id", int), ("code", str), ("message", str)),
    CANCEL: (("id", int),),
    DRAIN: (),
}

# Fields a type may carry: when present and not null, of these types.
_OPTIONAL: dict[str, tuple[tuple[str, type | tuple[type, ...]], ...]] = {
    HEARTBEAT: (
        ("backend_healthy", bool),
        ("engine", dict),
        ("hardware", dict),
        ("elsewhere", int),
    ),
    WELCOME: (
        ("liveness_interval", _NUM),
        ("proof", str),
        ("workers", list),
        ("accepts", list),
    ),
    # protocol/router_proof.py: the agent's challenge and the router's answer.
    HELLO: (("challenge", str),),
    ERROR: (("status", int), ("elsewhere", int)),
    REQUEST: (("report_usage", bool), ("traceparent", str), ("stream_tokens", bool)),
    RESPONSE_END: (("usage", dict), ("elsewhere", int)),
    RESPONSE: (("usage", dict), ("elsewhere", int)),
}

# `elsewhere` (heartbeat, response_end, response, error): how many requests from
# other routers the agent holds right now, so each router counts the agent's whole load
# against its `--capacity`. `workers` (welcome): the other router processes of the same
# host (`--workers`), as {"tcp_port": int, "peer_id": str}, which the agent dials too.
# `accepts` (welcome): the message types beyond the base set the router takes from
# the agent (`response`); an agent sends only the base set to a router that names none.

# Messages with a `headers` map, each checked to map strings to strings.
_HEADED = frozenset({REQUEST, RESPONSE_HEAD, RESPONSE})


def validate(message: object) -> None:
    if not isinstance(message, dict):
        raise ProtocolError(f"message is {type(message).__name__}, not a map")
    kind = message.get("type")
    fields = _REQUIRED.get(kind) if isinstance(kind, str) else None
    if fields is None:
        raise ProtocolError(f"unknown message type {kind!r}")
    for name, types in fields:
        value = message.get(name)
        if not isinstance(value, types) or (types is int and isinstance(value, bool)):
            raise ProtocolError(f"{kind}: field {name!r} missing or of the wrong type")
    for name, types in _OPTIONAL.get(kind, ()):
        value = message.get(name)
        if value is not None and (
            not isinstance(value, types) or (types is int and isinstance(value, bool))
        ):
            raise ProtocolError(f"{kind}: field {name!r} of the wrong type")
    if kind in _HEADED:
        for key, value in message["headers"].items():
            if not isinstance(key, str) or not isinstance(value, str):
                raise ProtocolError(f"{kind}: headers must map strings to strings")


def hello(token: str, metadata: dict, challenge: str | None = None) -> dict:
    msg = {"type": HELLO, "token": token, "metadata": metadata}
    if challenge is not None:
        msg["challenge"] = challenge
    return msg


def welcome(
    heartbeat_interval: float,
    router_peer_id: str,
    liveness_interval: float,
    workers: list[dict] | None = None,
    accepts: tuple[str, ...] = (),
) -> dict:
    """`heartbeat_interval` is the period the router expects of the agent;
    `liveness_interval` the longest the router stays silent on an idle session;
    `workers` the host's other router processes; `accepts` the message types beyond
    the base set that the router takes."""
    msg: dict = {
        "type": WELCOME,
        "heartbeat_interval": heartbeat_interval,
        "liveness_interval": liveness_interval,
        "router_peer_id": router_peer_id,
        "version": VERSION,
    }
    if workers:
        msg["workers"] = workers
    if accepts:
        msg["accepts"] = list(accepts)
    return msg


def refusal(reason: str) -> dict:
    return {"type": REFUSAL, "reason": reason}


def heartbeat(
    ts: float,
    backend_healthy: bool | None = None,
    engine: dict | None = None,
    hardware: dict | None = None,
) -> dict:
    msg: dict = {"type": HEARTBEAT, "ts": ts}
    if backend_healthy is not None:
        msg["backend_healthy"] = backend_healthy
        msg["engine"] = engine or {}
        msg["hardware"] = hardware or {}
    return msg


def request(
    req_id: int,
    method: str,
    path: str,
    headers: dict,
    body: bytes,
    stream: bool,
    report_usage: bool = False,
    traceparent: str | None = None,
    stream_tokens: bool = False,
) -> dict:
    msg = {
        "type": REQUEST,
        "id": req_id,
        "method": method,
        "path": path,
        "headers": headers,
        "body": body,
        "stream": stream,
    }
    if report_usage:
        # The router counts tokens for quotas or its audit log: send them back on
        # response_end (`usage`: prompt_tokens, completion_tokens).
        msg["report_usage"] = True
    if traceparent is not None:
        # W3C trace context of the router's try, for the agent's span and the engine.
        msg["traceparent"] = traceparent
    if stream_tokens:
        # The router may continue this stream elsewhere if it breaks: have the engine
        # put its running token count in every event, where the engine can, so the
        # router knows in tokens what the client was sent (router/continuation.py).
        msg["stream_tokens"] = True
    return msg


def response_head(req_id: int, status: int, headers: dict) -> dict:
    return {"type": RESPONSE_HEAD, "id": req_id, "status": status, "headers": headers}


def response_chunk(req_id: int, data: bytes) -> dict:
    return {"type": RESPONSE_CHUNK, "id": req_id, "data": data}


def response_end(req_id: int, usage: dict | None = None) -> dict:
    if usage is None:
        return {"type": RESPONSE_END, "id": req_id}
    return {"type": RESPONSE_END, "id": req_id, "usage": usage}


def response(req_id: int, status: int, headers: dict, body: bytes, usage: dict | None) -> dict:
    msg = {"type": RESPONSE, "id": req_id, "status": status, "headers": headers, "body": body}
    if usage is not None:
        msg["usage"] = usage
    return msg


def error(
    req_id: int,
    code: str,
    message: str,
    status: int | None = None,
    elsewhere: int | None = None,
) -> dict:
    msg: dict = {"type": ERROR, "id": req_id, "code": code, "message": message}
    if status is not None:
        msg["status"] = status
    if elsewhere is not None:
        msg["elsewhere"] = elsewhere
    return msg


def cancel(req_id: int) -> dict:
    return {"type": CANCEL, "id": req_id}


def drain() -> dict:
    return {"type": DRAIN}
