"""``dbo-runtime tune``: argument handling, sweep planning and the choice, on CPU.

The sweep itself runs through the real launcher and interleaved turns with FakeEngineRunner standing in for
vLLM (boundary: no GPU, so no engine can start in CI; ``tests/fakes/fake_engine_runner.py``, its per-value step
times from ``DBO_FAKE_STEP_MS``). GPU twin: ``test_tune_measures_a_curve_on_the_real_engine`` in tests/e2e/test_width_2gpu.py, and
``tools/gpu/session-tune.sh`` for the recorded curves.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest

from dbo_runtime.cli import tune
from dbo_runtime.cli.main import main
from dbo_runtime.core.comm_sweep import Measurement, choose, measurement, plan_sweep, rounds_needed
from dbo_runtime.core.errors import ConfigError

HT = "deepep_high_throughput"
ENGINE = ["--model", "m", "-dp", "2", "--enable-expert-parallel", "--all2all-backend", HT]


def _sweep(raw: str = "4,8,12,16,20", env: dict[str, str] | None = None, backend: str | None = HT, platform: str = "cuda") -> Any:
    return plan_sweep(raw, backend=backend, platform=platform, environ=env or {})


# -- the sweep -------------------------------------------------------------------------------------
def test_the_default_sweep_is_even_counts_up_to_deepep_hts_ceiling_with_todays_value() -> None:
    sweep = _sweep()
    assert sweep.values == (4, 8, 12, 16, 20) and sweep.default == 20 and sweep.ceiling == 20
    env = _sweep("4,8", {"VLLM_DBO_COMM_SMS": "14"})
    assert env.values == (4, 8, 14) and env.default == 14 and "added 14" in env.notes[0]
    assert _sweep("0,12").values == (0, 12, 20)  # 0: DBO without an SM partition


def test_all_is_every_even_count_deepep_accepts() -> None:
    assert _sweep("all").values == tuple(range(2, 21, 2))
    assert _sweep("0,2,4,6,8,10,12,14,16,18").values == (0, *range(2, 21, 2))  # eleven engines: the most there can be


@pytest.mark.parametrize("raw", ["ALL", "All"])
def test_all_is_lower_case_as_every_word_flag(raw: str) -> None:
    """As ``--shape PREFILL`` is refused: one rule for the case of a word."""
    with pytest.raises(ConfigError) as err:
        _sweep(raw)
    assert err.value.parameter == "--values" and err.value.value == raw
    assert str(err.value).endswith("(did you mean 'all'?)")


def test_a_value_listed_twice_is_refused_not_silently_dropped() -> None:
    with pytest.raises(ConfigError) as err:
        _sweep("8,12,8")
    assert str(err.value).endswith("each once (8 given more than once)")


@pytest.mark.parametrize(
    ("raw", "which"),
    [
        ("3", "(3 is odd)"),
        ("4,3", "(3 is odd)"),
        ("22", "(22 is outside [2, 20])"),
        ("-2", "(-2 is outside [2, 20])"),
        ("4,x", "('x' is not an integer)"),
        ("4;8", "('4;8' is not an integer)"),
        ("", "(no value given)"),
        ("  ", "(no value given)"),
        ("4,,8", "(an entry is empty)"),
        ("1_0", "('1_0' is not an integer)"),
        ("\uff14", "('\uff14' is not an integer)"),
        ("9" * 5000, "('999999999999...' is outside [2, 20])"),
        ("all,4", "('all' stands alone)"),
        ("ALL,4", "('all' stands alone)"),
    ],
)
def test_values_deepep_refuses_are_one_line_naming_the_wrong_value(raw: str, which: str) -> None:
    with pytest.raises(ConfigError) as err:
        _sweep(raw)
    assert err.value.parameter == "--values" and "even integers in [2, 20]" in str(err.value)
    assert str(err.value).endswith(which), str(err.value)


def test_only_the_high_throughput_backend_has_comm_sms_to_tune() -> None:
    for backend in ("deepep_low_latency", "nixl_ep", None):
        with pytest.raises(ConfigError) as err:
            _sweep(backend=backend)
        assert err.value.parameter == "--all2all-backend" and "reserve no comm SMs" in str(err.value)
        assert "did you mean" not in str(err.value)  # another backend is a choice, not a typo
    for typed in ("DEEPEP_HIGH_THROUGHPUT", "deepep_high_thruput"):
        with pytest.raises(ConfigError) as err:
            _sweep(backend=typed)
        assert str(err.value).endswith("(did you mean 'deepep_high_throughput'?)"), str(err.value)
    with pytest.raises(ConfigError, match="ROCm vLLM forces 0 comm SMs"):
        _sweep(platform="rocm")
    with pytest.raises(ConfigError) as err:
        _sweep(env={"VLLM_DBO_COMM_SMS": "abc"})
    assert err.value.parameter == "VLLM_DBO_COMM_SMS"
    with pytest.raises(ConfigError, match="besides the one in force"):
        _sweep("20")


# -- the choice ------------------------------------------------------------------------------------
def _m(value: int, reps: list[float], microbatched: int = 4) -> Measurement:
    return Measurement(value, dict(enumerate(reps, 1)), microbatched)


SEVEN = [10.0, 10.1, 9.9, 10.05, 9.95, 10.0, 10.02]


def test_a_value_faster_in_every_paired_round_is_chosen_with_its_ratio() -> None:
    doc = choose([_m(12, [x * 0.9 for x in SEVEN]), _m(16, [x * 0.96 for x in SEVEN]), _m(20, SEVEN)], 20, min_gain=0.02)
    assert doc["verdict"] == "measured" and doc["best"] == 12 and doc["chosen"] == 12
    assert doc["setting"] == "VLLM_DBO_COMM_SMS=12" and doc["best_paired_speedup"] == pytest.approx(1 / 0.9)
    assert doc["chosen_speedup"] == pytest.approx(1 / 0.9) and doc["p_value"] == pytest.approx(2 * 2**-7)  # k x 2^-n
    rows = {r["comm_sms"]: r for r in doc["curve"]}
    assert rows[12]["faster_rounds"] == rows[12]["rounds"] == 7 and rows[20]["paired_speedup"] == pytest.approx(1.0)
    assert "faster in every one" in doc["reason"]


def test_too_few_rounds_a_lost_round_or_a_small_gain_keep_todays_value() -> None:
    few = choose([_m(12, [9.0, 9.1, 8.9]), _m(20, [10.0, 10.1, 9.9])], 20, min_gain=0.02)
    assert few["chosen"] == 20 and "confirming needs all of at least 5" in few["reason"] and few["best"] == 12
    one_lost = choose([_m(12, [x * 0.95 for x in SEVEN[:3]] + [10.5] + [x * 0.95 for x in SEVEN[4:]]), _m(20, SEVEN)], 20, min_gain=0.02)
    assert one_lost["chosen"] == 20 and "in 6 of 7" in one_lost["reason"]
    small = choose([_m(16, [x * 0.99 for x in SEVEN]), _m(20, SEVEN)], 20, min_gain=0.02)
    assert small["chosen"] == 20 and "below --min-gain" in small["reason"]
    fastest = choose([_m(12, [x * 1.1 for x in SEVEN]), _m(20, SEVEN)], 20, min_gain=0.0)
    assert fastest["chosen"] == 20 and "is the fastest" in fastest["reason"] and fastest["best"] == 20


def test_noise_alone_moves_off_the_default_in_at_most_alpha_of_sweeps() -> None:
    """Every value equally fast, 3 % noise per measurement, 4 alternatives, the default 7 rounds."""
    import random

    rng = random.Random(0)
    switched = 0
    for _ in range(2000):
        sweep = [_m(v, [10.0 * (1 + rng.gauss(0, 0.03)) for _ in range(7)]) for v in (4, 8, 12, 16, 20)]
        switched += choose(sweep, 20, min_gain=0.02)["chosen"] != 20
    assert switched / 2000 <= 0.05


def test_without_microbatching_or_measurements_there_is_no_choice() -> None:
    never = choose([Measurement(12, error="DBO never microbatched"), Measurement(20, error="DBO never microbatched")], 20, min_gain=0.02)
    assert never["verdict"] == "inconclusive" and never["setting"] is None
    failed = choose([Measurement(12, error="engine died"), Measurement(20, error="engine died")], 20, min_gain=0.02)
    assert failed["verdict"] == "error" and tune.exit_code(failed) == 3 and tune.exit_code(never) == 4
    missing_default = choose([_m(12, [9.0]), Measurement(20, error="engine died")], 20, min_gain=0.02)
    assert missing_default["verdict"] == "error" and "in force today (20) was not measured" in missing_default["reason"]
    assert rounds_needed(4, 0.05) == 7 and rounds_needed(1, 0.05) == 5


def test_a_round_counts_its_slowest_rank_only_where_every_rank_microbatched() -> None:
    record = {
        "ok": True,
        "bench": [
            {"reps": [{"rep": 0, "warmup": True, "x": 50.0, "m": 3}, {"rep": 1, "x": 10.0, "m": 3}, {"rep": 2, "x": 11.0, "m": 3},
                      {"rep": 3, "x": 9.0, "m": 3}]},
            {"reps": [{"rep": 0, "warmup": True, "x": 60.0, "m": 3}, {"rep": 1, "x": 12.0, "m": 3}, {"rep": 2, "x": None, "m": 3},
                      {"rep": 3, "x": 9.5, "m": 0}]},
        ],
    }  # fmt: skip
    m = measurement(20, record, "x", "m")
    assert m.reps_ms == [12.0] and m.microbatched == 15  # rep 2: no timing on rank 1; rep 3: rank 1 never split
    assert measurement(20, {"ok": False, "error": "boom"}, "x", "m").error == "boom"
    idle = {"ok": True, "bench": [{"reps": [{"rep": 1, "x": None, "m": 0}]}]}
    assert measurement(20, idle, "x", "m").error == "DBO never microbatched"


# -- the plan --------------------------------------------------------------------------------------
def _opts(**over: Any) -> Any:
    ns = argparse.Namespace(shape="prefill", prefill_tokens=None, prompt_len="1024", decode_batch=None, reps="7",
                            warmup="1", steps=None, min_gain="0.02", timeout="3600")  # fmt: skip
    for key, value in over.items():
        setattr(ns, key, value)
    return tune.options(ns)


@pytest.mark.parametrize(
    ("over", "flag"),
    [
        ({"shape": "both"}, "--shape"),
        ({"reps": "0"}, "--reps"),
        ({"reps": "three"}, "--reps"),
        ({"warmup": "0"}, "--warmup"),
        ({"steps": "0"}, "--steps"),
        ({"min_gain": "1.5"}, "--min-gain"),
        ({"min_gain": "two"}, "--min-gain"),
        ({"timeout": "-5"}, "--timeout"),
        ({"prefill_tokens": "8"}, "--prefill-tokens"),
        ({"decode_batch": "0"}, "--decode-batch"),
        ({"prompt_len": "1048577"}, "--prompt-len"),  # verify's bound too (harness.prompts.MAX_PROMPT_LEN)
    ],
)
def test_bad_options_are_one_line_naming_the_option(over: dict[str, str], flag: str) -> None:
    with pytest.raises(ConfigError) as err:
        _opts(**over)
    assert err.value.parameter == flag


def test_the_prefill_plan_times_one_step_of_the_requested_tokens_without_prefix_caching() -> None:
    sweep = _sweep("12,16")
    specs, metric, counter, notes = tune.specs(["--model", "m", "--enable-expert-parallel"], 2, sweep, _opts(), {})
    assert [s.label for s in specs] == ["comm-12", "comm-16", "comm-20"] and metric == "prefill_partition_ms"
    assert counter == "prefill_partitions"
    for spec, value in zip(specs, (12, 16, 20)):
        assert spec.env == {"VLLM_USE_V2_MODEL_RUNNER": "0", "VLLM_DBO_COMM_SMS": str(value)}
        args = spec.engine_args
        assert args[-1] == "--enable-dbo" and "--no-enable-prefix-caching" in args
        assert args[args.index("--max-num-batched-tokens") + 1] == "8192"
        assert args[args.index("--gpu-memory-utilization") + 1] == "0.3"  # three engines share each GPU
        assert args[args.index("--kv-cache-memory-bytes") + 1] == str(4 << 30)  # no profiling against the others
        assert spec.bench == {"reps": 7, "warmup": 1, "coordinated": True, "max_tokens": 2}
        assert spec.prompts.num == 64 and spec.prompts.min_len == spec.prompts.max_len == 1024  # 4 steps of 8 per rank
    assert any("prefix caching off" in n for n in notes) and any("share each GPU" in n for n in notes)


def test_the_decode_plan_holds_the_batch_in_one_step() -> None:
    specs, metric, counter, _ = tune.specs(["--model", "m"], 2, _sweep("12"), _opts(shape="decode", decode_batch="64"), {})
    assert metric == "decode_partition_ms" and counter == "decode_partitions"
    args = specs[0].engine_args
    assert args[args.index("--max-num-seqs") + 1] == "64" and specs[0].prompts.num == 128 and specs[0].bench["max_tokens"] == 32
    with pytest.raises(ConfigError) as err:
        tune.specs(["--model", "m", "--max-num-seqs", "32"], 2, _sweep("12"), _opts(shape="decode", decode_batch="64"), {})
    assert err.value.parameter == "--decode-batch"


def test_memory_and_step_size_the_operator_set_are_checked_not_overridden() -> None:
    ok, _, _, _ = tune.specs(["--model", "m", "--gpu-memory-utilization", "0.2"], 2, _sweep("12,16"), _opts(), {})
    assert ok[0].engine_args.count("--gpu-memory-utilization") == 1
    with pytest.raises(ConfigError) as err:
        tune.specs(["--model", "m", "--gpu-memory-utilization", "0.9"], 2, _sweep("12,16"), _opts(), {})
    assert err.value.parameter == "--gpu-memory-utilization" and "3 engines" in str(err.value)
    kv, _, _, _ = tune.specs(["--model", "m", "--kv-cache-memory-bytes", "2147483648"], 2, _sweep("12,16"), _opts(), {})
    assert "--gpu-memory-utilization" in kv[0].engine_args  # vLLM still asks for utilization x memory free
    assert kv[0].engine_args.count("--kv-cache-memory-bytes") == 1
    with pytest.raises(ConfigError) as err:
        tune.specs(["--model", "m", "--max-num-batched-tokens", "4096"], 2, _sweep("12"), _opts(), {})
    assert err.value.parameter == "--max-num-batched-tokens"
    with pytest.raises(ConfigError) as err:
        tune.specs(["--model", "m"], 2, _sweep("12"), _opts(prompt_len="9000"), {})
    assert err.value.parameter == "--prompt-len"


# -- the command -----------------------------------------------------------------------------------
def _one_line(capsys: pytest.CaptureFixture[str]) -> str:
    err = [line for line in capsys.readouterr().err.splitlines() if not line.startswith("[tune]")]
    assert len(err) == 1 and "Traceback" not in err[0], err
    return err[0]


@pytest.mark.parametrize(
    ("argv", "names"),
    [
        (["tune", "--model", "m", "--enable-expert-parallel", "--all2all-backend", HT], "--data-parallel-size"),
        (["tune", "--model", "m", "-dp", "2", "--all2all-backend", HT], "--enable-expert-parallel"),
        (["tune", "--model", "m", "-dp", "2", "--enable-expert-parallel", "--all2all-backend", "deepep_low_latency"], "--all2all-backend"),
        (["tune", "--values", "5", *ENGINE], "--values"),
        (["tune", "--shape", "both", *ENGINE], "--shape"),
        (["tune", "-dp", "2"], "--model"),
        (["tune", "--headless", *ENGINE], "--headless"),
        (["tune", *ENGINE, "--no-enable-expert-parallel"], "--enable-expert-parallel"),  # the last one wins, as in vLLM
    ],
)
def test_bad_arguments_exit_2_with_one_line(argv: list[str], names: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    assert names in _one_line(capsys)


def test_the_gpus_needed_count_tensor_and_pipeline_parallel_ranks() -> None:
    assert tune.gpus_needed(["--model", "m"], 2) == 2
    assert tune.gpus_needed(["--model", "m", "-tp", "2", "--pipeline-parallel-size", "2"], 2) == 8


def test_without_gpus_it_cannot_run(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(tune, "check_with_vllm", lambda args, command: None)  # vLLM's parser needs a GPU platform
    monkeypatch.setattr(tune, "visible_gpus", lambda: 0)
    assert main(["tune", *ENGINE]) == 3
    assert "needs 2 GPU(s)" in _one_line(capsys)


def test_a_misspelt_setting_is_noted_before_the_machine_refuses_the_sweep(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """As verify: the environment's note is true on any machine, so it comes before "cannot run here"."""
    from dbo_runtime.cli._common import CliError

    def no_platform(args: list[str], command: str) -> None:
        raise CliError("engine arguments not checked: vLLM cannot build its parser here (no GPU platform); tune needs a GPU machine", 3)

    monkeypatch.setenv("DBO_RUNTIME_DISABEL", "1")
    monkeypatch.setattr(tune, "check_with_vllm", no_platform)
    assert main(["tune", *ENGINE]) == 3
    out, err = capsys.readouterr()
    lines = err.splitlines()
    assert out == "" and len(lines) == 2
    assert lines[0].startswith("[tune] note: DBO_RUNTIME_DISABEL is not a dbo_runtime setting") and "did you mean DBO_RUNTIME_DISABLE?" in lines[0]
    assert lines[1].startswith("dbo-runtime tune: engine arguments not checked")


