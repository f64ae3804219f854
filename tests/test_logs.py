"""`key=value` and JSON logs: per-subsystem levels from the environment, quoting, laziness."""

from __future__ import annotations

import contextlib
import io
import json
import logging
import re
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from protocol import logs
from protocol.logs import (
    SUBSYSTEMS,
    invalid_levels,
    kv,
    levels_from,
    parse_levels,
    quote,
    setup_logging,
)
from tests.fleet import ADMIN_KEY, Fleet, Router, wait_until


@pytest.fixture
def restore_logging() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    names = (*SUBSYSTEMS, "libp2p", "hypercorn.error", "logs")
    levels = {n: logging.getLogger(n).level for n in names}
    try:
        yield
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
        for n, lv in levels.items():
            logging.getLogger(n).setLevel(lv)


# --- level parsing -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "default", "per"),
    [
        ("", None, {}),
        ("info", logging.INFO, {}),
        ("DEBUG", logging.DEBUG, {}),
        ("policy=debug,router=debug", None, {"policy": logging.DEBUG, "router": logging.DEBUG}),
        (" warn , link = error ", logging.WARNING, {"link": logging.ERROR}),
        ("error,policy=debug", logging.ERROR, {"policy": logging.DEBUG}),
        ("policy=verbose,router=info", None, {"router": logging.INFO}),
        ("fatal", logging.CRITICAL, {}),
        ("warning", logging.WARNING, {}),
        (",,", None, {}),
    ],
)
def test_parse_levels(spec: str, default: int | None, per: dict[str, int]) -> None:
    assert parse_levels(spec) == (default, per)


def test_invalid_levels_are_reported() -> None:
    assert invalid_levels("policy=verbose,info,router=loud") == ["policy=verbose", "router=loud"]
    assert invalid_levels("policy=debug,info") == []


def test_levels_default_to_info() -> None:
    assert levels_from({}) == dict.fromkeys(SUBSYSTEMS, logging.INFO)


def test_seeds_golog_form_sets_only_the_named_subsystems() -> None:
    levels = levels_from({"GOLOG_LOG_LEVEL": "policy=debug,router=debug"})
    assert levels["policy"] == logging.DEBUG
    assert levels["router"] == logging.DEBUG
    assert levels["http"] == logging.INFO
    assert levels["link"] == logging.INFO


def test_both_variables_are_read_and_golog_wins_where_both_speak() -> None:
    env = {"HIVENET_LOG_LEVEL": "warn,http=debug,link=error", "GOLOG_LOG_LEVEL": "link=info"}
    levels = levels_from(env)
    assert levels["http"] == logging.DEBUG  # only HIVENET names it
    assert levels["link"] == logging.INFO  # both name it: GOLOG
    assert levels["policy"] == logging.WARNING  # HIVENET's bare level
    levels = levels_from({"HIVENET_LOG_LEVEL": "info", "GOLOG_LOG_LEVEL": "debug"})
    assert set(levels.values()) == {logging.DEBUG}
    levels = levels_from({"HIVENET_LOG_LEVEL": "debug", "GOLOG_LOG_LEVEL": "policy=warn"})
    assert levels["policy"] == logging.WARNING and levels["router"] == logging.DEBUG


def test_upstreams_subsystem_names_reach_the_loggers_doing_that_work() -> None:
    levels = levels_from({"GOLOG_LOG_LEVEL": "api=warn,p2p=debug,auth=error,storage=debug"})
    assert levels["http"] == logging.WARNING
    assert levels["link"] == levels["router.p2p"] == logging.DEBUG
    assert levels["tenant"] == logging.ERROR and levels["history"] == logging.DEBUG
    assert levels["policy"] == logging.INFO
    # Our own name, given too, wins over upstream's.
    assert levels_from({"GOLOG_LOG_LEVEL": "api=warn,http=debug"})["http"] == logging.DEBUG


