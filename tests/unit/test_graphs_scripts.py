"""``graphs/`` scripts on a machine that cannot run them: one line naming what is missing, exit 2.

They used to end in a ``ModuleNotFoundError`` traceback (``import deep_gemm``) on a machine
without DeepGEMM, with or without CUDA.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = sorted(p.name for p in (ROOT / "graphs").glob("*.py"))
ENGINE = {"bench_real_engine.py": "a CUDA GPU and vLLM 0.33", "bench_dbo_engine.py": "two CUDA GPUs and vLLM 0.33"}
"""Real-engine benchmarks: they need vLLM and GPUs, not DeepGEMM directly."""
KERNELS = [s for s in SCRIPTS if s not in ENGINE]


def load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"graphs_{name[:-3]}", ROOT / "graphs" / name)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_script_is_covered() -> None:
    assert SCRIPTS == [
        "bench_dbo_engine.py",
        "bench_dbo_stack.py",
        "bench_indexer_schedule.py",
        "bench_planner_warmup.py",
        "bench_real_engine.py",
        "bench_replay_planning.py",
        "scenario_suite.py",
    ]


@pytest.mark.parametrize("name", SCRIPTS)
def test_without_cuda_one_line_and_exit_2(name: str, tmp_path: Path) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA; the no-CUDA path is exercised on the CPU box")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "graphs" / name), "--out", str(tmp_path)], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    [line] = proc.stderr.strip().splitlines()
    need = ENGINE.get(name, "a CUDA GPU and DeepGEMM")
    assert line.startswith(f"{name[:-3]}: needs {need}: no CUDA device") and "Traceback" not in proc.stderr
    assert proc.stdout == "" and not any(tmp_path.iterdir())


@pytest.mark.parametrize("name", KERNELS)
def test_cuda_without_deepgemm_one_line_and_exit_2(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("DG_JIT_CACHE_DIR", str(tmp_path / "jit"))  # the benchmark sets a default at import
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setitem(sys.modules, "deep_gemm", None)  # `import deep_gemm` raises ImportError
    assert load(name).main(["--out", str(tmp_path / "out")]) == 2
    out, err = capsys.readouterr()
    [line] = err.strip().splitlines()
    assert line.startswith(f"{name[:-3]}: needs a CUDA GPU and DeepGEMM: DeepGEMM does not import (ModuleNotFoundError")
    assert out == ""


@pytest.mark.parametrize("name", sorted(ENGINE))
def test_gpus_without_vllm_one_line_and_exit_2(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from importlib import metadata

    real_version = metadata.version

    def version(dist: str) -> str:
        if dist == "vllm":
            raise metadata.PackageNotFoundError(dist)
        return real_version(dist)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(metadata, "version", version)
    monkeypatch.syspath_prepend(str(ROOT / "graphs"))
    assert load(name).main(["--out", str(tmp_path / "out")]) == 2
    out, err = capsys.readouterr()
    [line] = err.strip().splitlines()
    assert line.startswith(f"{name[:-3]}: needs {ENGINE[name]}: vLLM is not installed") and out == ""
