"""GPU twin of the even-compute-count tests: tests/unit/test_budget.py,
tests/unit/test_sm_control.py and tests/vllm/test_sm_contract.py (``sm90``).

On SM90, DeepGEMM's ``fp8_fp4_paged_mqa_logits`` at ``next_n == 4`` (MTP with 3 speculative tokens)
runs one 2-CTA multicast cluster per scheduler task over all of DeepGEMM's SMs. With an odd SM count
the launch fails (``CUDA_ERROR_INVALID_CLUSTER_SIZE``), although the schedule's row check passes
(``113 // 2 + 1 == 112 // 2 + 1``). vLLM 0.33.0's policy (``total - comm``) produces such counts on an
odd-SM device or MIG slice and with an odd comm share; dbo_runtime's SM90 budget rounds them down.

1. ``test_odd_count_fails_to_launch_next_n4``: real DeepGEMM, schedule planned for the live count,
   next_n 4: even counts launch, odd ones fail with a cluster error (run in a child process, so a
   launch failure cannot disturb the other twins).
2. ``test_budget_path_never_gives_deep_gemm_an_odd_count``: the configurations where vLLM would set an
   odd count, through ``compute_budget(compute_multiple=2)`` and SMControl with the real DeepGEMM knob:
   the count in force is even, the next_n 4 logits launch and are bit-identical to the 132-SM
   reference, and the exit restores exactly the count of the budget below.

    DBO_REQUIRE_GPU=1 python3 -m pytest tests/gpu/test_sm_parity_gpu.py -q
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

from dbo_runtime.adapters.deep_gemm import DeepGemmKnob, DeepGemmPlanner
from dbo_runtime.core.budget import compute_budget, deep_gemm_compute_multiple
from dbo_runtime.services.schedule_cache import IndexerScheduleCache
from dbo_runtime.sim.sm_scope import SMControl
from tests.gpu.test_indexer_schedule_gpu import BLOCK, _logits, _make_case, _mismatch, _reference

ROOT = Path(__file__).resolve().parents[2]

_CHILD = """
import json, sys, torch, deep_gemm
from dbo_runtime.adapters.deep_gemm import DeepGemmPlanner
from tests.gpu.test_indexer_schedule_gpu import BLOCK, _logits, _make_case
case = _make_case(4, torch.device("cuda", torch.cuda.current_device()))
planner = DeepGemmPlanner()
out = {}
for n in [int(a) for a in sys.argv[1:]]:  # even counts first: a failed launch cannot hide their result
    deep_gemm.set_num_sms(n)
    schedule = planner.plan(case.context_lens, BLOCK, n)
    try:
        _logits(deep_gemm, case, schedule)
        torch.cuda.synchronize()
        out[n] = {"rows": int(schedule.shape[0]), "error": None}
    except Exception as exc:
        out[n] = {"rows": int(schedule.shape[0]), "error": repr(exc)}
print("RESULT " + json.dumps(out))
"""


def _require_sm90(sm_major: int) -> None:
    if sm_major != 9:
        pytest.skip(f"the 2-CTA multicast paged-MQA kernel is SM90-only (this device: SM{sm_major}0)")


def test_odd_count_fails_to_launch_next_n4(
    deep_gemm: ModuleType, cuda_device: torch.device, sm_major: int, out_dir: Any
) -> None:
    _require_sm90(sm_major)
    total = int(deep_gemm.get_num_sms())
    even, odd = [112, total - total % 2 - 2], [113, total - 1 if total % 2 == 0 else total]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, *map(str, even + odd)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, f"child failed (rc {proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    result = {int(k): v for k, v in json.loads(lines[-1][len("RESULT "):]).items()}
    if out_dir is not None:
        (out_dir / "sm_parity_launch.json").write_text(json.dumps({"total": total, "next_n": 4, "launches": result}, indent=1))
    print(f"next_n 4 logits launch by DeepGEMM SM count: {result}")
    for n in even:
        assert result[n]["error"] is None, (n, result[n])
    for n in odd:
        assert result[n]["rows"] == n // 2 + 1  # the host row check passes: only the launch fails
        assert result[n]["error"] is not None and "cluster" in result[n]["error"].lower(), (n, result[n])


@pytest.mark.parametrize(
    ("total", "env", "ep"),
    [
        (None, 21, True),  # odd comm share above DeepEP HT's ceiling: vLLM sets 111
        (None, 19, False),  # no expert parallel, odd share: vLLM sets 113
        ("odd", 20, True),  # odd-SM device / MIG slice (emulated with DeepGEMM's count): vLLM sets 111
    ],
)
def test_budget_path_never_gives_deep_gemm_an_odd_count(
    deep_gemm: ModuleType, cuda_device: torch.device, sm_major: int, total: Any, env: int, ep: bool
) -> None:
    _require_sm90(sm_major)
    device_total = int(deep_gemm.get_num_sms())
    total = device_total - 1 if total == "odd" else device_total
    deep_gemm.set_num_sms(total)  # what DeepGEMM runs at outside any partition on such a device
    kw: dict[str, Any] = dict(
        total_sms=total, platform="cuda", enable_dbo=True, expert_parallel=ep,
        all2all_backend="deepep_high_throughput", env_comm_sms=env, device=cuda_device.index or 0,
    )
    vllm_policy = compute_budget(**kw)
    assert vllm_policy.compute % 2 == 1  # what vLLM 0.33.0 would hand DeepGEMM here
    budget = compute_budget(**kw, compute_multiple=deep_gemm_compute_multiple(sm_major))
    assert budget.compute == vllm_policy.compute - 1 and budget.idle == 1

    case = _make_case(4, cuda_device, seed=5)
    planner = DeepGemmPlanner()
    ref = _reference(deep_gemm, case, planner, device_total)
    deep_gemm.set_num_sms(total)
    cache = IndexerScheduleCache(planner)
    control = SMControl(cuda_device.index or 0, total)
    with control.partition(budget, compute_knob=DeepGemmKnob()):
        live = int(deep_gemm.get_num_sms())
        assert live == budget.compute and live % 2 == 0
        full = planner.plan(case.context_lens, BLOCK, total)  # the builder's own count
        cache.track(full, planned_sms=total, block_kv=BLOCK, next_n=4)
        got = _logits(deep_gemm, case, cache.resolve(full, case.context_lens, None, BLOCK))
        torch.cuda.synchronize()
    assert int(deep_gemm.get_num_sms()) == total  # restored exactly, not rounded
    assert _mismatch(case, got, ref) == 0.0