def test_other_loggers_can_be_named_too() -> None:
    assert levels_from({"GOLOG_LOG_LEVEL": "libp2p=debug"})["libp2p"] == logging.DEBUG


def test_setup_logging_applies_the_levels(restore_logging: None) -> None:
    setup_logging({"GOLOG_LOG_LEVEL": "policy=debug,router=debug", "HIVENET_LOG_LEVEL": "warn"})
    assert logging.getLogger("policy").level == logging.DEBUG
    assert logging.getLogger("router").level == logging.DEBUG
    assert logging.getLogger("http").level == logging.WARNING
    assert logging.getLogger("policy").isEnabledFor(logging.DEBUG)
    assert not logging.getLogger("http").isEnabledFor(logging.INFO)
    # libp2p stays quiet unless named.
    assert logging.getLogger("libp2p").level == logging.CRITICAL
    setup_logging({"GOLOG_LOG_LEVEL": "libp2p=debug"})
    assert logging.getLogger("libp2p").level == logging.DEBUG


def test_an_unknown_level_is_reported_once_not_fatal(
    restore_logging: None, capsys: pytest.CaptureFixture[str]
) -> None:
    setup_logging({"HIVENET_LOG_LEVEL": "policy=chatty"})
    err = capsys.readouterr().err
    assert 'log_level_ignored variable=HIVENET_LOG_LEVEL parts="policy=chatty"' in err
    assert logging.getLogger("policy").level == logging.INFO


# --- line format and quoting -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("plain", "plain"),
        ("m1", "m1"),
        ("org/model-8B", "org/model-8B"),
        (42, "42"),
        ("", '""'),
        ("two words", '"two words"'),
        ('say "hi"', '"say \\"hi\\""'),
        ("a=b", '"a=b"'),
        ("line\nbreak", '"line\\nbreak"'),
        ("tab\there", '"tab\\there"'),
        ("cr\rhere", '"cr\\rhere"'),
        ("back\\slash", '"back\\\\slash"'),
        ("bell\x07", '"bell\\x07"'),
        ("zwsp\u200b", '"zwsp\\u200b"'),
        ("tag\U000e0001", '"tag\\U000e0001"'),
        ("Zürich", "Zürich"),
        ("chain→step", "chain→step"),
    ],
)
def test_quote(value: object, expected: str) -> None:
    assert quote(value) == expected


def test_kv_skips_none_and_quotes_values() -> None:
    assert kv(req="abc", model="a b", tenant=None, n=3) == 'req=abc model="a b" n=3'


def _capture(name: str, level: int) -> tuple[logging.Logger, io.StringIO]:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logs._Formatter())
    logger = logging.getLogger(name)
    logger.handlers[:] = [handler]
    logger.propagate = False
    logger.setLevel(level)
    return logger, stream


def test_record_format_is_one_key_value_line() -> None:
    logger, stream = _capture("test.logs.format", logging.DEBUG)
    try:
        logger.warning("req=%s thing_happened model=%s", "r-1", quote("two\nlines"))
        logger.info("raw newline\nin message")
        try:
            raise ValueError("boom\nbang")
        except ValueError:
            logger.exception("failed")
    finally:
        logger.handlers.clear()
        logger.propagate = True
    lines = stream.getvalue().splitlines()
    assert len(lines) == 3
    first = lines[0]
    assert first.startswith("ts=")
    assert " level=warn subsystem=test.logs.format req=r-1 thing_happened " in first
    assert first.endswith('model="two\\nlines"')
    assert lines[1].endswith("raw newline\\nin message")
    assert " level=error " in lines[2] and ' exc="Traceback' in lines[2]


def test_a_disabled_level_does_not_format_its_arguments() -> None:
    calls = []

    class Expensive:
        def __str__(self) -> str:
            calls.append(1)
            return "expensive"

    logger, stream = _capture("test.logs.lazy", logging.INFO)
    try:
        logger.debug("value=%s", Expensive())
        assert calls == []
        assert stream.getvalue() == ""
        logger.info("value=%s", Expensive())
        assert calls == [1]
    finally:
        logger.handlers.clear()
        logger.propagate = True


