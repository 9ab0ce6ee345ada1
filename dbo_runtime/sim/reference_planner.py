"""DeepGEMM's ``get_paged_mqa_logits_metadata`` in torch, bit for bit (SM90, SM100); it syncs: never in a capture."""

from __future__ import annotations

import torch

SPLIT_KV_TOKENS = 256


def num_kv_multicast(next_n: int, sm_major: int = 9) -> int:
    """CTAs per schedule slot: 2 for SM90 ``next_n == 4``, else 1."""
    return 2 if (sm_major == 9 and next_n == 4) else 1


def schedule_slots(num_sms: int, next_n: int, sm_major: int = 9) -> int:
    """DeepGEMM's ``num_sms`` argument: the metadata has this + 1 rows."""
    return num_sms // num_kv_multicast(next_n, sm_major)


def num_next_n_atoms(next_n: int, sm_major: int = 9) -> int:
    """Q atoms per request: 1 on SM90, ``ceil(next_n / 2)`` on SM100."""
    return 1 if sm_major == 9 else (next_n + 1) // 2


def plan_paged_mqa_schedule(context_lens: torch.Tensor, block_kv: int, slots: int, sm_major: int = 9) -> torch.Tensor:
    """The metadata for int32 ``[batch, next_n]`` lengths (``block_kv``, 32 or 64, changes nothing)."""
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
