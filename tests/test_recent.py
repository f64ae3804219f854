"""The recent-requests ring and its stories stay bounded whatever comes through."""

from __future__ import annotations

import logging

from router import recent as recent_module
from router.recent import RecentRequests, StoryHandler, story


def _record(msg: str, *args: object, level: int = logging.INFO) -> logging.LogRecord:
    return logging.LogRecord("policy", level, __file__, 1, msg, args or None, None)


def test_the_ring_keeps_the_newest_and_forgets_the_rest() -> None:
    ring = RecentRequests(size=3, lines=2)
    for i in range(10):
        entry = ring.begin(f"r{i}", "/v1/chat/completions")
        entry.model, entry.status = ("m1" if i % 2 else "m2"), 200 + i
        ring.end(entry)
    assert [r["id"] for r in ring.list({}, 10)] == ["r9", "r8", "r7"]
    assert ring.get("r6") is None
    assert [r["id"] for r in ring.list({"model": "M1"}, 10)] == ["r9", "r7"]
    assert [r["id"] for r in ring.list({"status": "208"}, 10)] == ["r8"]
    assert [r["id"] for r in ring.list({}, 1)] == ["r9"]


def test_stories_are_bounded_and_only_for_kept_requests() -> None:
    ring = RecentRequests(size=2, lines=2)
    handler = StoryHandler(ring)
    entry = ring.begin("a", "/v1/chat/completions")
    for n in range(5):
        handler.handle(_record("req=%s step_selected n=%d", "a", n))
    handler.handle(_record("req=%s not kept", "zzz"))
    handler.handle(_record("%s", 'req=a policy_exhausted reason="x"', level=logging.WARNING))
    # Lines of other shapes are passed over without a look.
    handler.handle(_record("router_ready"))
    handler.handle(_record("req=%(id)s", {"id": "a"}))
    handler.handle(logging.LogRecord("x", logging.INFO, "", 1, 42, None, None))
    ring.end(entry)
    lines = story(ring.get("a").records)  # type: ignore[union-attr]
    assert len(lines) == 2 and lines[0].endswith("req=a step_selected n=0")
    assert " level=info subsystem=policy " in lines[0]


def test_a_burst_past_max_open_is_summarised_without_lines(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(recent_module, "MAX_OPEN", 2)
    ring = RecentRequests(size=10)
    entries = [ring.begin(f"r{i}", "/v1/chat/completions") for i in range(5)]
    handler = StoryHandler(ring)
    for i in range(5):
        handler.handle(_record("req=%s x", f"r{i}"))
    for entry in entries:
        ring.end(entry)
    assert [len(ring.get(f"r{i}").records) for i in range(5)] == [1, 1, 0, 0, 0]  # type: ignore[union-attr]
    assert len(ring.list({}, 10)) == 5


def test_a_line_that_cannot_be_formatted_is_left_out() -> None:
    ring = RecentRequests()
    entry = ring.begin("a", "/v1/chat/completions")
    StoryHandler(ring).handle(_record("req=%s %d", "a", "not a number"))
    ring.end(entry)
    assert story(entry.records) == []
