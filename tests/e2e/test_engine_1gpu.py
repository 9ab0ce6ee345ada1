"""dbo_runtime inside the real vLLM 0.33.0 engine on one GPU (DBO needs DP >= 2, so
here: activation, transparency with DBO off, MTP, counters and /metrics)."""

from __future__ import annotations

from importlib import metadata
from typing import Any

import pytest

from tests.e2e import plan
from tests.e2e.conftest import Records
from tests.e2e.jobs import SERVE_LABEL

pytestmark = pytest.mark.e2e

TRANSPARENCY = [
    (model, mode, runner)
    for model in ("deepseek-v32", "shared-topk")
    for mode in ("eager", "graphs")
    for runner in ("v1", "v2")
]
ALL_1GPU = list(plan.one_gpu())


def _ok(record: dict[str, Any]) -> dict[str, Any]:
    assert record["ok"], f"{record['label']} failed: {record.get('error')}\n{record.get('log_tail') or ''}"
    return record


def _dlogprobs(a: dict[str, Any], b: dict[str, Any]) -> list[float]:
    """|logprob difference| of every token both runs returned in their top-k, position by position."""
    out: list[float] = []
    for ra, rb in zip(a["requests"], b["requests"], strict=True):
        for pa, pb in zip(ra["logprobs"], rb["logprobs"], strict=True):
            out.extend(abs(pa[token] - pb[token]) for token in set(pa) & set(pb))
    return out


def _identical(a: dict[str, Any], b: dict[str, Any]) -> tuple[float, float]:
    """Greedy tokens identical; returns (max, mean) |logprob difference| (0.0 when bit-identical)."""
    assert len(a["requests"]) == len(b["requests"]) > 0
    for ra, rb in zip(a["requests"], b["requests"], strict=True):
        assert ra["index"] == rb["index"]
        assert ra["tokens"] == rb["tokens"], f"request {ra['index']}: tokens differ"
    diffs = _dlogprobs(a, b)
    return (max(diffs), sum(diffs) / len(diffs)) if diffs else (0.0, 0.0)


BF16_STEPS_ALLOWED = 2.0**-8
"""The largest |Δlogprob| is always allowed this much: it moves in whole bf16 steps of a logit (2^-12
and 2^-9 measured on 2x H200), and a control that happens to miss one would otherwise fail a clean pair."""
CONTROL_MEAN_FACTOR = 3.0
"""A pair's mean |Δlogprob| may be this many times its mode's vanilla-vs-vanilla control's."""
CONTROL_MEAN_MIN = 1e-7
"""...taking the control's as at least this (a bit-identical control would otherwise allow nothing)."""


def _controls(records: Records) -> tuple[float, dict[str, float]]:
    """vLLM's own run-to-run noise, from the same vanilla engine started twice per mode:
    (the largest single |Δlogprob| over both controls, the mean |Δlogprob| per mode).

    Why two statistics. vLLM is not repeatable run to run: measured on 2x H200, both
    controls moved hundreds of the ~5700 returned logprobs. The largest move is lumpy, whole bf16
    steps of a logit: the graphs control moved 1/512 at requests 33, 38 and 39, positions 17, 7 and 21,
    the eager control only 2.5e-4, yet the eager-V1 plugin pairs moved 1/512 at those same requests and
    positions. So the bound on the largest move pools both controls. The mean is stable (eager 6.5e-6,
    graphs 1.3e-5, the 16 pairs 4.4e-6 to 1.35e-5) and is judged per mode; a plugin defect that moved
    every logprob by even one bf16 step would raise it a hundredfold."""
    worst = 0.0
    means: dict[str, float] = {}
    for mode in ("eager", "graphs"):
        a, b = _ok(records[f"1gpu-deepseek-v32-{mode}-v2-vanilla"]), _ok(records[f"1gpu-deepseek-v32-{mode}-v2-vanilla2"])
        top, means[mode] = _identical(a, b)
        worst = max(worst, top)
    return worst, means


@pytest.mark.runs(
    *[f"1gpu-{m}-{mode}-{r}-{p}" for m, mode, r in TRANSPARENCY for p in ("plugin", "vanilla")],
    *[f"1gpu-deepseek-v32-{mode}-v2-vanilla2" for mode in ("eager", "graphs")],
)
@pytest.mark.parametrize(("model", "mode", "runner"), TRANSPARENCY)
def test_plugin_is_transparent_with_dbo_off(records: Records, model: str, mode: str, runner: str) -> None:
    """Greedy tokens identical to vanilla vLLM (DBO_RUNTIME_DISABLE=1); logprobs differ no more than
    vanilla differs from itself between two runs (bit-identical when vLLM is)."""
    base = f"1gpu-{model}-{mode}-{runner}"
    with_plugin, vanilla = _ok(records[f"{base}-plugin"]), _ok(records[f"{base}-vanilla"])
    assert len(with_plugin["requests"]) == 48 and all(len(r["tokens"]) == 24 for r in with_plugin["requests"])
    worst, mean = _identical(with_plugin, vanilla)
    control_worst, control_means = _controls(records)
    records.annotate(
        f"{base}-plugin",
        tokens_identical_to=f"{base}-vanilla",
        max_abs_dlogprob=worst,
        mean_abs_dlogprob_topk=mean,
        vanilla_run_to_run_max_abs_dlogprob=control_worst,
        vanilla_run_to_run_mean_abs_dlogprob_topk=control_means[mode],
    )
    assert worst <= max(2 * control_worst, BF16_STEPS_ALLOWED), (worst, control_worst)
    assert mean <= CONTROL_MEAN_FACTOR * max(control_means[mode], CONTROL_MEAN_MIN), (mean, control_means[mode])
    # The runner the test asked for is the one vLLM used (read from the worker itself).
    assert with_plugin["runner_seen"] == [runner]


