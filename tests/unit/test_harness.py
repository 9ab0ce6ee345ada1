"""The real-engine harness on CPU: comparison metrics, prompts, and the launcher's process handling
(with FakeEngineRunner at the no-GPU boundary; the GPU twin is tests/e2e)."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from dbo_runtime.core.errors import ConfigError
from dbo_runtime.harness import launch as launch_mod
from dbo_runtime.harness.compare import Request, Thresholds, compare, verdict
from dbo_runtime.harness.launch import RunSpec, launch
from dbo_runtime.harness.prompts import PromptSpec, for_rank, from_file, synthetic
from tests.e2e.pool import assign_gpus, run_all
from tests.harness.engine_runner import E2ESpec, describe
from tests.harness.runs import record_facts


def req(index: int, tokens: list[int], lps: list[dict[int, float]] | None = None) -> Request:
    return Request(index, tokens, lps if lps is not None else [{t: -0.5} for t in tokens])


# -- compare ----------------------------------------------------------------------------------------
def test_identical_runs_agree_fully() -> None:
    a = [req(0, [5, 6, 7]), req(1, [8, 9, 10])]
    result = compare(a, a)
    assert (result.agreement, result.prefix_agreement, result.exact_requests, result.max_abs_dlogprob) == (1.0, 1.0, 2, 0.0)


def test_divergence_metrics_and_dlogprob_only_on_the_shared_prefix() -> None:
    ref = [req(0, [1, 2, 3, 4], [{1: -0.1}, {2: -0.2}, {3: -0.3}, {4: -0.4}])]
    # diverges at position 2; position 2 still has the reference token in the top-k; position 3 differs wildly
    other = [req(0, [1, 2, 9, 4], [{1: -0.1}, {2: -0.25}, {9: -0.2, 3: -0.9}, {4: -50.0}])]
    result = compare(ref, other)
    assert result.first_divergences == [2]
    assert result.equal_tokens == 3 and result.agreement == 0.75 and result.prefix_agreement == 0.5
    assert result.max_abs_dlogprob == pytest.approx(0.6)  # |-0.3 - -0.9| at the divergence; position 3 ignored
    assert result.dlogprob_positions == 3 and result.exact_requests == 0


def test_missing_requests_and_missing_logprobs_are_counted() -> None:
    ref = [req(0, [1, 2]), req(1, [3, 4])]
    other = [req(0, [1, 2], [{1: -0.5}, {7: -0.1}])]
    result = compare(ref, other)
    assert result.missing_requests == [1] and result.agreement == 0.5
    assert result.dlogprob_bounded == 1 and result.dlogprob_missing == 0
    passed, reasons = verdict(result, Thresholds(0.9, 0.1))
    assert not passed and any("missing" in r for r in reasons) and any("agreement" in r for r in reasons)


def test_reference_token_outside_the_top_k_counts_with_its_lower_bound() -> None:
    """A reference token outside the DBO run's top-5 is neither skipped (that could hide the largest
    changes) nor a verdict rule of its own: it counts with its lower bound."""
    ref = [req(0, [1, 2], [{1: -0.1}, {2: -0.2}])]
    other = [req(0, [1, 9], [{1: -0.1}, {9: -0.05, 8: -1.5, 7: -2.7}])]
    result = compare(ref, other)
    assert result.dlogprob_bounded == 1 and result.max_abs_dlogprob == pytest.approx(2.5)  # -0.2 - (-2.7)
    assert not verdict(result, Thresholds(0.0, 0.25))[0]
    nan = [req(0, [1, 2], [{1: float("nan")}, {2: -0.2}])]
    bad = compare(ref, nan)
    assert bad.nonfinite_logprobs == 1
    passed, reasons = verdict(bad, Thresholds(0.0, 10.0))
    assert not passed and any("non-finite" in r for r in reasons)


def test_agreement_standard_error_comes_from_the_per_request_spread() -> None:
    ref = [req(i, [1, 2, 3, 4]) for i in range(4)]
    same = compare(ref, ref)
    assert same.agreement_se == 0.0
    # two requests identical, two diverged at the first token: per-request agreement 1, 1, 0, 0
    other = [req(0, [1, 2, 3, 4]), req(1, [1, 2, 3, 4]), req(2, [9, 9, 9, 9]), req(3, [9, 9, 9, 9])]
    result = compare(ref, other)
    assert result.agreement == 0.5
    assert result.agreement_se == pytest.approx((1 / 3) ** 0.5 / 2)  # sample std sqrt(1/3), n = 4
    assert record_facts(result, "ref", 4)["agreement_se"] == result.agreement_se


def test_thresholds_validate() -> None:
    with pytest.raises(ConfigError, match="--min-agreement"):
        Thresholds(1.5, 0.1).validate()
    with pytest.raises(ConfigError, match="--max-dlogprob"):
        Thresholds(0.5, float("nan")).validate()


def test_request_from_json_roundtrip() -> None:
    r = Request.from_json({"index": 3, "tokens": [1, 2], "logprobs": [{"1": -0.5}, {"2": -1.0}]})
    assert r.logprobs[0] == {1: -0.5} and r.tokens == [1, 2]


# -- prompts ----------------------------------------------------------------------------------------
def test_synthetic_prompts_are_deterministic_and_in_range() -> None:
    spec = PromptSpec(num=20, min_len=5, max_len=9, seed=7)
    a, b = synthetic(spec, 50), synthetic(spec, 50)
    assert a == b and len(a) == 20
    for p in a:
        assert 5 <= len(p["prompt_token_ids"]) <= 9 and all(2 <= t < 50 for t in p["prompt_token_ids"])
    assert synthetic(PromptSpec(num=20, min_len=5, max_len=9, seed=8), 50) != a


def test_round_robin_ranks_cover_every_prompt_once() -> None:
    got = sorted(i for r in range(3) for i in for_rank(list(range(10)), r, 3))
    assert got == list(range(10))


@pytest.mark.parametrize("name", ["p.json", "p.JSONL", "p.Json"])
def test_a_json_lines_prompt_file_is_read_as_such_whatever_its_suffixs_case(tmp_path: Path, name: str) -> None:
    f = tmp_path / name
    f.write_text('{"prompt_token_ids": [5, 6]}\n{"prompt": "hi"}\n')
    assert from_file(str(f)) == [{"prompt_token_ids": [5, 6]}, {"prompt": "hi"}]


def test_a_json_prompt_file_may_be_one_array_and_a_text_file_is_a_prompt_per_line(tmp_path: Path) -> None:
    f = tmp_path / "p.json"
    f.write_text(json.dumps([{"prompt": "a\u2028b"}, {"prompt_token_ids": [7]}], indent=2, ensure_ascii=False))
    assert from_file(str(f)) == [{"prompt": "a\u2028b"}, {"prompt_token_ids": [7]}]
    txt = tmp_path / "p.txt"
    txt.write_bytes(b"one\r\n\ntwo\r\n")
    assert from_file(str(txt)) == [{"prompt": "one"}, {"prompt": "two"}]


@pytest.mark.parametrize(
    "text",
    [
        '{"prompt_token_ids": [true]}',  # a bool is an int in Python: true would be token 1
        '{"prompt_token_ids": [-1]}',
        '{"prompt_token_ids": []}',
        '{"prompt": ""}',
        '{"prompt": "a", "prompt_token_ids": [1]}',
        "[1, 2]",
        '{"prompt": "b"',
        "",
    ],
)
def test_a_bad_prompt_file_is_one_config_error_naming_the_flag(tmp_path: Path, text: str) -> None:
    f = tmp_path / "bad.jsonl"
    f.write_text('{"prompt": "fine"}\n' + text + "\n" if text else "\n  \n")
    with pytest.raises(ConfigError) as err:
        from_file(str(f))
    assert err.value.parameter == "--prompt-file" and err.value.value == str(f)
    for absent in (tmp_path / "absent.jsonl", tmp_path):
        with pytest.raises(ConfigError, match="--prompt-file"):
            from_file(str(absent))
    with pytest.raises(ConfigError, match="--prompts"):
        PromptSpec(num=0).validate()


# -- describe / record ------------------------------------------------------------------------------
def test_describe_reads_the_configuration() -> None:
    spec = RunSpec(
        "x",
        ["--model", "/m/shared-topk", "--enable-dbo", "--all2all-backend", "deepep_low_latency", "--compilation-config", '{"cudagraph_mode": "FULL_DECODE_ONLY"}'],
        dp=2,
        env={"DBO_RUNTIME_DISABLE": "1"},
    )
    d = describe(spec)
    assert d["model"] == "shared-topk" and d["dbo"] and d["runner"] == "v1" and d["graphs"]
    assert not spec.record([], [], 0.0)["plugin"]
    assert d["cudagraph_mode"] == "FULL_DECODE_ONLY" and d["all2all_backend"] == "deepep_low_latency"
    assert describe(RunSpec("y", ["--model", "m", "--enforce-eager"]))["runner"] == "v2"  # vLLM 0.33's default without DBO


def test_assemble_names_the_deepgemm_crash() -> None:
    spec = E2ESpec("crash", ["--model", "m"], dp=2)
    ranks = [{"rank": 0, "ok": False, "error": "EngineDeadError: dead"}, {"rank": 1, "ok": False, "error": "killed"}]
    log = "(Worker_DP0) RuntimeError: Assertion error (csrc/apis/attention.hpp:388): _schedule_meta_size == num_sms / num_kv_multicast + 1"
    rec = spec.record(ranks, [log, ""], 3.0)
    assert not rec["ok"] and "deepgemm_schedule_assert" in rec["failure_signatures"]
    assert "_schedule_meta_size" in rec["error"] and rec["plugin_log_lines"] == []


def test_assemble_names_deepep_lls_queue_depth_limit() -> None:
    """On 2x H200 a DeepEP-LL engine with 2048 batched tokens dies on its first dispatch (queue depth)."""
    from dbo_runtime.harness.launch import SIGNATURE_HINTS

    spec = RunSpec("ll", ["--model", "m"], dp=2)
    log = "(Worker_DP0_EP0) ERROR [multiproc_executor.py:1189]     assert self.nvshmem_qp_depth >= (num_max_dispatch_tokens_per_rank + 1) * 2"
    rec = spec.record([{"rank": 0, "ok": False, "error": "RuntimeError: Engine core initialization failed."}], [log], 3.0)
    assert rec["failure_signatures"] == ["deepep_ll_qp_depth"]
    assert "NVSHMEM_QP_DEPTH" in SIGNATURE_HINTS["deepep_ll_qp_depth"] and "cuda_oom" not in SIGNATURE_HINTS


# -- launcher with FakeEngineRunner -------------------------------------------------------------------
@pytest.fixture
def fake_runner(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(launch_mod.RUNNER_MODULE_ENV, "tests.fakes.fake_engine_runner")
    monkeypatch.setattr(launch_mod, "FAIL_GRACE_S", 1.0)


def test_launch_merges_ranks(tmp_path: Path, fake_runner: None) -> None:
    rec = launch(E2ESpec("good", ["--model", "m"], dp=2, meta={"fake": {}}), tmp_path)
    assert rec["ok"] and [r["index"] for r in rec["requests"]] == [0, 1, 2, 3]
    assert rec["microbatched_steps"] == [5, 5] and rec["vllm_version"] == "0.33.0"
    assert any("patches installed" in line for line in rec["plugin_log_lines"])
    assert json.loads((tmp_path / "good" / "record.json").read_text())["ok"]


def test_a_reused_run_directory_lends_nothing_to_the_next_run(tmp_path: Path, fake_runner: None) -> None:
    """A stale rank1.log of an earlier DP-2 run must not be scanned for this run's failure signatures,
    nor a stale record.json re-assembled with it."""
    old = tmp_path / "good"
    old.mkdir()
    (old / "rank1.log").write_text("_schedule_meta_size == num_sms / num_kv_multicast + 1\n")
    (old / "record.json").write_text(json.dumps({"label": "good", "ok": False}))
    rec = launch(RunSpec("good", ["--model", "m"], dp=1, meta={"fake": {}}), tmp_path)
    assert rec["ok"] and rec["failure_signatures"] == [] and not (old / "rank1.log").exists()


def test_a_cold_jit_cache_run_gets_an_empty_cache_of_its_own(tmp_path: Path, fake_runner: None) -> None:
    stale = tmp_path / "cold" / "dg-jit-cold"
    stale.mkdir(parents=True)
    (stale / "kernel.so").write_text("compiled by an earlier run")
    assert launch(RunSpec("cold", ["--model", "m"], cold_jit_cache=True, meta={"fake": {}}), tmp_path)["ok"]
    assert f"DG_JIT_CACHE_DIR={stale} entries=0" in (tmp_path / "cold" / "rank0.log").read_text()
    stale.mkdir(exist_ok=True)
    (stale / "kernel.so").write_text("compiled by the cold run")
    assert launch(RunSpec("warm", ["--model", "m"], env={"DG_JIT_CACHE_DIR": str(stale)}, meta={"fake": {}}), tmp_path)["ok"]
    assert f"DG_JIT_CACHE_DIR={stale} entries=1" in (tmp_path / "warm" / "rank0.log").read_text()  # a warm run keeps it


def test_staggered_requests_shrink_the_decode_batch_one_by_one() -> None:
    from vllm import SamplingParams

    from tests.harness.engine_runner import staggered

    base = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    assert [p.max_tokens for p in staggered(base, 4)] == [2, 3, 4, 5] and base.max_tokens == 2
    assert all(p.ignore_eos and p.temperature == 0.0 for p in staggered(base, 4))


def test_launch_kills_the_hung_peer_of_a_crashed_rank(tmp_path: Path, fake_runner: None) -> None:
    started = time.monotonic()
    rec = launch(RunSpec("crash", ["--model", "m"], dp=2, meta={"fake": {"0": "hang", "1": "crash"}}), tmp_path)
    assert time.monotonic() - started < 30
    assert not rec["ok"] and "deepgemm_schedule_assert" in rec["failure_signatures"]
    assert "wrote no result" in rec["error"]


def test_launch_timeout(tmp_path: Path, fake_runner: None) -> None:
    rec = launch(RunSpec("slow", ["--model", "m"], dp=1, meta={"fake": {"0": "hang"}}, timeout_s=2.0), tmp_path)
    assert not rec["ok"] and "hang_killed" in rec["failure_signatures"]


def test_a_timeout_before_every_engine_was_ready_is_not_a_hang(tmp_path: Path, fake_runner: None) -> None:
    """With 16-32 engines starting at once a healthy run can time out while starting; that must not count
    as reproducing the vanilla DBO hang."""
    spec = RunSpec("slow-start", ["--model", "m"], dp=2, meta={"fake": {"0": "hang", "1": "start-hang"}}, timeout_s=2.0)
    rec = launch(spec, tmp_path)
    assert not rec["ok"] and "start_timeout" in rec["failure_signatures"] and "hang_killed" not in rec["failure_signatures"]


def test_pool_runs_everything_within_the_engine_budget(tmp_path: Path, fake_runner: None) -> None:
    specs = [RunSpec(f"r{i}", ["--model", "m"], dp=1 + i % 2, meta={"fake": {}}) for i in range(4)]
    jobs = [("job", 2, lambda: {"label": "job", "ok": True})]
    got = run_all(specs, tmp_path, max_engines=2, gpus=[0, 1], jobs=jobs)
    assert list(got) == ["r0", "r1", "r2", "r3", "job"] and all(r["ok"] for r in got.values())
    assert [s.env.get("CUDA_VISIBLE_DEVICES") for s in assign_gpus(specs, [0, 1])] == ["0", None, "1", None]
    with pytest.raises(ValueError, match="duplicate"):
        run_all([specs[0], specs[0]], tmp_path, max_engines=1)


def test_interleaved_turns_run_one_engine_at_a_time_in_rotating_order(tmp_path: Path, fake_runner: None) -> None:
    """The order rotates: a fixed order would put the same configuration first after every idle gap in
    every rep."""
    from dbo_runtime.harness.turns import run_interleaved

    bench = {"max_tokens": 4, "reps": 2, "warmup": 1, "coordinated": True}
    specs = [RunSpec(name, ["--model", "m"], dp=2, meta={"fake": {}}, bench=bench) for name in ("a", "b", "c")]
    got = run_interleaved(specs, tmp_path, reps=2, timeout_s=60)
    assert all(r["ok"] for r in got.values())
    assert got["a"]["turn_order"] == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]
    assert [len(b["reps"]) for b in got["a"]["bench"]] == [3, 3]
    with pytest.raises(ValueError, match="coordinated"):
        run_interleaved([RunSpec("c", ["--model", "m"])], tmp_path, reps=1)


@pytest.mark.parametrize("dp", [1, 2])
def test_interleaved_turns_in_a_reused_workdir_wait_for_this_run_s_engines(
    tmp_path: Path, fake_runner: None, monkeypatch: pytest.MonkeyPatch, dp: int
) -> None:
    """A second run in the same directory finds the first run's ``ready-`` / ``go-`` / ``done-`` files. The
    coordinator must not take them for this run's engines (it would report turns as done that never ran, and touch
    ``go`` files that the new engine's launch then deletes, leaving that engine waiting for a turn that never
    comes). Each launch is held back half a second, as a real engine's start is, so the stale files are there to
    be misread."""
    from dbo_runtime.harness import turns

    bench = {"max_tokens": 4, "reps": 2, "warmup": 1, "coordinated": True}
    specs = [RunSpec(name, ["--model", "m"], dp=dp, meta={"fake": {}}, bench=bench) for name in ("a", "b")]
    first = turns.run_interleaved(specs, tmp_path, reps=2, timeout_s=60)
    assert all(r["ok"] for r in first.values())
    assert [p.name for p in (tmp_path / "a" / "barrier").glob("*/done-rep2.0")] == ["done-rep2.0"]
    real_launch = turns.launch

    def late_launch(*args: object, **kwargs: object) -> dict:
        time.sleep(0.5)
        return real_launch(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(turns, "launch", late_launch)
    said: list[str] = []
    second = turns.run_interleaved(specs, tmp_path, reps=2, timeout_s=20, progress=said.append)
    assert all(r["ok"] for r in second.values()), {k: r.get("error") for k, r in second.items()}
    assert [len(b["reps"]) for b in second["a"]["bench"]] == [3] * dp
    assert second["a"]["turn_order"] == ["a", "b", "b", "a", "a", "b"]
    assert [m for m in said if m.startswith("rep ")] == [f"rep {r}: {x} done" for r, x in ((0, "a"), (0, "b"), (1, "b"), (1, "a"), (2, "a"), (2, "b"))]
    assert len(list((tmp_path / "a" / "barrier").iterdir())) == 1  # the first run's turn files are gone


def test_no_turn_starts_after_the_deadline_and_the_engines_are_killed(tmp_path: Path, fake_runner: None) -> None:
    """A turn started after the deadline would overlap the one still running (its engine is mid-rep), and an engine
    left waiting for a turn would outlive the coordinator."""
    from dbo_runtime.harness.turns import run_interleaved

    bench = {"max_tokens": 4, "reps": 1, "warmup": 0, "coordinated": True}
    slow = RunSpec("slow", ["--model", "m"], meta={"fake": {"0": "slow-rep"}, "fake_rep_s": 30}, bench=bench, timeout_s=120)
    other = RunSpec("other", ["--model", "m"], meta={"fake": {}}, bench=bench, timeout_s=120)
    said: list[str] = []
    started = time.monotonic()
    got = run_interleaved([slow, other], tmp_path, reps=1, timeout_s=8, progress=said.append)
    assert time.monotonic() - started < 60
    assert not list((tmp_path / "other" / "barrier").glob("*/go-rep0")), said
    assert not got["slow"]["ok"] and not got["other"]["ok"]
    assert "rep 0: slow did not finish (time limit)" in said and any(m.startswith("time limit of 8 s") for m in said), said


def test_a_run_that_finished_its_turns_keeps_its_record_when_its_engine_exits_late(tmp_path: Path, fake_runner: None) -> None:
    """Every turn done before the deadline, but the engine's exit (its CUDA teardown) comes after it: the record is
    the engine's, not "no record (timeout)", and nothing is left running."""
    from dbo_runtime.harness.turns import run_interleaved

    bench = {"max_tokens": 4, "reps": 1, "warmup": 0, "coordinated": True}
    spec = RunSpec("late", ["--model", "m"], meta={"fake": {}, "fake_exit_s": 6}, bench=bench, timeout_s=120)
    got = run_interleaved([spec], tmp_path, reps=1, timeout_s=3)
    assert got["late"]["ok"], got["late"].get("error")
    assert got["late"]["turn_order"] == ["late"]


