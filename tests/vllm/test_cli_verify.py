"""``dbo-runtime verify`` on CPU: argument handling (with vLLM's real parser) and the verdict logic.

The engine runs themselves need GPUs: their GPU twin is ``tests/e2e/test_dbo_2gpu.py::test_verify_cli``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from dbo_runtime.cli import verify
from dbo_runtime.cli.main import main
from dbo_runtime.core.errors import ConfigError
from dbo_runtime.harness.compare import Request, Thresholds, compare
from dbo_runtime.harness.compare import verdict as verdict_fn


@pytest.fixture
def fake_cuda_device_type(monkeypatch: pytest.MonkeyPatch) -> None:
    """FakeDeviceType: vLLM's DeviceConfig infers the device from the platform, which is
    'unspecified' without a GPU (boundary: no GPU in CI); the GPU twin parses on a real platform."""
    from vllm.platforms import current_platform

    monkeypatch.setattr(current_platform, "device_type", "cuda", raising=False)


def test_split_engine_args() -> None:
    args, dp, notes = verify.split_engine_args(["--model", "m", "-dp", "2", "--enable-dbo", "--enable-expert-parallel"])
    assert args == ["--model", "m", "--enable-expert-parallel"] and dp == 2 and any("--enable-dbo ignored" in n for n in notes)
    args, dp, _ = verify.split_engine_args(["m", "--data-parallel-size=4", "--", "--seed", "1"])
    assert args == ["--model", "m", "--seed", "1"] and dp == 4
    _, dp, notes = verify.split_engine_args(["--model", "m"])
    assert dp == 1 and any("never microbatches" in n for n in notes)


@pytest.mark.parametrize(
    ("argv", "parameter"),
    [
        (["--model", "m", "-dp", "x"], "-dp"),
        (["--model", "m", "--data-parallel-size", "0"], "--data-parallel-size"),
        (["--model", "m", "--data-parallel-size"], "--data-parallel-size"),
        (["--model", "m", "--data-parallel-address", "10.0.0.1"], "--data-parallel-address"),
        (["--model", "m", "--headless"], "--headless"),
        (["--enable-expert-parallel"], "--model"),
        (["--model", "m", "--config", "serve.yaml"], "--config"),
    ],
)
def test_split_engine_args_refuses_with_the_parameter_named(argv: list[str], parameter: str) -> None:
    with pytest.raises(ConfigError) as info:
        verify.split_engine_args(argv)
    assert info.value.parameter == parameter


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--prompts", "0", "--model", "m", "-dp", "2"], "--prompts=0"),
        (["--prompts", "1", "--model", "m", "-dp", "2"], "at least the data-parallel size"),
        (["--prompt-len", "9-3", "--model", "m", "-dp", "2"], "--prompt-len='9-3'"),
        (["--prompt-len", "abc", "--model", "m", "-dp", "2"], "--prompt-len='abc'"),
        (["--max-tokens", "0", "--model", "m", "-dp", "2"], "--max-tokens=0"),
        (["--min-agreement", "1.5", "--model", "m", "-dp", "2"], "--min-agreement=1.5"),
        (["--timeout", "-1", "--model", "m", "-dp", "2"], "--timeout=-1"),
        (["--prompt-file", "/nonexistent.jsonl", "--model", "m", "-dp", "2"], "--prompt-file='/nonexistent.jsonl'"),
        (["--prompts", "x", "--model", "m", "-dp", "2"], "--prompts='x' is not allowed; allowed values: an integer"),
        (["--model", "m"], "--data-parallel-size=1 is not allowed; allowed values: 2 or more"),
        (["--max-dlogprob", "big", "--model", "m", "-dp", "2"], "--max-dlogprob='big' is not allowed; allowed values: a finite number"),
        # caught before vLLM's parser, which would answer "cannot run here" (exit 3)
        (["--prompts", "4", "--model"], "--model is given without a value"),
        (["--model", "-dp", "2"], "--model is given without a value"),
        (["--workdir", "/dev/null/sub", "--model", "m", "-dp", "2"], "--workdir='/dev/null/sub'"),
    ],
)
def test_bad_verify_options_are_one_line_exit_2(argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["verify", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0], err


def test_bad_vllm_args_are_one_line_exit_2(fake_cuda_device_type: None, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["verify", "--model", "m", "-dp", "2", "--no-such-vllm-flag", "1"]) == 2
    err = [line for line in capsys.readouterr().err.strip().splitlines() if not line.startswith("[verify]")]
    assert len(err) == 1 and "VLLM_ENGINE_ARGS" in err[0] and "--no-such-vllm-flag" in err[0], err


def test_verify_options_do_not_shadow_vllm_engine_args(fake_cuda_device_type: None) -> None:
    """verify takes the arguments it knows; a name shared with vLLM would silently steal a vLLM setting."""
    import argparse

    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    vllm_options = set(EngineArgs.add_cli_args(FlexibleArgumentParser())._option_string_actions)
    ours = verify.add_parser(argparse.ArgumentParser().add_subparsers())
    mine = {o for o in ours._option_string_actions if o not in ("-h", "--help")}
    assert not mine & vllm_options, mine & vllm_options


def test_other_subcommands_still_reject_unknown_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["sms", "--total-sms", "132", "--bogus"]) == 2
    assert "unrecognized arguments: --bogus" in capsys.readouterr().err


def test_no_gpu_is_one_line() -> None:
    import subprocess
    import sys

    # a fresh interpreter: vLLM caches its parser's defaults, so the in-process fake would leak in
    proc = subprocess.run([sys.executable, "-m", "dbo_runtime", "verify", "--model", "m", "-dp", "2"], capture_output=True, text=True, timeout=300)
    err = [line for line in proc.stderr.strip().splitlines() if line.startswith("dbo-runtime verify")]
    assert proc.returncode in (1, 3) and len(err) == 1, proc.stderr[-2000:]
    assert "needs a GPU machine" in err[0] or "needs 2 GPU(s)" in err[0]
    assert "Traceback" not in proc.stderr


def test_too_few_gpus_is_one_line_exit_3(fake_cuda_device_type: None, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["verify", "--model", "m", "-dp", "2"]) == 3
    err = [line for line in capsys.readouterr().err.strip().splitlines() if not line.startswith("[verify]")]
    assert err == ["dbo-runtime verify: needs 2 GPU(s) for data-parallel size 2 (one engine rank per GPU); 0 visible"]


# -- the verdict document ---------------------------------------------------------------------------
def _rec(ok: bool = True, tokens: list[list[int]] | None = None, steps: Any = (4, 4), error: str | None = None, sigs: list[str] | None = None) -> dict[str, Any]:
    toks = tokens or [[1, 2, 3], [4, 5, 6]]
    return {
        "ok": ok,
        "error": error,
        "failure_signatures": sigs or [],
        "start_s": [30.0, 31.0],
        "generate_s": [1.0, 1.0],
        "microbatched_steps": list(steps) if steps is not None else None,
        "plugin": True,
        "requests": [{"index": i, "tokens": t, "logprobs": [{str(x): -0.5} for x in t]} for i, t in enumerate(toks)],
    }


def _doc(records: dict[str, Any], tmp_path: Path) -> dict[str, Any]:
    return verify._result(records, Thresholds(0.98, 0.25), tmp_path, [], Request, compare, verdict_fn)


def test_result_pass_fail_error_inconclusive(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    doc = _doc({"dbo-off": _rec(), "dbo-on": _rec()}, tmp_path)
    assert doc["verdict"] == "pass" and doc["exit_code"] == 0
    doc = _doc({"dbo-off": _rec(), "dbo-on": _rec(tokens=[[1, 9, 9], [4, 5, 6]])}, tmp_path)
    assert doc["verdict"] == "fail" and doc["exit_code"] == 1 and "agreement" in doc["reasons"][0]
    crash = _rec(ok=False, error="EngineDeadError", sigs=["deepgemm_schedule_assert"])
    doc = _doc({"dbo-off": _rec(), "dbo-on": crash}, tmp_path)
    assert doc["verdict"] == "error" and doc["exit_code"] == 3 and any(r.startswith("known failure: deepgemm_schedule_assert (vLLM 0.33's DBO crash") for r in doc["reasons"])
    doc = _doc({"dbo-off": _rec(), "dbo-on": _rec(steps=(0, 5))}, tmp_path)
    assert doc["verdict"] == "inconclusive" and doc["exit_code"] == 4
    doc = _doc({"dbo-off": _rec(), "dbo-on": _rec(steps=None)}, tmp_path)
    assert doc["verdict"] == "pass" and any("cannot confirm" in n for n in doc["notes"])
    verify._print(doc, as_json=False)
    out = capsys.readouterr().out
    assert "token agreement" in out and "verdict: PASS" in out


def test_prompt_file_problems_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    binary = tmp_path / "p.txt"
    binary.write_bytes(b"\xff\xfe\x00bad")
    assert main(["verify", "--prompt-file", str(binary), "--model", "m", "-dp", "2"]) == 2
    assert "a readable UTF-8 text file" in capsys.readouterr().err
    one = tmp_path / "one.txt"
    one.write_text("only one prompt\n")
    assert main(["verify", "--prompt-file", str(one), "--model", "m", "-dp", "2"]) == 2
    assert "at least 2 prompts (one per data-parallel rank)" in capsys.readouterr().err


def test_unusable_workdir_is_one_line(
    tmp_path: Path, fake_cuda_device_type: None, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(verify, "visible_gpus", lambda: 2)  # FakeGpuCount: past the GPU check (no GPU in CI)
    afile = tmp_path / "afile"
    afile.write_text("")
    assert main(["verify", "--workdir", str(afile / "sub"), "--model", "m", "-dp", "2"]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if not line.startswith("[verify]")]
    assert len(err) == 1 and "--workdir" in err[0] and "Traceback" not in err[0]


# -- the noise floor -----------------------------------------------------------------------------------
def _lp_rec(shift: float, tokens: list[list[int]] | None = None) -> dict[str, Any]:
    """A record whose every logprob is -0.5 - shift (tokens as given)."""
    rec = _rec(tokens=tokens)
    for r in rec["requests"]:
        r["logprobs"] = [{str(x): -0.5 - shift, "999": -3.0} for x in r["tokens"]]
    return rec


def test_noise_floor_judges_dbo_against_a_batch_shape_change(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The dummy-weight picture measured on 2x H200: DBO with dbo_runtime moved logprobs ~3e-5, the top-k bug
    ~3.4e-4; both pass the absolute thresholds, so only a floor can tell them apart."""
    rule = verify.FloorRule()

    def doc(on: dict[str, Any], floor: dict[str, Any]) -> dict[str, Any]:
        records = {"dbo-off": _lp_rec(0.0), "dbo-on": on, "noise-floor": floor}
        return verify._result(records, Thresholds(0.98, 0.25), tmp_path, [], Request, compare, verdict_fn, rule)

    fixed = doc(_lp_rec(3.1e-5), _lp_rec(2e-5))
    assert fixed["verdict"] == "pass" and fixed["noise_floor"]["mean_abs_dlogprob_exact"] == pytest.approx(2e-5)
    bug = doc(_lp_rec(3.4e-4), _lp_rec(2e-5))
    assert bug["verdict"] == "fail" and bug["exit_code"] == 1 and "> 3 x noise floor" in bug["reasons"][0]
    assert bug["judged_by"] == "noise_floor"
    # the same DBO run judged without a floor passes: what the floor adds
    assert _doc({"dbo-off": _lp_rec(0.0), "dbo-on": _lp_rec(3.4e-4)}, tmp_path)["verdict"] == "pass"
    # a model that moves a lot under a mere batch-shape change: DBO may move it as much
    chaotic = doc(_lp_rec(0.1, tokens=[[1, 9, 9], [4, 5, 6]]), _lp_rec(0.08, tokens=[[1, 2, 9], [4, 9, 6]]))
    assert chaotic["verdict"] == "pass", chaotic["reasons"]
    worse = doc(_lp_rec(0.1, tokens=[[9, 9, 9], [9, 9, 9]]), _lp_rec(0.08))
    assert worse["verdict"] == "fail" and worse["reasons"][0].startswith("token agreement 0.0000 < noise floor")
    # the floor run failing is an error, like any run
    broken = doc(_lp_rec(0.0), _rec(ok=False, error="boom"))
    assert broken["verdict"] == "error" and "noise-floor" in broken["reasons"][0]
    verify._print(fixed, as_json=False)
    out = capsys.readouterr().out
    assert "(noise floor 1.0000)" in out and "noise-floor run" in out and "verdict: PASS" in out


