"""GPU twin of the SMControl unit/contract tests: the knobs are the real DeepGEMM (and DeepEP) globals.

The CPU contract tests record knob calls on fakes; here the same partition turns
DeepGEMM's process-global SM count (and DeepEP's static ``Buffer.num_sms``
where the wheel imports) on an H200, and we read them back.
"""

from __future__ import annotations

import threading
from types import ModuleType

import pytest
import torch

from dbo_runtime.adapters.deep_gemm import DeepGemmKnob
from dbo_runtime.adapters.deep_gemm import get_num_sms as adapter_get_num_sms
from dbo_runtime.core.budget import compute_budget
from dbo_runtime.sim.sm_scope import FunctionKnob, SMControl


def h200_budget(total: int, comm: int = 20):  # type: ignore[no-untyped-def]
    return compute_budget(
        total_sms=total,
        platform="cuda",
        enable_dbo=True,
        expert_parallel=True,
        all2all_backend="deepep_high_throughput",
        env_comm_sms=comm,
        device=torch.cuda.current_device(),
    )


def test_partition_changes_deep_gemm_num_sms_and_restores(deep_gemm: ModuleType, cuda_device: torch.device) -> None:
    total = torch.cuda.get_device_properties(cuda_device).multi_processor_count
    assert deep_gemm.get_num_sms() == total
    control = SMControl(cuda_device.index or 0, total)
    budget = h200_budget(total)
    seen_by_threads: list[int] = []
    with control.partition(budget, compute_knob=DeepGemmKnob()):
        assert deep_gemm.get_num_sms() == total - 20 == adapter_get_num_sms()
        # DeepGEMM's count is process-global: both microbatch threads see it.
        threads = [threading.Thread(target=lambda: seen_by_threads.append(deep_gemm.get_num_sms())) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        with control.partition(h200_budget(total, 32), compute_knob=DeepGemmKnob()):
            assert deep_gemm.get_num_sms() == total - 32
        assert deep_gemm.get_num_sms() == total - 20  # previous budget, not "all SMs"
    assert deep_gemm.get_num_sms() == total
    assert seen_by_threads == [total - 20] * 2


def test_partition_restores_after_exception(deep_gemm: ModuleType, cuda_device: torch.device) -> None:
    total = torch.cuda.get_device_properties(cuda_device).multi_processor_count
    control = SMControl(cuda_device.index or 0, total)
    with pytest.raises(RuntimeError, match="step failed"), control.partition(h200_budget(total), compute_knob=DeepGemmKnob()):
        raise RuntimeError("step failed")
    assert deep_gemm.get_num_sms() == total


def test_deepep_buffer_comm_knob(deep_gemm: ModuleType, deep_ep: ModuleType, cuda_device: torch.device) -> None:
    total = torch.cuda.get_device_properties(cuda_device).multi_processor_count
    control = SMControl(cuda_device.index or 0, total)
    before = deep_ep.Buffer.num_sms
    # vLLM's HT manager clamps the restore value (total) to the 20 its buffers were sized for.
    comm = FunctionKnob("deep_ep.Buffer.set_num_sms", lambda n: deep_ep.Buffer.set_num_sms(min(n, before)))
    with control.partition(h200_budget(total, 16), comm_knob=comm, compute_knob=DeepGemmKnob()):
        assert deep_ep.Buffer.num_sms == 16 and deep_gemm.get_num_sms() == total - 16
    assert deep_ep.Buffer.num_sms == before and deep_gemm.get_num_sms() == total
