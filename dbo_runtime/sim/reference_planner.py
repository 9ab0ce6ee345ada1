"""DeepGEMM's paged-MQA-logits schedule planner in pure torch, bit-for-bit.

``dbo-runtime simulate`` and the CPU tests need what ``get_paged_mqa_logits_metadata`` returns for an
SM count without a GPU (``tests/gpu/test_reference_planner_gpu.py`` checks it against the kernel).
It syncs with the device, so never inside a capture. Non-varlen path only (SM90, SM100).
"""

from __future__ import annotations

import torch

from dbo_runtime.core.errors import ConfigError

SPLIT_KV_TOKENS = 256
"""Tokens per schedule segment (DeepGEMM's ``split_kv``)."""

SUPPORTED_BLOCK_KV = (32, 64)
"""Accepted ``block_kv``; SM90 plans both as 64."""

PLANNER_SM_MAJORS = (9, 10)


def _check_int(parameter: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(parameter, value, f"an int >= {minimum}")
    return value


def num_kv_multicast(next_n: int, sm_major: int = 9) -> int:
    """CTAs sharing one schedule slot: 2 for SM90 ``next_n == 4`` (cluster multicast), else 1."""
    _check_int("next_n", next_n, 1)
    _check_int("sm_major", sm_major, 1)
    return 2 if (sm_major == 9 and next_n == 4) else 1


def schedule_slots(num_sms: int, next_n: int, sm_major: int = 9) -> int:
    """Slots for ``num_sms`` SMs (DeepGEMM's ``num_sms`` argument); the metadata has this + 1 rows."""
    _check_int("num_sms", num_sms, 1)
    slots = num_sms // num_kv_multicast(next_n, sm_major)
    if slots < 1:
        raise ConfigError("num_sms", num_sms, ">= 2 for next_n == 4 on SM90 (one slot per 2-CTA cluster)")
    return slots


def num_next_n_atoms(next_n: int, sm_major: int = 9) -> int:
    """Q atoms per request as DeepGEMM passes them: 1 on SM90, ``ceil(next_n / 2)`` on SM100."""
    _check_int("next_n", next_n, 1)
    if sm_major not in PLANNER_SM_MAJORS:
        raise ConfigError("sm_major", sm_major, PLANNER_SM_MAJORS)
    if sm_major == 9:
        return 1
    return next_n if next_n <= 1 else (next_n + 1) // 2


def _check_context_lens(context_lens: object) -> torch.Tensor:
    if not isinstance(context_lens, torch.Tensor):
        raise ConfigError("context_lens", type(context_lens).__name__, "a torch.Tensor")
    if context_lens.dim() != 2:
        raise ConfigError("context_lens", f"{context_lens.dim()}-D tensor", "a 2-D [batch, next_n] tensor")
    if context_lens.dtype != torch.int32:
        raise ConfigError("context_lens", context_lens.dtype, [torch.int32])
    if not context_lens.is_contiguous():
        raise ConfigError("context_lens", "non-contiguous tensor", "a contiguous tensor")
    batch, next_n = context_lens.shape
    if batch < 1:
        # DeepGEMM would underflow `batch_size - 1`; vLLM never plans an empty batch.
        raise ConfigError("context_lens", f"shape {tuple(context_lens.shape)}", "at least one row (batch >= 1)")
    if next_n < 1:
        raise ConfigError("context_lens", f"shape {tuple(context_lens.shape)}", "at least one column (next_n >= 1)")
    last = context_lens[:, -1]
    if bool((last < 0).any()):
        raise ConfigError("context_lens", "negative length", "lengths >= 0 (the kernel reads them as uint32)")
    return last


def plan_paged_mqa_schedule(
    context_lens: torch.Tensor, block_kv: int, num_slots: int, sm_major: int = 9
) -> torch.Tensor:
    """DeepGEMM ``get_paged_mqa_logits_metadata(context_lens, block_kv, num_slots)`` on any device."""
    last = _check_context_lens(context_lens)
    if isinstance(block_kv, bool) or block_kv not in SUPPORTED_BLOCK_KV:
        raise ConfigError("block_kv", block_kv, SUPPORTED_BLOCK_KV)
    slots = _check_int("num_slots", num_slots, 1)
    if sm_major not in PLANNER_SM_MAJORS:
        raise ConfigError("sm_major", sm_major, PLANNER_SM_MAJORS)
    batch, next_n = context_lens.shape
    atoms = num_next_n_atoms(next_n, sm_major)
    device = context_lens.device

    segs = (last.to(torch.int64) + (SPLIT_KV_TOKENS - 1)) // SPLIT_KV_TOKENS
    prefix = torch.cumsum(segs, 0)
    scaled = prefix * atoms
    total = scaled[-1]
    q = total // slots
    r = total - q * slots
    pivot = slots - r
    sm = torch.arange(slots, dtype=torch.int64, device=device)
    seg_starts = sm * q + torch.clamp(sm - pivot, min=0)

    lo = torch.searchsorted(scaled, seg_starts, right=True)
    q_idx = torch.clamp(lo, max=batch - 1)
    prev = torch.where(q_idx > 0, prefix[torch.clamp(q_idx - 1, min=0)], torch.zeros_like(q_idx))
    offset_in_q = seg_starts - prev * atoms
    num_segs_q = prefix[q_idx] - prev
    has_segs = num_segs_q > 0
    safe = torch.where(has_segs, num_segs_q, torch.ones_like(num_segs_q))
    atom_idx = torch.where(has_segs, offset_in_q // safe, torch.zeros_like(offset_in_q))
    kv_split_idx = torch.where(has_segs, offset_in_q % safe, torch.zeros_like(offset_in_q))

    # no segments: every row is the one-past-the-end sentinel
    empty = total == 0
    out = torch.empty((slots + 1, 2), dtype=torch.int64, device=device)
    out[:slots, 0] = torch.where(empty, batch * atoms, q_idx * atoms + atom_idx)
    out[:slots, 1] = torch.where(empty, 0, kv_split_idx)
    out[slots, 0] = batch * atoms
    out[slots, 1] = 0
    return out.to(torch.int32)
