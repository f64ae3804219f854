"""Where the branches merged on one day meet: the console's recent-requests ring on
requests that are cancelled or share an ID, `POST /admin/explain` with hostile fields
and an engine's missing route, forwarding headers from a trusted proxy, and the
console's paths and query parameters. Driven through the router's ASGI app with the
console attached, as router/http/console_setup.py attaches it."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest
import trio

from protocol.errors import ErrorCode, RouterError
from router.explain import Explainer, ExplainRequest
from router.http.app import RouterApp
from router.http.client_ip import TrustedProxies
from router.http.console import Console
from router.policy.rank import Ranking
from router.recent import RecentRequests
from router.session import Served
from router.state_url import parse_sentinel_url
from tests.test_fuzz import ADMIN_KEY, build_app
from tests.test_session import ANY, MODEL, Harness, fail, make_peer, policy, request

CHAT = "/v1/chat/completions"
RESPONSES = "/v1/responses"
NOT_SERVED = ErrorCode.ENDPOINT_NOT_SUPPORTED


def with_console() -> tuple[RouterApp, RecentRequests]:
    app, _link, table, queue = build_app()
    explainer = Explainer(
        table, queue, Ranking(), app.store.for_model, lambda *_: None, trio.current_time
    )
    recent = RecentRequests()
    app.console = Console(explainer, recent, app.store, app.client_keys)
    return app, recent


def scope_of(method: str, path: str, headers: list[tuple[bytes, bytes]]) -> dict:
    return {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "headers": headers,
        "client": ("127.0.0.1", 5000),
        "server": ("127.0.0.1", 8080),
    }


async def stalled_request(app: RouterApp, rid: str, seconds: float) -> None:
    """A chat request whose body never arrives, cut after `seconds` the way the HTTP
    server cuts one (the answer deadline, a drain's end): its cancel scope."""
    headers = [(b"content-type", b"application/json"), (b"x-request-id", rid.encode())]

    async def receive() -> dict:
        await trio.sleep_forever()
        raise AssertionError

    async def send(message: dict) -> None:
        pass

    with trio.move_on_after(seconds):
        await app(scope_of("POST", CHAT, headers), receive, send)


async def test_a_cancelled_request_leaves_nothing_open_in_the_ring() -> None:
    app, recent = with_console()
    rid = "6f1c2d3e-4b5a-4c6d-8e7f-0a1b2c3d4e5f"
    await stalled_request(app, rid, 0.05)
    # The ring's open requests are capped (MAX_OPEN): each one a cut request left
    # there would be lost for good, and past the cap no request gets a story.
    assert not recent._open, recent
    listed = recent.list({}, 10)
    assert [r["id"] for r in listed] == [rid]
    assert listed[0]["status"] == 499


async def test_two_requests_with_one_id_each_keep_their_entry() -> None:
    """A client-chosen X-Request-ID may run twice at once (idempotent retries join the
    first): the first to end must not take the other's open entry with it."""
    recent = RecentRequests()
    first = recent.begin("r", CHAT)
    second = recent.begin("r", CHAT)
    recent.end(first)
    assert recent._open.get("r") is second
    recent.end(second)
    assert not recent._open


async def post_json(app: RouterApp, path: str, body: bytes) -> tuple[int, dict]:
    sent: list[dict] = []
    incoming = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive() -> dict:
        if incoming:
            return incoming.pop(0)
        await trio.sleep_forever()
        raise AssertionError

    async def send(message: dict) -> None:
        sent.append(message)

    headers = [(b"authorization", f"Bearer {ADMIN_KEY}".encode())]
    await app(scope_of("POST", path, headers), receive, send)
    start, *bodies = sent
    return start["status"], json.loads(b"".join(b.get("body", b"") for b in bodies))


async def test_explain_refuses_fields_of_the_wrong_type_with_400() -> None:
    app, _ = with_console()
    for bad in (
        {"model": "m", "path": ["/v1/chat/completions"]},
        {"model": "m", "path": {"a": 1}},
        {"model": "m", "path": 7},
    ):
        status, body = await post_json(app, "/admin/explain", json.dumps(bad).encode())
        assert status == 400, (bad, body)
        assert body["error"]["code"] == "request_invalid", body
        assert "`path`" in body["error"]["message"]
    status, body = await post_json(app, "/admin/explain", b'{"model": "m"}')
    assert status == 200 and body["outcome"] != "routed", body


def test_a_forwarded_address_with_a_zone_is_not_believed() -> None:
    """An IPv6 zone (`fe80::1%…`) is free text to Python's parser: a client behind a
    trusted proxy would write what it likes into the audit line's `source_ip`."""
    proxies = TrustedProxies.parse("127.0.0.0/8")
    for hostile in (b'fe80::1%"><script>', b"fe80::1%a b", b"fe80::1%" + b"z" * 4000):
        scope = {"client": ("127.0.0.1", 1), "headers": [(b"x-forwarded-for", hostile)]}
        assert proxies.client_ip(scope) == "127.0.0.1"
        scope = {"client": ("127.0.0.1", 1), "headers": [(b"x-real-ip", hostile)]}
        assert proxies.client_ip(scope) == "127.0.0.1"
    scope = {"client": ("127.0.0.1", 1), "headers": [(b"x-forwarded-for", b"2001:db8::7")]}
    assert proxies.client_ip(scope) == "2001:db8::7"


async def test_explain_leaves_out_an_agent_known_to_lack_the_path(autojump_clock: Any) -> None:
    """Explain (issue 52) and the memory of an engine's missing route (issue 47) were
    written side by side: a real request skips an agent that lately answered
    `endpoint_not_supported` for its path, so explain must too, or it names an agent
    the request never goes to."""
    h = Harness(policy(ANY), [make_peer("A"), make_peer("B")], script={"A": [fail(NOT_SERVED)]})
    served = await h.dispatcher().dispatch(request(path=RESPONSES))
    assert isinstance(served, Served) and served.peer.peer_id == "B"
    served.response.close()
    explainer = Explainer(
        h.table, h.queue, h.session.ranking, h.store.for_model, lambda *_: None, trio.current_time
    )
    answer = explainer.explain(ExplainRequest(MODEL, path=RESPONSES), "llm", "t", 0)
    assert answer["chosen"] == "B", answer
    (step,) = answer["steps"]
    verdicts = {a["peer_id"]: a["excluded_by"] for a in step["agents"]}
    assert verdicts["A"] is not None and verdicts["A"].startswith("gate[5]"), verdicts
    assert verdicts["B"] is None
    # Another path still goes to A, as a real request does.
    chat = explainer.explain(ExplainRequest(MODEL), "llm", "t", 0)
    assert chat["chosen"] == "A", chat
    # A alone: the client would hear endpoint_not_supported, and explain says so.
    h.table.remove(h.table.get("B"))  # type: ignore[arg-type]
    with pytest.raises(RouterError) as refused:
        await h.dispatcher().dispatch(request(path=RESPONSES))
    assert refused.value.code is NOT_SERVED
    alone = explainer.explain(ExplainRequest(MODEL, path=RESPONSES), "llm", "t", 0)
    assert alone["outcome"] == "exhausted", alone
    assert alone["exhaustion"]["error"] == "endpoint_not_supported", alone


async def call(
    app: RouterApp, method: str, path: str, query: bytes = b"", accept: bytes = b""
) -> tuple[int, dict, bytes]:
    sent: list[dict] = []

    async def receive() -> dict:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict) -> None:
        sent.append(message)

    headers = [(b"authorization", f"Bearer {ADMIN_KEY}".encode())]
    if accept:
        headers.append((b"accept", accept))
    scope = scope_of(method, path, headers)
    scope["query_string"] = query
    await app(scope, receive, send)
    start, *bodies = sent
    headers = {k.decode(): v.decode() for k, v in start["headers"]}
    return start["status"], headers, b"".join(b.get("body", b"") for b in bodies)