# --- a live router ---------------------------------------------------------------------------


def test_a_router_honours_the_seeds_debug_setting(tmp_path: Path) -> None:
    """`GOLOG_LOG_LEVEL=policy=debug,router=debug` over `HIVENET_LOG_LEVEL=warn`: policy
    debug lines appear, the http subsystem's info lines (the access log) do not."""
    fleet = Fleet(tmp_path)
    try:
        router = fleet.router(
            "--queue-depth",
            "0",
            env={"HIVENET_LOG_LEVEL": "warn", "GOLOG_LOG_LEVEL": "policy=debug,router=debug"},
        )
        agent = fleet.agent(router, "m1", "--capacity", "1")
        agent.sim_state(stall_after_tokens=0)
        body = {"model": "m1", "messages": [{"role": "user", "content": "x"}]}

        def hold() -> None:
            # Stalled by the engine; the client gives up after a while.
            with contextlib.suppress(httpx.HTTPError):
                httpx.post(router.url + "/v1/chat/completions", json=body, timeout=3)

        # One request holds the only slot; the next finds no room and says so at debug.
        t = threading.Thread(target=hold)
        t.start()
        wait_until(lambda: router.agent(agent.peer_id)["status"]["active_requests"] == 1, 15)
        rid = str(uuid.uuid4())
        r = httpx.post(
            router.url + "/v1/chat/completions",
            json=body,
            headers={"x-request-id": rid},
            timeout=30,
        )
        assert r.status_code == 503
        t.join(30)
        log = router.log()
        assert re.search(rf"level=debug subsystem=policy req={rid} queue_full", log)
        assert re.search(rf"level=warn subsystem=policy req={rid} [^\n]*policy_exhausted", log)
        assert "level=info subsystem=router router_ready" in log
        assert "level=info subsystem=http" not in log
    finally:
        fleet.close()


# --- JSON lines ---------------------------------------------------------------------------

_KEYS = st.from_regex(r"[a-z][a-z_]{0,11}", fullmatch=True)


@given(st.dictionaries(_KEYS, st.text(max_size=40), max_size=6), st.sampled_from(["", "ev_x"]))
def test_fields_of_reads_back_every_kv_line(fields: dict[str, str], event: str) -> None:
    line = " ".join(filter(None, (event, kv(**fields))))
    expected = ({"msg": event} if event else {}) | fields
    assert logs.fields_of(line) == expected


def test_fields_of_keeps_free_text_and_the_event_in_place() -> None:
    got = logs.fields_of('req=r-1 client_disconnected tenant="a b" done')
    assert got == {"msg": "client_disconnected done", "req": "r-1", "tenant": "a b"}
    assert logs.fields_of("inbound connection ended: reset") == {
        "msg": "inbound connection ended: reset"
    }
    assert logs.fields_of('why="unterminated') == {"why": "unterminated"}


def test_json_record_has_the_fields_of_the_text_record() -> None:
    record = logging.LogRecord(
        "policy",
        logging.WARNING,
        __file__,
        1,
        "req=%s policy_exhausted reason=%s level=%s",
        ("r-1", quote('gate[4] match [engine(got="",want="vllm")=2]'), "forged"),
        None,
    )
    text = logs._Formatter().format(record)
    obj = json.loads(logs._JsonFormatter().format(record))
    assert obj == logs.fields_of(text) | {"level": "warn"}
    assert list(obj)[:4] == ["ts", "level", "subsystem", "msg"]
    assert obj["reason"] == 'gate[4] match [engine(got="",want="vllm")=2]'
    assert obj["level"] == "warn"  # a message cannot overwrite the record's own fields


