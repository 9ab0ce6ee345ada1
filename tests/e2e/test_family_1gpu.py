"""Issues 16 and 17 in the real vLLM 0.33.0 engine on one GPU: the fail-closed guard on an emulated unverified
vLLM build, and every DSA-family architecture (GLM-5.3 geometry, DeepSeek-V4, DeepSeek-V4.1, GLM-5.3-Flash) with
the plugin against vanilla (DBO off, eager and graphs: tokens identical) and with DBO at DP 1 (the hooks armed).
DBO needs DP >= 2 to microbatch: the two-GPU issue runs the family's DBO A/B."""

from __future__ import annotations

from importlib import metadata
from typing import Any

import pytest

from dbo_runtime.integration.releases import SUPPORTED
from tests.e2e import plan
from tests.e2e.conftest import Records
from tests.e2e.test_engine_1gpu import _identical, _ok

pytestmark = pytest.mark.e2e

FAMILY = list(plan.FAMILY)
WAYS_OUT = ("without --enable-dbo", f"install a vLLM release dbo_runtime verifies ({' or '.join(SUPPORTED)})", "DBO_RUNTIME_DISABLE=1")


@pytest.mark.runs("1gpu-guard-unverified-dbo-refused", "1gpu-guard-unverified-dbo-disabled")
def test_an_unverified_build_refuses_a_shared_topk_model_and_disable_starts_it(records: Records) -> None:
    refused = records["1gpu-guard-unverified-dbo-refused"]
    assert not refused["ok"], "the engine started with its top-k fix unverified"
    error = str(refused["error"])
    assert "DboRefusal: dbo_runtime refuses DeepseekV32ForCausalLM with --enable-dbo: layers 2, 4 reuse" in error, error
    assert "is unverified (code differs from vLLM 0.33.0 at topk.builder_register_layer" in error, error
    assert all(way in error for way in WAYS_OUT), error
    disabled = _ok(records["1gpu-guard-unverified-dbo-disabled"])
    assert len(disabled["requests"]) == 4 and disabled["counters"] is None  # vanilla vLLM, knowingly
    records.annotate("1gpu-guard-unverified-dbo-refused", refusal=error[-1500:])


@pytest.mark.parametrize(
    ("model", "mode"),
    [
        pytest.param(m, mode, id=f"{m}-{mode}", marks=pytest.mark.runs(f"1gpu-{m}-{mode}-plugin", f"1gpu-{m}-{mode}-vanilla"))
        for m in FAMILY
        for mode in ("eager", "graphs")
    ],
)
def test_family_plugin_is_transparent_with_dbo_off(records: Records, model: str, mode: str) -> None:
    base = f"1gpu-{model}-{mode}"
    with_plugin, vanilla = records[f"{base}-plugin"], records[f"{base}-vanilla"]
    if not with_plugin["ok"] and not vanilla["ok"]:
        pytest.fail(f"{plan.FAMILY[model]['architecture']} does not run here, with or without dbo_runtime: {vanilla['error']}")
    worst, mean = _identical(_ok(with_plugin), _ok(vanilla))
    records.annotate(f"{base}-plugin", tokens_identical_to=f"{base}-vanilla", max_abs_dlogprob=worst, mean_abs_dlogprob_topk=mean)
    lines = [line for line in with_plugin["plugin_log_lines"] if f"patches installed for vLLM {metadata.version('vllm')} (verified by its code)" in line]
    assert lines and "-- " in lines[0]
    # every fix in force: no broken patch, and no feature reported as anything but verified after "guard: on"
    assert "BROKEN" not in lines[0] and lines[0].rstrip().endswith("guard: on"), lines[0]


@pytest.mark.parametrize("model", [pytest.param(m, id=m, marks=pytest.mark.runs(f"1gpu-{m}-dbo-dp1-plugin")) for m in FAMILY])
def test_family_enable_dbo_at_dp1_arms_the_hooks(records: Records, model: str) -> None:
    record = _ok(records[f"1gpu-{model}-dbo-dp1-plugin"])
    counters: dict[str, Any] = record["counters"][0]
    assert counters["warmups"] > 0, counters  # the indexer builder registered and warmed its planner
    assert any("DBO SM budget" in line for line in record["plugin_log_lines"])
    if model == "glm53-geometry":
        assert counters["topk_groups_attached"] >= 1, counters  # leaders 0,1,2,6: groups 2 and 6 have followers
    if model == "deepseek-v41":
        assert counters["topk_shared_buffers"] >= 1, counters  # the model-wide top-k (and candidate) buffers
    assert record["microbatched_steps"] == 0  # DP 1 never microbatches
    records.annotate(f"1gpu-{model}-dbo-dp1-plugin", counters=counters)