async def test_console_paths_outside_its_files_are_404_with_its_headers() -> None:
    app, _ = with_console()
    status, headers, body = await call(app, "GET", "/ui/")
    assert status == 200 and b"<html" in body.lower()
    for path in (
        "/ui/../pyproject.toml",
        "/ui/%2e%2e/pyproject.toml",
        "/ui/..%2f..%2fetc/passwd",
        "/ui/./index.html",
        "/ui//etc/passwd",
        "/ui/index.html\x00.js",
        "/ui/\\..\\pyproject.toml",
        "/ui/" + "a" * 100_000,
    ):
        status, headers, body = await call(app, "GET", path)
        assert status == 404, path[:40]
        assert json.loads(body)["error"]["code"] == "not_found"
        assert "frame-ancestors 'none'" in headers["content-security-policy"]


async def test_recent_requests_query_parameters_are_checked() -> None:
    app, _ = with_console()
    for query in (
        b"limit=0",
        b"limit=501",
        b"limit=-1",
        b"limit=1e2",
        b"limit=" + b"9" * 5000,
        b"limit=%00",
    ):
        status, _, body = await call(app, "GET", "/admin/requests", query)
        assert status == 400, query[:30]
        assert "`limit`" in json.loads(body)["error"]["message"]
    hostile = b"&".join(
        [b"model=%ff%fe", b"status=" + b"5" * 3000, b"tenant=" + b"%" * 2000, b"x=1"] * 50
    )
    status, _, body = await call(app, "GET", "/admin/requests", hostile)
    assert status == 200 and json.loads(body)["count"] == 0


async def put_policy(app: RouterApp, text: str, if_match: bytes) -> tuple[int, dict, dict]:
    sent: list[dict] = []
    incoming = [{"type": "http.request", "body": text.encode(), "more_body": False}]

    async def receive() -> dict:
        if incoming:
            return incoming.pop(0)
        await trio.sleep_forever()
        raise AssertionError

    async def send(message: dict) -> None:
        sent.append(message)

    headers = [(b"authorization", f"Bearer {ADMIN_KEY}".encode()), (b"if-match", if_match)]
    await app(scope_of("PUT", "/admin/policy", headers), receive, send)
    start, *bodies = sent
    head = {k.decode(): v.decode() for k, v in start["headers"]}
    return start["status"], head, json.loads(b"".join(b.get("body", b"") for b in bodies))


