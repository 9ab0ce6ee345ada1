"""The DBO scenario's kernels: real DeepGEMM on a GPU, or a CPU simulation (``sim.reference_planner``) with its SM
count, planner, capture probes and the logits kernel's schedule assertion, so the crash and its fix show on a CPU."""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

# numpy first: torch's initialisation swallows a Ctrl-C raised while it imports numpy
import numpy  # noqa: F401
import torch

from dbo_runtime.sim import reference_planner as ref


@functools.lru_cache(maxsize=8)
def logits_options(kernel: Callable[..., Any]) -> dict[str, Any]:
    """Options calling DeepGEMM's paged-MQA logits alike on every build (some have no ``clean_logits``)."""
    import inspect

    params: Any
    try:
        params = inspect.signature(kernel).parameters
    except (TypeError, ValueError):
        params = {}
    return {"logits_dtype": torch.float32, **({"clean_logits": False} if "clean_logits" in params else {})}


class ScheduleAssertion(RuntimeError):
    """DeepGEMM's ``_schedule_meta_size == num_sms / num_kv_multicast + 1`` host assertion."""


@dataclass
class JitLedger:
    """Variants launched eagerly: a first launch inside a capture would JIT-compile there."""

    seen: set[tuple[str, int, int]] = field(default_factory=set)
    compiled_in_capture: list[tuple[str, int, int]] = field(default_factory=list)

    def note(self, kernel: str, batch: int, slots: int, capturing: bool) -> None:
        key = (kernel, -(-batch // 32) * 32, slots)
        if capturing and key not in self.seen:
            self.compiled_in_capture.append(key)
        self.seen.add(key)


class SimulatedDeepGemm:
    """CPU stand-in for DeepGEMM: reference planner, same assertion, fp32 logits (a simulation)."""

    name = "cpu-simulated-deepgemm"
    simulated = True

    def __init__(self, total_sms: int = 132, sm_major: int = 9) -> None:
        self.device = torch.device("cpu")
        self.total_sms = total_sms
        self.sm_major = sm_major
        self._num_sms = total_sms
        self.planner_launches = 0

    def get_num_sms(self) -> int:
        return self._num_sms

    def set_num_sms(self, num_sms: int) -> None:
        if not 0 < num_sms <= self.total_sms:
            raise RuntimeError(f"set_num_sms({num_sms}) outside [1, {self.total_sms}]")
        self._num_sms = num_sms

    def slots(self, num_sms: int, next_n: int) -> int:
        return ref.schedule_slots(num_sms, next_n, self.sm_major)

    def plan(self, context_lens: Any, block_kv: int, num_sms: int, indices: Any | None = None) -> Any:
        slots = self.slots(num_sms, int(context_lens.shape[1]))
        self.planner_launches += 1
        return ref.plan_paged_mqa_schedule(context_lens, block_kv, slots, sm_major=self.sm_major)

    def capturing(self) -> bool:
        return False

    def capture_id(self) -> int | None:
        return None

    def make_inputs(self, *, q: torch.Tensor, k: torch.Tensor, block_kv: int) -> tuple[Any, Any]:
        num_blocks = k.shape[0] // block_kv
        return q.float(), k.float().reshape(num_blocks, block_kv, k.shape[-1])

    def logits(self, q: Any, kv_cache: Any, weights: torch.Tensor, context_lens: torch.Tensor,
               block_table: torch.Tensor, schedule: torch.Tensor, max_context_len: int) -> torch.Tensor:  # fmt: skip
        batch, next_n, _, dim = q.shape
        slots = self.slots(self._num_sms, next_n)
        if schedule.shape[0] != slots + 1:
            raise ScheduleAssertion(
                "Assertion error (csrc/apis/attention.hpp:388): _schedule_meta_size == num_sms / "
                f"num_kv_multicast + 1 and _meta_info_size == 2 (schedule rows {schedule.shape[0]}, "
                f"DeepGEMM SMs {self._num_sms})"
            )
        block_kv = kv_cache.shape[1]
        blocks = -(-max_context_len // block_kv)
        keys = kv_cache[block_table[:, :blocks].long()].reshape(batch, blocks * block_kv, dim)[:, :max_context_len]
        scores = torch.einsum("bnhd,btd->bnht", q, keys).relu()
        out = torch.einsum("bnht,bnh->bnt", scores, weights.view(batch, next_n, -1))
        return out.reshape(batch * next_n, max_context_len)


class DeepGemmBackend:
    """Real DeepGEMM on the current CUDA device (``deep_gemm`` wheel; vLLM not needed)."""

    name = "deep_gemm"
    simulated = False

    def __init__(self) -> None:
        import deep_gemm

        from dbo_runtime.adapters import deep_gemm as adapter

        self.dg = deep_gemm
        self.adapter = adapter
        self.device = torch.device("cuda", torch.cuda.current_device())
        self.total_sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        self.sm_major = int(torch.cuda.get_device_capability(self.device)[0])
        self.planner = adapter.DeepGemmPlanner()
        self.jit = JitLedger()
        self.planner_launches = 0

    def get_num_sms(self) -> int:
        return int(self.dg.get_num_sms())

    def set_num_sms(self, num_sms: int) -> None:
        self.dg.set_num_sms(num_sms)

    def slots(self, num_sms: int, next_n: int) -> int:
        return int(self.planner.slots(num_sms, next_n))

    def plan(self, context_lens: Any, block_kv: int, num_sms: int, indices: Any | None = None) -> Any:
        capturing = self.capturing()
        self.planner_launches += 1
        self.jit.note("planner", int(context_lens.shape[0]), self.slots(num_sms, int(context_lens.shape[1])), capturing)
        return self.planner.plan(context_lens, block_kv, num_sms, indices)

    def capturing(self) -> bool:
        return bool(torch.cuda.is_current_stream_capturing())

    def capture_id(self) -> int | None:
        return self.planner.capture_id()

    def make_inputs(self, *, q: torch.Tensor, k: torch.Tensor, block_kv: int) -> tuple[Any, Any]:
        """fp8 e4m3 q, and DeepGEMM's fused kv cache: per block ``block_kv*D`` fp8 values, then fp32 scales."""
        dim = k.shape[-1]
        num_blocks = k.shape[0] // block_kv
        scale = (k.abs().amax(dim=-1, keepdim=True).float() / 448.0).clamp(min=1e-6)
        k_fp8 = (k.float() / scale).to(torch.float8_e4m3fn)
        kv = torch.empty((num_blocks, block_kv * (dim + 4)), dtype=torch.uint8, device=k.device)
        kv[:, : block_kv * dim] = k_fp8.view(torch.uint8).reshape(num_blocks, block_kv * dim)
        kv[:, block_kv * dim :] = scale.reshape(num_blocks, block_kv).contiguous().view(torch.uint8)
        return q.to(torch.float8_e4m3fn), kv.view(num_blocks, block_kv, 1, dim + 4)

    def logits(self, q: Any, kv_cache: Any, weights: torch.Tensor, context_lens: torch.Tensor,
               block_table: torch.Tensor, schedule: torch.Tensor, max_context_len: int) -> torch.Tensor:  # fmt: skip
        batch, next_n = q.shape[0], q.shape[1]
        capturing = self.capturing()
        self.jit.note("logits", batch, self.slots(self.get_num_sms(), next_n), capturing)
        kernel = self.dg.fp8_fp4_paged_mqa_logits
        try:
            args = (q, None), kv_cache, weights, context_lens, block_table, schedule, max_context_len
            return kernel(*args, **logits_options(kernel))
        except RuntimeError as exc:
            if "_schedule_meta_size" in str(exc):
                raise ScheduleAssertion(str(exc)) from exc
            raise


def real_kernels_missing() -> str | None:
    """Why ``DeepGemmBackend`` cannot run here, in one line (None when it can)."""
    if not torch.cuda.is_available():
        return "no CUDA device (torch.cuda.is_available() is False)"
    try:
        importlib.import_module("deep_gemm")
    except Exception as exc:
        first = (str(exc).strip().splitlines() or [""])[0]
        return f"DeepGEMM does not import ({type(exc).__name__}: {first})"
    return None


KernelBackend = SimulatedDeepGemm | DeepGemmBackend
"""What the scenario runs on; ``sm_major`` decides DeepGEMM's SM multiple (even on SM90, ``core.budget``)."""
