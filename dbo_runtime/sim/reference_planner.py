"""DeepGEMM's paged-MQA-logits schedule planner in pure torch, bit-for-bit.

``dbo-runtime simulate`` and the CPU tests need what ``get_paged_mqa_logits_metadata`` returns for an
SM count without a GPU (``tests/gpu/test_reference_planner_gpu.py`` checks it against the kernel).
It syncs with the device, so never inside a capture. Non-varlen path only (SM90, SM100).
"""

from __future__ import annotations

import torch

SPLIT_KV_TOKENS = 256
"""Tokens per schedule segment (DeepGEMM's ``split_kv``)."""


def num_kv_multicast(next_n: int, sm_major: int = 9) -> int:
    """CTAs sharing one schedule slot: 2 for SM90 ``next_n == 4`` (cluster multicast), else 1."""
    return 2 if (sm_major == 9 and next_n == 4) else 1


def schedule_slots(num_sms: int, next_n: int, sm_major: int = 9) -> int:
    """Slots for ``num_sms`` SMs (DeepGEMM's ``num_sms`` argument); the metadata has this + 1 rows."""
    return num_sms // num_kv_multicast(next_n, sm_major)


def num_next_n_atoms(next_n: int, sm_major: int = 9) -> int:
    """Q atoms per request as DeepGEMM passes them: 1 on SM90, ``ceil(next_n / 2)`` on SM100."""
    return 1 if sm_major == 9 else (next_n + 1) // 2


def plan_paged_mqa_schedule(context_lens: torch.Tensor, block_kv: int, slots: int, sm_major: int = 9) -> torch.Tensor:
    """DeepGEMM ``get_paged_mqa_logits_metadata(context_lens, block_kv, slots)`` on any device: an int32
    ``[batch, next_n]`` tensor of lengths, ``block_kv`` 32 or 64 (the split is 256 tokens either way)."""
    last = context_lens[:, -1]
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
