"""``dbo-runtime sms``: split, JSON schema, error lines, NVML/CUDA merging.

The no-GPU path runs for real (this box has no NVIDIA driver and CPU torch);
the NVML-present path uses ``tests/fakes/fake_pynvml.py`` at the driver
boundary (twin: ``tests/gpu/test_cli_gpu.py``).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dbo_runtime.adapters import cuda_devices, nvml
from dbo_runtime.cli.main import main
from tests.fakes.fake_cuda_devices import fake_cuda_device, fake_cuda_scan
from tests.fakes.fake_pynvml import FakeGpu, FakeMig, FakePynvml, NVMLError_DriverNotLoaded, h200, h200_mig

ROOT = Path(__file__).resolve().parents[2]

DEVICE_KEYS = {
    "label", "kind", "nvml_index", "cuda_index", "mig_slot", "name", "uuid", "compute_capability",
    "sms", "sms_source", "sms_cuda", "sms_nvml_mig_attributes", "sms_nvml_cores", "nvml_gpu_cores",
    "cores_per_sm", "sms_consistent", "mig_enabled", "sm_clock_mhz", "max_sm_clock_mhz",
    "utilization_gpu_pct", "utilization_memory_pct", "budget", "note", "warnings",
}  # fmt: skip
BUDGET_KEYS = {
    "total", "comm", "compute", "partitioned", "comm_knob", "compute_knob", "rocm_override",
    "env_comm_sms", "max_sms_used", "expert_parallel", "describe", "deepep_sms",
}  # fmt: skip


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_DBO_COMM_SMS", raising=False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("COLUMNS", raising=False)  # a narrow terminal width would fold table cells


def run_json(capsys: pytest.CaptureFixture[str], *args: str) -> dict:
    rc = main(["sms", "--json", *args])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert err == ""
    return json.loads(out)


def split(device: dict) -> tuple[int, int, int]:
    b = device["budget"]
    return b["total"], b["comm"], b["compute"]


def use_fake_nvml(monkeypatch: pytest.MonkeyPatch, fake: FakePynvml) -> FakePynvml:
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    return fake


# -- the split, from --total-sms ---------------------------------------------------------------


def test_embedded_h200_profile_json_schema_and_ht_split(capsys: pytest.CaptureFixture[str]) -> None:
    doc = run_json(capsys, "--total-sms", "132")
    assert doc["schema"] == "dbo-runtime/sms/v1"
    assert doc["source"] == "--total-sms"
    assert doc["settings"] == {
        "platform": "cuda",
        "all2all_backend": "deepep_high_throughput",
        "enable_dbo": True,
        "expert_parallel": True,
        "comm_sms": 20,
        "comm_sms_source": "default",
        "max_sms_used": None,
        "max_sms_used_source": "vllm-0.33.0-manager",
        "deep_gemm": True,
    }
    assert doc["nvml"]["available"] is None and doc["cuda"]["available"] is None
    [dev] = doc["devices"]
    assert set(dev) == DEVICE_KEYS
    assert set(dev["budget"]) == BUDGET_KEYS
    assert dev["name"] == "NVIDIA H200 (embedded profile)"
    assert (dev["sms"], dev["sms_source"], dev["kind"]) == (132, "--total-sms", "profile")
    assert split(dev) == (132, 20, 112)
    assert dev["budget"]["comm_knob"] and dev["budget"]["compute_knob"] and dev["budget"]["partitioned"]


def test_other_total_is_not_called_h200(capsys: pytest.CaptureFixture[str]) -> None:
    [dev] = run_json(capsys, "--total-sms", "78")["devices"]
    assert "H200" not in dev["name"] and "78" in dev["name"]
    assert split(dev) == (78, 20, 58)


@pytest.mark.parametrize("backend", ["deepep_low_latency", "nixl_ep"])
def test_low_latency_and_nixl_do_not_partition(capsys: pytest.CaptureFixture[str], backend: str) -> None:
    doc = run_json(capsys, "--total-sms", "132", "--all2all-backend", backend)
    [dev] = doc["devices"]
    assert split(dev) == (132, 0, 132)
    assert doc["settings"]["max_sms_used"] == 0
    assert not dev["budget"]["comm_knob"] and not dev["budget"]["compute_knob"]


def test_table_shows_split_and_knobs(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["sms", "--total-sms", "132"]) == 0
    out = capsys.readouterr().out
    assert "NVIDIA H200 (embedded profile)" in out
    assert main(["sms", "--total-sms", "132", "--platform", "rocm"]) == 0  # 132 compute units on ROCm: not an H200
    rocm = capsys.readouterr().out
    assert "NVIDIA H200" not in rocm and "GPU with 132 SMs (--total-sms)" in rocm
    assert "132/20/112" in out
    assert "DeepGEMM set_num_sms(112)" in out and "all2all set_num_sms(20)" in out
    assert main(["sms", "--total-sms", "132", "--all2all-backend", "deepep_low_latency"]) == 0
    out = capsys.readouterr().out
    assert "132/0/132" in out and "none (no partition)" in out


def test_rocm_deepep_ht_override_forces_comm_zero(capsys: pytest.CaptureFixture[str]) -> None:
    [dev] = run_json(capsys, "--total-sms", "304", "--platform", "rocm")["devices"]
    assert split(dev) == (304, 0, 304)
    assert dev["budget"]["rocm_override"] is True
    assert main(["sms", "--total-sms", "304", "--platform", "rocm"]) == 0
    assert "ROCm HT override" in capsys.readouterr().out


def test_rocm_default_comm_is_64_for_allgather_reducescatter(capsys: pytest.CaptureFixture[str]) -> None:
    doc = run_json(capsys, "--total-sms", "304", "--platform", "rocm", "--all2all-backend", "allgather_reducescatter")
    assert doc["settings"]["comm_sms"] == 64
    assert split(doc["devices"][0]) == (304, 64, 240)
    assert doc["devices"][0]["budget"]["rocm_override"] is False


def test_no_expert_parallel_still_lowers_deep_gemm(capsys: pytest.CaptureFixture[str]) -> None:
    [dev] = run_json(capsys, "--total-sms", "132", "--no-expert-parallel")["devices"]
    assert split(dev) == (132, 20, 112)
    assert dev["budget"]["comm_knob"] is False and dev["budget"]["compute_knob"] is True
    # without EP vLLM never asks the manager, so max_sms_used does not cap comm
    [dev] = run_json(capsys, "--total-sms", "132", "--no-expert-parallel", "--all2all-backend", "deepep_low_latency")["devices"]
    assert split(dev) == (132, 20, 112)


def test_no_deep_gemm_reserves_comm_but_leaves_compute_knob(capsys: pytest.CaptureFixture[str]) -> None:
    [dev] = run_json(capsys, "--total-sms", "132", "--no-deep-gemm")["devices"]
    assert split(dev) == (132, 20, 112)
    assert dev["budget"]["compute_knob"] is False and dev["budget"]["comm_knob"] is True


def test_max_sms_used_override(capsys: pytest.CaptureFixture[str]) -> None:
    doc = run_json(capsys, "--total-sms", "132", "--max-sms-used", "10")
    assert doc["settings"]["max_sms_used_source"] == "--max-sms-used"
    assert split(doc["devices"][0]) == (132, 10, 122)
    doc = run_json(capsys, "--total-sms", "132", "--all2all-backend", "deepep_low_latency", "--max-sms-used", "none")
    assert split(doc["devices"][0]) == (132, 20, 112)


def test_comm_from_env_and_flag_precedence(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_DBO_COMM_SMS", "24")
    doc = run_json(capsys, "--total-sms", "132")
    assert (doc["settings"]["comm_sms"], doc["settings"]["comm_sms_source"]) == (24, "VLLM_DBO_COMM_SMS")
    assert split(doc["devices"][0]) == (132, 24, 108)
    doc = run_json(capsys, "--total-sms", "132", "--comm-sms", "16")
    assert (doc["settings"]["comm_sms"], doc["settings"]["comm_sms_source"]) == (16, "--comm-sms")
    assert split(doc["devices"][0]) == (132, 16, 116)


def test_odd_comm_is_fine_when_deepep_ht_is_not_used(capsys: pytest.CaptureFixture[str]) -> None:
    [dev] = run_json(capsys, "--total-sms", "132", "--comm-sms", "21", "--all2all-backend", "deepep_low_latency")["devices"]
    assert split(dev) == (132, 0, 132)


# -- bad values: one line naming the parameter and the allowed values ----------------------------


@pytest.mark.parametrize(
    ("args", "env", "parameter", "allowed"),
    [
        (["--all2all-backend", "foo"], None, "--all2all-backend='foo'", "deepep_high_throughput, deepep_low_latency, nixl_ep"),
        (["--all2all-backend", "naive"], None, "--all2all-backend='naive'", "with DBO on cuda"),
        (["--all2all-backend", "DEEPEP_LOW_LATENCY"], None, "--all2all-backend='DEEPEP_LOW_LATENCY'", "(did you mean 'deepep_low_latency'?)"),
        (["--comm-sms", "132"], None, "--comm-sms=132", "[0, 130]"),  # the H200 profile is SM90: DeepGEMM keeps an even share
        (["--comm-sms", "19"], None, "--comm-sms=19", "even integers"),
        (["--comm-sms", "-4"], None, "--comm-sms=-4", "integers >= 0"),
        (["--comm-sms", "many"], None, "--comm-sms='many'", "integers >= 0"),
        (["--total-sms", "0"], None, "--total-sms=0", "integers in [21, 1024], above the comm share 20"),
        (["--total-sms", "abc"], None, "--total-sms='abc'", "integers in [21, 1024], above the comm share 20"),
        (["--platform", "tpu"], None, "--platform='tpu'", "'cuda', 'rocm'"),
        (["--max-sms-used", "-1"], None, "--max-sms-used=-1", "integers >= 0, or 'none'"),
        (["--max-sms-used", "None"], None, "--max-sms-used='None'", "integers >= 0, or 'none'"),  # word options are lower case
        ([], "abc", "VLLM_DBO_COMM_SMS='abc'", "integers >= 0"),
        ([], "140", "VLLM_DBO_COMM_SMS=140", "[0, 130]"),
    ],
)
def test_bad_values_give_one_line_and_exit_2(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    args: list[str],
    env: str | None,
    parameter: str,
    allowed: str,
) -> None:
    if env is not None:
        monkeypatch.setenv("VLLM_DBO_COMM_SMS", env)
    base = [] if "--total-sms" in args else ["--total-sms", "132"]
    rc = main(["sms", *base, *args])
    out, err = capsys.readouterr()
    assert rc == 2
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("dbo-runtime sms: error: " + parameter)
    assert allowed in lines[0]
    assert "Traceback" not in err


def test_table_shows_the_deepep_ht_clamp_vllm_applies(capsys: pytest.CaptureFixture[str]) -> None:
    """vLLM's HT manager clamps set_num_sms to 20: --comm-sms 32 takes 32 SMs from DeepGEMM, DeepEP gets 20."""
    [dev] = run_json(capsys, "--total-sms", "132", "--comm-sms", "32")["devices"]
    assert split(dev) == (132, 32, 100) and dev["budget"]["deepep_sms"] == 20
    assert any("12 of the 32 comm SMs stay idle" in w for w in dev["warnings"])
    assert main(["sms", "--total-sms", "132", "--comm-sms", "32"]) == 0
    out = capsys.readouterr().out
    assert "all2all set_num_sms(32) -> DeepEP 20 (HT clamp)" in out
    assert "warning: device profile: 12 of the 32 comm SMs stay idle" in out
    [dev] = run_json(capsys, "--total-sms", "132")["devices"]
    assert dev["budget"]["deepep_sms"] == 20 and dev["warnings"] == []
    [dev] = run_json(capsys, "--total-sms", "132", "--all2all-backend", "deepep_low_latency", "--max-sms-used", "none")["devices"]
    assert dev["budget"]["comm_knob"] and dev["budget"]["deepep_sms"] is None  # LL's set_num_sms is vLLM's base no-op