@pytest.mark.parametrize(
    ("args", "per_rank", "expected"),
    [
        ([], 32, ["--max-num-seqs", "16"]),
        (["--max-num-seqs", "8"], 32, ["--max-num-seqs", "4"]),
        (["--max_num_seqs", "8"], 32, ["--max-num-seqs", "4"]),  # vLLM takes underscores too
        (["--max-num-seqs=64"], 32, ["--max-num-seqs", "16"]),
        (["--max-num-seqs", "64", "--max-num-active-seqs", "12"], 32, ["--max-num-active-seqs", "6"]),
    ],
)
def test_floor_halves_the_sequences_held_at_a_time(args: list[str], per_rank: int, expected: list[str]) -> None:
    added, note = verify.floor_args(["--model", "m", *args], per_rank)
    assert added == expected and f"{expected[0]} {expected[1]}" in note


def test_floor_needs_two_sequences_per_rank() -> None:
    with pytest.raises(ConfigError, match="--noise-floor"):
        verify.floor_args(["--model", "m"], 1)
    with pytest.raises(ConfigError, match="at least 2 sequences") as raised:
        verify.floor_args(["--model", "m", "--max-num-seqs", "1"], 32)
    assert str(raised.value).startswith("--noise-floor is given with 1 sequence per DP rank at a time")  # no placeholder quoted


