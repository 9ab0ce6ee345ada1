"""``dbo-runtime verify`` on CPU: the engine arguments (with vLLM's real parser), the checks before any engine
starts, and the verdict logic. The engine runs themselves need GPUs: their GPU twin is
``tests/e2e/test_dbo_2gpu.py::test_verify_cli``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from dbo_runtime.cli import _engine, verify
from dbo_runtime.cli.main import main
from dbo_runtime.core.errors import ConfigError
from dbo_runtime.harness.compare import Thresholds


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("VLLM_DBO_COMM_SMS", "NVSHMEM_QP_DEPTH", "DBO_RUNTIME_DISABLE", "DBO_RUNTIME_TOPK_LAYOUT"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def fake_cuda_device_type(monkeypatch: pytest.MonkeyPatch) -> None:
    """FakeDeviceType: vLLM's DeviceConfig infers the device from the platform, which is
    'unspecified' without a GPU (boundary: no GPU in CI); the GPU twin parses on a real platform."""
    from vllm.platforms import current_platform

    monkeypatch.setattr(current_platform, "device_type", "cuda", raising=False)


def test_the_engine_arguments_lose_the_dp_size_and_the_dbo_flags() -> None:
    args, dp, notes = _engine.split_engine_args(["--model", "m", "-dp", "2", "--enable-dbo", "--enable_expert_parallel"], "verify")
    assert args == ["--model", "m", "--enable-expert-parallel"] and dp == 2 and any("--enable-dbo ignored" in n for n in notes)
    args, dp, _ = _engine.split_engine_args(["m", "--data_parallel_size=4", "--", "--seed", "1"], "verify")
    assert args == ["--model", "m", "--seed", "1"] and dp == 4


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--model", "m", "-dp", "x"], "-dp='x' is not allowed; allowed values: an integer >= 2"),
        (["--model", "m", "--data-parallel-address", "10.0.0.1"], "--data-parallel-address is given"),
        (["--model", "m", "--config", "serve.yaml"], "--config is given"),
        (["--enable-expert-parallel", "-dp", "2"], "MODEL is missing"),
        (["--model", "m", "-dp", "0"], "--data-parallel-size=0 is not allowed; allowed values: an integer >= 2"),
        (["--model", "m"], "--data-parallel-size is not given (vLLM's default is 1); allowed values: an integer >= 2"),
            (["--model", "m", "-dp", "1"], "--data-parallel-size=1 is not allowed; allowed values: an integer >= 2"),
        (["--prompts", "1", "--model", "m", "-dp", "2"], "at least the data-parallel size"),
        (["--prompt-len", "9-3", "--model", "m", "-dp", "2"], "--prompt-len='9-3' is not allowed"),
        (["--min-agreement", "1.5", "--model", "m", "-dp", "2"], "--min-agreement=1.5 is not allowed"),
        (["--prompt-file", "/nonexistent.jsonl", "--model", "m", "-dp", "2"], "--prompt-file='/nonexistent.jsonl'"),
        (["--model", "m", "-dp", "2", "--all2all-backend", "deepep_low_latency", "--enable-expert-parallel", "--max-num-batched-tokens", "2048"],
         "NVSHMEM_QP_DEPTH is unset (NVSHMEM default 1024); allowed values: an integer >= 4098"),
    ],
)  # fmt: skip
def test_what_an_engine_would_refuse_is_one_line_before_any_starts(
    argv: list[str], needle: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(_engine, "check_with_vllm", lambda *a: pytest.fail("reached vLLM's parser: the refusal came too late"))
    assert main(["verify", "--workdir", str(tmp_path / "w"), *argv]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if not line.startswith("[verify]")]
    assert len(err) == 1 and needle in err[0], err
    assert not (tmp_path / "w").exists()  # a refused run leaves nothing on disk


def test_a_prompt_file_shorter_than_the_dp_size_is_named_with_its_count(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "one.txt").write_text("a single prompt\n")
    assert main(["verify", "--workdir", str(tmp_path / "w"), "--prompt-file", str(tmp_path / "one.txt"), "--model", "m", "-dp", "2"]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if not line.startswith("[verify]")]
    assert len(err) == 1 and f"--prompt-file='{tmp_path / 'one.txt'}' is not allowed" in err[0] and "(1 here)" in err[0], err


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--no-such-vllm-flag", "1"], "engine argument '--no-such-vllm-flag' is not allowed: vLLM has no such engine argument"),
        (["--port=8000", "--host", "0.0.0.0"], "engine argument '--port' is not allowed: it is a vllm serve server option; verify runs the engine offline"),
        (["--max-model-len", "abc"], "an engine argument is refused by vLLM's parser (argument --max-model-len: invalid"),
    ],
)  # fmt: skip
def test_bad_vllm_args_are_one_line_exit_2(argv: list[str], expected: str, fake_cuda_device_type: None, capsys: pytest.CaptureFixture[str]) -> None:
    """A copied ``vllm serve`` line: the option vLLM's engine parser refuses is named, a server option as one."""
    assert main(["verify", "--model", "m", "-dp", "2", *argv]) == 2
    err = [line for line in capsys.readouterr().err.strip().splitlines() if not line.startswith("[verify]")]
    assert len(err) == 1 and err[0].startswith(f"dbo-runtime verify: error: {expected}"), err
    assert err[0].endswith("allowed values: vLLM engine arguments"), err


