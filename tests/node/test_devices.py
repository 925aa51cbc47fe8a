"""Device detection: each source's parsing, the precedence, CPU nodes and the CUDA-node error."""

from __future__ import annotations

import pytest

from kserve_trio.core.errors import ConfigError
from kserve_trio.node._devices import (
    NO_GPUS_MESSAGE,
    Machine,
    check_devices,
    cpu_threads,
    cpu_workers,
    detect_devices,
    devfs_devices,
    node_backend,
    parse_cpu_max,
    parse_gpus_env,
    parse_nvidia_smi,
    parse_visible_devices,
)


def machine(smi: str | None = None, dev: list[str] | None = None, calls: list | None = None):
    """A fake machine whose probes record that they ran."""
    log = calls if calls is not None else []

    def nvidia_smi():
        log.append("nvidia-smi")
        return smi

    def dev_names():
        log.append("/dev")
        return dev or []

    return Machine(nvidia_smi, dev_names, lambda: [0, 1], lambda: None)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("2", ["0", "1"]),
        ("0", []),
        (" 3 ", ["0", "1", "2"]),
        ("1,3", ["1", "3"]),
        ("GPU-aaaa, GPU-bbbb", ["GPU-aaaa", "GPU-bbbb"]),
        ("5", ["0", "1", "2", "3", "4"]),
    ],
)
def test_gpus_env_is_a_count_or_a_list(text, expected):
    assert parse_gpus_env(text) == expected


@pytest.mark.parametrize("text", ["", "  ", "1,,2", "1,"])
def test_gpus_env_rejects_empty_values_and_entries(text):
    with pytest.raises(ConfigError, match="KSERVE_TRIO_GPUS"):
        parse_gpus_env(text)


@pytest.mark.parametrize(
    ("text", "expected"),
    [("", []), ("0,1", ["0", "1"]), (" 2 , 3 ", ["2", "3"]), ("-1", []), ("1,-1,2", ["1"])],
)
def test_visible_devices_read_as_cuda_reads_them(text, expected):
    assert parse_visible_devices(text) == expected


def test_nvidia_smi_output_gives_the_indices():
    assert parse_nvidia_smi("0\n1\n\n 2 \n") == ["0", "1", "2"]
    assert parse_nvidia_smi("No devices were found\n") == []


def test_devfs_takes_plain_numeric_nodes_sorted_as_numbers():
    names = ["nvidia10", "nvidiactl", "nvidia2", "nvidia-uvm", "nvidia0", "nvidia-caps", "null"]
    assert devfs_devices(names) == ["0", "2", "10"]


def test_precedence_env_beats_everything_and_probes_do_not_run():
    calls: list[str] = []
    env = {"KSERVE_TRIO_GPUS": "1", "CUDA_VISIBLE_DEVICES": "4,5"}
    found = detect_devices({"gpus": 3}, env, machine("0\n1\n", calls=calls), auto_detect=True)
    assert found.devices == ("0",)
    assert found.source == "KSERVE_TRIO_GPUS"
    assert calls == []


def test_precedence_node_gpus_beat_the_machine():
    calls: list[str] = []
    env = {"CUDA_VISIBLE_DEVICES": "4,5"}
    found = detect_devices(
        {"gpus": [2, "GPU-x"]}, env, machine("0\n", calls=calls), auto_detect=True
    )
    assert found.devices == ("2", "GPU-x")
    assert found.source == "node gpus"
    assert detect_devices({"gpus": 2}, env, machine(), auto_detect=True).devices == ("0", "1")
    assert calls == []


def test_precedence_auto_falls_through_to_cuda_visible_devices():
    calls: list[str] = []
    found = detect_devices(
        {"gpus": "AUTO"},
        {"CUDA_VISIBLE_DEVICES": "3,1"},
        machine("0\n", calls=calls),
        auto_detect=True,
    )
    assert found.devices == ("3", "1")
    assert found.source == "CUDA_VISIBLE_DEVICES"
    assert calls == []


