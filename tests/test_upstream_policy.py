"""The Go router's policy fields (issue 19): top-level `models` and the front-door
`shed_if` (the per-step mechanism one level up), and `--policy-model-dir`: its start-up
checks, its SIGHUP reloads that keep the good files, and policy selection per model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from protocol.errors import ErrorCode, RouterError
from router.capacity import WaitQueue
from router.metrics import RouterMetrics
from router.policy.admission import load_value
from router.policy.schema import PolicyError, Rule, Shed, load_policy
from router.policy.store import PolicyStore
from router.session import LoadShed, Served
from tests.test_session import MODEL, Harness, make_peer, request

STEP = "routing_policy:\n  strategy: least-loaded\n"
FRONT = "shed_if:\n  kv_cache_utilization: {gt: 0.9}\n  waiting_requests: {gt: 20}\n" + STEP


def test_top_level_models_and_shed_if_load() -> None:
    loaded = load_policy("models: [a, b]\n" + FRONT)
    assert loaded.models == ("a", "b")
    assert loaded.shed_if == Shed(
        (Rule("kv_cache_utilization", "gt", 0.9), Rule("waiting_requests", "gt", 20.0))
    )
    assert loaded.routing_policy.shed_if is None


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("models: a\n" + STEP, "models: must be a non-empty list of model names"),
        ("models: [a, a]\n" + STEP, "models[1]: 'a' listed twice"),
        ("models: ['']\n" + STEP, "models[0]: must be a non-empty string"),
        (
            "shed_if: {gpu_temperature_c: {gt: 80}}\n" + STEP,
            "shed_if.gpu_temperature_c: unknown shed_if key",
        ),
        ("shed_if: {}\n" + STEP, "shed_if: needs at least one load condition"),
        ("shed_if: {waiting_requests: 20}\n" + STEP, "shed_if.waiting_requests: must be a mapping"),
    ],
)
def test_top_level_mistakes_are_named(text: str, expected: str) -> None:
    with pytest.raises(PolicyError) as failed:
        load_policy(text)
    assert any(expected in e for e in failed.value.errors), failed.value.errors


def test_a_steps_shed_if_still_refuses_per_agent_fields() -> None:
    with pytest.raises(PolicyError) as failed:
        load_policy(STEP + "  shed_if: {kv_cache_utilization: {gt: 0.9}}\n")
    assert "shed_if reads router-wide load" in failed.value.errors[0]


async def test_pool_averages_count_healthy_reporting_agents(autojump_clock: Any) -> None:
    hot = make_peer("A", kv_cache_utilization=0.99)
    cool = make_peer("B", kv_cache_utilization=0.81)
    silent = make_peer("C")
    down = make_peer("D", kv_cache_utilization=1.0)
    down.healthy = False
    queue = WaitQueue(10)
    value = load_value("kv_cache_utilization", MODEL, [hot, cool, silent, down], queue)
    assert value == pytest.approx(0.9)
    assert load_value("kv_cache_utilization", MODEL, [silent], queue) is None


async def test_the_front_door_sheds_before_any_step(autojump_clock: Any) -> None:
    hot = make_peer("A", kv_cache_utilization=0.95)
    h = Harness(FRONT, [hot])
    outcome = await h.route()
    assert isinstance(outcome, LoadShed) and outcome.front_door
    assert outcome.steps_tried == 0 and h.calls == []
    with pytest.raises(RouterError) as caught:
        await h.dispatcher().dispatch(request())
    assert caught.value.code == ErrorCode.TOO_MANY_CONCURRENT
    assert caught.value.http_status == 429 and caught.value.retry_after == 1
    hot.engine["kv_cache_utilization"] = 0.5
    assert isinstance(await h.route(), Served)


def write(directory: Path, name: str, text: str) -> None:
    (directory / name).write_text(text)


def test_policy_dir_selects_per_model_and_reloads_file_by_file(tmp_path: Path) -> None:
    write(tmp_path, "_default.yaml", STEP)
    write(tmp_path, "big.yaml", "models: [big]\n" + STEP)
    write(tmp_path, "notes.txt", "not a policy")
    # A tool's temporary file while it writes big.yaml by rename: no policy of its own.
    write(tmp_path, ".big.yaml.tmp.yaml", "models: [big]\n" + STEP)
    store = PolicyStore(RouterMetrics(), None, str(tmp_path))
    assert set(store.models.named) == {"big"}
    assert store.for_model("big") is store.models.for_model("big")
    assert store.for_model("other") is store.current
    big = store.for_model("big")

    # A broken edit keeps that file's running policy; a new good file loads.
    write(tmp_path, "big.yaml", "models: [big]\nrouting_policy: {strategy: fastest}\n")
    write(tmp_path, "small.yaml", "models: [small]\n" + STEP)
    errors = store.reload_file()
    assert any("big: routing_policy.strategy: unknown strategy 'fastest'" in e for e in errors)
    assert store.for_model("big") is big
    assert store.for_model("small") is not store.current

    # A file claiming a model another owns is refused; a deleted file's models go
    # back to the global policy; a deleted _default.yaml keeps the running global.
    write(tmp_path, "thief.yaml", "models: [small]\n" + STEP)
    running = store.current
    (tmp_path / "_default.yaml").unlink()
    (tmp_path / "big.yaml").unlink()
    errors = store.reload_file()
    assert any("thief: model 'small' already belongs to policy 'small'" in e for e in errors)
    assert store.for_model("big") is store.current is running
    assert set(store.models.named) == {"small"}


def failed_reloads(store: PolicyStore) -> float:
    return store.reloads.labels("failure")._value.get()


def test_a_policy_file_that_cannot_be_read_keeps_its_running_policy(tmp_path: Path) -> None:
    # Upstream: "invalid existing files keep their previous active policy". A file
    # caught half-written (not UTF-8 yet) is one; it must not drop its models.
    write(tmp_path, "big.yaml", "models: [big]\n" + STEP)
    store = PolicyStore(RouterMetrics(), None, str(tmp_path))
    big = store.for_model("big")
    (tmp_path / "big.yaml").write_bytes(b"models: [big]\n\xff\xfe")
    errors = store.reload_file()
    assert any("big.yaml: cannot read policy file" in e for e in errors), errors
    assert store.for_model("big") is big
    assert failed_reloads(store) == 1


def test_a_model_moves_between_files_in_one_reload_whatever_their_order(
    tmp_path: Path,
) -> None:
    write(tmp_path, "a.yaml", "models: [a]\n" + STEP)
    write(tmp_path, "b.yaml", "models: [b, moving]\n" + STEP)
    store = PolicyStore(RouterMetrics(), None, str(tmp_path))
    # a.yaml is read first and claims a model b.yaml, read after it, gives up.
    write(tmp_path, "a.yaml", "models: [a, moving]\n" + STEP)
    write(tmp_path, "b.yaml", "models: [b]\n" + STEP)
    assert store.reload_file() == []
    assert store.models.owner == {"a": "a", "moving": "a", "b": "b"}
    assert failed_reloads(store) == 0


def test_a_directory_reload_says_what_it_did_even_when_nothing_changed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    write(tmp_path, "_default.yaml", STEP)
    write(tmp_path, "a.yaml", "models: [a]\n" + STEP)
    write(tmp_path, "b.yaml", "models: [b]\n" + STEP)
    store = PolicyStore(RouterMetrics(), None, str(tmp_path))
    caplog.set_level("INFO", logger="policy")
    assert store.reload_file() == []
    (tmp_path / "b.yaml").unlink()
    write(tmp_path, "c.yaml", "models: [c]\n" + STEP)
    assert store.reload_file() == []
    lines = [r.getMessage() for r in caplog.records]
    lines = [line for line in lines if "policy_directory_reloaded" in line]
    assert lines == [
        f'policy_directory_reloaded directory={tmp_path} changed="" removed="" rejected=0'
        " documents=2",
        f"policy_directory_reloaded directory={tmp_path} changed=c removed=b rejected=0"
        " documents=2",
    ]


@pytest.mark.parametrize(
    ("files", "expected"),
    [
        (
            {"a.yaml": "models: [m]\n" + STEP, "b.yaml": "models: [m]\n" + STEP},
            "b: model 'm' already belongs to policy 'a'",
        ),
        ({"a.yaml": STEP}, "a: models: missing (required"),
        ({"_default.yaml": "routing_policy: {}\n"}, "_default.yaml: routing_policy.strategy"),
        ({"_x.yaml": "models: [m]\n" + STEP}, "not starting with `_`"),
        ({"_default.yaml": STEP, "_default.yml": STEP}, "keep one of them"),
    ],
)
def test_a_bad_policy_dir_is_a_startup_error(
    tmp_path: Path, files: dict[str, str], expected: str
) -> None:
    for name, text in files.items():
        write(tmp_path, name, text)
    with pytest.raises(PolicyError) as failed:
        PolicyStore(RouterMetrics(), None, str(tmp_path))
    assert any(expected in e for e in failed.value.errors), failed.value.errors


def test_a_missing_policy_dir_is_a_startup_error(tmp_path: Path) -> None:
    with pytest.raises(PolicyError, match="not a directory"):
        PolicyStore(RouterMetrics(), None, str(tmp_path / "nope"))