def test_log_format_flag_wins_over_golog_variable() -> None:
    assert logs.log_format_from(None, {}) == "text"
    assert logs.log_format_from(None, {"GOLOG_LOG_FMT": "json"}) == "json"
    assert logs.log_format_from(None, {"GOLOG_LOG_FMT": "nocolor"}) == "text"
    assert logs.log_format_from("text", {"GOLOG_LOG_FMT": "json"}) == "text"


def test_an_unknown_log_format_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    from router.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["serve", "--log-format", "xml"])
    assert exit_.value.code == 2
    assert "--log-format" in capsys.readouterr().err


def test_router_and_agent_write_json_lines(tmp_path: Path) -> None:
    """`--log-format json` on the router, `GOLOG_LOG_FMT=json` on the agent: every line
    of both is one JSON object, and the seeds' exhaustion line keeps its fields."""
    fleet = Fleet(tmp_path)
    try:
        router = fleet.router("--queue-depth", "0", "--log-format", "json")
        agent = fleet.agent(router, "m1", env={"GOLOG_LOG_FMT": "json"})
        rid = str(uuid.uuid4())
        body = {"model": "absent", "messages": [{"role": "user", "content": "x"}]}
        r = httpx.post(
            router.url + "/v1/chat/completions",
            json=body,
            headers={"x-request-id": rid},
            timeout=30,
        )
        assert r.status_code == 404
        wait_until(lambda: rid in router.log(), 10)
        records = [json.loads(line) for line in router.log().splitlines() if line.strip()]
        assert all({"ts", "level", "subsystem"} <= set(rec) for rec in records)
        assert any(rec.get("msg") == "router_ready" for rec in records)
        mine = [rec for rec in records if rec.get("req") == rid]
        assert mine and all(rec["subsystem"] in logs.SUBSYSTEMS for rec in mine)
        agent_lines = [line for line in agent.log().splitlines() if line.strip()]
        assert agent_lines
        assert all(json.loads(line)["subsystem"] for line in agent_lines)
        # The Go agent's process-wide label: its peer ID on every line after the key
        # is read (the first lines, about reading it, come before).
        labelled = [json.loads(line).get("peer_id") for line in agent_lines]
        after_key = labelled[labelled.index(agent.peer_id) :]
        assert len(after_key) > 1 and set(after_key) == {agent.peer_id}, agent_lines
    finally:
        fleet.close()


# --- the documented exhaustion lines, end to end, in both formats ------------------------

# INTERFACE.md's chain: the primary wants vLLM (the sim agents are not), `relaxed` spends
# its two tries on the two failing agents, `last-resort` keeps out their hot KV caches.
_INTERFACE_CHAIN = """\
routing_policy:
  match:
    engine: vllm
  strategy: least-loaded
fallback_chain:
  - name: relaxed
    match: {}
    strategy: least-loaded
    max_tries: 2
  - name: last-resort
    match: {}
    exclude_if:
      kv_cache_utilization:
        gt: 0.85
    strategy: least-loaded
"""
# The seeds' gate-5 example: more tries than agents, so both fail and none is left.
_PREV_FAILURES = "routing_policy:\n  match: {}\n  strategy: least-loaded\n  max_tries: 5\n"
_MODEL = "Qwen-3.6-35B"  # the seeds' example's model and tenant
_TENANT = "chaintrust"


