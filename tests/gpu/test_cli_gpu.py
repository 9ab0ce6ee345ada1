"""GPU twin of ``tests/unit/test_cli_sms.py``: ``dbo-runtime sms`` on real NVML and CUDA.

On the CPU box the NVML side is ``tests/fakes/fake_pynvml.py`` and the CUDA side
``tests/fakes/fake_cuda_devices.py``; here both are real. Checks that the CLI's
SM count equals torch's ``multi_processor_count``, that NVML cores / cores-per-SM
agrees (16896 / 128 = 132 on an H200), that NVML and CUDA devices are matched by
UUID, and that ``python -m dbo_runtime`` runs without vLLM (the GPU box has none).

Writes ``cli_sms.json``, ``cli_sms_table.txt`` and ``cli_doctor.json`` under
``$OUT`` when set, and prints one ``CLI-GPU:`` summary line (run with ``-s``).
"""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import subprocess
import sys
from types import ModuleType

import pytest
import torch

from dbo_runtime.adapters import nvml
from dbo_runtime.adapters.cuda_devices import normalize_uuid
from dbo_runtime.cli.main import main

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_DBO_COMM_SMS", raising=False)
    monkeypatch.delenv("COLUMNS", raising=False)


def _sms_doc(capsys: pytest.CaptureFixture[str]) -> dict:
    rc = main(["sms", "--json"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    return json.loads(out)


def test_sms_json_matches_torch_and_nvml(
    cuda_device: torch.device, pynvml: ModuleType, capsys: pytest.CaptureFixture[str], out_dir: pathlib.Path | None
) -> None:
    doc = _sms_doc(capsys)
    index = cuda_device.index if cuda_device.index is not None else torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    sms = int(props.multi_processor_count)

    [row] = [d for d in doc["devices"] if d["cuda_index"] == index]
    assert row["kind"] == "gpu", row  # matched to its NVML device (by UUID)
    assert (row["sms"], row["sms_cuda"], row["sms_source"]) == (sms, sms, "cuda")

    pynvml.nvmlInit()
    try:
        handle = pynvml.nvmlDeviceGetHandleByIndex(row["nvml_index"])
        cores = int(pynvml.nvmlDeviceGetNumGpuCores(handle))
        cc = tuple(int(x) for x in pynvml.nvmlDeviceGetCudaComputeCapability(handle))
        uuid = pynvml.nvmlDeviceGetUUID(handle)
    finally:
        pynvml.nvmlShutdown()
    uuid = uuid.decode() if isinstance(uuid, bytes) else uuid
    assert normalize_uuid(uuid) == normalize_uuid(str(props.uuid))
    assert cc == (props.major, props.minor)
    cps = nvml.cores_per_sm(cc)
    assert cps is not None
    assert cores == cps * sms
    # the memory bench_host_cost sizes --at-once by: NVML's total, at least what CUDA reports (the driver reserves some)
    [gpu] = [g for g in nvml.query().gpus if g.index == row["nvml_index"]]
    if "H200" in props.name:  # NVML reports a discrete GPU's memory; some integrated parts answer NotSupported
        assert gpu.memory_total_bytes is not None
    assert gpu.memory_total_bytes is None or gpu.memory_total_bytes >= props.total_memory
    assert (row["nvml_gpu_cores"], row["cores_per_sm"], row["sms_nvml_cores"]) == (cores, cps, sms)
    assert row["sms_consistent"] is True
    assert row["mig_enabled"] is False
    b = row["budget"]
    assert (b["total"], b["comm"], b["compute"]) == (sms, 20, sms - 20)
    assert b["comm_knob"] and b["compute_knob"]
    if "H200" in props.name:
        assert sms == 132 and cores == 16896 and (b["total"], b["comm"], b["compute"]) == (132, 20, 112)

    if out_dir is not None:
        (out_dir / "cli_sms.json").write_text(json.dumps(doc, indent=2))
    with capsys.disabled():
        print(
            f"\nCLI-GPU: device={props.name!r} sms={row['sms']} cuda={row['sms_cuda']} "
            f"nvml_cores={cores}/{cps}={row['sms_nvml_cores']} mig={row['mig_enabled']} "
            f"split={b['total']}/{b['comm']}/{b['compute']} driver={doc['nvml']['driver_version']}"
        )


def test_sms_table_on_gpu(cuda_device: torch.device, capsys: pytest.CaptureFixture[str], out_dir: pathlib.Path | None) -> None:
    sms = int(torch.cuda.get_device_properties(cuda_device).multi_processor_count)
    assert main(["sms"]) == 0
    table = capsys.readouterr().out
    assert f"{sms}/20/{sms - 20}" in table and f"DeepGEMM set_num_sms({sms - 20})" in table
    assert max(map(len, table.splitlines())) <= 100  # with real NVML names and checks
    assert main(["sms", "--all2all-backend", "deepep_low_latency"]) == 0
    assert f"{sms}/0/{sms}" in capsys.readouterr().out
    if out_dir is not None:
        (out_dir / "cli_sms_table.txt").write_text(table)
    with capsys.disabled():
        print("\n" + table)


def test_module_entry_runs_without_vllm(cuda_device: torch.device, out_dir: pathlib.Path | None) -> None:
    env = dict(os.environ)
    env.pop("VLLM_DBO_COMM_SMS", None)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    sms = subprocess.run(
        [sys.executable, "-m", "dbo_runtime", "sms", "--json"], capture_output=True, text=True, env=env, cwd=ROOT, timeout=300
    )
    assert sms.returncode == 0, sms.stderr
    expected = int(torch.cuda.get_device_properties(cuda_device).multi_processor_count)
    assert expected in [d["sms"] for d in json.loads(sms.stdout)["devices"]]

    doctor = subprocess.run(
        [sys.executable, "-m", "dbo_runtime", "doctor", "--json"], capture_output=True, text=True, env=env, cwd=ROOT, timeout=300
    )
    assert "Traceback" not in doctor.stderr, doctor.stderr
    doc = json.loads(doctor.stdout)
    if out_dir is not None:
        (out_dir / "cli_doctor.json").write_text(json.dumps(doc, indent=2))
    assert doc["nvml"]["available"] is True, doc["nvml"]
    if importlib.util.find_spec("vllm") is None:
        assert doctor.returncode == 1
        assert doc["vllm"]["version"] is None and "vLLM is not installed" in doc["problems"]
        assert doc["next"].startswith("install vLLM ")
