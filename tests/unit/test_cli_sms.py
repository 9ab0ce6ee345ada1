"""``dbo-runtime sms``: the split vLLM applies, its JSON, and the NVML/CUDA merge.

The no-GPU path runs for real (no NVIDIA driver here, CPU torch); the NVML-present path uses
``tests/fakes/fake_pynvml.py`` at the driver boundary (twin: ``tests/gpu/test_cli_gpu.py``).
"""

from __future__ import annotations

import json
import sys

import pytest

from dbo_runtime.adapters import cuda_devices
from dbo_runtime.cli.main import main
from tests.fakes.fake_cuda_devices import fake_cuda_device, fake_cuda_scan
from tests.fakes.fake_pynvml import FakeMig, FakePynvml, NVMLError_DriverNotLoaded, h200, h200_mig

DEVICE_KEYS = {
    "label", "kind", "nvml_index", "cuda_index", "mig_slot", "name", "uuid", "compute_capability",
    "sms", "sms_source", "sms_cuda", "sms_nvml_mig_attributes", "sms_nvml_cores", "nvml_gpu_cores",
    "cores_per_sm", "sms_consistent", "mig_enabled", "budget", "note", "warnings",
}  # fmt: skip
BUDGET_KEYS = {
    "total", "comm", "compute", "partitioned", "comm_knob", "compute_knob", "rocm_override",
    "env_comm_sms", "max_sms_used", "expert_parallel", "describe", "deepep_sms",
}  # fmt: skip


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("VLLM_DBO_COMM_SMS", "CUDA_VISIBLE_DEVICES", "DBO_RUNTIME_DISABLE"):
        monkeypatch.delenv(name, raising=False)


def run_json(capsys: pytest.CaptureFixture[str], *args: str) -> dict:
    rc = main(["sms", "--json", *args])
    out, err = capsys.readouterr()
    assert rc == 0, err
    return json.loads(out)


def split(device: dict) -> tuple[int, int, int]:
    b = device["budget"]
    return b["total"], b["comm"], b["compute"]


def fake_gpus(monkeypatch: pytest.MonkeyPatch, fake: FakePynvml, *cuda: object) -> FakePynvml:
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.setattr(cuda_devices, "scan", lambda: fake_cuda_scan(*cuda))
    return fake


def test_the_h200_profile_json_and_the_ht_split(capsys: pytest.CaptureFixture[str]) -> None:
    doc = run_json(capsys, "--total-sms", "132")
    assert doc["schema"] == "dbo-runtime/sms/v1" and doc["source"] == "--total-sms"
    assert doc["settings"]["comm_sms"] == 20 and doc["settings"]["comm_sms_source"] == "default"
    assert isinstance(doc["vllm_release"], str) and doc["vllm_release"]
    [dev] = doc["devices"]
    assert set(dev) == DEVICE_KEYS and set(dev["budget"]) == BUDGET_KEYS
    assert (dev["name"], dev["sms"], dev["kind"]) == ("NVIDIA H200 (embedded profile)", 132, "profile")
    assert split(dev) == (132, 20, 112) and dev["budget"]["comm_knob"] and dev["budget"]["compute_knob"]
    [other] = run_json(capsys, "--total-sms", "78")["devices"]
    assert "H200" not in other["name"] and split(other) == (78, 20, 58)


@pytest.mark.parametrize("backend", ["deepep_low_latency", "nixl_ep"])
def test_low_latency_and_nixl_do_not_partition(capsys: pytest.CaptureFixture[str], backend: str) -> None:
    [dev] = run_json(capsys, "--total-sms", "132", "--all2all-backend", backend)["devices"]
    assert split(dev) == (132, 0, 132) and not dev["budget"]["compute_knob"]
    assert main(["sms", "--total-sms", "132", "--all2all-backend", backend]) == 0
    assert f"profile: no SM partition: {backend} reserves no comm SMs" in capsys.readouterr().out
    assert main(["sms", "--total-sms", "132", "--comm-sms", "0"]) == 0  # the user's 0, not the backend's
    assert "profile: no SM partition: comm_sms is 0 (--comm-sms)" in capsys.readouterr().out


def test_the_table_shows_the_split_the_knobs_and_the_release_verified(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["sms", "--total-sms", "132"]) == 0
    out = capsys.readouterr().out
    assert "132/20/112" in out and "DeepGEMM set_num_sms(112)" in out and "all2all set_num_sms(20)" in out
    assert "dbo_runtime verified: " in out
    assert main(["sms", "--total-sms", "132", "--comm-sms", "32"]) == 0  # vLLM's HT manager clamps to 20
    out = capsys.readouterr().out
    assert "all2all set_num_sms(32) -> DeepEP 20 (HT clamp)" in out and "12 of the 32 comm SMs stay idle" in out
    for argv in (["--comm-sms", "21"], ["--platform", "rocm", "--all2all-backend", "allgather_reducescatter"]):
        assert main(["sms", "--total-sms", "132", *argv]) == 0
        assert max(map(len, capsys.readouterr().out.splitlines())) <= 100, argv  # a table and notes of <= 100 columns