def test_empty_cuda_visible_devices_means_no_gpus_without_probing():
    calls: list[str] = []
    found = detect_devices(
        {}, {"CUDA_VISIBLE_DEVICES": ""}, machine("0\n", calls=calls), auto_detect=True
    )
    assert found.devices == ()
    assert calls == []


def test_precedence_nvidia_smi_then_devfs():
    calls: list[str] = []
    found = detect_devices({}, {}, machine("0\n1\n", ["nvidia7"], calls), auto_detect=True)
    assert (found.devices, found.source, calls) == (("0", "1"), "nvidia-smi", ["nvidia-smi"])
    calls.clear()
    found = detect_devices(
        {}, {}, machine(None, ["nvidia1", "nvidia0", "nvidiactl"], calls), auto_detect=True
    )
    assert (found.devices, found.source, calls) == (
        ("0", "1"),
        "/dev/nvidia*",
        ["nvidia-smi", "/dev"],
    )
    found = detect_devices({}, {}, machine("", ["nvidia3"]), auto_detect=True)
    assert found.devices == ("3",)  # nvidia-smi ran but listed nothing: devfs still answers
    found = detect_devices({}, {}, machine(None, ["null"]), auto_detect=True)
    assert (found.devices, found.source) == ((), "none")


def test_a_cpu_node_never_probes_the_machine_but_honours_explicit_devices():
    calls: list[str] = []
    env = {"CUDA_VISIBLE_DEVICES": "0,1"}
    found = detect_devices({}, env, machine("0\n1\n", ["nvidia0"], calls), auto_detect=False)
    assert (found.devices, found.source, calls) == ((), "cpu backend", [])
    assert detect_devices({"gpus": 1}, env, machine(), auto_detect=False).devices == ("0",)
    assert detect_devices({}, {"KSERVE_TRIO_GPUS": "2"}, machine(), auto_detect=False).devices == (
        "0",
        "1",
    )


def test_gpus_env_zero_is_a_cpu_node_even_with_devices_visible():
    found = detect_devices({}, {"KSERVE_TRIO_GPUS": "0"}, machine("0\n"), auto_detect=True)
    assert found.devices == ()


def test_backend_comes_from_env_then_global_runtime_then_cpu():
    assert node_backend({}, {}) == "cpu"
    assert node_backend({"global": {"runtime": {"backend": "GPU"}}}, {}) == "cuda"
    assert node_backend({"global": {"runtime": {"backend": "cuda"}}}, {}) == "cuda"
    env = {"INFERENCE_SERVER_RUNTIME_BACKEND": "cpu"}
    assert node_backend({"global": {"runtime": {"backend": "cuda"}}}, env) == "cpu"


def test_a_cuda_node_without_devices_is_a_clear_error():
    with pytest.raises(ConfigError) as info:
        check_devices("cuda", [])
    assert str(info.value) == NO_GPUS_MESSAGE
    assert "--gpus all" in NO_GPUS_MESSAGE
    assert "KSERVE_TRIO_GPUS" in NO_GPUS_MESSAGE
    assert "global.runtime.backend: cpu" in NO_GPUS_MESSAGE
    check_devices("cuda", ["0"])
    check_devices("cpu", [])


def test_cpu_workers_default_and_errors():
    assert cpu_workers({}) == 1
    assert cpu_workers({"KSERVE_TRIO_CPU_WORKERS": "3"}) == 3
    for bad in ("0", "-1", "two"):
        with pytest.raises(ConfigError, match="KSERVE_TRIO_CPU_WORKERS"):
            cpu_workers({"KSERVE_TRIO_CPU_WORKERS": bad})


def test_cpu_threads_is_the_affinity_capped_by_the_cgroup_quota():
    assert cpu_threads(list(range(8)), None) == 8
    assert cpu_threads(list(range(8)), 2.5) == 3
    assert cpu_threads(list(range(2)), 16.0) == 2
    assert cpu_threads([], None) == 1
    assert parse_cpu_max("max 100000\n") is None
    assert parse_cpu_max("200000 100000\n") == 2.0
    assert parse_cpu_max("garbage") is None
