"""``dbo-runtime doctor`` against the real vLLM 0.33.0 installed in the venv.

Failure paths change only dbo_runtime's own inputs (the patch list, the version
it reads), never vLLM: a Patch naming an attribute vLLM does not have must be
reported missing and fail the run.
"""

from __future__ import annotations

import json

import pytest

from dbo_runtime.cli.main import main
from dbo_runtime.integration import plugin
from dbo_runtime.integration.patching import Patch

DOC_KEYS = {"schema", "ok", "problems", "dbo_runtime_version", "python", "vllm", "plugin", "patches", "deep_gemm", "nvml"}
PATCH_KEYS = {"name", "target", "state", "lazy", "optional", "detail", "reason", "upstream_pr", "removal"}


@pytest.fixture(autouse=True)
def _wide_table(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("COLUMNS", raising=False)  # a narrow terminal width would fold table cells


def doctor_json(capsys: pytest.CaptureFixture[str]) -> tuple[int, dict]:
    rc = main(["doctor", "--json"])
    out = capsys.readouterr().out
    return rc, json.loads(out)


def bogus_patch(**kw: object) -> Patch:
    fields: dict = {
        "name": "test.bogus",
        "module": "vllm.v1.worker.ubatch_utils",
        "attr": "no_such_function_in_vllm_0_33",
        "make": lambda original: original,
        "reason": "test",
        "upstream_pr": "none",
        "removal": "never",
    }
    fields.update(kw)
    return Patch(**fields)


def test_real_vllm_every_target_found(capsys: pytest.CaptureFixture[str]) -> None:
    rc, doc = doctor_json(capsys)
    assert set(doc) == DOC_KEYS and doc["schema"] == "dbo-runtime/doctor/v1"
    assert doc["vllm"] == {"version": "0.33.0", "supported": True, "supported_series": "0.33"}
    assert doc["plugin"]["entry_point"] is True
    expected = [p.name for p in plugin.all_patches()]
    assert expected, "the plugin declares no patches"
    assert [p["name"] for p in doc["patches"]] == expected
    for p in doc["patches"]:
        assert set(p) == PATCH_KEYS
        # found, or a lazy/optional module that cannot be imported on this CPU box
        assert p["state"] == "found" or (p["state"] == "skipped" and (p["lazy"] or p["optional"])), p
    assert doc["problems"] == [] and doc["ok"] is True and rc == 0
    # no driver / no CUDA DeepGEMM build on this box: reported, not a failure
    assert doc["nvml"]["available"] is False and "NVML" in doc["nvml"]["detail"]
    assert doc["deep_gemm"]["available"] is False and doc["deep_gemm"]["detail"]


def test_missing_required_target_fails(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    real = plugin.all_patches
    monkeypatch.setattr(plugin, "all_patches", lambda: [*real(), bogus_patch()])
    rc, doc = doctor_json(capsys)
    assert rc == 1 and doc["ok"] is False
    [bogus] = [p for p in doc["patches"] if p["name"] == "test.bogus"]
    assert bogus["state"] == "missing" and "AttributeError" in bogus["detail"]
    assert any("vllm.v1.worker.ubatch_utils.no_such_function_in_vllm_0_33" in line for line in doc["problems"])
    assert main(["doctor"]) == 1
    out = capsys.readouterr().out
    assert "PROBLEMS" in out and "no_such_function_in_vllm_0_33" in out


@pytest.mark.parametrize("flag", ["optional", "lazy"])
def test_missing_optional_or_lazy_target_is_skipped_not_failed(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, flag: str
) -> None:
    real = plugin.all_patches
    monkeypatch.setattr(plugin, "all_patches", lambda: [*real(), bogus_patch(**{flag: True})])
    rc, doc = doctor_json(capsys)
    [bogus] = [p for p in doc["patches"] if p["name"] == "test.bogus"]
    assert bogus["state"] == "skipped"
    assert rc == 0 and doc["ok"] is True


def test_unsupported_vllm_version_fails(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(plugin, "vllm_version", lambda: "0.34.1")
    rc, doc = doctor_json(capsys)
    assert rc == 1
    assert doc["vllm"]["supported"] is False
    assert any("0.34.1 is not supported" in line for line in doc["problems"])


def test_vllm_not_installed_is_reported_and_fails(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(plugin, "vllm_version", lambda: None)
    rc, doc = doctor_json(capsys)
    assert rc == 1
    assert doc["vllm"]["version"] is None and "vLLM not installed" in doc["problems"]
    assert all(p["detail"] == "vLLM not installed" for p in doc["patches"])
    assert main(["doctor"]) == 1
    assert "vLLM not installed" in capsys.readouterr().out


def test_table_lists_every_target(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["doctor"]) == 0
    out, err = capsys.readouterr()
    for patch in plugin.all_patches():
        assert patch.name in out
    assert "vLLM 0.33.0 (supported" in out and "OK" in out
    assert "Traceback" not in err
