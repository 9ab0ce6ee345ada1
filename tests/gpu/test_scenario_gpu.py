"""GPU twin of tests/unit/test_simulate.py: the scenario with real DeepGEMM and real CUDA graphs.

Three modes as vLLM runs DBO (eager, MRV1 capture, MRV2 capture), GLM-5.3 layer
pattern and indexer shapes, a reduced request count to keep the run short; the
full-size suite is graphs/scenario_suite.py.
"""

from __future__ import annotations

import dataclasses
from types import ModuleType

import pytest

from dbo_runtime.sim.scenario import GLM53, MODES, run_scenario

CFG = dataclasses.replace(GLM53, num_requests=16, max_context=8192, steps=6)


@pytest.fixture(scope="module")
def backend():  # type: ignore[no-untyped-def]
    from dbo_runtime.sim.backends import DeepGemmBackend

    return DeepGemmBackend()


@pytest.mark.parametrize("mode", MODES)
def test_scenario_bit_identical(deep_gemm: ModuleType, backend, mode: str) -> None:  # type: ignore[no-untyped-def]
    res = run_scenario(CFG, backend, mode)  # type: ignore[arg-type]
    assert res.ok, (res.error, [dataclasses.asdict(c) for c in res.checks], res.jit_in_capture)
    assert len(res.checks) == CFG.steps
    assert res.steady_state_replans == 0
    if mode != "eager":
        assert [c.phase for c in res.checks[:2]] == ["warmup", "capture"]
        assert all(c.phase == "replay" for c in res.checks[2:])
        assert res.captured_replans >= 1  # the re-plan lives inside the graph
    assert deep_gemm.get_num_sms() == backend.total_sms


def test_contrast_vllm_0_33_asserts(deep_gemm: ModuleType, backend) -> None:  # type: ignore[no-untyped-def]
    res = run_scenario(dataclasses.replace(CFG, fix_schedule=False, isolate_topk=False, steps=1), backend)
    assert res.error.startswith("DeepGEMM assertion") and "_schedule_meta_size" in res.error


def test_contrast_shared_topk_corrupts_followers(deep_gemm: ModuleType, backend) -> None:  # type: ignore[no-untyped-def]
    res = run_scenario(dataclasses.replace(CFG, isolate_topk=False, steps=2), backend)
    assert not res.error and all(c.follower_mismatch > 0 for c in res.checks)