def test_every_run_gets_the_runner_dbo_would_use() -> None:
    """vLLM 0.33 runs DBO on V1 unless VLLM_USE_V2_MODEL_RUNNER is set; without pinning, DBO-off would run
    V2 and verify would compare runners."""
    assert verify.same_runner_env({}) == {"VLLM_USE_V2_MODEL_RUNNER": "0"}
    assert verify.same_runner_env({"VLLM_USE_V2_MODEL_RUNNER": "1"}) == {}


def test_degenerate_or_broken_floor(tmp_path: Path) -> None:
    rule = verify.FloorRule()
    records = {"dbo-off": _lp_rec(0.0), "dbo-on": _lp_rec(3.4e-4), "noise-floor": _lp_rec(0.0)}
    doc = verify._result(records, Thresholds(0.98, 0.25), tmp_path, [], Request, compare, verdict_fn, rule)
    assert doc["judged_by"] == "thresholds" and doc["verdict"] == "pass" and any("identical" in n for n in doc["notes"])
    broken = _lp_rec(1e-5)
    broken["requests"][1]["logprobs"][0] = {"4": float("nan")}
    doc = verify._result({**records, "noise-floor": broken}, Thresholds(0.98, 0.25), tmp_path, [], Request, compare, verdict_fn, rule)
    assert doc["verdict"] == "error" and "noise-floor run is unusable" in doc["reasons"][0]