def test_interleaved_turns_refuse_two_specs_with_one_label(tmp_path: Path) -> None:
    from dbo_runtime.harness.turns import run_interleaved

    bench = {"max_tokens": 4, "reps": 1, "warmup": 1, "coordinated": True}
    spec = RunSpec("same", ["--model", "m"], bench=bench)
    with pytest.raises(ValueError, match="labels must be distinct"):
        run_interleaved([spec, spec], tmp_path, reps=1)
    assert not (tmp_path / "same").exists()


def test_a_turn_that_never_finishes_is_not_reported_done(tmp_path: Path, fake_runner: None) -> None:
    from dbo_runtime.harness.turns import run_interleaved

    bench = {"max_tokens": 4, "reps": 1, "warmup": 1, "coordinated": True}
    spec = RunSpec("dies", ["--model", "m"], meta={"fake": {"0": "exit-after-ready"}}, bench=bench, timeout_s=30)
    said: list[str] = []
    got = run_interleaved([spec], tmp_path, reps=1, timeout_s=30, progress=said.append)
    assert not got["dies"]["ok"]
    assert not any(m.endswith("done") for m in said), said
    assert any("did not finish" in m for m in said), said


def test_launch_fails_fast_when_a_microbatch_thread_died(tmp_path: Path, fake_runner: None) -> None:
    """vLLM 0.33.0 does not exit when the DeepGEMM assertion kills a microbatch thread: it hangs.
    The launcher reads the logs and stops the run instead of waiting for the timeout."""
    started = time.monotonic()
    spec = RunSpec("hung", ["--model", "m"], dp=2, meta={"fake": {"0": "assert-hang", "1": "hang"}}, timeout_s=120)
    rec = launch(spec, tmp_path)
    assert time.monotonic() - started < 30
    assert not rec["ok"] and {"deepgemm_schedule_assert", "ubatch_thread_died"} <= set(rec["failure_signatures"])