def test_degenerate_split_is_warned(capsys: pytest.CaptureFixture[str]) -> None:
    [dev] = run_json(capsys, "--total-sms", "132", "--comm-sms", "130")["devices"]
    assert split(dev) == (132, 130, 2)
    assert any(w.startswith("compute 2 of 132 SMs is less than the comm share 130") for w in dev["warnings"])
    assert main(["sms", "--total-sms", "132", "--comm-sms", "130"]) == 0
    assert "warning: device profile: compute 2 of 132 SMs" in capsys.readouterr().out
    [dev] = run_json(capsys, "--total-sms", "133", "--comm-sms", "132")["devices"]  # no architecture: vLLM's rule
    assert split(dev) == (133, 132, 1)


def test_sm90_leaves_no_compute_sm_for_an_odd_remainder(capsys: pytest.CaptureFixture[str]) -> None:
    """131 comm SMs on the H200 leave 1 compute SM, which SM90's even rounding makes 0: refused, naming the range."""
    assert main(["sms", "--total-sms", "132", "--comm-sms", "131"]) == 2
    err = capsys.readouterr().err
    assert "--comm-sms=131 is not allowed; allowed values: integers in [0, 130]" in err
    assert "multiple of 2 on SM90" in err


def test_json_errors_are_json_on_stdout(capsys: pytest.CaptureFixture[str]) -> None:
    if cuda_devices.scan().devices:
        pytest.skip("this machine has a CUDA device; the no-GPU path is exercised on the CPU box")
    assert main(["sms", "--json"]) == 3
    out, err = capsys.readouterr()
    doc = json.loads(out)
    assert doc["schema"] == "dbo-runtime/sms/v1" and doc["exit_code"] == 3 and "no GPU visible" in doc["error"]["message"]
    assert "no GPU visible" in err
    assert main(["sms", "--json", "--total-sms", "x"]) == 2
    doc = json.loads(capsys.readouterr().out)
    assert doc["error"]["parameter"] == "--total-sms" and doc["error"]["allowed"].startswith("integers in [21, 1024]")


