"""Pure-torch reference of DeepGEMM's paged-MQA-logits schedule planner.

Why this exists: under DBO the indexer's schedule must be re-planned for the compute SM budget,
and the logits kernel trusts the schedule blindly on CUDA-graph replay (a stale plan returns
wrong logits without an error: the replay-safety row of docs/accuracy.md). CPU tests and the budget simulation
need to know *exactly* what ``deep_gemm.get_paged_mqa_logits_metadata`` returns for a given SM
count without a GPU, so this module reproduces it bit-for-bit with vectorised torch ops
(``tests/gpu/test_reference_planner_gpu.py`` checks that against the real kernel). It is a
reference, not a hot-path planner: it validates values on the host (a device sync on CUDA
tensors) and must never run inside a graph capture.

Sources (read for this module; the pinned GPU wheel is what the twin test runs against):

* ``tokenspeed-deepgemm==2.5.0.post20260604`` (the wheel installed on the GPU machine), file
  ``deep_gemm/include/deep_gemm/scheduler/paged_mqa_logits.cuh``: kernel
  ``sched::smxx_paged_mqa_logits_metadata<kAlignedBatchSize, SPLIT_KV, kNumSMs, kIsVarlen>``
  and ``PagedMQALogitsScheduler``. Text-identical to upstream ``deepseek-ai/DeepGEMM`` at commit
  ``245dc5d6a5fe344c61505fe71011d203141d4479``.
* Host side of that wheel (``_C.so``, compiled from ``csrc/apis/attention.hpp`` and
  ``csrc/jit_kernels/impls/smxx_fp8_fp4_paged_mqa_logits.hpp``; the matching csrc revision is
  not in the stored index, so these facts were read from the wheel's disassembly and assert
  strings): ``get_paged_mqa_logits_metadata`` asserts ``context_lens.dim() == 2``, int32,
  contiguous; for the non-varlen path ``arch_major`` must be 9 or 10 and
  ``block_kv == 32 or block_kv == 64``; on SM90 it then *replaces* ``block_kv`` by 64 and passes
  ``num_next_n_atoms = 1``; on SM100 it keeps ``block_kv`` and passes
  ``num_next_n_atoms = next_n if next_n <= 1 else (next_n + 1) // 2``. The launcher uses
  ``split_kv = 256`` (a constant, asserting ``256 % block_kv == 0``) and
  ``aligned_batch_size = align(batch_size, 32)``; output is ``torch.empty({num_sms + 1, 2})``.
  Upstream ``deepseek-ai/DeepGEMM`` ``csrc/apis/attention.hpp`` at ``0274ad7b`` (a later
  revision with a separate ``sm90_paged_mqa_logits_metadata``) keeps the same SM90 contract:
  block_kv 32 or 64, planned as 64, ``num_next_n_atoms = 1``.
* vLLM 0.33.0 ``vllm/utils/deep_gemm.py`` ``native_next_n_supported`` and
  ``_paged_mqa_logits_schedule_slots`` (:684-704): SM90 runs ``next_n == 4`` as one task per
  2-CTA multicast cluster, so vLLM passes ``num_sms // 2`` as DeepGEMM's ``num_sms`` argument,
  and the logits kernel asserts ``_schedule_meta_size == num_sms / num_kv_multicast + 1``.

Semantics (non-varlen, the only path SM90 has):

* Only the *last* column of ``context_lens[B, next_n]`` is read; a request has
  ``ceil(len / 256)`` segments (SPLIT_KV = 256 tokens = 4 blocks of 64). All ``next_n`` rows of a
  request form one q atom on SM90 (``num_next_n_atoms == 1``; the 2-CTA cluster splits next_n=4,
  the schedule does not); SM100 has ``ceil(next_n / 2)`` atoms per request, each walking all of
  the request's segments.
* ``total = sum(segments) * num_next_n_atoms`` is split over ``S = num_slots`` slots with
  ``q, r = divmod(total, S)``, *reversed*: the first ``S - r`` slots get ``q`` segments, the last
  ``r`` get ``q + 1``. Slot ``i`` starts at linear segment ``i * q + max(0, i - (S - r))``.
* Row ``i < S`` is slot ``i``'s start cursor ``(q_atom_idx, kv_split_idx)``, found by an
  upper-bound binary search of the start over the prefix sum, with the request index clamped to
  ``B - 1``; row ``S`` is the end fence ``(B * num_next_n_atoms, 0)``. Consequence worth
  knowing: when every context is empty all cursors are ``((B - 1) * atoms, 0)``, not the fence.

Not covered: the varlen path (``indices=...``, DeepSeek-V4) is SM100-only in DeepGEMM and has its
own pairing logic; SM120 uses a different metadata kernel that this wheel does not expose.
Confirmed only by reading, not by running here: everything above; the GPU twin test is the proof.
"""

from __future__ import annotations

import torch

from dbo_runtime.core.errors import ConfigError

SPLIT_KV_TOKENS = 256
"""Tokens per schedule segment; a constant in DeepGEMM's launcher (``split_kv = 256``)."""

SUPPORTED_BLOCK_KV = (32, 64)
"""``block_kv`` values the wheel's non-varlen planner accepts (SM90 plans both as 64)."""