def test_summary_delta_is_later_minus_earlier() -> None:
    from dbo_runtime.harness.runner import summary_delta

    before = [{"summary": {"microbatched_builds": 1}}, {"summary": {"microbatched_builds": 2}}]
    after = [{"summary": {"microbatched_builds": 35}}, {"summary": {"microbatched_builds": 36}}]
    assert summary_delta(before, after, "microbatched_builds") == 68  # earlier minus later would read -34 per rank
    assert summary_delta(None, after, "microbatched_builds") is None


class _FakeParams:
    """vLLM's ``SamplingParams`` as the benchmark loop uses it (no engine in CI)."""

    def __init__(self, **kw: object) -> None:
        self.max_tokens = kw["max_tokens"]


def _fake_llm(one_s: float, full_s: float) -> type:
    """A stand-in ``LLM`` whose 1-token pass takes ``one_s`` and any longer pass ``full_s``."""

    class LLM:
        def generate(self, batch: list[object], params: _FakeParams, use_tqdm: bool = False) -> None:
            time.sleep(one_s if params.max_tokens == 1 else full_s)

    return LLM


def test_bench_reports_no_step_time_when_the_host_made_it_unmeasurable(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a loaded host (14 engines on the other GPU) the 1-token pass can take longer than the 64-token
    pass: that rep has no decode step time, not a 0.0 ms one."""
    from dbo_runtime.harness import runner

    monkeypatch.setattr(runner, "_stats", lambda llm: [{"summary": {"microbatched_builds": 0, "self_time_ns": 0}}])
    from tests.harness.engine_runner import ROW_HOOK_ENV, bench_row

    monkeypatch.delenv(ROW_HOOK_ENV, raising=False)
    bench = {"max_tokens": 8, "reps": 1, "warmup": 0}
    out = runner.bench_reps(_fake_llm(one_s=0.05, full_s=0.01)(), _FakeParams, [1, 2], bench, 0, 1, bench_row(2))
    [row] = out["reps"]
    assert row["decode_step_ms"] is None and row["decode_tok_per_s"] is None
    assert "plugin_self_us_per_step" not in row  # only a measurement harness adds its columns


def test_a_benchmark_takes_the_faster_of_two_one_token_passes(monkeypatch: pytest.MonkeyPatch) -> None:
    """A compile that stalls one 1-token pass (7.6 s of a 61-layer engine's first reps) must not become a tiny or
    missing decode step: the rep's step is the full pass less the faster 1-token pass, and both are kept."""
    from dbo_runtime.harness import runner
    from tests.harness.engine_runner import ROW_HOOK_ENV, bench_row

    monkeypatch.setattr(runner, "_stats", lambda llm: [{"summary": {"microbatched_builds": 0}}])
    monkeypatch.delenv(ROW_HOOK_ENV, raising=False)
    sleeps = iter([0.2, 0.3, 0.01])  # the first 1-token pass stalls, then the full pass, then the second 1-token pass

    class LLM:
        def generate(self, batch: list[object], params: _FakeParams, use_tqdm: bool = False) -> None:
            time.sleep(next(sleeps))

    bench = {"max_tokens": 8, "reps": 1, "warmup": 0, "prefill_twice": True}
    [row] = runner.bench_reps(LLM(), _FakeParams, [1, 2], bench, 0, 1, bench_row(2))["reps"]
    first, second = row["prefill_passes_s"]
    assert first > 0.19 and second < 0.15 and row["prefill_s"] == second
    assert row["decode_step_ms"] == pytest.approx((row["total_s"] - second) / 7 * 1e3)
    # without it (dbo-runtime tune reads only the first pass's partitions): one 1-token pass, no extra prefill
    sleeps = iter([0.01, 0.02])
    [row] = runner.bench_reps(LLM(), _FakeParams, [1, 2], {**bench, "prefill_twice": False}, 0, 1, bench_row(2))["reps"]
    assert len(row["prefill_passes_s"]) == 1 and next(sleeps, None) is None


def test_replay_reads_a_finished_session_back(tmp_path: Path) -> None:
    """DBO_E2E_REPLAY: the recorded runs of a GPU session are judged again without an engine."""
    from tests.e2e.pool import replay_all

    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "record.json").write_text(json.dumps({"label": "a", "ok": True, "requests": [{"index": 0, "tokens": [1]}]}))
    (tmp_path / "job").mkdir()
    (tmp_path / "job" / "record.json").write_text(json.dumps({"label": "job", "ok": True, "workdir": "/tmp/e2e-out/job"}))
    records = replay_all(tmp_path, ["a", "job", "never-ran"])
    assert records["a"]["requests"][0]["tokens"] == [1]
    assert records["job"]["workdir"] == str(tmp_path / "job")  # a verify job's per-run records are found here
    assert not records["never-ran"]["ok"] and "holds no run" in records["never-ran"]["error"]
    assert records["never-ran"]["failure_signatures"] == []  # tests read it on failed records
    with pytest.raises(ValueError, match="does not exist"):
        replay_all(tmp_path / "nowhere", ["a"])


def test_replay_assembles_runs_again_also_those_a_time_limit_cut_off(tmp_path: Path) -> None:
    """Replay assembles every run again from its spec, rank results and logs, not from record.json as
    written: so a signature added later, or a run the session limit killed before it wrote record.json,
    is judged too."""
    from dataclasses import asdict

    from tests.e2e.pool import replay_all

    spec = RunSpec("ll", ["--model", "m"], dp=2)
    run = tmp_path / "ll"
    run.mkdir()
    (run / "spec.json").write_text(json.dumps(asdict(spec), default=str))
    (run / "rank0.json").write_text(json.dumps({"rank": 0, "ok": False, "error": "RuntimeError: Engine core initialization failed."}))
    (run / "rank0.log").write_text("    assert self.nvshmem_qp_depth >= (num_max_dispatch_tokens_per_rank + 1) * 2\n")
    (run / "rank1.log").write_text("")
    [record] = replay_all(tmp_path, ["ll"]).values()
    assert not record["ok"] and record["failure_signatures"] == ["deepep_ll_qp_depth"]
    assert record["stopped_by_session_limit"] and "rank 1 stopped before it wrote a result" in record["error"]


def test_a_benchmark_stopped_by_a_limit_keeps_the_reps_it_finished(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A session's time limit kills a 78-layer benchmark engine before it writes its result: every finished rep is
    on disk already (``rankN.partial.json``), and reassembling the run reads them back into its record's bench."""
    from dataclasses import asdict

    from dbo_runtime.harness import runner
    from tests.harness.runs import reassemble

    Params, LLM = _FakeParams, _fake_llm(one_s=0.001, full_s=0.01)
    monkeypatch.setattr(runner, "_stats", lambda llm: [{"summary": {"microbatched_builds": 0}}])
    spec = RunSpec("hc-selftime", ["--model", "m"], dp=1)
    (tmp_path / "spec.json").write_text(json.dumps(asdict(spec), default=str))
    monkeypatch.setattr(runner, "_PARTIAL", [runner.partial_path(tmp_path / "rank0.json")])
    monkeypatch.setattr(runner, "_VERSIONS", {"vllm": "0.33.0", "device": "NVIDIA H100 80GB HBM3"})  # the engine is up
    runner.bench_reps(LLM(), Params, [1, 2], {"max_tokens": 8, "reps": 2, "warmup": 1}, 0, 1)
    assert runner.partial_path(tmp_path / "rank0.json") == tmp_path / "rank0.partial.json"
    record = reassemble(tmp_path)  # no rank0.json: the engine was killed after its reps
    assert record is not None and not record["ok"] and record["stopped_by_session_limit"]
    assert record["device"] == "NVIDIA H100 80GB HBM3" and record["versions"]["vllm"] == "0.33.0"  # which GPU measured them
    [bench] = record["bench"]
    assert [r["rep"] for r in bench["reps"]] == [0, 1, 2] and [r["warmup"] for r in bench["reps"]] == [True, False, False]
    (tmp_path / "rank0.partial.json").write_text("{not json")
    assert reassemble(tmp_path)["bench"] is None  # type: ignore[index]  # a torn file is no reps, not a crash


def test_reassembly_keeps_the_configuration_the_run_was_launched_with(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """verify pins VLLM_USE_V2_MODEL_RUNNER=0 in its own environment, not in the spec: assembling
    again in another process must not turn a V1 run into a V2 one."""
    from dataclasses import asdict

    from tests.harness.runs import reassemble

    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    spec = RunSpec("off", ["--model", "m"], dp=1)
    (tmp_path / "spec.json").write_text(json.dumps(asdict(spec), default=str))
    (tmp_path / "rank0.json").write_text(json.dumps({"rank": 0, "ok": True, "requests": []}))
    (tmp_path / "record.json").write_text(json.dumps({"label": "off", "runner": "v1", "plugin": True, "wall_s": 3.0}))
    record = reassemble(tmp_path)
    assert record is not None and record["runner"] == "v1" and record["wall_s"] == 3.0 and record["ok"]



def test_pool_admits_runs_by_their_memory_share_on_each_gpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM asks for ``gpu_memory_utilization`` x the GPU free at each engine's start: runs whose shares do not
    fit beside each other wait, whatever the engine budget allows (the launcher is a recording stand-in)."""
    import threading

    from tests.e2e import pool

    lock = threading.Lock()
    live: dict[str, float] = {}
    peaks: list[float] = []

    def fake_launch(spec: RunSpec, workdir: Path, progress: Any = None) -> dict[str, Any]:
        share = pool.memory_share(spec)
        with lock:
            live[spec.label] = share
            peaks.append(sum(live.values()))
        time.sleep(0.05)
        with lock:
            del live[spec.label]
        return {"label": spec.label, "ok": True}

    monkeypatch.setattr(pool, "launch", fake_launch)
    wide = [RunSpec(f"w{i}", ["--model", "m", "--gpu-memory-utilization", "0.45"], dp=2) for i in range(4)]
    small = [RunSpec(f"s{i}", ["--model", "m", "--gpu-memory-utilization", "0.06"], dp=2) for i in range(4)]
    got = run_all([*wide, *small], tmp_path, max_engines=16, gpus=[0, 1])
    assert all(r["ok"] for r in got.values())
    assert max(peaks) <= pool.MEMORY_BUDGET + 1e-9  # at most two wide runs and the small ones beside them
    assert pool.memory_share(RunSpec("d", ["--model", "m"])) == pool.DEFAULT_UTILIZATION
    assert pool.gpus_of(RunSpec("one", ["--model", "m"], env={"CUDA_VISIBLE_DEVICES": "1"}), [0, 1]) == [1]


def test_an_engine_whose_run_folder_was_taken_over_stops_and_writes_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An engine left over from an earlier coordinator (killed, say, by a session limit) must not answer for the
    later run that removed its turn folder: its waits end at once, and it keeps no reps and writes no result
    among the later run's files."""
    import shutil
    import threading

    from dbo_runtime.harness import runner

    gone = tmp_path / "barrier" / "run-old"
    monkeypatch.setenv(runner.BARRIER_ENV, str(gone))
    for wait in (lambda: runner.wait_turn("rep0", 0), lambda: runner.barrier("bench0a", 0, 2)):
        gone.mkdir(parents=True)
        remover = threading.Timer(0.3, shutil.rmtree, args=(gone,))  # the later run clears the folder mid-wait
        remover.start()
        started = time.monotonic()
        with pytest.raises(runner.Superseded):
            wait()
        assert time.monotonic() - started < 5
        remover.join()
    # a peer that never comes: a timeout naming the wait, not a hang
    gone.mkdir(parents=True)
    monkeypatch.setattr(runner, "BARRIER_TIMEOUT_S", 0.1)
    with pytest.raises(TimeoutError, match="barrier 'bench0a': the other DP ranks did not arrive"):
        runner.barrier("bench0a", 0, 2)
    with pytest.raises(TimeoutError, match="turn 'rep0': never started by the coordinator"):
        runner.wait_turn("rep0", 0)
    shutil.rmtree(gone)
    out = tmp_path / "rank0.json"
    runner._PARTIAL[:] = [runner.partial_path(out)]
    runner._save_partial({"reps": [{"rep": 0}]})
    assert not runner.partial_path(out).exists()
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"label": "old"}))
    monkeypatch.setattr(runner, "run", lambda spec, rank, size, result: None)
    assert runner.main([str(spec), str(out)]) == 1 and not out.exists()


