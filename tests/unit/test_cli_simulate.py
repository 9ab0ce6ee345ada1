"""``dbo-runtime simulate`` on the CPU simulation: the verdict, what it says about the installed vLLM, and the
refusals of what this machine or the environment cannot run."""

from __future__ import annotations

import json

import pytest

from dbo_runtime.cli.main import main
from dbo_runtime.integration import releases

VERIFIED = releases.identify().release is not None
"""Whether the installed vLLM is a release dbo_runtime recorded: simulate exits 0 only then."""
CODE = 0 if VERIFIED else 1
QUICK = ["simulate", "--backend", "cpu", "--steps", "1", "--requests", "4"]


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("DBO_RUNTIME_DISABLE", "VLLM_DBO_COMM_SMS", "DBO_RUNTIME_TOPK_LAYOUT", "VLLM_DEEP_GEMM_WARMUP"):
        monkeypatch.delenv(name, raising=False)


def test_the_verdict_and_the_installed_vllm_in_json_and_text(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*QUICK, "--json"]) == CODE
    doc = json.loads(capsys.readouterr().out)
    assert doc["schema"] == "dbo-runtime/simulate/v2" and doc["simulation"] == "PASS" and doc["protected"] is VERIFIED
    assert doc["verdict"] == ("PASS" if VERIFIED else "NOT PROTECTED")
    assert doc["vllm"]["installed"] == releases.installed_version() and doc["vllm"]["in_force"] is VERIFIED and doc["exit_code"] == CODE
    assert next(r["name"] for r in doc["runs"]) == "dbo_runtime" and all(r["as_expected"] for r in doc["runs"])
    assert main(QUICK) == CODE
    out = capsys.readouterr().out
    assert all(len(line) <= 100 for line in out.splitlines() if not line.startswith("verdict: ")), out
    assert f"vLLM here: {doc['vllm']['installed']}" in out and "crash: assertion" in out and "WRONG RESULTS" in out
    verdict = out.split("\nverdict: ", 1)[1]
    assert verdict.startswith("PASS: ") if VERIFIED else verdict.startswith("NOT PROTECTED: ")


def test_on_a_vllm_the_fixes_do_not_hold_the_verdict_says_it_is_not_protected(capsys: pytest.CaptureFixture[str]) -> None:
    """A build whose code differs from every verified release (``tests/fakes/vllm_build``): the simulation still
    passes, since it checks dbo_runtime's own logic, but that vLLM is not protected, and the exit says so."""
    from tests.fakes.vllm_build import edited_sources, replace_once

    edit = {"vllm.v1.attention.backends.mla.indexer": replace_once("self.num_sms = sm_count", "self.num_sms = int(sm_count)")}
    with edited_sources(edit):
        assert main([*QUICK, "--no-contrast"]) == 1
        out = capsys.readouterr().out
        assert main([*QUICK, "--no-contrast", "--json"]) == 1
        doc = json.loads(capsys.readouterr().out)
    verdict = " ".join(out.split("verdict: ", 1)[1].split())
    assert verdict.startswith("NOT PROTECTED: this vLLM's fixes are not in force") and "dbo_runtime's own logic passed" in verdict
    assert "PASS" not in verdict and doc["verdict"] == "NOT PROTECTED" and doc["simulation"] == "PASS"
    assert doc["protected"] is False and "indexer" in doc["vllm"]["detail"]


def test_disabled_is_a_warning_with_the_verdict(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DBO_RUNTIME_DISABLE", "1")
    assert main([*QUICK, "--no-contrast", "--json"]) == 1  # a server with this environment is not protected
    doc = json.loads(capsys.readouterr().out)
    assert doc["protected"] is False and doc["dbo_runtime_disabled_by_env"] and any("DBO_RUNTIME_DISABLE=1" in w for w in doc["warnings"])


def test_comm_sms_zero_expects_the_topk_bug_not_the_crash(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*QUICK, "--comm-sms", "0", "--json"]) == CODE
    runs = {r["name"]: r for r in json.loads(capsys.readouterr().out)["runs"]}
    assert all(r["as_expected"] for r in runs.values()) and not any(r["error"] for r in runs.values())


@pytest.mark.parametrize(
    ("argv", "env", "rc", "start"),
    [
        (["--mode", "mrv2"], {}, 2, "dbo-runtime simulate: error: --mode='mrv2' is not allowed"),  # the CPU backend has no graphs
        (["--backend", "auto", "--mode", "mrv1"], {}, 3, "dbo-runtime simulate: --mode mrv1 needs a CUDA GPU"),
        (["--backend", "deep_gemm"], {}, 3, "dbo-runtime simulate: --backend deep_gemm needs a CUDA GPU and DeepGEMM"),
        ([], {"DBO_RUNTIME_TOPK_LAYOUT": "bogus"}, 2, "dbo-runtime simulate: error: DBO_RUNTIME_TOPK_LAYOUT='bogus'"),
        ([], {"VLLM_DEEP_GEMM_WARMUP": "bogus"}, 2, "dbo-runtime simulate: error: VLLM_DEEP_GEMM_WARMUP='bogus'"),
        (["--comm-sms", "131"], {}, 2, "dbo-runtime simulate: error: --comm-sms=131 is not allowed"),
    ],
)
def test_what_cannot_run_is_one_line(
    argv: list[str], env: dict[str, str], rc: int, start: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA machine runs these")
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert main([*QUICK, *argv]) == rc
    out, err = capsys.readouterr()
    assert out == "" and err.splitlines()[-1].startswith(start), err