def test_unknown_flag_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["sms", "--bogus"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "--bogus" in err


# -- hardware paths ------------------------------------------------------------------------------


def test_no_gpu_for_real_is_one_line_exit_3(capsys: pytest.CaptureFixture[str]) -> None:
    if cuda_devices.scan().devices:
        pytest.skip("this machine has a CUDA device; the no-GPU path is exercised on the CPU box")
    rc = main(["sms"])
    out, err = capsys.readouterr()
    assert rc == 3
    assert out == ""
    [line] = err.strip().splitlines()
    assert "no GPU visible" in line and "NVML" in line and "torch.cuda.is_available() is False" in line
    assert "--total-sms" in line


def test_cuda_scan_does_not_initialise_cuda_without_gpu() -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("CUDA present")
    scan = cuda_devices.scan()
    assert scan.devices == () and "is_available() is False" in scan.reason
    assert torch.cuda.is_initialized() is False


def test_fake_nvml_h200_uses_cores_cross_check_when_cuda_is_absent(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = use_fake_nvml(monkeypatch, FakePynvml([h200()]))
    monkeypatch.setattr(cuda_devices, "scan", lambda: fake_cuda_scan())
    doc = run_json(capsys)
    assert doc["source"] == "hardware"
    assert doc["nvml"] == {"available": True, "detail": "1 GPU(s)", "driver_version": "580.95.05"}
    [dev] = doc["devices"]
    assert dev["kind"] == "gpu" and dev["name"] == "NVIDIA H200" and dev["compute_capability"] == "9.0"
    assert (dev["nvml_gpu_cores"], dev["cores_per_sm"], dev["sms_nvml_cores"]) == (16896, 128, 132)
    assert (dev["sms"], dev["sms_source"]) == (132, "nvml-cores")
    assert dev["sms_nvml_mig_attributes"] is None  # NotSupported on a full GPU, degraded to None
    assert dev["mig_enabled"] is False
    assert (dev["sm_clock_mhz"], dev["max_sm_clock_mhz"], dev["utilization_gpu_pct"]) == (345, 1980, 7)
    assert split(dev) == (132, 20, 112)
    assert fake.inits == fake.shutdowns == 1


def test_sm90_hardware_rows_round_deep_gemm_like_the_worker(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`sms` showed vLLM's odd DeepGEMM count (111 with VLLM_DBO_COMM_SMS=21) where the worker sets 110 on
    SM90 (the 2-CTA paged-MQA kernel fails on odd counts); the embedded H200 profile is SM90, other --total-sms profiles have no architecture."""
    use_fake_nvml(monkeypatch, FakePynvml([h200()]))
    monkeypatch.setattr(cuda_devices, "scan", lambda: fake_cuda_scan())
    [dev] = run_json(capsys, "--comm-sms", "21")["devices"]
    assert dev["compute_capability"] == "9.0" and split(dev) == (132, 21, 110)
    [profile] = run_json(capsys, "--total-sms", "132", "--comm-sms", "21")["devices"]
    assert profile["compute_capability"] == "9.0" and split(profile) == (132, 21, 110)  # the H200 profile is SM90
    [other] = run_json(capsys, "--total-sms", "131", "--comm-sms", "21")["devices"]
    assert other["compute_capability"] is None and split(other) == (131, 21, 110)  # even already
    [odd] = run_json(capsys, "--total-sms", "130", "--comm-sms", "21")["devices"]
    assert split(odd) == (130, 21, 109)  # architecture unknown: vLLM's own count


def test_fake_nvml_merges_cuda_device_by_uuid_and_flags_mismatch(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    gpu0, gpu1 = h200(), h200()
    gpu1.uuid = "GPU-6b1f0c2e-0000-4000-8000-000000000002"
    use_fake_nvml(monkeypatch, FakePynvml([gpu0, gpu1]))
    # CUDA enumerates in another order than NVML, spells UUIDs without "GPU-", and sees a third device
    scan = fake_cuda_scan(
        fake_cuda_device(0, 114, gpu1.uuid[4:].upper()),
        fake_cuda_device(1, 132, gpu0.uuid[4:]),
        fake_cuda_device(2, 78, None, name="NVIDIA H100 PCIe"),
    )
    monkeypatch.setattr(cuda_devices, "scan", lambda: scan)
    devs = run_json(capsys)["devices"]
    assert [(d["label"], d["kind"], d["cuda_index"]) for d in devs] == [("0", "gpu", 1), ("1", "gpu", 0), ("cuda:2", "cuda", 2)]
    assert (devs[0]["sms"], devs[0]["sms_source"], devs[0]["sms_consistent"]) == (132, "cuda", True)
    assert (devs[1]["sms"], devs[1]["sms_cuda"], devs[1]["sms_nvml_cores"], devs[1]["sms_consistent"]) == (114, 114, 132, False)
    assert split(devs[1]) == (114, 20, 94)
    assert (devs[2]["sms"], devs[2]["sms_source"]) == (78, "cuda")
    assert main(["sms"]) == 0
    assert "MISMATCH" in capsys.readouterr().out


def test_fake_nvml_mig_instances_get_their_own_split(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    gpu = h200_mig(
        FakeMig("NVIDIA H200 MIG 3g.71gb", "MIG-aaaa-0001", 60, gpu_instance_id=2),
        None,
        FakeMig("NVIDIA H200 MIG 2g.35gb", "MIG-aaaa-0002", 32, gpu_instance_id=5, gpu_instance_slice_count=2),
    )
    use_fake_nvml(monkeypatch, FakePynvml([gpu]))
    monkeypatch.setattr(cuda_devices, "scan", lambda: fake_cuda_scan())
    devs = run_json(capsys)["devices"]
    assert [d["label"] for d in devs] == ["0", "0 MIG 0", "0 MIG 2"]
    parent, mig0, mig2 = devs
    assert parent["mig_enabled"] is True and parent["budget"] is None and "MIG enabled" in parent["note"]
    assert parent["utilization_gpu_pct"] is None  # NotSupported in MIG mode
    assert (mig0["kind"], mig0["sms"], mig0["sms_source"], mig0["mig_slot"]) == ("mig", 60, "nvml-mig-attributes", 0)
    assert split(mig0) == (60, 20, 40)
    assert (mig2["sms"], split(mig2)) == (32, (32, 20, 12))
    assert main(["sms"]) == 0
    out = capsys.readouterr().out
    assert "0 MIG 2" in out and "60/20/40" in out and "MIG attributes 32" in out


def test_fake_nvml_mig_slice_smaller_than_comm_is_a_named_error(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    use_fake_nvml(monkeypatch, FakePynvml([h200_mig(FakeMig("NVIDIA H200 MIG 1g.18gb", "MIG-bbbb-0001", 16))]))
    monkeypatch.setattr(cuda_devices, "scan", lambda: fake_cuda_scan())
    assert main(["sms"]) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    # nobody set the comm share: the line says so instead of quoting a value as if it had been set
    assert line.startswith("dbo-runtime sms: error: VLLM_DBO_COMM_SMS=<not set: default 20> is not allowed")
    assert "[0, 14]" in line and "device 0 MIG 0" in line and "set VLLM_DBO_COMM_SMS or pass --comm-sms" in line
    assert main(["sms", "--comm-sms", "8"]) == 0
    assert "16/8/8" in capsys.readouterr().out


def test_fake_nvml_not_supported_fields_degrade_to_none(monkeypatch: pytest.MonkeyPatch) -> None:
    [whole] = nvml.query(FakePynvml([FakeGpu()])).gpus
    assert whole.memory_total_bytes == 143_771 * 2**20
    gpu = FakeGpu(unsupported={"nvmlDeviceGetClockInfo", "nvmlDeviceGetNumGpuCores", "nvmlDeviceGetMigMode", "nvmlDeviceGetUUID", "nvmlDeviceGetMemoryInfo"})
    snap = nvml.query(FakePynvml([gpu]))
    [g] = snap.gpus
    assert g.name == "NVIDIA H200" and g.max_sm_clock_mhz == 1980 and g.memory_total_bytes is None
    assert g.sm_clock_mhz is None and g.num_gpu_cores is None and g.sms_from_cores is None
    assert g.mig_enabled is None and g.uuid is None and g.mig_devices == ()


def test_nvml_init_failure_and_no_cuda_is_exit_3(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    use_fake_nvml(monkeypatch, FakePynvml([], init_error=NVMLError_DriverNotLoaded()))
    monkeypatch.setattr(cuda_devices, "scan", lambda: fake_cuda_scan())
    assert main(["sms", "--json"]) == 3
    out, err = capsys.readouterr()
    assert json.loads(out)["exit_code"] == 3 and "Driver Not Loaded" in err and len(err.strip().splitlines()) == 1


def test_cores_per_sm_table() -> None:
    assert nvml.cores_per_sm((9, 0)) == 128
    assert nvml.cores_per_sm((8, 0)) == 64
    assert nvml.cores_per_sm((8, 9)) == 128
    assert nvml.cores_per_sm((99, 0)) is None
    assert nvml.cores_per_sm(None) is None


def test_plain_table_when_rich_is_absent(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("rich", "rich.console", "rich.table", "rich.text"):
        monkeypatch.setitem(sys.modules, name, None)
    assert main(["sms", "--total-sms", "132"]) == 0
    out = capsys.readouterr().out
    assert "132/20/112" in out and "NVIDIA H200 (embedded profile)" in out
    assert "┃" not in out  # not rich's box drawing


# -- entry points --------------------------------------------------------------------------------


def test_help_lists_discovered_subcommands(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "sms" in out and "doctor" in out
    assert main([]) == 2


def test_console_script_and_module_entry_in_subprocesses() -> None:
    script = shutil.which("dbo-runtime", path=str(Path(sys.executable).parent))
    assert script is not None, "dbo-runtime console script missing: pip install -e . in the venv"
    env = {k: v for k, v in os.environ.items() if k != "VLLM_DBO_COMM_SMS"}
    ok = subprocess.run([script, "sms", "--total-sms", "132", "--json"], capture_output=True, text=True, env=env, timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert split(json.loads(ok.stdout)["devices"][0]) == (132, 20, 112)
    bad = subprocess.run([script, "sms", "--total-sms", "132", "--comm-sms", "19"], capture_output=True, text=True, env=env, timeout=120)
    assert bad.returncode == 2 and bad.stdout == ""
    assert len(bad.stderr.strip().splitlines()) == 1 and "Traceback" not in bad.stderr
    # `sms` must not import vLLM (the GPU box has none): run it through `python -m dbo_runtime`'s main
    code = (
        "import sys; from dbo_runtime.cli.main import main; "
        "rc = main(['sms', '--total-sms', '132', '--json']); "
        "main(['sms', '--json']); "  # the hardware path too (exit 3 on this box, 0 on a GPU box)
        "sys.exit(rc if 'vllm' not in sys.modules else 99)"
    )
    probe = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert probe.returncode == 0, probe.stderr
    mod = subprocess.run([sys.executable, "-m", "dbo_runtime", "sms", "--total-sms", "132"], capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert mod.returncode == 0 and "132/20/112" in mod.stdout


@pytest.mark.parametrize(
    ("name", "value", "said"),
    [
        ("DBO_RUNTIME_TOPK_LAYOUT", "bogus", "DBO_RUNTIME_TOPK_LAYOUT='bogus' is not allowed"),
        ("DBO_RUNTIME_PLANNER_WARM_MAX_BATCH", "-1", "DBO_RUNTIME_PLANNER_WARM_MAX_BATCH=-1 is not allowed"),
        ("VLLM_DEEP_GEMM_WARMUP", "FULL", "VLLM_DEEP_GEMM_WARMUP='FULL' is not allowed"),
    ],
)
def test_a_setting_a_server_refuses_is_a_warning_the_split_still_shown(
    name: str, value: str, said: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """sms does not read these settings, but doctor and the server refuse them: warned in the same words."""
    monkeypatch.setenv(name, value)
    assert main(["sms", "--json", "--total-sms", "132"]) == 0
    out, err = capsys.readouterr()
    doc = json.loads(out)
    [line] = err.splitlines()
    assert line.startswith(f"dbo-runtime sms: warning: {said}") and "a server refuses it at engine start" in line
    assert line.removeprefix("dbo-runtime sms: warning: ") in doc["warnings"]
    assert split(doc["devices"][0]) == (132, 20, 112)


def test_the_plugins_settings_are_not_warned_about_while_it_is_disabled(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """As doctor: DBO_RUNTIME_DISABLE=1 never reads them (vLLM's own are still read)."""
    monkeypatch.setenv("DBO_RUNTIME_DISABLE", "1")
    monkeypatch.setenv("DBO_RUNTIME_TOPK_LAYOUT", "bogus")
    assert main(["sms", "--total-sms", "132"]) == 0
    assert "TOPK_LAYOUT" not in capsys.readouterr().err


@pytest.mark.parametrize(
    ("args", "unused"),
    [
        (["--all2all-backend", "deepep_low_latency", "--comm-sms", "99999999999"], "deepep_low_latency with expert parallelism reserves no comm SMs"),
        (["--all2all-backend", "nixl_ep", "--comm-sms", "132"], "nixl_ep with expert parallelism reserves no comm SMs"),
        (["--platform", "rocm", "--comm-sms", "200"], "ROCm with DeepEP high-throughput reserves no CUs"),
    ],
)
def test_a_comm_share_the_device_cannot_hold_is_refused_with_every_backend(
    args: list[str], unused: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """vLLM never applies it there (it lowers the share to 0 first), but the same variable stops an engine whose
    backend differs: refused as under high-throughput, with the device's range."""
    assert main(["sms", "--total-sms", "132", *args]) == 2
    [line] = capsys.readouterr().err.splitlines()
    value = args[-1]
    assert line.startswith(f"dbo-runtime sms: error: --comm-sms={value} is not allowed; allowed values: integers in [0, 131]")
    assert unused in line


def test_a_comm_share_the_device_holds_stays_accepted_where_it_is_unused(capsys: pytest.CaptureFixture[str]) -> None:
    [dev] = run_json(capsys, "--total-sms", "132", "--all2all-backend", "deepep_low_latency", "--comm-sms", "131")["devices"]
    assert split(dev) == (132, 0, 132)
    [dev] = run_json(capsys, "--total-sms", "132", "--platform", "rocm", "--comm-sms", "131")["devices"]
    assert dev["budget"]["rocm_override"] is True


def test_the_environments_comm_share_gets_the_same_refusal_in_verify_and_tune(monkeypatch: pytest.MonkeyPatch) -> None:
    from dbo_runtime.cli._engine import comm_sms_problem

    env = {"VLLM_DBO_COMM_SMS": "500"}
    problem = comm_sms_problem(["--all2all-backend", "deepep_low_latency"], env)
    assert problem is not None and problem.parameter == "VLLM_DBO_COMM_SMS" and "integers in [0, 131]" in problem.allowed


@pytest.mark.parametrize("typed", ["NAIVE", "ALLGATHER_REDUCESCATTER"])
def test_no_backend_hint_points_at_a_backend_the_same_check_refuses(typed: str, capsys: pytest.CaptureFixture[str]) -> None:
    """naive has no DBO and allgather_reducescatter is ROCm's: offering either on CUDA would only earn a second
    refusal, so the case hint comes from the backends this platform allows."""
    assert main(["sms", "--total-sms", "132", "--all2all-backend", typed]) == 2
    line = capsys.readouterr().err.strip()
    assert line.endswith(f"{typed!r} is not a vLLM backend)") and "did you mean" not in line, line


def test_a_bad_comm_env_hidden_by_the_flag_is_still_said(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """``--comm-sms`` is a what-if and wins, but a ``VLLM_DBO_COMM_SMS`` vLLM would refuse stays in the environment
    a server starts from: one warning on stderr and in the JSON, never silence. A valid one the flag overrides is
    no problem."""
    monkeypatch.setenv("VLLM_DBO_COMM_SMS", "abc")
    assert main(["sms", "--json", "--total-sms", "132", "--comm-sms", "10"]) == 0
    out, err = capsys.readouterr()
    doc = json.loads(out)
    [said] = [w for w in doc["warnings"] if "VLLM_DBO_COMM_SMS" in w]
    assert said.startswith("VLLM_DBO_COMM_SMS='abc' in this environment is not an integer >= 0: --comm-sms 10 stands in")
    assert split(doc["devices"][0]) == (132, 10, 122) and f"dbo-runtime sms: warning: {said}" in err
    monkeypatch.setenv("VLLM_DBO_COMM_SMS", "16")
    assert not [w for w in run_json(capsys, "--total-sms", "132", "--comm-sms", "10")["warnings"] if "VLLM_DBO_COMM_SMS" in w]
