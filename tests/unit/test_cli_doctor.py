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

DOC_KEYS = {
    "schema", "ok", "problems", "warnings", "dbo_runtime_version", "python", "vllm", "plugin", "features", "guard",
    "patches", "deep_gemm", "nvml", "import_warnings",
}  # fmt: skip
PATCH_KEYS = {"name", "feature", "target", "state", "fingerprint", "lazy", "optional", "detail", "reason", "upstream_pr", "removal"}


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
    assert set(doc) == DOC_KEYS and doc["schema"] == "dbo-runtime/doctor/v2"
    assert doc["vllm"] == {"version": "0.33.0", "verified_release": "0.33.0", "trusted_by": "fingerprints"}
    assert {f["name"]: f["state"] for f in doc["features"]} == {f.name: "in force" for f in plugin.all_features()}
    assert [g["state"] for g in doc["guard"]] == ["found", "found", "found"]
    assert doc["plugin"]["entry_point"] is True
    assert doc["plugin"]["load_format_entry_point"] is True  # the test load format, a separate entry point
    expected = [p.name for p in plugin.all_patches()]
    assert expected, "the plugin declares no patches"
    assert [p["name"] for p in doc["patches"]] == expected
    for p in doc["patches"]:
        assert set(p) == PATCH_KEYS
        # found, or a lazy/optional module that cannot be imported on this CPU box
        assert p["state"] == "found" or (p["state"] == "skipped" and (p["lazy"] or p["optional"])), p
        assert p["fingerprint"] in ("match", "not bound"), p
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


