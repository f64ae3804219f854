"""Hardware sampling: NVML replaced at the pynvml call boundary, and the real host."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pynvml
import pytest

from agent.hardware import HardwareSampler

GPU_FIELDS = ("gpu_temperature_c", "gpu_util_percent", "gpu_vram_used_percent")


@dataclass
class _Gpu:
    name: bytes | str
    temperature: int
    utilization: int  # percent, as NVML reports it
    used: int
    total: int
    broken: frozenset[str] = frozenset()
    power_mw: int = 0


@dataclass
class _Utilization:
    gpu: int
    memory: int


@dataclass
class _Memory:
    total: int
    free: int
    used: int


def _fake_nvml(monkeypatch: pytest.MonkeyPatch, gpus: list[_Gpu]) -> list[str]:
    calls: list[str] = []

    def query(kind: str, handle: int) -> _Gpu:
        calls.append(kind)
        gpu = gpus[handle]
        if kind in gpu.broken:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return gpu

    def temperature(handle: int, sensor: int) -> int:
        assert sensor == pynvml.NVML_TEMPERATURE_GPU
        return query("temperature", handle).temperature

    def utilization(handle: int) -> _Utilization:
        return _Utilization(gpu=query("utilization", handle).utilization, memory=0)

    def memory(handle: int) -> _Memory:
        gpu = query("memory", handle)
        return _Memory(total=gpu.total, free=gpu.total - gpu.used, used=gpu.used)

    monkeypatch.setattr(pynvml, "nvmlInit", lambda: calls.append("init"))
    monkeypatch.setattr(pynvml, "nvmlDeviceGetCount", lambda: len(gpus))
    monkeypatch.setattr(pynvml, "nvmlDeviceGetHandleByIndex", lambda index: index)
    monkeypatch.setattr(pynvml, "nvmlDeviceGetTemperature", temperature)
    monkeypatch.setattr(pynvml, "nvmlDeviceGetUtilizationRates", utilization)
    monkeypatch.setattr(pynvml, "nvmlDeviceGetMemoryInfo", memory)
    monkeypatch.setattr(pynvml, "nvmlDeviceGetName", lambda handle: query("name", handle).name)
    monkeypatch.setattr(
        pynvml, "nvmlDeviceGetPowerUsage", lambda handle: query("power", handle).power_mw
    )
    return calls


GIB = 1 << 30


def test_two_gpus_highest_value_in_policy_units(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _fake_nvml(
        monkeypatch,
        [
            _Gpu(
                b"NVIDIA H100 80GB HBM3",
                temperature=61,
                utilization=35,
                used=70 * GIB,
                total=80 * GIB,
            ),
            _Gpu(
                b"NVIDIA H100 80GB HBM3",
                temperature=86,
                utilization=97,
                used=20 * GIB,
                total=80 * GIB,
            ),
        ],
    )
    sampler = HardwareSampler()
    values = sampler.sample()
    # The hot GPU gives temperature and utilization, the full one VRAM use.
    assert values["gpu_temperature_c"] == 86.0
    assert values["gpu_util_percent"] == pytest.approx(0.97)
    assert values["gpu_vram_used_percent"] == pytest.approx(0.875)
    assert 0.0 <= values["memory_used_percent"] <= 1.0
    assert 0.0 <= values["cpu_usage_percent"] <= 1.0
    assert sampler.gpu_model() == "NVIDIA H100 80GB HBM3"
    sampler.sample()
    assert calls.count("init") == 1


def test_a_failing_gpu_query_is_left_out(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_nvml(
        monkeypatch,
        [
            _Gpu(
                "RTX4090",
                temperature=90,
                utilization=99,
                used=1,
                total=2,
                broken=frozenset({"temperature", "utilization", "name"}),
            ),
            _Gpu("RTX4090", temperature=55, utilization=10, used=0, total=0),
        ],
    )
    sampler = HardwareSampler()
    values = sampler.sample()
    assert values["gpu_temperature_c"] == 55.0
    assert values["gpu_util_percent"] == pytest.approx(0.10)
    # GPU 1 reports no total memory: only GPU 0's fraction counts.
    assert values["gpu_vram_used_percent"] == pytest.approx(0.5)
    assert sampler.gpu_model() is None


def test_nvml_init_failure_is_remembered(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []

    def fail() -> None:
        calls.append("init")
        raise pynvml.NVMLError(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)

    monkeypatch.setattr(pynvml, "nvmlInit", fail)
    sampler = HardwareSampler()
    for _ in range(3):
        values = sampler.sample()
        assert all(values[name] is None for name in GPU_FIELDS)
    assert sampler.gpu_model() is None
    assert calls == ["init"]


def test_this_host_without_nvml() -> None:
    # The CI host has no NVIDIA driver; on a GPU host this checks real readings instead.
    sampler = HardwareSampler()
    values = sampler.sample()
    assert set(values) == {
        *GPU_FIELDS,
        "memory_used_percent",
        "cpu_usage_percent",
        "memory_used_bytes",
        "memory_available_bytes",
        "memory_total_bytes",
        "gpus",
    }
    assert 0 < values["memory_used_bytes"] < values["memory_total_bytes"]
    assert 0 < values["memory_available_bytes"] <= values["memory_total_bytes"]
    assert 0.0 <= values["memory_used_percent"] <= 1.0
    assert 0.0 <= values["cpu_usage_percent"] <= 1.0
    if sampler.gpu_model() is None:
        assert all(values[name] is None for name in GPU_FIELDS)
        assert values["gpus"] == []
    else:
        assert 0.0 <= values["gpu_util_percent"] <= 1.0
        assert 0.0 <= values["gpu_vram_used_percent"] <= 1.0
        assert values["gpu_temperature_c"] > 0.0


def _agent_metadata(tmp_path: Path, gpu_model: str = "") -> dict:
    from agent.app import AgentDaemon
    from agent.settings import AgentSettings

    settings = AgentSettings(
        routers=[],
        model="m1",
        engine="sim",
        gpu_model=gpu_model,
        identity_path=str(tmp_path / "agent.key"),
    )
    return AgentDaemon(settings).metadata()


def test_gpu_model_from_nvml_unless_given(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    _fake_nvml(
        monkeypatch,
        [
            _Gpu("NVIDIA L40S", temperature=40, utilization=0, used=0, total=GIB),
            _Gpu("NVIDIA L40S", temperature=41, utilization=0, used=0, total=GIB),
        ],
    )
    assert _agent_metadata(tmp_path)["gpu_model"] == "NVIDIA L40S"
    # The operator's --gpu-model wins: it is what policies match on.
    assert _agent_metadata(tmp_path, "L40S-48GB")["gpu_model"] == "L40S-48GB"


def test_gpu_model_empty_without_nvml(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    def fail() -> None:
        raise pynvml.NVMLError(pynvml.NVML_ERROR_DRIVER_NOT_LOADED)

    monkeypatch.setattr(pynvml, "nvmlInit", fail)
    assert _agent_metadata(tmp_path)["gpu_model"] == ""


def test_fractions_and_celsius_from_nvml_units(monkeypatch: pytest.MonkeyPatch) -> None:
    # NVML reports utilization in percent and memory in bytes; the policy wants 0-1.
    _fake_nvml(
        monkeypatch,
        [_Gpu("A100", temperature=100, utilization=100, used=80 * GIB, total=80 * GIB)],
    )
    values = HardwareSampler().sample()
    assert values["gpu_util_percent"] == 1.0
    assert values["gpu_vram_used_percent"] == 1.0
    assert values["gpu_temperature_c"] == 100.0


def test_cpu_and_memory_from_psutil_as_fractions(monkeypatch: pytest.MonkeyPatch) -> None:
    import psutil

    @dataclass
    class _VirtualMemory:
        percent: float
        used: int = 6 * GIB
        available: int = 2 * GIB
        total: int = 8 * GIB

    calls: list[object] = []

    def cpu_percent(interval: float | None = None) -> float:
        calls.append(interval)
        return 37.5

    monkeypatch.setattr(psutil, "virtual_memory", lambda: _VirtualMemory(percent=73.5))
    monkeypatch.setattr(psutil, "cpu_percent", cpu_percent)
    values = HardwareSampler().sample()
    assert values["memory_used_percent"] == pytest.approx(0.735)
    assert values["cpu_usage_percent"] == pytest.approx(0.375)
    used, available, total = (values[f"memory_{k}_bytes"] for k in ("used", "available", "total"))
    assert (used, available, total) == (6 * GIB, 2 * GIB, 8 * GIB)
    # Never blocking: CPU use since the previous call, primed when the sampler starts.
    assert calls == [None, None]


def test_one_record_per_gpu_in_nvml_units_made_plain(monkeypatch: pytest.MonkeyPatch) -> None:
    """Upstream's per-GPU array: percent, bytes, watts (NVML's milliwatts); a failing
    query leaves that value None, not 0, and the other values of that GPU stand."""
    _fake_nvml(
        monkeypatch,
        [
            _Gpu("H200", temperature=64, utilization=93, used=120 * GIB, total=141 * GIB,
                 power_mw=612_345),
            _Gpu("H200", temperature=31, utilization=0, used=GIB, total=141 * GIB,
                 broken=frozenset({"power", "temperature"})),
        ],
    )  # fmt: skip
    gpus = HardwareSampler().sample()["gpus"]
    assert gpus == [
        {
            "index": 0,
            "util_percent": 93.0,
            "vram_used_bytes": 120 * GIB,
            "vram_free_bytes": 21 * GIB,
            "vram_total_bytes": 141 * GIB,
            "temperature_c": 64.0,
            "power_watts": pytest.approx(612.345),
        },
        {
            "index": 1,
            "util_percent": 0.0,
            "vram_used_bytes": GIB,
            "vram_free_bytes": 140 * GIB,
            "vram_total_bytes": 141 * GIB,
            "temperature_c": None,
            "power_watts": None,
        },
    ]


def test_gpu_devices_restrict_the_gpus_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    """`--gpu-devices-file` (issue 19): only the listed UUIDs count; none, no GPU."""
    _fake_nvml(
        monkeypatch,
        [
            _Gpu("H200", temperature=40, utilization=10, used=1 * GIB, total=80 * GIB),
            _Gpu("H200", temperature=85, utilization=99, used=79 * GIB, total=80 * GIB),
        ],
    )
    monkeypatch.setattr(pynvml, "nvmlDeviceGetUUID", lambda index: f"GPU-{index}".encode())
    assert HardwareSampler(frozenset({"GPU-0"})).sample()["gpu_temperature_c"] == 40.0
    assert HardwareSampler(None).sample()["gpu_temperature_c"] == 85.0
    nothing = HardwareSampler(frozenset()).sample()
    assert nothing["gpu_temperature_c"] is None and nothing["gpu_util_percent"] is None


def test_gpu_records_keep_their_nvml_index_when_devices_leave_some_out(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Upstream: GPUs 0 and 2 of a host are series `gpu_index` 0 and 2, not 0 and 1."""
    _fake_nvml(
        monkeypatch,
        [
            _Gpu("H200", temperature=40, utilization=10, used=GIB, total=80 * GIB),
            _Gpu("H200", temperature=50, utilization=20, used=GIB, total=80 * GIB),
            _Gpu("H200", temperature=60, utilization=30, used=GIB, total=80 * GIB),
        ],
    )
    monkeypatch.setattr(pynvml, "nvmlDeviceGetUUID", lambda index: f"GPU-{index}")
    gpus = HardwareSampler(frozenset({"GPU-0", "GPU-2"})).sample()["gpus"]
    assert [(g["index"], g["temperature_c"]) for g in gpus] == [(0, 40.0), (2, 60.0)]


