"""Boundary fake for DeepGEMM on a CPU box (no CUDA, no DeepGEMM build).

What it stands in for, and nothing more:

* the process-global SM count (``get_num_sms`` / ``set_num_sms``, asserting ``0 <= n <= total``);
* ``get_paged_mqa_logits_metadata(context_lens, block_kv, num_slots, indices=None)`` -- DeepGEMM's
  own signature, where the third argument is already the slot count (vLLM's wrapper divides by
  2 for SM90 ``next_n == 4``). Values come from ``dbo_runtime.sim.reference_planner``
  (checked bit-for-bit against the real kernel by its GPU twin);
* ``fp8_fp4_paged_mqa_logits`` -- performs DeepGEMM's host assertion
  (``csrc/apis/attention.hpp``: ``_schedule_meta_size == num_sms / num_kv_multicast + 1``) and
  raises like it; returns logits whose row ``r`` is filled with the schedule's row count, so a
  test can see which schedule the kernel was given.

GPU twin: ``tests/gpu/test_indexer_schedule_gpu.py`` runs the same checks with real DeepGEMM.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from dbo_runtime.sim.reference_planner import plan_paged_mqa_schedule, schedule_slots


@dataclass
class FakeDeepGemm:
    total_sms: int = 132
    sm_major: int = 9
    num_sms: int = -1
    plan_calls: list[tuple[int, int, tuple[int, ...]]] = field(default_factory=list)
    """``(slots, block_kv, context_lens.shape)`` per planner call."""
    logits_calls: int = 0

    def __post_init__(self) -> None:
        if self.num_sms < 0:
            self.num_sms = self.total_sms

    # -- runtime ----------------------------------------------------------------------------
    def get_num_sms(self) -> int:
        return self.num_sms

    def set_num_sms(self, num_sms: int) -> None:
        if not 0 <= num_sms <= self.total_sms:
            raise RuntimeError(f"Assertion error (csrc/jit/device_runtime.hpp): 0 <= new_num_sms <= {self.total_sms}")
        self.num_sms = num_sms

    # -- kernels ----------------------------------------------------------------------------
    def get_paged_mqa_logits_metadata(
        self, context_lens: torch.Tensor, block_kv: int, num_slots: int, indices: Any | None = None
    ) -> torch.Tensor:
        self.plan_calls.append((int(num_slots), int(block_kv), tuple(context_lens.shape)))
        return plan_paged_mqa_schedule(context_lens, block_kv, num_slots, self.sm_major)

    def fp8_fp4_paged_mqa_logits(
        self,
        q: Any,
        kv_cache: torch.Tensor,
        weights: torch.Tensor,
        context_lens: torch.Tensor,
        block_table: torch.Tensor,
        schedule_meta: torch.Tensor,
        max_context_len: int,
        clean_logits: bool = False,
        logits_dtype: Any = None,
        indices: Any | None = None,
    ) -> torch.Tensor:
        next_n = int(context_lens.shape[1])
        multicast = 2 if (self.sm_major == 9 and next_n == 4) else 1
        rows, width = schedule_meta.shape
        if not (rows == self.num_sms // multicast + 1 and width == 2):
            raise RuntimeError(
                "Assertion error (csrc/apis/attention.hpp:388): _schedule_meta_size == num_sms / "
                "num_kv_multicast + 1 and _meta_info_size == 2"
            )
        self.logits_calls += 1
        batch = int(context_lens.shape[0])
        return torch.full((batch * next_n, max_context_len), float(rows), dtype=torch.float32)


@dataclass
class FakeSchedulePlanner:
    """``SchedulePlanner`` over a ``FakeDeepGemm`` (what ``DeepGemmPlanner`` is over real DeepGEMM)."""

    dg: FakeDeepGemm
    capturing_now: bool = False
    current_capture: int | None = None
    name: str = "fake_deep_gemm"

    def get_num_sms(self) -> int:
        return self.dg.get_num_sms()

    def slots(self, num_sms: int, next_n: int) -> int:
        return schedule_slots(num_sms, next_n, self.dg.sm_major)

    def plan(self, context_lens: torch.Tensor, block_kv: int, num_sms: int, indices: Any | None = None) -> torch.Tensor:
        next_n = int(context_lens.shape[1]) if context_lens.dim() == 2 else 1
        return self.dg.get_paged_mqa_logits_metadata(context_lens, block_kv, self.slots(num_sms, next_n), indices)

    def capturing(self) -> bool:
        return self.capturing_now

    def capture_id(self) -> int | None:
        return self.current_capture if self.capturing_now else None


def vllm_signature_planner(dg: FakeDeepGemm) -> Any:
    """``vllm.utils.deep_gemm.get_paged_mqa_logits_metadata`` over the fake (SM count in, slot rule applied)."""

    def get_paged_mqa_logits_metadata(
        context_lens: torch.Tensor, block_size: int, num_sms: int, indices: Any | None = None
    ) -> torch.Tensor:
        next_n = int(context_lens.shape[1]) if context_lens.dim() == 2 else 1
        return dg.get_paged_mqa_logits_metadata(
            context_lens, block_size, schedule_slots(num_sms, next_n, dg.sm_major), indices
        )

    return get_paged_mqa_logits_metadata


def vllm_signature_logits(dg: FakeDeepGemm) -> Any:
    """``vllm.utils.deep_gemm.fp8_fp4_paged_mqa_logits`` over the fake, in the installed vLLM's own parameters
    (``logits_dtype`` where that release has it); the logits come back in ``logits_dtype``."""
    import inspect

    from vllm.utils import deep_gemm as vdg

    signature = inspect.signature(vdg.fp8_fp4_paged_mqa_logits)

    def fp8_fp4_paged_mqa_logits(*args: Any, **kwargs: Any) -> torch.Tensor:
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        a = bound.arguments
        logits = dg.fp8_fp4_paged_mqa_logits(
            a["q"], a["kv_cache"], a["weights"], a["context_lens"], a["block_tables"], a["schedule_metadata"],
            a["max_model_len"], indices=a["indices"],
        )  # fmt: skip
        return logits.to(a.get("logits_dtype", torch.float32))

    fp8_fp4_paged_mqa_logits.__signature__ = signature  # type: ignore[attr-defined]
    return fp8_fp4_paged_mqa_logits
