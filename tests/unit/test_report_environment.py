"""``sim.report.environment``: the versions a GPU result is recorded with."""

from __future__ import annotations

from importlib import metadata
from pathlib import Path

import pytest

from dbo_runtime.sim import report


def test_deep_gemm_version_falls_back_to_the_copy_vllm_vendors(monkeypatch: pytest.MonkeyPatch) -> None:
    """Runs 19-23 (2x H200) recorded ``deep_gemm: null``: vLLM 0.33 ships DeepGEMM inside its wheel
    (``vllm/third_party/deep_gemm``) with no distribution of its own. Reads the real vLLM 0.33.0 here."""
    real = metadata.version

    def version(name: str) -> str:
        if "deep" in name.replace("_", "-"):
            raise metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(metadata, "version", version)
    init = Path(__import__("vllm").__file__).parent / "third_party" / "deep_gemm" / "__init__.py"
    assert init.is_file(), "vLLM 0.33.0 vendors DeepGEMM"
    got = report.environment()["deep_gemm"]
    assert got is not None and got.startswith("vllm-vendored deep_gemm==") and got.split("==")[1][0].isdigit()


def test_vendored_deep_gemm_is_none_without_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert report._vendored_deep_gemm() is None