def test_exhaustion_lines_have_the_documented_fields_in_text_and_json(tmp_path: Path) -> None:
    """INTERFACE.md's `policy_exhausted` example and the seeds' gate-5 one, produced by a
    real chain and read field by field and in order, from a text router and a JSON one
    that the same two agents serve; the `forward_error` lines come first, as the seeds'
    "Previous failures" tells operators to look for them."""
    fleet = Fleet(tmp_path)
    try:
        chain = tmp_path / "chain.yaml"
        chain.write_text(_INTERFACE_CHAIN)
        common = ("--policy-file", str(chain), "--heartbeat-interval", "1s")
        env = {"HIVENET_ROUTER_API_KEYS": f"client-key:{_TENANT}"}
        text = fleet.router(*common, env=env)
        jsonl = fleet.router(*common, "--log-format", "json", env=env)
        agents = [
            fleet.agent([text, jsonl], _MODEL, "--heartbeat-interval", "1s", wait=False)
            for _ in range(2)
        ]
        fleet.join(*agents)
        for agent in agents:
            agent.sim_state(kv_cache_utilization=0.95, fail_status=503, fail_count=1000)
        for router in (text, jsonl):
            wait_until(
                lambda r=router: all(
                    r.agent(a.peer_id)["engine"]["kv_cache_utilization"] == 0.95 for a in agents
                ),
                20,
                "both caches at 0.95 on both routers",
            )

        def exhaust(router: Router) -> str:
            rid = str(uuid.uuid4())
            r = httpx.post(
                router.url + "/v1/chat/completions",
                json={"model": _MODEL, "messages": [{"role": "user", "content": "x"}]},
                headers={"Authorization": "Bearer client-key", "X-Request-ID": rid},
                timeout=30,
            )
            assert r.status_code == 503, r.text
            return rid

        reasons = {
            "chain": (
                "[routing_policy→relaxed→last-resort]",
                "3/3",
                'routing_policy: gate[4] match [engine(got="sim",want="vllm")=2]'
                " | relaxed: max_tries exhausted"
                " | last-resort: gate[7] exclude_if [kv_cache_utilization=2]",
            ),
            "prev": (
                "[routing_policy]",
                "1/1",
                "routing_policy: gate[5] prev_failures [prev_failed=2]",
            ),
        }
        rids = {("chain", router): exhaust(router) for router in (text, jsonl)}
        for router in (text, jsonl):
            r = httpx.put(
                router.url + "/admin/policy",
                content=_PREV_FAILURES,
                headers={"Authorization": f"Bearer {ADMIN_KEY}"},
                timeout=10,
            )
            assert r.status_code == 200, r.text
            rids["prev", router] = exhaust(router)

        for case, (chain_field, tried, reason) in reasons.items():
            rid = rids[case, text]
            escaped = reason.replace('"', '\\"')
            line = text.wait_log(rf"[^\n]*req={rid} [^\n]*policy_exhausted[^\n]*").group(0)
            assert line.split(" ", 2)[1:2] == ["level=warn"]
            assert line.split(" ", 3)[3] == (
                f'req={rid} model="{_MODEL}" capability="llm" tenant={_TENANT}'
                f' policy_exhausted chain={chain_field} tried={tried} reason="{escaped}"'
            )
            before = text.log().index(line)
            assert text.log().count(f"req={rid} forward_error ") == 2
            assert text.log().index(f"req={rid} forward_error ") < before

            rid = rids[case, jsonl]
            jsonl.wait_log(rf'"req": "{rid}", "model"')
            records = [json.loads(x) for x in jsonl.log().splitlines() if rid in x]
            [record] = [r for r in records if r.get("msg") == "policy_exhausted"]
            assert list(record) == [
                "ts", "level", "subsystem", "msg",
                "req", "model", "capability", "tenant", "chain", "tried", "reason",
            ]  # fmt: skip
            assert {k: v for k, v in record.items() if k != "ts"} == {
                "level": "warn",
                "subsystem": "policy",
                "msg": "policy_exhausted",
                "req": rid,
                "model": _MODEL,
                "capability": "llm",
                "tenant": _TENANT,
                "chain": chain_field,
                "tried": tried,
                "reason": reason,
            }
            errors = [r for r in records if r.get("msg") == "forward_error"]
            assert len(errors) == 2 and records.index(errors[-1]) < records.index(record)
            assert {e["code"] for e in errors} == {"backend_unavailable"}
            assert {e["peer"] for e in errors} == {a.peer_id for a in agents}
    finally:
        fleet.close()
