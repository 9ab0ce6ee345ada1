"""Issue 20 in the real vLLM 0.33.0 engine on one GPU: with ``--enable-dbo`` (DP 1 announces the DBO budget),
an empty DeepGEMM JIT cache and a decode batch that takes every size from 64 down to 1, no indexer planner
variant is met first inside a serving step: the warm-up at model load compiled all of them, eager (no capture
sizes) and with graphs, and with MTP's next_n 2."""

from __future__ import annotations

from typing import Any

import pytest

from tests.e2e import plan
from tests.e2e.conftest import Records
from tests.e2e.test_engine_1gpu import _ok

pytestmark = pytest.mark.e2e

SWEEP = list(plan.jit_sweep())


@pytest.mark.runs(*SWEEP)
@pytest.mark.parametrize("label", SWEEP)
def test_no_planner_jit_inside_a_step_on_a_cold_cache(records: Records, label: str) -> None:
    record = _ok(records[label])
    spec = plan.jit_sweep()[label]
    lengths = sorted(len(r["tokens"]) for r in record["requests"])
    assert lengths == [spec.max_tokens + i for i in range(spec.prompts.num)], lengths  # the batch shrank one by one
    counters: dict[str, Any] = record["counters"][0]
    assert counters["warmups"] > 0 and counters["warm_failures"] == 0, counters
    assert counters["jit_in_step"] == 0, counters
    assert any("DBO SM budget" in line for line in record["plugin_log_lines"])
    records.annotate(label, counters=counters)
