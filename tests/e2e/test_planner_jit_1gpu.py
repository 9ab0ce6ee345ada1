"""Issue 20 in the real vLLM 0.33.0 engine on one GPU: with ``--enable-dbo`` (DP 1 announces the DBO budget and
the warm-up compiles its planners, but vLLM never microbatches there, so every step plans at the full SM count),
an empty DeepGEMM JIT cache and a decode batch that shrinks from 64 to 1, no planner kernel is compiled inside a
serving step: eager (no capture sizes), with graphs, and with MTP's next_n 2. Judged twice: the plugin's own
``jit_in_step`` counter, and the run's cold ``DG_JIT_CACHE_DIR`` listed when serving starts and after it (what
DeepGEMM itself compiled). The DBO count inside microbatched steps is the two-GPU twin's (``dp2-jit-sweep``)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.e2e import plan
from tests.e2e.conftest import Records
from tests.e2e.test_engine_1gpu import _ok

pytestmark = pytest.mark.e2e

SWEEP = list(plan.jit_sweep())


def is_planner_kernel(path: str) -> bool:
    """A compiled paged-MQA planner in DeepGEMM's cache (``<kernel name>.<hash>``), not the sparse or prefill
    metadata kernels, nor a folder DeepGEMM still writes before it renames it into place."""
    parts = path.split("/")
    return "paged_mqa_logits_metadata" in path and "sparse" not in path and not any(p.startswith("tmp") for p in parts)


def judge_sweep(record: dict[str, Any], requests: int, max_tokens: int) -> dict[str, Any]:
    """The assertions both sweeps share; returns the counters (one worker's, or every DP rank's)."""
    lengths = sorted(len(r["tokens"]) for r in record["requests"])
    assert lengths == sorted(max_tokens + i for rank in range(record.get("dp") or 1) for i in range(requests)), lengths
    for counters in record["counters"]:
        assert counters["warmups"] > 0 and counters["warm_failures"] == 0, counters
        assert counters["jit_in_step"] == 0, counters
    caches = record.get("jit_cache") or []
    assert len(caches) == (record.get("dp") or 1), f"a rank wrote no listing of its cold DeepGEMM cache: {caches}"
    for cache in caches:
        planners = [k for k in cache["at_ready"] if is_planner_kernel(k)]
        assert planners, f"no planner kernel named in the cold cache at start, so the listing proves nothing: {cache['at_ready']}"
        assert not [k for k in cache["new_in_serving"] if is_planner_kernel(k)], cache["new_in_serving"]
    return {"counters": record["counters"], "jit_cache": caches}


@pytest.mark.parametrize("label", [pytest.param(label, id=label, marks=pytest.mark.runs(label)) for label in SWEEP])
def test_no_planner_jit_inside_a_step_on_a_cold_cache(records: Records, label: str) -> None:
    record = _ok(records[label])
    spec = plan.jit_sweep()[label]
    assert any("DBO SM budget" in line for line in record["plugin_log_lines"])
    records.annotate(label, **judge_sweep(record, spec.prompts.num, spec.max_tokens))