def test_without_gpus_the_refusal_is_all_it_prints(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """The notes (prefix caching off, the memory split) describe a sweep that will not run: on a machine that
    cannot run one, the refusal is the only line, whether the GPU count or vLLM's parser says so."""
    from dbo_runtime.cli._common import CliError

    monkeypatch.setattr(tune, "check_with_vllm", lambda args, command: None)  # vLLM's parser needs a GPU platform
    monkeypatch.setattr(tune, "visible_gpus", lambda: 0)
    assert main(["tune", *ENGINE]) == 3
    out, err = capsys.readouterr()
    assert out == "" and err.splitlines() == ["dbo-runtime tune: needs 2 GPU(s) (data-parallel 2 x tensor x pipeline parallel); 0 visible"]

    def no_platform(args: list[str], command: str) -> None:  # what the real check says on a CPU box
        raise CliError("engine arguments not checked: vLLM cannot build its parser here (no GPU platform); tune needs a GPU machine", 3)

    monkeypatch.setattr(tune, "check_with_vllm", no_platform)
    assert main(["tune", *ENGINE]) == 3
    out, err = capsys.readouterr()
    assert out == "" and len(err.splitlines()) == 1 and err.startswith("dbo-runtime tune: engine arguments not checked")


def _sweep_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, curve: dict[str, float], *extra: str) -> tuple[int, dict[str, Any]]:
    from dbo_runtime.harness import launch as launch_mod

    monkeypatch.setenv(launch_mod.RUNNER_MODULE_ENV, "tests.fakes.fake_engine_runner")
    monkeypatch.setenv("DBO_FAKE_STEP_MS", json.dumps(curve))
    monkeypatch.delenv("VLLM_DBO_COMM_SMS", raising=False)
    monkeypatch.setattr(tune, "check_with_vllm", lambda args, command: None)  # FakeEngineRunner takes any argument
    monkeypatch.setattr(tune, "visible_gpus", lambda: 2)  # FakeGpuCount
    code = main(["tune", "--json", "--values", "12,16", "--workdir", str(tmp_path), *extra, *ENGINE])
    return code, {}