def test_too_few_gpus_is_one_line_exit_3(fake_cuda_device_type: None, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main(["verify", "--workdir", str(tmp_path / "w"), "--model", "m", "-dp", "2"]) == 3
    err = [line for line in capsys.readouterr().err.strip().splitlines() if not line.startswith("[verify]")]
    assert err == ["dbo-runtime verify: needs 2 GPU(s) (one engine rank per GPU for data-parallel size 2); 0 visible"]
    assert not (tmp_path / "w").exists()


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
    return verify._result(records, Thresholds(0.98, 0.25), tmp_path, [])


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
    verify.render(doc)
    out = capsys.readouterr().out
    assert "token agreement" in out and "verdict: PASS" in out


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
        return verify._result(records, Thresholds(0.98, 0.25), tmp_path, [], rule)

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
    verify.render(fixed)
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


def test_degenerate_or_broken_floor(tmp_path: Path) -> None:
    rule = verify.FloorRule()
    records = {"dbo-off": _lp_rec(0.0), "dbo-on": _lp_rec(3.4e-4), "noise-floor": _lp_rec(0.0)}
    doc = verify._result(records, Thresholds(0.98, 0.25), tmp_path, [], rule)
    assert doc["judged_by"] == "thresholds" and doc["verdict"] == "pass" and any("identical" in n for n in doc["notes"])
    broken = _lp_rec(1e-5)
    broken["requests"][1]["logprobs"][0] = {"4": float("nan")}
    doc = verify._result({**records, "noise-floor": broken}, Thresholds(0.98, 0.25), tmp_path, [], rule)
    assert doc["verdict"] == "error" and "noise-floor run is unusable" in doc["reasons"][0]


def test_noise_floor_end_to_end_with_the_fake_engine(
    tmp_path: Path, fake_cuda_device_type: None, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """verify's own plan through the real launcher, with FakeEngineRunner standing in for vLLM (no GPU in
    CI; GPU twin: the verify cases of tests/e2e): three runs, the floor's halved sequences, the runner pin."""
    import json

    from dbo_runtime.harness import launch as launch_mod

    monkeypatch.setenv(launch_mod.RUNNER_MODULE_ENV, "tests.fakes.fake_engine_runner")
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    monkeypatch.setattr(_engine, "visible_gpus", lambda: 2)  # FakeGpuCount
    argv = ["verify", "--json", "--noise-floor", "--prompts", "8", "--prompt-len", "300-400", "--workdir", str(tmp_path), "--model", "m", "-dp", "2"]
    code = main(argv)
    doc = json.loads(capsys.readouterr().out)
    assert code == 0 and doc["verdict"] == "pass", doc
    assert list(doc["runs"]) == ["dbo-off", "dbo-on", "noise-floor"]
    assert any("--max-num-seqs 2" in n for n in doc["notes"])
    assert any("identical" in n for n in doc["notes"]) and doc["judged_by"] == "thresholds"  # the fake ignores batch shapes
    specs = {label: json.loads((tmp_path / label / "spec.json").read_text()) for label in doc["runs"]}
    assert specs["noise-floor"]["engine_args"][-2:] == ["--max-num-seqs", "2"] and "--enable-dbo" not in specs["noise-floor"]["engine_args"]
    assert specs["dbo-on"]["engine_args"][-1] == "--enable-dbo"
    assert all(s["env"] == {"VLLM_USE_V2_MODEL_RUNNER": "0"} for s in specs.values())