PLANNER_SM_MAJORS = (9, 10)
"""Architectures whose non-varlen planner this reference mirrors."""

SM90_NATIVE_NEXT_N = (1, 2, 4)


def _check_int(parameter: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(parameter, value, f"an int >= {minimum}")
    return value


def native_next_n_supported(next_n: int, sm_major: int = 9) -> bool:
    """Whether the paged-MQA logits kernel takes ``next_n`` query rows per request natively.

    Mirrors vLLM 0.33.0 ``native_next_n_supported``: the SM90 kernel is instantiated only for
    ``next_n`` in {1, 2, 4}; other architectures schedule any ``next_n``. vLLM flattens
    unsupported values to one row per query before planning.
    """
    _check_int("next_n", next_n, 1)
    _check_int("sm_major", sm_major, 1)
    if sm_major == 9:
        return next_n in SM90_NATIVE_NEXT_N
    return True


def num_kv_multicast(next_n: int, sm_major: int = 9) -> int:
    """CTAs sharing one schedule slot: 2 for SM90 ``next_n == 4`` (cluster multicast), else 1."""
    _check_int("next_n", next_n, 1)
    _check_int("sm_major", sm_major, 1)
    return 2 if (sm_major == 9 and next_n == 4) else 1


def schedule_slots(num_sms: int, next_n: int, sm_major: int = 9) -> int:
    """Schedule slots the logits kernel launches for a budget of ``num_sms`` SMs.

    Mirrors vLLM 0.33.0 ``_paged_mqa_logits_schedule_slots``. This is the value to pass as
    DeepGEMM's ``num_sms`` argument (and to ``plan_paged_mqa_schedule``): the metadata must have
    ``schedule_slots(get_num_sms(), next_n) + 1`` rows or the logits kernel's host assert fires.
    Zero slots would make the planner divide by zero on the GPU, so it is refused here.
    """
    _check_int("num_sms", num_sms, 1)
    slots = num_sms // num_kv_multicast(next_n, sm_major)
    if slots < 1:
        raise ConfigError("num_sms", num_sms, ">= 2 for next_n == 4 on SM90 (one slot per 2-CTA cluster)")
    return slots


def num_next_n_atoms(next_n: int, sm_major: int = 9) -> int:
    """Q atoms per request in the schedule, as DeepGEMM's host code passes them to the planner.

    SM90 always passes 1 (the whole ``next_n`` group is one atom; the multicast cluster splits it
    in hardware); SM100 passes ``ceil(next_n / 2)`` because its kernel walks 2 rows per atom.
    """
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
        # DeepGEMM would read prefix_sum[0] from a zero-sized shared buffer and underflow
        # `batch_size - 1`; vLLM never plans an empty decode batch.
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
    """DeepGEMM ``get_paged_mqa_logits_metadata(context_lens, block_kv, num_slots)``, on any device.

    ``num_slots`` is DeepGEMM's ``num_sms`` argument, i.e. ``schedule_slots(num_sms, next_n)``
    (vLLM pre-divides for SM90 ``next_n == 4``). Returns int32 ``[num_slots + 1, 2]`` on
    ``context_lens.device``. ``block_kv`` only gates validity: the segment size is always 256
    tokens for the planners mirrored here.
    """
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
    prefix = torch.cumsum(segs, 0)  # inclusive, like the kernel's warp scan
    scaled = prefix * atoms
    total = scaled[-1]
    q = total // slots
    r = total - q * slots
    pivot = slots - r
    sm = torch.arange(slots, dtype=torch.int64, device=device)
    seg_starts = sm * q + torch.clamp(sm - pivot, min=0)

    # Kernel: upper-bound binary search of seg_starts in prefix * atoms, clamped to batch - 1.
    lo = torch.searchsorted(scaled, seg_starts, right=True)
    q_idx = torch.clamp(lo, max=batch - 1)
    prev = torch.where(q_idx > 0, prefix[torch.clamp(q_idx - 1, min=0)], torch.zeros_like(q_idx))
    offset_in_q = seg_starts - prev * atoms
    num_segs_q = prefix[q_idx] - prev
    has_segs = num_segs_q > 0
    safe = torch.where(has_segs, num_segs_q, torch.ones_like(num_segs_q))
    atom_idx = torch.where(has_segs, offset_in_q // safe, torch.zeros_like(offset_in_q))
    kv_split_idx = torch.where(has_segs, offset_in_q % safe, torch.zeros_like(offset_in_q))

    out = torch.empty((slots + 1, 2), dtype=torch.int64, device=device)
    out[:slots, 0] = q_idx * atoms + atom_idx
    out[:slots, 1] = kv_split_idx
    out[slots, 0] = batch * atoms
    out[slots, 1] = 0
    return out.to(torch.int32)


def plan_for_sm_budget(
    context_lens: torch.Tensor, block_kv: int, num_sms: int, sm_major: int = 9
) -> torch.Tensor:
    """Plan for an SM budget the way vLLM's wrapper does: slots from ``next_n``, then plan."""
    _check_context_lens(context_lens)
    return plan_paged_mqa_schedule(
        context_lens, block_kv, schedule_slots(num_sms, int(context_lens.shape[1]), sm_major), sm_major
    )