def test_missing_optional_target_is_skipped_not_failed(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    real = plugin.all_patches
    monkeypatch.setattr(plugin, "all_patches", lambda: [*real(), bogus_patch(optional=True)])
    rc, doc = doctor_json(capsys)
    [bogus] = [p for p in doc["patches"] if p["name"] == "test.bogus"]
    assert bogus["state"] == "skipped"
    assert rc == 0 and doc["ok"] is True
    assert not [w for w in doc["warnings"] if "no_such_function_in_vllm_0_33" in w], doc["warnings"]


def test_a_lazy_target_gone_from_a_module_that_imports_is_missing(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Lazy only means patched at first import: where the module imports here, its target was checked, and one
    that is gone is a problem, not "not checked here"."""
    real = plugin.all_patches
    monkeypatch.setattr(plugin, "all_patches", lambda: [*real(), bogus_patch(lazy=True)])
    rc, doc = doctor_json(capsys)
    [bogus] = [p for p in doc["patches"] if p["name"] == "test.bogus"]
    assert bogus["state"] == "missing" and "AttributeError" in bogus["detail"]
    assert rc == 1 and doc["ok"] is False
    assert any("no_such_function_in_vllm_0_33" in line for line in doc["problems"])


def test_skipped_required_target_is_a_warning_not_ok(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """A required lazy target that cannot be checked here ends the table with WARNINGS, not a plain OK."""
    real = plugin.all_patches
    monkeypatch.setattr(plugin, "all_patches", lambda: [*real(), bogus_patch(lazy=True, module="dbo_no_such_module_here")])
    assert main(["doctor"]) == 0  # a warning, not a failure
    out = capsys.readouterr().out
    last = out.strip().splitlines()[-1]
    assert last.startswith("WARNINGS (not failures): ")
    assert "required patch target not checked here: dbo_no_such_module_here." in last
    assert "skipped (warning)" in out


def test_no_third_party_import_noise_on_stderr() -> None:
    """vLLM's `_C` and torch's Triton warnings stay off stderr (they are kept as import_warnings)."""
    import subprocess
    import sys

    for args in (["doctor"], ["doctor", "--json"]):
        proc = subprocess.run([sys.executable, "-m", "dbo_runtime", *args], capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
        assert proc.stderr == "", proc.stderr
    doc = json.loads(proc.stdout)
    assert all(isinstance(line, str) for line in doc["import_warnings"])  # kept, not dropped


def test_a_version_string_alone_neither_passes_nor_fails_a_build(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A development build named like a later release is trusted by its code: identical code passes,
    code that differs from vLLM 0.33.0 in a patch's anchor fails and names the feature."""
    from tests.fakes.vllm_build import edited_sources, replace_once

    monkeypatch.setattr(plugin, "vllm_version", lambda: "0.33.1rc1.dev123+g4ba787ec9")
    rc, doc = doctor_json(capsys)
    assert rc == 0 and doc["vllm"]["version"] == "0.33.1rc1.dev123+g4ba787ec9"
    edit = {"vllm.v1.attention.backends.mla.indexer": replace_once("self.num_sms = sm_count", "self.num_sms = int(sm_count)")}
    with edited_sources(edit):
        rc, doc = doctor_json(capsys)
    assert rc == 1
    [indexer] = [f for f in doc["features"] if f["name"] == "indexer"]
    assert indexer["verdict"] == "unverified" and "indexer.builder_init" in indexer["detail"]
    assert any(line.startswith("indexer (indexer schedule fix (vllm#60732)): unverified") for line in doc["problems"])
    assert [p["fingerprint"] for p in doc["patches"] if p["name"] == "indexer.builder_init"] == ["differs"]


def test_an_upstream_fix_is_reported_as_provided_by_vllm(capsys: pytest.CaptureFixture[str]) -> None:
    from tests.fakes.vllm_build import UPSTREAM_60732, edited_sources

    with edited_sources(UPSTREAM_60732):
        rc, doc = doctor_json(capsys)
        assert main(["doctor"]) == 0
        out = capsys.readouterr().out
    assert rc == 0
    [indexer] = [f for f in doc["features"] if f["name"] == "indexer"]
    assert indexer["state"].startswith("provided by vLLM")
    assert "indexer: provided by vLLM" in out


def test_vllm_not_installed_is_reported_and_fails(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(plugin, "vllm_version", lambda: None)
    rc, doc = doctor_json(capsys)
    assert rc == 1
    assert doc["vllm"]["version"] is None and "vLLM not installed" in doc["problems"]
    assert all(p["detail"] == "vLLM not installed" for p in doc["patches"])
    assert main(["doctor"]) == 1
    assert "vLLM not installed" in capsys.readouterr().out


def test_vllm_that_does_not_import_is_one_problem_not_a_warning_per_target(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Installed but broken (a missing CUDA library, a bad wheel): every patch target is unchecked for that one
    reason, which the problem names; a warning per target would repeat it 36 times."""
    from dbo_runtime.cli import doctor

    monkeypatch.setattr(doctor, "_vllm_import_error", lambda: "ImportError: libcudart.so.13: cannot open shared object file")
    rc, doc = doctor_json(capsys)
    assert rc == 1
    assert [p for p in doc["problems"] if "does not import" in p] and "libcudart" in doc["problems"][0]
    assert not [w for w in doc["warnings"] if "not checked here" in w]


def test_table_lists_every_target(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["doctor"]) == 0
    out, err = capsys.readouterr()
    for patch in plugin.all_patches():
        assert patch.name in out
    assert "vLLM 0.33.0 (the verified release" in out
    last = out.strip().splitlines()[-1]
    # OK, or -- where GLM-5-Next's module does not import (no torchvision) -- a warning naming it
    assert last == "OK" or ("WARNINGS" in out and "glm5next" in out), last
    assert "Traceback" not in err


def test_disabled_is_one_warning_not_a_problem_per_fix(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """DBO_RUNTIME_DISABLE=1 patches nothing and refuses nothing (README): the doctor says that in one line and
    exits 0, instead of one "refused at engine start" problem per feature, which the disabled plugin never does."""
    from dbo_runtime.cli._common import DISABLED_WARNING

    monkeypatch.setenv("DBO_RUNTIME_DISABLE", "1")
    monkeypatch.setenv("DBO_RUNTIME_STRICT", "1")
    rc, doc = doctor_json(capsys)
    assert doc["plugin"]["strict"] is True
    assert all(f["verdict"] == "disabled" and f["state"].startswith("disabled by DBO_RUNTIME_DISABLE") for f in doc["features"])
    assert rc == 0 and doc["ok"] and doc["problems"] == [] and doc["warnings"][0] == DISABLED_WARNING.format(value="1")
    assert "nothing patched, nothing refused" in DISABLED_WARNING and "vLLM's own DBO" in DISABLED_WARNING
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert "DBO_RUNTIME_STRICT is on" in out and out.count(DISABLED_WARNING.format(value="1")) == 1 and "refused at engine start" not in out
    monkeypatch.setenv("DBO_RUNTIME_TOPK_LAYOUT", "bad")  # a setting the disabled plugin never reads
    rc, doc = doctor_json(capsys)
    assert rc == 0 and doc["problems"] == []
    monkeypatch.delenv("DBO_RUNTIME_DISABLE")
    rc, doc = doctor_json(capsys)
    assert rc == 1 and any("DBO_RUNTIME_TOPK_LAYOUT='bad'" in p for p in doc["problems"])


@pytest.mark.parametrize(
    ("name", "value", "needle"),
    [
        ("VLLM_DBO_COMM_SMS", "19", "VLLM_DBO_COMM_SMS=19 is not allowed; allowed values: even integers"),  # DeepEP HT's even rule
        ("VLLM_DBO_COMM_SMS", "abc", "VLLM_DBO_COMM_SMS='abc' is not allowed; allowed values: integers >= 0, or not set"),
        ("VLLM_DEEP_GEMM_WARMUP", "bogus", "VLLM_DEEP_GEMM_WARMUP='bogus' is not allowed; allowed values: 'skip', 'full' or 'relax'"),
        ("VLLM_DEEP_GEMM_WARMUP", "", "VLLM_DEEP_GEMM_WARMUP='' is not allowed; allowed values: 'skip', 'full' or 'relax'"),
    ],
)
def test_a_setting_the_engines_refuse_is_a_problem(
    name: str, value: str, needle: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The doctor runs verify's own pre-check for the comm share (one rule), and vLLM's choices for the warm-up."""
    from dbo_runtime.cli._engine import comm_sms_problem

    monkeypatch.setenv(name, value)
    rc, doc = doctor_json(capsys)
    assert rc == 1 and any(p.startswith(needle) for p in doc["problems"]), doc["problems"]
    if name == "VLLM_DBO_COMM_SMS":
        same = comm_sms_problem(["--all2all-backend", "deepep_high_throughput"], {name: value})
        assert same is not None and str(same) in doc["problems"]


@pytest.mark.parametrize(("name", "value"), [("VLLM_DBO_COMM_SMS", "18"), ("VLLM_DEEP_GEMM_WARMUP", "skip")])
def test_a_setting_the_engines_take_is_no_problem(name: str, value: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(name, value)
    _rc, doc = doctor_json(capsys)
    assert not any(name in p for p in doc["problems"]), doc["problems"]


def test_the_disabled_warning_quotes_the_value_set(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("DBO_RUNTIME_DISABLE", "TRUE")
    rc, doc = doctor_json(capsys)
    assert rc == 0 and doc["warnings"][0].startswith("DBO_RUNTIME_DISABLE=TRUE: nothing patched")