def test_rocm_deepep_ht_forces_comm_zero_and_allgather_takes_64(capsys: pytest.CaptureFixture[str]) -> None:
    [dev] = run_json(capsys, "--total-sms", "304", "--platform", "rocm")["devices"]
    assert split(dev) == (304, 0, 304) and dev["budget"]["rocm_override"]
    [dev] = run_json(capsys, "--total-sms", "304", "--platform", "rocm", "--all2all-backend", "allgather_reducescatter")["devices"]
    assert split(dev) == (304, 64, 240)
    assert main(["sms", "--total-sms", "304", "--all2all-backend", "allgather_reducescatter"]) == 2  # CUDA by default
    [line] = capsys.readouterr().err.splitlines()
    assert "is not allowed" in line and "(it needs --platform rocm)" in line


def test_the_comm_share_comes_from_the_flag_then_the_environment(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_DBO_COMM_SMS", "16")
    doc = run_json(capsys, "--total-sms", "132")
    assert (doc["settings"]["comm_sms"], doc["settings"]["comm_sms_source"]) == (16, "VLLM_DBO_COMM_SMS")
    doc = run_json(capsys, "--total-sms", "132", "--comm-sms", "24")
    assert (doc["settings"]["comm_sms"], doc["settings"]["comm_sms_source"]) == (24, "--comm-sms")
    monkeypatch.setenv("VLLM_DBO_COMM_SMS", "+8")  # int() reads it, as vLLM does
    assert run_json(capsys, "--total-sms", "132")["settings"]["comm_sms"] == 8


@pytest.mark.parametrize(
    ("args", "env", "start"),
    [
        (["--comm-sms", "131"], None, "--comm-sms=131 is not allowed; allowed values: integers in [0, 130]"),  # SM90's even rounding leaves no compute SM
        (["--comm-sms", "-2"], None, "--comm-sms=-2 is not allowed; allowed values: integers in [0, 130]"),  # the range, however far off
        ([], "abc", "VLLM_DBO_COMM_SMS='abc' is not allowed; allowed values: integers in [0, 130]"),
        ([], "-3", "VLLM_DBO_COMM_SMS=-3 is not allowed; allowed values: integers in [0, 130]"),
        (["--platform", "rocm", "--all2all-backend", "nixl_ep", "--comm-sms", "400"], None, "--comm-sms=400 is not allowed"),
    ],
)
def test_a_split_vllm_would_refuse_is_one_line_and_exit_2(
    args: list[str], env: str | None, start: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    if env is not None:
        monkeypatch.setenv("VLLM_DBO_COMM_SMS", env)
    assert main(["sms", "--total-sms", "132", *args]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.splitlines()) == 1 and err.startswith(f"dbo-runtime sms: error: {start}")


def test_a_default_comm_share_too_large_for_the_device_names_the_flag_not_an_unset_variable(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("VLLM_DBO_COMM_SMS", raising=False)
    assert main(["sms", "--total-sms", "10"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dbo-runtime sms: error: --comm-sms=20 is not allowed") and "20 is vLLM's default; pass --comm-sms N" in err


def test_no_gpu_is_one_line_and_exit_3(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    fake_gpus(monkeypatch, FakePynvml([], init_error=NVMLError_DriverNotLoaded()))
    assert main(["sms"]) == 3
    out, err = capsys.readouterr()
    assert out == "" and len(err.splitlines()) == 1 and "Driver Not Loaded" in err and "--total-sms" in err
    monkeypatch.setenv("VLLM_DBO_COMM_SMS", "abc")  # a malformed share is the user's to fix first, GPU or not
    assert main(["sms"]) == 2
    assert capsys.readouterr().err == "dbo-runtime sms: error: VLLM_DBO_COMM_SMS='abc' is not allowed; allowed values: a non-negative integer\n"


def test_an_h200_without_cuda_is_counted_by_nvml_cores(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    fake = fake_gpus(monkeypatch, FakePynvml([h200()]))
    doc = run_json(capsys)
    [dev] = doc["devices"]
    assert doc["source"] == "hardware" and doc["nvml"]["driver_version"] == "580.95.05"
    assert (dev["nvml_gpu_cores"], dev["cores_per_sm"], dev["sms"], dev["sms_source"]) == (16896, 128, 132, "nvml-cores")
    assert split(dev) == (132, 20, 112) and fake.inits == fake.shutdowns == 1
    [dev] = run_json(capsys, "--comm-sms", "21")["devices"]  # SM90: DeepGEMM's share rounded down to even, as the worker does
    assert split(dev) == (132, 21, 110)


def test_cuda_devices_merge_by_uuid_and_a_mismatch_is_flagged(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    gpu0, gpu1 = h200(), h200()
    gpu1.uuid = "GPU-6b1f0c2e-0000-4000-8000-000000000002"
    fake_gpus(
        monkeypatch, FakePynvml([gpu0, gpu1]),
        fake_cuda_device(0, 114, gpu1.uuid[4:].upper()), fake_cuda_device(1, 132, gpu0.uuid[4:]),
        fake_cuda_device(2, 78, None, name="NVIDIA H100 PCIe"),
    )  # fmt: skip
    devs = run_json(capsys)["devices"]
    assert [(d["label"], d["kind"], d["cuda_index"]) for d in devs] == [("0", "gpu", 1), ("1", "gpu", 0), ("cuda:2", "cuda", 2)]
    assert (devs[1]["sms"], devs[1]["sms_consistent"], split(devs[1])) == (114, False, (114, 20, 94))
    assert main(["sms"]) == 0 and "MISMATCH" in capsys.readouterr().out
    mig = h200_mig(FakeMig("NVIDIA H100 80GB HBM3 MIG 1g.10gb", "MIG-dddd-0001", 16))
    fake_gpus(monkeypatch, FakePynvml([gpu0, gpu1, mig]), fake_cuda_device(0, 114, gpu1.uuid[4:].upper()))
    assert main(["sms", "--comm-sms", "8"]) == 0  # a MISMATCH row beside a MIG slice CUDA cannot see
    out = capsys.readouterr().out
    assert "MISMATCH" in out and "nvml-mig " in out and max(map(len, out.splitlines())) <= 100


def test_mig_instances_get_their_own_split(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    gpu = h200_mig(
        FakeMig("NVIDIA H200 MIG 3g.71gb", "MIG-aaaa-0001", 60, gpu_instance_id=2),
        None,
        FakeMig("NVIDIA H200 MIG 2g.35gb", "MIG-aaaa-0002", 32, gpu_instance_id=5, gpu_instance_slice_count=2),
    )
    fake_gpus(monkeypatch, FakePynvml([gpu]))
    parent, mig0, mig2 = run_json(capsys)["devices"]
    assert parent["budget"] is None and "MIG enabled" in parent["note"]
    assert (mig0["label"], mig0["sms_source"], split(mig0)) == ("0 MIG 0", "nvml-mig-attributes", (60, 20, 40))
    assert split(mig2) == (32, 20, 12)
    assert main(["sms"]) == 0
    out = capsys.readouterr().out  # the parent's note is a caption line; an H100 MIG name still fits 100 columns
    assert "0: MIG enabled: DBO runs on the MIG instances" in out and max(map(len, out.splitlines())) <= 100
    fake_gpus(monkeypatch, FakePynvml([h200_mig(FakeMig("NVIDIA H100 80GB HBM3 MIG 3g.40gb", "MIG-cccc-0001", 60))]))
    assert main(["sms"]) == 0 and max(map(len, capsys.readouterr().out.splitlines())) <= 100
    fake_gpus(monkeypatch, FakePynvml([h200_mig(FakeMig("NVIDIA H200 MIG 1g.18gb", "MIG-bbbb-0001", 16))]))
    assert main(["sms"]) == 2  # 20 comm SMs leave no compute SM on a 16-SM slice, the only device
    assert "device 0 MIG 0, 16 SMs" in capsys.readouterr().err
    small = h200_mig(FakeMig("NVIDIA H200 MIG 1g.18gb", "MIG-bbbb-0001", 16))
    small.uuid = "GPU-6b1f0c2e-0000-4000-8000-0000000000bb"
    fake_gpus(monkeypatch, FakePynvml([h200(), small]))
    assert main(["sms"]) == 0  # beside a device with a split, the slice's refusal is its warning line
    out = capsys.readouterr().out
    assert "132/20/112" in out and "warning: GPU 1 MIG 0: no split: --comm-sms=20 is not allowed" in out
    assert "GPU 1 MIG 0: -" not in out
    assert main(["sms", "--comm-sms", "8"]) == 0 and "16/8/8" in capsys.readouterr().out


def test_eight_gpus_share_one_caption_line(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    gpus = [h200() for _ in range(8)]
    for i, gpu in enumerate(gpus):
        gpu.uuid = f"GPU-6b1f0c2e-0000-4000-8000-00000000001{i}"
    fake_gpus(monkeypatch, FakePynvml(gpus))
    assert main(["sms", "--comm-sms", "32"]) == 0
    lines = capsys.readouterr().out.splitlines()
    everyone = ", ".join(f"GPU {i}" for i in range(8))
    assert sum(line.startswith(everyone[:20]) for line in lines) == 1
    assert sum(line.startswith("warning: GPU 0, GPU 1") and "12 of the 32 comm SMs stay idle" in line for line in lines) == 1
    assert max(map(len, lines)) <= 100


def test_a_setting_a_server_refuses_is_a_warning_and_the_split_still_shown(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DBO_RUNTIME_TOPK_LAYOUT", "bogus")
    monkeypatch.setenv("DBO_RUNTIME_DISABLE", "1")
    doc = run_json(capsys, "--total-sms", "132")
    assert split(doc["devices"][0]) == (132, 20, 112) and doc["plugin"]["disabled_by_env"] is True
    assert any(w.startswith("DBO_RUNTIME_DISABLE=1: nothing patched") for w in doc["warnings"])
    monkeypatch.delenv("DBO_RUNTIME_DISABLE")
    doc = run_json(capsys, "--total-sms", "132")
    assert any("DBO_RUNTIME_TOPK_LAYOUT" in w and "a server refuses it" in w for w in doc["warnings"])