@pytest.mark.parametrize("failing", ["nvmlDeviceGetHandleByIndex", "nvmlDeviceGetUUID"])
def test_a_gpu_nvml_cannot_reach_is_left_out_alone(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, failing: str
) -> None:
    """One GPU fallen off the bus must not hide the others (a hot one among them)."""
    _fake_nvml(
        monkeypatch,
        [
            _Gpu("H100", temperature=88, utilization=90, used=GIB, total=80 * GIB),
            _Gpu("H100", temperature=40, utilization=10, used=GIB, total=80 * GIB),
            _Gpu("H100", temperature=45, utilization=15, used=GIB, total=80 * GIB),
        ],
    )
    monkeypatch.setattr(pynvml, "nvmlDeviceGetUUID", lambda index: f"GPU-{index}")
    works = getattr(pynvml, failing)

    def lost(index: int) -> object:
        if index == 1:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)
        return works(index)

    monkeypatch.setattr(pynvml, failing, lost)
    with caplog.at_level("WARNING", logger="agent"):
        values = HardwareSampler(frozenset({"GPU-0", "GPU-1", "GPU-2"})).sample()
    assert values["gpu_temperature_c"] == 88.0
    assert [g["index"] for g in values["gpus"]] == [0, 2]
    assert [r.getMessage() for r in caplog.records] == [
        'hardware_gpu_unavailable index=1 error="GPU is lost"'
    ]


def test_nvml_unavailable_is_said_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def fail() -> None:
        raise pynvml.NVMLError(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)

    monkeypatch.setattr(pynvml, "nvmlInit", fail)
    with caplog.at_level("WARNING", logger="agent"):
        sampler = HardwareSampler()
        sampler.sample()
        sampler.sample()
    assert [r.getMessage() for r in caplog.records] == [
        'hardware_nvml_unavailable error="NVML Shared Library Not Found"'
    ]