async def test_if_match_headers_huge_many_or_odd_get_412_in_the_flat_shape() -> None:
    """`If-Match` (issue 49) on the write whose errors are upstream's flat
    `{"error": …}` (issue 47): what a script sends back is compared, never trusted."""
    app, _ = with_console()
    text = "routing_policy:\n  strategy: round-robin\n"
    current = f'"{app.store.version()}"'.encode()
    for hostile in (
        b'"x", ' * 3000,  # 15 kB of stale tags
        b"W/" + current,  # a weak tag never matches a strong comparison
        b"\xff\xfe" + current,
        current[:-1],
        b",,,,",
        b"",
    ):
        status, head, body = await put_policy(app, text, hostile)
        assert status == 412, hostile[:30]
        assert isinstance(body["error"], str) and body["current_etag"] == current.decode()
        assert head["etag"] == current.decode()
    status, head, body = await put_policy(app, text, b'"a", ' * 2000 + current)
    assert status == 200, body


async def test_policy_as_json_does_not_expand_yaml_aliases_without_bound() -> None:
    """`GET /admin/policy` as JSON (issue 47) writes the YAML's aliases out in full: a
    policy of 64 steps sharing one long tag list by alias is 64 copies of it (a 0.8 MB
    policy became 63 MB of JSON and 3.4 s of the router's one thread). Past a bound the
    fields are left out, as for YAML that JSON cannot hold; the YAML form is whole."""
    app, _ = with_console()
    tags = ", ".join(f"t{i:05d}" for i in range(20_000))
    steps = "".join(
        f"  - name: s{i}\n    match: {{tags: *a}}\n    strategy: round-robin\n" for i in range(63)
    )
    text = (
        f"routing_policy:\n  match: {{tags: &a [{tags}]}}\n  strategy: round-robin\n"
        f"fallback_chain:\n{steps}"
    )
    assert app.store.replace(text, "test") == []
    status, _, body = await call(app, "GET", "/admin/policy", accept=b"application/json")
    assert status == 200
    assert len(body) < 1 << 20, len(body)
    answer = json.loads(body)
    assert len(answer["chain"]) == 64 and answer["version"] == app.store.version()
    assert "routing_policy" not in answer
    status, _, body = await call(app, "GET", "/admin/policy")
    assert status == 200 and body.decode() == text
    # A policy of ordinary size is answered whole.
    assert app.store.replace("routing_policy:\n  strategy: round-robin\n", "test") == []
    status, _, body = await call(app, "GET", "/admin/policy", accept=b"application/json")
    assert json.loads(body)["routing_policy"] == {"strategy": "round-robin"}


def tagged_policy(seed: int, lines: int) -> str:
    """A valid policy of `lines` tag lines, drawn from 200 tags: the shape that makes a
    line diff slowest (lines that repeat, but too rarely for difflib to skip them)."""
    rng = random.Random(seed)
    tags = "".join(f"      - t{rng.randint(0, 200)}\n" for _ in range(lines))
    return f"routing_policy:\n  match:\n    tags:\n{tags}  strategy: round-robin\n"


async def test_policy_validate_does_not_diff_two_huge_policies_line_by_line() -> None:
    """The console's validate (issue 52) diffs the running policy against the proposed
    one on the router's only thread; difflib is quadratic in the worst case (two policies
    of 40,000 lines: 2.4 s, of 80,000: about 15 s of every request waiting). Past a bound
    the answer says the diff was left out; validation itself still runs."""
    app, _ = with_console()
    assert app.store.replace(tagged_policy(1, 40_000), "test") == []
    proposed = tagged_policy(2, 40_000).encode()
    status, body = await post_json(app, "/admin/policy/validate", proposed)
    assert status == 200 and body["valid"] is True, body
    assert body["diff"].startswith("(diff left out:"), body["diff"][:200]
    assert len(body["diff"]) < 500
    # A small proposal against the same large policy is still diffed.
    small = b"routing_policy:\n  strategy: least-loaded\n"
    status, body = await post_json(app, "/admin/policy/validate", small)
    assert status == 200 and "+  strategy: least-loaded\n" in body["diff"]


def test_sentinel_urls_with_odd_digits_are_refused_with_the_form() -> None:
    """`str.isdigit` is true of `²` and of Arabic-Indic digits, and `int` refuses 5,000
    digits with its own words: each is refused naming what was wrong."""
    for bad, words in (
        ("redis+sentinel://h:²/m", "is not HOST:PORT"),
        ("redis+sentinel://h:" + "9" * 5000 + "/m", "is not HOST:PORT"),
        ("redis+sentinel://h:1/m?db=²", "is not a database number"),
        ("redis+sentinel://h:1/m?db=" + "9" * 5000, "is not a database number"),
    ):
        with pytest.raises(ValueError, match=words):
            parse_sentinel_url(bad)
    assert parse_sentinel_url("redis+sentinel://h:1/m?db=3").db == 3