def test_floor_slack_grows_with_the_floors_spread() -> None:
    from dbo_runtime.harness.compare import Comparison

    floor = Comparison(requests=64, agreement=0.80, agreement_se=0.05, mean_abs_dlogprob_exact=0.01)
    ok, _ = verify.FloorRule().judge(Comparison(requests=64, agreement=0.60, mean_abs_dlogprob_exact=0.01), floor)
    assert ok  # 0.80 - 3 * sqrt(2) * 0.05 = 0.588
    ok, reasons = verify.FloorRule().judge(Comparison(requests=64, agreement=0.58, mean_abs_dlogprob_exact=0.01), floor)
    assert not ok and reasons[0].startswith("token agreement 0.5800 < noise floor 0.8000 - 0.212")
    ok, reasons = verify.FloorRule().judge(Comparison(requests=64, agreement=0.8, missing_requests=[3], nonfinite_logprobs=2), floor)
    assert not ok and any("missing" in r for r in reasons) and any("non-finite" in r for r in reasons)


def test_noise_floor_option_is_not_a_vllm_option() -> None:
    import argparse

    parser = verify.add_parser(argparse.ArgumentParser().add_subparsers())
    assert parser.parse_args(["--noise-floor"]).noise_floor is True


def test_noise_floor_end_to_end_with_the_fake_engine(
    tmp_path: Path, fake_cuda_device_type: None, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """verify's own plan through the real launcher, with FakeEngineRunner standing in for vLLM (no GPU in
    CI; GPU twin: the verify cases of tests/e2e): three runs, the floor's halved sequences, the runner pin."""
    import json

    from dbo_runtime.harness import launch as launch_mod

    monkeypatch.setenv(launch_mod.RUNNER_MODULE_ENV, "tests.fakes.fake_engine_runner")
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    monkeypatch.setattr(verify, "visible_gpus", lambda: 2)  # FakeGpuCount
    argv = ["verify", "--json", "--noise-floor", "--prompts", "8", "--prompt-len", "300-400", "--workdir", str(tmp_path), "--model", "m", "-dp", "2"]
    code = main(argv)
    doc = json.loads(capsys.readouterr().out)
    assert code == 0 and doc["verdict"] == "pass", doc
    assert list(doc["runs"]) == ["dbo-off", "dbo-on", "noise-floor"]
    assert any("--max-num-seqs 2" in n for n in doc["notes"]) and any("VLLM_USE_V2_MODEL_RUNNER is not set" in n for n in doc["notes"])
    assert any("identical" in n for n in doc["notes"]) and doc["judged_by"] == "thresholds"  # the fake ignores batch shapes
    specs = {label: json.loads((tmp_path / label / "spec.json").read_text()) for label in doc["runs"]}
    assert specs["noise-floor"]["engine_args"][-2:] == ["--max-num-seqs", "2"] and "--enable-dbo" not in specs["noise-floor"]["engine_args"]
    assert specs["dbo-on"]["engine_args"][-1] == "--enable-dbo"
    assert all(s["env"] == {"VLLM_USE_V2_MODEL_RUNNER": "0"} for s in specs.values())


def test_an_early_refusal_leaves_no_temporary_directory(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """The temporary workdir is made after vLLM's parser and the GPU check: made before them, every
    refused run would leave an empty /tmp/dbo-verify-* behind."""
    made: list[str] = []
    monkeypatch.setattr(verify.tempfile, "mkdtemp", lambda **kw: made.append("x") or "/nonexistent")
    monkeypatch.setattr(verify, "visible_gpus", lambda: 0)
    assert main(["verify", "--model", "m", "-dp", "2"]) == 3  # no GPU platform here, or no GPUs: refused
    capsys.readouterr()
    assert made == []


# -- DeepEP LL queue depth, said before any engine starts ------------------------------------------
LL = ["--model", "m", "-dp", "2", "--enable-expert-parallel", "--all2all-backend", "deepep_low_latency"]


@pytest.mark.parametrize(
    ("extra", "env", "problem"),
    [
        ([], {}, None),  # vLLM's LL default of 256 batched tokens fits the NVSHMEM default
        (["--performance-mode", "throughput"], {}, ">= 1026"),  # the default doubled: 512 tokens
        (["--max-num-batched-tokens", "2k"], {}, ">= 4002"),  # vLLM reads human-readable integers
        (["--max-num-batched-tokens", "2048"], {"NVSHMEM_QP_DEPTH": "4098"}, None),  # exactly the bound
        (["--max-num-batched-tokens", "511"], {}, None),  # 2 x 512 = 1024: exactly the default depth
        (["--max-num-batched-tokens", "512"], {}, "NVSHMEM_QP_DEPTH is unset (NVSHMEM default 1024)"),
        (["--max_num_batched_tokens=2048"], {}, ">= 4098"),
        (["--max-num-batched-tokens", "2048"], {"NVSHMEM_QP_DEPTH": "8192"}, None),
        (["--max-num-batched-tokens", "2048"], {"NVSHMEM_QP_DEPTH": "4097"}, "NVSHMEM_QP_DEPTH=4097"),
        (["--max-num-batched-tokens", "2048"], {"NVSHMEM_QP_DEPTH": "lots"}, "an integer >= 4098"),
    ],
)
def test_ll_queue_depth_is_checked_from_the_engine_args(extra: list[str], env: dict[str, str], problem: str | None) -> None:
    """On 2x H200 an LL engine with 2048 batched tokens dies at start-up on DeepEP's
    ``nvshmem_qp_depth >= (num_max_dispatch_tokens_per_rank + 1) * 2``: verify checks it first."""
    args, _, _ = verify.split_engine_args([*LL, *extra])
    found = verify.ll_qp_depth_problem(args, env)
    if problem is None:
        assert found is None
    else:
        assert found is not None and found.parameter == "NVSHMEM_QP_DEPTH" and problem in str(found), found


def test_ll_queue_depth_ignores_other_backends_and_runs_without_ep() -> None:
    args = ["--model", "m", "--all2all-backend", "deepep_high_throughput", "--enable-expert-parallel", "--max-num-batched-tokens", "8192"]
    assert verify.ll_qp_depth_problem(args, {}) is None
    no_ep = ["--model", "m", "--all2all-backend", "deepep_low_latency", "--max-num-batched-tokens", "8192"]
    assert verify.ll_qp_depth_problem(no_ep, {}) is None  # vLLM never builds the LL kernels without EP
    assert verify.ll_qp_depth_problem([*no_ep, "-ep"], {}) is not None


def test_ll_queue_depth_refusal_is_one_line_before_any_engine(
    fake_cuda_device_type: None, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    started: list[object] = []
    monkeypatch.delenv("NVSHMEM_QP_DEPTH", raising=False)
    monkeypatch.setattr(verify, "visible_gpus", lambda: started.append("gpu check") or 2)
    assert main(["verify", *LL, "--max-num-batched-tokens", "2048"]) == 2
    err = [line for line in capsys.readouterr().err.strip().splitlines() if not line.startswith("[verify]")]
    assert len(err) == 1 and "NVSHMEM_QP_DEPTH" in err[0] and "NVSHMEM_QP_DEPTH=8192" in err[0], err
    assert started == []  # refused before the GPU check and any engine


@pytest.mark.parametrize("value", ["19", "-3", "abc", "131"])
def test_a_comm_sms_value_vllm_would_fail_on_is_refused_before_any_engine(
    value: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """An odd count reaching DeepEP HT would fail in the middle of the DBO run, after the whole DBO-off one."""
    monkeypatch.setenv("VLLM_DBO_COMM_SMS", value)
    argv = ["verify", "--model", "m", "-dp", "2", "--enable-expert-parallel", "--all2all-backend", "deepep_high_throughput"]
    assert main(argv) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if not line.startswith("[verify]")]
    assert len(err) == 1 and "VLLM_DBO_COMM_SMS" in err[0], err


def test_the_plugins_switches_are_said_before_the_engines_start(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("DBO_RUNTIME_DISABLE", "ture")
    monkeypatch.setattr(verify, "check_with_vllm", lambda args, command="verify": None)
    monkeypatch.setattr(verify, "visible_gpus", lambda: 0)
    assert main(["verify", "--model", "m", "-dp", "2"]) == 3
    assert "DBO_RUNTIME_DISABLE" in capsys.readouterr().err


@pytest.mark.parametrize("value", ["0", "x", "1.5"])
@pytest.mark.parametrize("flag", ["--max-num-seqs", "--max-num-active-seqs"])
def test_floor_refuses_a_sequence_limit_it_cannot_halve_instead_of_reading_it_as_unset(flag: str, value: str) -> None:
    """The floor halves the limit, so verify reads it and refuses it here, before any GPU or engine is asked for."""
    with pytest.raises(ConfigError, match=f"{flag}=.*an integer >= 1"):
        verify.floor_args(["--model", "m", flag, value], 32)
