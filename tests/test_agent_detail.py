"""The heartbeat values beside the gate fields (router/agent_detail.py): per-GPU records,
host memory bytes and the engine's preemptions, from a real agent on the sim engine,
and what the router makes of hostile ones."""

from __future__ import annotations

import pytest

from router.agent_detail import MAX_GPUS, gpu_total, gpus_of, memory_of, preemptions_of
from tests.fleet import Fleet, wait_until


def test_routing_table_and_metrics_show_memory_bytes_and_preemptions(fleet: Fleet) -> None:
    router = fleet.router()
    agent = fleet.agent(router, "m1", "--heartbeat-interval", "1s")
    row = wait_until(
        lambda: (
            (a := router.agent(agent.peer_id))
            and a["hardware"]["memory_total_bytes"]
            and a["engine"]["preemptions_total"] is not None
            and a
        ),
        what="hardware and engine snapshots",
    )
    hardware = row["hardware"]
    assert 0 < hardware["memory_used_bytes"] < hardware["memory_total_bytes"]
    assert 0 < hardware["memory_available_bytes"] <= hardware["memory_total_bytes"]
    # This host has no NVIDIA GPU: an empty array and no totals, never zeros.
    assert hardware["gpu"] == []
    assert hardware["gpu_power_watts"] is None
    assert row["engine"]["preemptions_total"] == 0  # the sim never preempts
    assert router.metric("hivenet_router_agent_memory_total_bytes", peer_id=agent.peer_id) > 0
    assert "hivenet_router_agent_preemptions_total{" in router.metrics()


GPU = {
    "index": 0,
    "util_percent": 93.0,
    "vram_used_bytes": 120,
    "vram_free_bytes": 21,
    "vram_total_bytes": 141,
    "temperature_c": 64,
    "power_watts": 612.5,
}


def test_well_formed_values_are_kept() -> None:
    gpus = gpus_of({"gpus": [GPU, {**GPU, "index": 1, "power_watts": 100}]})
    assert gpus[0].to_json() == {**GPU, "vram_used_bytes": 120.0}
    assert gpu_total(gpus, "power_watts") == 712.5
    assert memory_of({"memory_used_bytes": 5, "memory_total_bytes": 8}) == {
        "memory_used_bytes": 5.0,
        "memory_available_bytes": None,
        "memory_total_bytes": 8.0,
    }
    assert preemptions_of({"preemptions_total": 3}) == 3.0


@pytest.mark.parametrize(
    "gpus",
    [
        "not a list",
        {"0": GPU},
        [GPU] * (MAX_GPUS + 1),
        [GPU, "not a map"],
        [GPU, None],
        [GPU, GPU],  # index 0 twice
        [{**GPU, "index": 1}, {**GPU, "index": "x"}],  # the second's place is 1 too
    ],
)
def test_a_malformed_gpu_list_is_no_gpu_list(gpus: object) -> None:
    assert gpus_of({"gpus": gpus}) == ()


@pytest.mark.parametrize(
    "value", [float("nan"), float("inf"), -1, True, "12", None, [1], {"a": 1}, 10**400]
)
def test_a_value_that_is_not_a_finite_amount_is_unknown(value: object) -> None:
    (gpu,) = gpus_of({"gpus": [{**GPU, "power_watts": value, "index": value}]})
    assert gpu.values["power_watts"] is None
    assert gpu.index == 0  # a bad index is the GPU's place in the list
    assert memory_of({"memory_used_bytes": value})["memory_used_bytes"] is None
    assert preemptions_of({"preemptions_total": value}) is None


class _Float(float):
    pass


class _Int(int):
    pass


# Each type a heartbeat's value may take: msgpack's floats and integers (the fast
# paths) and, for Python callers, bools and subclasses (the general path).
AMOUNTS = [
    (0, 0.0),
    (0.0, 0.0),
    (-0.0, 0.0),
    (7, 7.0),
    (2**64, float(2**64)),
    (1.5, 1.5),
    (_Float(2.5), 2.5),
    (_Int(3), 3.0),
    (-1, None),
    (-0.5, None),
    (float("-inf"), None),
    (float("nan"), None),
    (False, None),
    (10**400, None),
]


@pytest.mark.parametrize(("value", "amount"), AMOUNTS)
def test_each_kind_of_number_is_read_as_an_amount_or_unknown(
    value: object, amount: float | None
) -> None:
    (gpu,) = gpus_of({"gpus": [{**GPU, "vram_used_bytes": value}]})
    for got in (
        gpu.values["vram_used_bytes"],
        memory_of({"memory_total_bytes": value})["memory_total_bytes"],
        preemptions_of({"preemptions_total": value}),
    ):
        assert got == amount
        assert type(got) is type(amount)  # a float, never the agent's int or subclass