@pytest.mark.runs(*[f"1gpu-mtp{k}-{p}" for k in (1, 3) for p in ("plugin", "vanilla")])
@pytest.mark.parametrize("k", [1, 3])
def test_mtp_tokens_identical(records: Records, k: int) -> None:
    """MTP with k speculative tokens (the indexer's next_n = k + 1) runs with the plugin, same tokens."""
    with_plugin, vanilla = _ok(records[f"1gpu-mtp{k}-plugin"]), _ok(records[f"1gpu-mtp{k}-vanilla"])
    worst, mean = _identical(with_plugin, vanilla)
    records.annotate(f"1gpu-mtp{k}-plugin", tokens_identical_to=f"1gpu-mtp{k}-vanilla", max_abs_dlogprob=worst, mean_abs_dlogprob_topk=mean)


@pytest.mark.runs(*[label for label in ALL_1GPU if label.endswith("-plugin")])
def test_activation_line_in_engine_logs(records: Records) -> None:
    """The operator sees from vLLM's own log that dbo_runtime is active, which patches, which vLLM."""
    for label in (x for x in ALL_1GPU if x.endswith("-plugin")):
        record = _ok(records[label])
        lines = [line for line in record["plugin_log_lines"] if f"patches installed for vLLM {metadata.version('vllm')} (verified by its code)" in line]
        assert lines, f"{label}: no activation line in the engine log"
        # DP 1 runs the worker inside the engine-core process: the line carries vLLM's EngineCore prefix.
        assert any("EngineCore" in line for line in lines), (label, lines)
        assert all("sm_control (" in line and "indexer (" in line and "topk (" in line for line in lines)


@pytest.mark.runs(*[label for label in ALL_1GPU if label.endswith("-vanilla")])
def test_vanilla_runs_have_no_plugin(records: Records) -> None:
    for label in (x for x in ALL_1GPU if x.endswith("-vanilla")):
        record = _ok(records[label])
        assert not [line for line in record["plugin_log_lines"] if "patches installed" in line], label
        assert record["counters"] is None, label  # Worker.dbo_runtime_stats does not exist without the plugin


@pytest.mark.runs("1gpu-deepseek-v32-eager-v1-plugin", "1gpu-shared-topk-graphs-v2-plugin")
def test_counters_readable_per_worker(records: Records) -> None:
    """LLM.collective_rpc("dbo_runtime_stats") answers on every worker, with the documented keys."""
    for label in ("1gpu-deepseek-v32-eager-v1-plugin", "1gpu-shared-topk-graphs-v2-plugin"):
        record = _ok(records[label])
        assert record["counters"] and len(record["counters"]) == 1
        for key in ("microbatched_builds", "partitions", "replans_call_site", "replans_in_graph", "planned_ahead", "warmups", "topk_groups_attached"):
            assert isinstance(record["counters"][0][key], int), key
        assert record["microbatched_steps"] == 0  # DBO off


@pytest.mark.runs("1gpu-shared-topk-dbo-dp1-plugin")
def test_enable_dbo_with_dp1_sets_up_but_never_microbatches(records: Records) -> None:
    """--enable-dbo on one GPU: the budget is announced (132 -> 112 with DeepEP HT), the planner is
    warmed, the follower group gets per-microbatch state -- and vLLM never microbatches (DP 1)."""
    record = _ok(records["1gpu-shared-topk-dbo-dp1-plugin"])
    counters = record["counters"][0]
    assert counters["warmups"] > 0 and counters["topk_groups_attached"] >= 1
    assert record["microbatched_steps"] == 0 and counters["partitions"] == 0
    assert any("DBO SM budget" in line for line in record["plugin_log_lines"]), record["plugin_log_lines"]


@pytest.mark.runs(SERVE_LABEL)
def test_vllm_serve_metrics_have_dbo_series(records: Records) -> None:
    """`vllm serve --enable-dbo` in Prometheus multiprocess mode: /metrics carries the DBO series."""
    job = records[SERVE_LABEL]
    assert job["ok"], f"{job.get('error')}\n{job.get('log_tail')}"
    text = "\n".join(job["metrics"])
    for name in (
        "dbo_runtime_dbo_compute_sms",
        "dbo_runtime_dbo_comm_sms",
        "dbo_runtime_sm_partitions_total",
        "dbo_runtime_indexer_replans_total",
        "dbo_runtime_indexer_planned_ahead_total",
        "dbo_runtime_planner_warmups_total",
    ):
        assert name in text, f"{name} missing from /metrics:\n{text}"
    assert any(line.startswith("dbo_runtime_dbo_compute_sms") and line.rstrip().endswith(" 112.0") for line in job["metrics"]), text
    assert any(f"patches installed for vLLM {metadata.version('vllm')} (verified by its code)" in line for line in job["plugin_log_lines"])