def test_a_sweep_measures_every_value_in_interleaved_turns_and_names_the_setting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _ = _sweep_run(tmp_path, monkeypatch, {"12": 9.0, "16": 9.5, "20": 10.0})
    doc = json.loads(capsys.readouterr().out)
    assert code == 0 and doc["schema"] == "dbo-runtime/tune/v1" and doc["verdict"] == "measured"
    assert [r["comm_sms"] for r in doc["curve"]] == [12, 16, 20] and doc["setting"] == "VLLM_DBO_COMM_SMS=12"
    medians = {r["comm_sms"]: r["median_ms"] for r in doc["curve"]}
    assert medians[12] == pytest.approx(9.0 * 1.005) and medians[20] == pytest.approx(10.0 * 1.005)  # rank 1 counts
    assert all(r["microbatched_steps"] > 0 for r in doc["curve"])
    order = doc["turn_order"]
    assert order[:3] == ["comm-12", "comm-16", "comm-20"] and order[3:6] == ["comm-16", "comm-20", "comm-12"]  # rotated


def test_the_table_says_what_to_set(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from dbo_runtime.harness import launch as launch_mod

    monkeypatch.setenv(launch_mod.RUNNER_MODULE_ENV, "tests.fakes.fake_engine_runner")
    monkeypatch.setenv("DBO_FAKE_STEP_MS", json.dumps({"12": 10.0, "20": 10.05}))
    monkeypatch.delenv("VLLM_DBO_COMM_SMS", raising=False)
    monkeypatch.setattr(tune, "check_with_vllm", lambda args, command: None)
    monkeypatch.setattr(tune, "visible_gpus", lambda: 2)
    assert main(["tune", "--values", "12", "--workdir", str(tmp_path), *ENGINE]) == 0
    out = capsys.readouterr().out
    assert "use: VLLM_DBO_COMM_SMS=20 -- 12 measured" in out  # 0.5 %: below --min-gain, keep today's


def test_a_sweep_that_never_microbatched_is_inconclusive(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("DBO_FAKE_MICROBATCHED", "0")
    code, _ = _sweep_run(tmp_path, monkeypatch, {"12": 9.0, "20": 10.0})
    doc = json.loads(capsys.readouterr().out)
    assert code == 4 and doc["verdict"] == "inconclusive" and doc["setting"] is None


def _fake_engines(monkeypatch: pytest.MonkeyPatch, curve: dict[str, float]) -> None:
    from dbo_runtime.harness import launch as launch_mod

    monkeypatch.setenv(launch_mod.RUNNER_MODULE_ENV, "tests.fakes.fake_engine_runner")
    monkeypatch.setenv("DBO_FAKE_STEP_MS", json.dumps(curve))
    monkeypatch.delenv("VLLM_DBO_COMM_SMS", raising=False)
    monkeypatch.setattr(tune, "check_with_vllm", lambda args, command: None)  # FakeEngineRunner takes any argument
    monkeypatch.setattr(tune, "visible_gpus", lambda: 2)  # FakeGpuCount


def _no_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fails the test if tune gets as far as vLLM's parser (the last step before engines start)."""

    def reached(args: list[str], command: str) -> None:
        raise AssertionError("tune reached vLLM's parser: the refusal came too late")

    monkeypatch.setattr(tune, "check_with_vllm", reached)


# -- --png: checked before any engine, drawn after the result --------------------------------------
@pytest.mark.parametrize("where", ["under_a_file", "proc", "a_folder", "no_matplotlib", "empty"])
def test_a_png_that_cannot_be_drawn_is_refused_before_any_engine(
    where: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from dbo_runtime.cli import _paths

    _no_engine(monkeypatch)
    monkeypatch.setattr(_paths, "matplotlib_installed", lambda: where != "no_matplotlib")  # FakeMatplotlib: not in the venv
    afile = tmp_path / "afile"
    afile.write_text("")
    png = {"under_a_file": afile / "c.png", "proc": Path("/proc/x/y.png"), "a_folder": tmp_path, "no_matplotlib": tmp_path / "c.png", "empty": ""}[where]
    assert main(["tune", "--png", str(png), *ENGINE]) == 2
    line = _one_line(capsys)
    start = "a non-empty file path" if where == "empty" else "a file path"
    assert line.startswith(f"dbo-runtime tune: error: --png='{png}' is not allowed; allowed values: {start} whose folder"), line
    if where == "proc":
        assert line.endswith("(/proc is not writable: its file system takes no new files)"), line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]


@pytest.mark.parametrize("flag", ["--png", "--workdir"])
def test_its_own_paths_are_checked_before_the_engine_arguments(
    flag: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A bad tune path is named as itself even when the engine arguments also lack the DP size, as verify's
    options are: the operator fixes tune's own options first, then the engine's."""
    _no_engine(monkeypatch)
    afile = tmp_path / "afile"
    afile.write_text("")
    assert main(["tune", flag, str(afile / "x.png"), "--model", "m"]) == 2
    line = _one_line(capsys)
    assert line.startswith(f"dbo-runtime tune: error: {flag}="), line


@pytest.mark.parametrize("installed", [True, False])
def test_a_png_suffix_matplotlib_cannot_write_is_refused_before_any_engine(
    installed: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """matplotlib would say "Format 'txt' is not supported" only after the whole sweep. Without matplotlib to ask,
    the formats every matplotlib writes."""
    from dbo_runtime.cli import _paths

    _no_engine(monkeypatch)
    monkeypatch.setattr(_paths, "matplotlib_installed", lambda: installed)
    png = tmp_path / "c.txt"
    assert main(["tune", "--png", str(png), *ENGINE]) == 2
    line = _one_line(capsys)
    assert line.startswith(f"dbo-runtime tune: error: --png='{png}' is not allowed; allowed values: a file name ending in a format matplotlib writes: ")
    assert ".png" in line and ".txt" not in line.split("allowed values:")[1]
    if not installed:
        assert line.endswith("writes: .pdf, .png, .svg")


def test_a_png_path_is_the_file_matplotlib_writes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No suffix: matplotlib appends .png, so that is the path tune reports; a suffix in any case is its format."""
    from dbo_runtime.cli import _paths

    monkeypatch.setattr(_paths, "matplotlib_installed", lambda: True)
    monkeypatch.setattr(_paths, "plot_formats", lambda: _paths.FORMATS_WITHOUT_MATPLOTLIB)
    assert _paths.check_png(str(tmp_path / "curve"), "tune") == tmp_path / "curve.png"
    assert _paths.check_png(str(tmp_path / "curve.SVG"), "tune") == tmp_path / "curve.SVG"


def test_a_drawing_that_fails_is_a_note_after_the_result(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The result is printed before the curve is drawn, and a file system that refuses the PNG (ENOSPC, a folder
    removed meanwhile) gives a note, never a traceback that hides an hour of measuring."""
    import sys
    import types

    from dbo_runtime.cli import _paths

    _fake_engines(monkeypatch, {"12": 9.0, "20": 10.0})
    fake = types.ModuleType("matplotlib")  # FakeMatplotlib: the venv has none; only the file write is exercised
    fake.use = lambda backend: None  # type: ignore[attr-defined]
    fake.pyplot = types.ModuleType("matplotlib.pyplot")  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "matplotlib", fake)
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", fake.pyplot)  # type: ignore[attr-defined]
    monkeypatch.setattr(_paths, "matplotlib_installed", lambda: True)

    def no_space(plt: Any, doc: dict[str, Any], path: Path) -> str:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(tune, "_savefig", no_space)
    code = main(["tune", "--values", "12", "--workdir", str(tmp_path / "w"), "--png", str(tmp_path / "c.png"), *ENGINE])
    out = capsys.readouterr().out
    assert code == 0 and "Traceback" not in out
    use, note = out.index("use: VLLM_DBO_COMM_SMS="), out.index("note: no PNG: --png")
    assert use < note and "No space left on device" in out[note:]


@pytest.mark.parametrize("raw", ["bogus", "", "FULL"])
def test_a_warmup_mode_vllm_refuses_is_refused_before_any_engine(
    raw: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """vLLM 0.33 takes VLLM_DEEP_GEMM_WARMUP from exact choices and raises on anything else when an engine starts
    (``env_with_choices``, read by ``enable_envs_cache``): every engine of the sweep would die after loading."""
    _no_engine(monkeypatch)
    monkeypatch.setenv("VLLM_DEEP_GEMM_WARMUP", raw)
    assert main(["tune", "--workdir", str(tmp_path / "w"), *ENGINE]) == 2
    assert _one_line(capsys) == (
        f"dbo-runtime tune: error: VLLM_DEEP_GEMM_WARMUP={raw!r} is not allowed; allowed values: 'skip', 'full' or "
        "'relax' (exact, lower case), or not set (relax): vLLM refuses any other value at engine start"
    )
    assert not (tmp_path / "w").exists()


# -- --workdir: nothing on disk before a refusal ---------------------------------------------------
def test_a_refused_sweep_creates_no_workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(tune, "check_with_vllm", lambda args, command: None)  # vLLM's parser needs a GPU platform
    monkeypatch.setattr(tune, "visible_gpus", lambda: 0)
    new = tmp_path / "new" / "sub"
    assert main(["tune", "--workdir", str(new), *ENGINE]) == 3  # no GPUs
    assert "needs 2 GPU(s)" in _one_line(capsys) and not (tmp_path / "new").exists()
    afile = tmp_path / "afile"
    afile.write_text("")
    _no_engine(monkeypatch)
    assert main(["tune", "--workdir", str(afile / "sub"), *ENGINE]) == 2
    line = _one_line(capsys)
    assert "--workdir=" in line and f"({afile} is a file, not a folder)" in line


def test_a_sweep_creates_its_workdir_when_the_engines_start(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    _fake_engines(monkeypatch, {"12": 9.0, "20": 10.0})
    work = tmp_path / "new" / "sub"
    assert main(["tune", "--json", "--values", "12", "--workdir", str(work), *ENGINE]) == 0
    assert json.loads(capsys.readouterr().out)["workdir"] == str(work) and work.is_dir()


# -- underscore spellings, options the shape does not read, too few rounds ----------------------------
def test_underscore_spellings_of_engine_flags_read_as_dashes(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's parser takes --data_parallel_size as --data-parallel-size; so does every check tune and verify make."""
    from dbo_runtime.cli._engine import engine_arg, has_flag, normal_arg, split_engine_args

    args, dp, _ = split_engine_args(
        ["--model", "m", "--data_parallel_size", "2", "--enable_expert_parallel", "--all2all_backend=" + HT, "--enable_dbo",
         "--compilation_config.cudagraph_mode", "NONE", "--hf-overrides", '{"num_hidden_layers": 4}'], "tune"
    )  # fmt: skip
    assert dp == 2 and "--enable-dbo" not in args and "--enable_dbo" not in args
    assert has_flag(args, "--enable-expert-parallel") and engine_arg(args, "--all2all-backend") == HT
    assert "--compilation-config.cudagraph_mode" in args  # only the name before the first "." is vLLM's to rewrite
    assert normal_arg("-dp") == "-dp" and normal_arg("--max_num_seqs=4") == "--max-num-seqs=4"
    assert tune.decode_needs_eager(["--enforce_eager"], 2) is False
    _no_engine(monkeypatch)
    assert main(["tune", "--png", "/proc/x/y.png", "--model", "m", "--data_parallel_size", "2", "--enable_expert_parallel",
                 "--all2all_backend", HT]) == 2  # fmt: skip
    assert "--png=" in _one_line(capsys)  # past the DP, EP and backend checks


@pytest.mark.parametrize(("argv", "flag"), [(["--shape", "decode", "--prefill-tokens", "100"], "--prefill-tokens"),
                                             (["--shape", "decode", "--steps", "2"], "--steps"),
                                             (["--decode-batch", "64"], "--decode-batch")])  # fmt: skip
def test_an_option_the_shape_does_not_read_is_refused(argv: list[str], flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["tune", *argv, *ENGINE]) == 2
    line = _one_line(capsys)
    assert f"error: {flag}=" in line and "left out with --shape" in line


def test_too_few_rounds_for_the_values_are_refused_before_any_engine(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """--values all is 10 values: confirming one against the 9 others at 5 % needs 8 rounds all faster, so the
    default 7 could only ever say "keep today's" after the whole sweep."""
    _no_engine(monkeypatch)
    monkeypatch.delenv("VLLM_DBO_COMM_SMS", raising=False)
    assert rounds_needed(9, 0.05) == 8
    assert main(["tune", "--values", "all", "--reps", "7", *ENGINE]) == 2
    assert "error: --reps=7 is not allowed; allowed values: >= 8 for 10 values" in _one_line(capsys)


def test_left_out_reps_become_what_the_values_need() -> None:
    """Without --reps, --values all runs the 8 rounds its 10 values need instead of refusing a default the user never
    gave; five values keep the default 7."""
    sweep_all = plan_sweep("all", backend="deepep_high_throughput", platform="cuda", environ={})
    sweep_five = plan_sweep("8,12,16,20,4", backend="deepep_high_throughput", platform="cuda", environ={})
    assert tune.check_reps(_opts(reps=None), sweep_all).reps == 8
    assert tune.check_reps(_opts(reps=None), sweep_five).reps == 7
    with pytest.raises(ConfigError, match="--reps"):
        tune.check_reps(_opts(reps="7"), sweep_all)


def test_decode_with_cuda_graphs_is_timed_eager() -> None:
    """A FULL CUDA-graph replay never enters SMControl's partition, so a graphed decode step is never measured:
    where vLLM keeps graphs, tune adds --enforce-eager and says so; where they are off already it adds nothing."""
    decode = _opts(shape="decode")
    added, _, _, _, _, notes = tune.workload(["--model", "m", "--all2all-backend", "deepep_low_latency"], 2, decode)
    assert "--enforce-eager" in added and any("FULL CUDA-graph replay never enters the SM partition" in n for n in notes)
    for args, dp in ((["--model", "m", "--all2all-backend", HT], 2), (["--model", "m", "--enforce-eager"], 2)):
        added, _, _, _, _, notes = tune.workload(args, dp, decode)
        assert "--enforce-eager" not in added and not any("CUDA-graph" in n for n in notes)
    assert tune.decode_needs_eager(["--model", "m", "--all2all-backend", HT], 1)  # DP 1: vLLM keeps graphs even with HT
    added, *_ = tune.workload(["--model", "m", "--all2all-backend", "deepep_low_latency"], 2, _opts())
    assert "--enforce-eager" not in added  # prefill is not captured


@pytest.mark.parametrize(("raw", "shown"), [("1", "1"), ("ture", "'ture'")])
def test_with_the_plugin_disabled_tune_refuses_before_anything_else(
    raw: str, shown: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """tune measures through dbo_runtime's counters: under DBO_RUNTIME_DISABLE the sweep could only end
    inconclusive, so it is one line naming the switch, exit 2, before vLLM's parser or the GPU count; a value the
    switch does not know (``ture``) is refused the same way rather than guessed."""
    monkeypatch.setenv("DBO_RUNTIME_DISABLE", raw)
    monkeypatch.setattr(tune, "check_with_vllm", lambda args, command: pytest.fail("checked the engine arguments"))
    assert main(["tune", *ENGINE]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.splitlines() == [
        f"dbo-runtime tune: error: DBO_RUNTIME_DISABLE={shown} is not allowed; allowed values: an off value ('0', "
        "'false', 'no', 'off', '', or not set): tune measures through dbo_runtime's counters, which a disabled plugin "
        "does not keep"
    ]


@pytest.mark.parametrize("raw", ["0", "off", "False", ""])
def test_tune_takes_every_off_value_of_the_disable_switch(raw: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DBO_RUNTIME_DISABLE", raw)
    tune._require_plugin()
