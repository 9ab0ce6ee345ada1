"""``dbo-runtime tune``: the sweep, the choice, the engines it plans, and the command, on CPU.

The sweep itself runs through the real launcher and interleaved turns with FakeEngineRunner standing in for
vLLM (boundary: no GPU, so no engine can start in CI; ``tests/fakes/fake_engine_runner.py``, its per-value step
times from ``DBO_FAKE_STEP_MS``). GPU twin: ``test_tune_measures_a_curve_on_the_real_engine`` in
tests/e2e/test_width_2gpu.py.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path
from typing import Any

import pytest

from dbo_runtime.cli import _engine, tune
from dbo_runtime.cli.main import build_parser, main
from dbo_runtime.core.comm_sweep import Measurement, choose, measurement, plan_sweep
from dbo_runtime.core.errors import ConfigError

HT = "deepep_high_throughput"
ENGINE = ["--model", "m", "-dp", "2", "--enable-expert-parallel", "--all2all-backend", HT]
SEVEN = [10.0, 10.1, 9.9, 10.05, 9.95, 10.0, 10.02]


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("VLLM_DBO_COMM_SMS", "DBO_RUNTIME_DISABLE", "DBO_FAKE_MICROBATCHED"):
        monkeypatch.delenv(name, raising=False)


def _sweep(raw: str = "4,8,12,16,20", env: dict[str, str] | None = None) -> Any:
    return plan_sweep(raw, backend=HT, platform="cuda", environ=env or {})


def _opts(*argv: str) -> argparse.Namespace:
    return tune.check_reps(tune.options(build_parser().parse_args(["tune", *argv])), _sweep("12,16"))


def _m(value: int, reps: list[float]) -> Measurement:
    return Measurement(value, dict(enumerate(reps, 1)), 4)


def test_the_sweep_adds_todays_value_and_refuses_what_deepep_refuses() -> None:
    assert _sweep().values == (4, 8, 12, 16, 20) and _sweep().default == 20
    env = _sweep("4,8", {"VLLM_DBO_COMM_SMS": "14"})
    assert env.values == (4, 8, 14) and env.default == 14
    assert _sweep("all").values == tuple(range(2, 21, 2))
    for bad in ("5", "8,12,8", "22"):  # odd, twice, above DeepEP HT's 20
        with pytest.raises(ConfigError) as err:
            _sweep(bad)
        assert err.value.parameter == "--values"


def test_a_value_faster_in_every_paired_round_is_chosen_and_anything_less_keeps_todays() -> None:
    doc = choose([_m(12, [x * 0.9 for x in SEVEN]), _m(16, [x * 0.96 for x in SEVEN]), _m(20, SEVEN)], 20, min_gain=0.02)
    assert doc["verdict"] == "measured" and doc["chosen"] == 12 and doc["setting"] == "VLLM_DBO_COMM_SMS=12"
    lost = choose([_m(12, [x * 0.95 for x in SEVEN[:3]] + [10.5] + [x * 0.95 for x in SEVEN[4:]]), _m(20, SEVEN)], 20, min_gain=0.02)
    assert lost["chosen"] == 20 and "in 6 of 7" in lost["reason"]
    small = choose([_m(16, [x * 0.99 for x in SEVEN]), _m(20, SEVEN)], 20, min_gain=0.02)
    assert small["chosen"] == 20 and "below --min-gain" in small["reason"]
    never = choose([Measurement(12, error="DBO never microbatched"), Measurement(20, error="DBO never microbatched")], 20, min_gain=0.02)
    assert never["verdict"] == "inconclusive" and never["setting"] is None


def test_noise_alone_moves_off_the_default_in_at_most_alpha_of_sweeps() -> None:
    rng = random.Random(0)
    runs = [[_m(v, [10.0 * (1 + rng.gauss(0, 0.03)) for _ in range(7)]) for v in (4, 8, 12, 16, 20)] for _ in range(1000)]
    assert sum(choose(r, 20, min_gain=0.02)["chosen"] != 20 for r in runs) / len(runs) <= 0.05


def test_a_round_counts_its_slowest_rank_only_where_every_rank_microbatched() -> None:
    record = {"ok": True, "bench": [
        {"reps": [{"rep": 0, "warmup": True, "x": 50.0, "m": 3}, {"rep": 1, "x": 10.0, "m": 3}, {"rep": 2, "x": 11.0, "m": 3}, {"rep": 3, "x": 9.0, "m": 3}]},
        {"reps": [{"rep": 0, "warmup": True, "x": 60.0, "m": 3}, {"rep": 1, "x": 12.0, "m": 3}, {"rep": 2, "x": None, "m": 3}, {"rep": 3, "x": 9.5, "m": 0}]},
    ]}  # fmt: skip
    m = measurement(20, record, "x", "m")
    assert m.reps_ms == [12.0] and m.microbatched == 15


def test_the_prefill_plan_times_one_step_of_the_requested_tokens() -> None:
    specs, metric, _, notes = tune.specs(["--model", "m", "--enable-expert-parallel"], 2, _sweep("12,16"), _opts(), {})
    assert [s.label for s in specs] == ["comm-12", "comm-16", "comm-20"] and metric == "prefill_partition_ms"
    for spec, value in zip(specs, (12, 16, 20)):
        args = spec.engine_args
        assert spec.env["VLLM_DBO_COMM_SMS"] == str(value) and args[-1] == "--enable-dbo" and "--no-enable-prefix-caching" in args
        assert args[args.index("--max-num-batched-tokens") + 1] == "8192"
        assert args[args.index("--gpu-memory-utilization") + 1] == "0.3"  # three engines share each GPU
        assert spec.bench["reps"] == 7 and spec.prompts.num == 64  # 4 steps of 8 prompts per rank, 2 ranks
    assert any("prefix caching off" in n for n in notes)


def test_the_decode_plan_holds_the_batch_in_one_step_and_runs_eager() -> None:
    specs, metric, _, _ = tune.specs(["--model", "m"], 2, _sweep("12"), _opts("--shape", "decode", "--decode-batch", "64"), {})
    args = specs[0].engine_args
    assert metric == "decode_partition_ms" and args[args.index("--max-num-seqs") + 1] == "64" and "--enforce-eager" in args
    assert specs[0].prompts.num == 128
    with pytest.raises(ConfigError) as err:
        tune.specs(["--model", "m", "--max-num-seqs", "32"], 2, _sweep("12"), _opts("--shape", "decode", "--decode-batch", "64"), {})
    assert err.value.parameter == "--decode-batch"


@pytest.mark.parametrize(
    ("engine", "opts", "parameter"),
    [
        (["--gpu-memory-utilization", "0.9"], [], "--gpu-memory-utilization"),  # three engines on the same GPUs
        (["--max-num-batched-tokens", "4096"], [], "--max-num-batched-tokens"),
        ([], ["--prompt-len", "9000"], "--prompt-len"),
    ],
)
def test_what_the_operator_set_is_checked_not_overridden(engine: list[str], opts: list[str], parameter: str) -> None:
    with pytest.raises(ConfigError) as err:
        tune.specs(["--model", "m", *engine], 2, _sweep("12,16"), _opts(*opts), {})
    assert err.value.parameter == parameter


@pytest.mark.parametrize(
    ("argv", "env", "needle"),
    [
        (["--model", "m", "-dp", "2", "--all2all-backend", HT], {}, "--enable-expert-parallel"),
        ([*ENGINE, "--no-enable-expert-parallel"], {}, "--enable-expert-parallel"),  # the last one wins, as in vLLM
        (["--values", "5", *ENGINE], {}, "--values"),
        (["--reps", "3", "--values", "all", *ENGINE], {}, "--reps=3 is not allowed"),
        (["--min-gain", "1.5", *ENGINE], {}, "--min-gain=1.5"),
        (ENGINE, {"DBO_RUNTIME_DISABLE": "1"}, "DBO_RUNTIME_DISABLE=1 is not allowed"),
        (ENGINE, {"VLLM_DBO_COMM_SMS": "19"}, "VLLM_DBO_COMM_SMS=19 is not allowed"),
    ],
)
def test_bad_arguments_are_one_line_and_exit_2_before_any_engine(
    argv: list[str], env: dict[str, str], needle: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(_engine, "check_with_vllm", lambda *a: pytest.fail("reached vLLM's parser: the refusal came too late"))
    assert main(["tune", *argv]) == 2
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith("dbo-runtime tune: error: ") and needle in line


def test_without_gpus_it_cannot_run(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_engine, "check_with_vllm", lambda *a: None)
    assert main(["tune", *ENGINE, "-tp", "2"]) == 3
    assert capsys.readouterr().err.splitlines()[-1] == "dbo-runtime tune: needs 4 GPU(s) (data-parallel 2 x tensor x pipeline parallel); 0 visible"


def _sweep_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, curve: dict[str, float], *extra: str) -> int:
    from dbo_runtime.harness import launch as launch_mod

    monkeypatch.setenv(launch_mod.RUNNER_MODULE_ENV, "tests.fakes.fake_engine_runner")
    monkeypatch.setenv("DBO_FAKE_STEP_MS", json.dumps(curve))
    monkeypatch.setattr(_engine, "check_with_vllm", lambda *a: None)  # FakeEngineRunner takes any argument
    monkeypatch.setattr(_engine, "visible_gpus", lambda: 2)  # FakeGpuCount
    return main(["tune", "--values", "12,16", "--workdir", str(tmp_path / "w"), *extra, *ENGINE])


def test_a_sweep_measures_every_value_in_interleaved_turns_and_names_the_setting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _sweep_run(tmp_path, monkeypatch, {"12": 9.0, "16": 9.5, "20": 10.0}, "--json") == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["schema"] == "dbo-runtime/tune/v1" and doc["verdict"] == "measured" and doc["setting"] == "VLLM_DBO_COMM_SMS=12"
    assert [r["comm_sms"] for r in doc["curve"]] == [12, 16, 20] and all(r["microbatched_steps"] > 0 for r in doc["curve"])
    assert doc["turn_order"][:3] == ["comm-12", "comm-16", "comm-20"] and doc["turn_order"][3:6] == ["comm-16", "comm-20", "comm-12"]
    assert _sweep_run(tmp_path, monkeypatch, {"12": 10.0, "16": 10.02, "20": 10.05}) == 0
    assert "use: VLLM_DBO_COMM_SMS=20 -- " in capsys.readouterr().out  # 0.5 %: below --min-gain, keep today's


def test_a_sweep_that_never_microbatched_is_inconclusive(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("DBO_FAKE_MICROBATCHED", "0")
    assert _sweep_run(tmp_path, monkeypatch, {"12": 9.0, "20": 10.0}, "--json") == 4
    doc = json.loads(capsys.readouterr().out)
    assert doc["verdict"] == "inconclusive" and doc["setting"] is None