def test_ctrl_c_during_the_turns_kills_every_engine_before_it_propagates(
    tmp_path: Path, fake_runner: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engines run in sessions of their own (a terminal's SIGINT does not reach them) under daemon launch
    threads (whose clean-up never runs at exit): a KeyboardInterrupt in the turn loop kills them first."""
    from dbo_runtime.harness import turns

    killed: list[bool] = []
    real_kill_all = turns.kill_all
    monkeypatch.setattr(turns, "kill_all", lambda: (killed.append(True), real_kill_all())[1])
    bench = {"max_tokens": 4, "reps": 1, "warmup": 0, "coordinated": True}
    alive = RunSpec("alive", ["--model", "m"], meta={"fake": {}}, bench={**bench, "reps": 2}, timeout_s=120)

    def interrupt(message: str) -> None:
        if threading.current_thread() is threading.main_thread():  # Ctrl-C lands on the main thread; launch threads report too
            raise KeyboardInterrupt

    started = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        turns.run_interleaved([alive], tmp_path, reps=2, timeout_s=60, progress=interrupt)  # after its first turn
    assert killed and time.monotonic() - started < 30


def test_a_machine_that_cannot_run_the_engine_is_exit_3(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """README: 3 is "cannot run here" for every command and script; check_load_format returns this value as is."""
    from tests.harness import machine

    monkeypatch.setattr(machine, "engine_missing", lambda gpus: "no CUDA device")
    assert machine.refuse_without_engine("check_load_format", 1, "nothing checked") == 3
    assert capsys.readouterr().err == "check_load_format: needs a CUDA GPU and vLLM 0.33.0 or 0.34.0: no CUDA device; nothing checked\n"
    monkeypatch.setattr(machine, "engine_missing", lambda gpus: None)
    assert machine.refuse_without_engine("x", 1) is None
