"""CPU tests of the reference paged-MQA schedule planner.

Three independent checks: a literal line-by-line Python port of DeepGEMM's metadata kernel
(per-SM loop, uint32 binary search), hand-computed plans, and schedule invariants derived from
the scheduler's traversal (not from the planner's formula). The slot rule is checked against
the real vLLM 0.33.0 functions with only the device capability faked. The bit-exact check
against the real kernel is the GPU twin, tests/gpu/test_reference_planner_gpu.py.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
import torch

from dbo_runtime.sim.reference_planner import (
    SPLIT_KV_TOKENS,
    num_kv_multicast,
    num_next_n_atoms,
    plan_paged_mqa_schedule,
    schedule_slots,
)

U32 = 0xFFFFFFFF


def _kernel_port(lens: list[list[int]], num_sms: int, atoms: int) -> list[list[int]]:
    """sched::smxx_paged_mqa_logits_metadata (non-varlen), one thread's loop body per SM."""
    batch = len(lens)
    next_n = len(lens[0])
    prefix: list[int] = []
    running = 0
    for row in lens:
        running = (running + (row[next_n - 1] + SPLIT_KV_TOKENS - 1) // SPLIT_KV_TOKENS) & U32
        prefix.append(running)
    total = (running * atoms) & U32
    q, r = total // num_sms, total % num_sms
    pivot = num_sms - r
    out = [[0, 0] for _ in range(num_sms + 1)]
    for sm_idx in range(num_sms):
        seg_starts = sm_idx * q + (sm_idx - pivot if sm_idx > pivot else 0)
        lo, hi = 0, batch
        while lo < hi:
            mid = (lo + hi) // 2
            if prefix[mid] * atoms <= seg_starts:
                lo = mid + 1
            else:
                hi = mid
        q_idx = min(lo, (batch - 1) & U32)
        offset_in_q = seg_starts if q_idx == 0 else seg_starts - prefix[q_idx - 1] * atoms
        num_segs_q = prefix[0] if q_idx == 0 else prefix[q_idx] - prefix[q_idx - 1]
        atom_idx = offset_in_q // num_segs_q if num_segs_q > 0 else 0
        kv_split_idx = offset_in_q % num_segs_q if num_segs_q > 0 else 0
        out[sm_idx] = [q_idx * atoms + atom_idx, kv_split_idx]
    out[num_sms] = [batch * atoms, 0]
    return out


def _segments(context_lens: torch.Tensor) -> list[int]:
    return [(int(v) + SPLIT_KV_TOKENS - 1) // SPLIT_KV_TOKENS for v in context_lens[:, -1]]


def _walk(schedule: list[list[int]], segs: list[int], atoms: int) -> list[list[tuple[int, int]]]:
    """Segments each slot processes, walking PagedMQALogitsScheduler.fetch_next_task in split units.

    Like the kernel, a cursor advances one split at a time and moves to the next atom once the split
    index reaches the atom's segment count; the slot stops exactly at the next slot's start cursor.
    """
    batch = len(segs)
    per_slot = []
    for slot in range(len(schedule) - 1):
        cur_q, cur_kv = schedule[slot]
        end_q, end_kv = schedule[slot + 1]
        done: list[tuple[int, int]] = []
        guard = 0
        while not (cur_q == end_q and cur_kv == end_kv):
            assert cur_q < batch * atoms, f"slot {slot} walked past the last atom"
            if cur_kv < segs[cur_q // atoms]:  # an empty request is fetched as a task with no KV work
                done.append((cur_q, cur_kv))
            cur_kv += 1
            if cur_kv >= segs[cur_q // atoms]:
                cur_kv, cur_q = 0, cur_q + 1
            guard += 1
            assert guard <= (sum(segs) + batch) * atoms + 1, f"slot {slot} never reaches its end cursor"
        per_slot.append(done)
    return per_slot


def _random_lens(rng: random.Random, batch: int, next_n: int, max_len: int) -> torch.Tensor:
    rows = []
    for _ in range(batch):
        kind = rng.random()
        last = 0 if kind < 0.05 else rng.randint(1, max_len)
        rows.append([rng.randint(0, max_len) for _ in range(next_n - 1)] + [last])
    return torch.tensor(rows, dtype=torch.int32)


# --------------------------------------------------------------------------- hand-computed


def test_hand_computed_even_split() -> None:
    # segments 1, 1, 2, 4 (prefix 1, 2, 4, 8); 8 over 4 slots = 2 each, starts 0, 2, 4, 6.
    lens = torch.tensor([[1], [256], [257], [1000]], dtype=torch.int32)
    assert plan_paged_mqa_schedule(lens, 64, 4).tolist() == [[0, 0], [2, 0], [3, 0], [3, 2], [4, 0]]


def test_hand_computed_remainder_goes_to_last_slots() -> None:
    # 8 over 3: q=2, r=2 -> slot 0 gets 2, slots 1 and 2 get 3 (starts 0, 2, 5).
    lens = torch.tensor([[1], [256], [257], [1000]], dtype=torch.int32)
    assert plan_paged_mqa_schedule(lens, 64, 3).tolist() == [[0, 0], [2, 0], [3, 1], [4, 0]]


def test_hand_computed_fewer_segments_than_slots() -> None:
    # 1 segment over 4 slots: q=0, r=1 -> all cursors at (0, 0); only the last slot has work.
    lens = torch.tensor([[1]], dtype=torch.int32)
    assert plan_paged_mqa_schedule(lens, 64, 4).tolist() == [[0, 0]] * 4 + [[1, 0]]


def test_hand_computed_all_empty_contexts_are_all_sentinels() -> None:
    # No segments: every row is one past the end (batch * atoms), so no slot runs a zero-KV task.
    lens = torch.zeros((3, 2), dtype=torch.int32)
    assert plan_paged_mqa_schedule(lens, 64, 2).tolist() == [[3, 0], [3, 0], [3, 0]]
    assert plan_paged_mqa_schedule(torch.zeros((3, 4), dtype=torch.int32), 64, 2, sm_major=10).tolist() == [[6, 0]] * 3


def test_hand_computed_sm100_next_n_atoms() -> None:
    # SM100 next_n=4 -> 2 atoms per request, each walking all segments: total = (1 + 2) * 2 = 6.
    lens = torch.tensor([[0, 0, 0, 200], [0, 0, 0, 300]], dtype=torch.int32)
    assert plan_paged_mqa_schedule(lens, 64, 3, sm_major=10).tolist() == [[0, 0], [2, 0], [3, 0], [4, 0]]
    # The same lens on SM90 are one atom per request: total 3 over 3 slots.
    assert plan_paged_mqa_schedule(lens, 64, 3, sm_major=9).tolist() == [[0, 0], [1, 0], [1, 1], [2, 0]]


def test_split_is_256_tokens_whatever_block_kv() -> None:
    lens = torch.tensor([[256], [257], [512], [513]], dtype=torch.int32)
    plan64 = plan_paged_mqa_schedule(lens, 64, 6)
    assert plan64.tolist() == plan_paged_mqa_schedule(lens, 32, 6).tolist()
    # segments 1, 2, 2, 3 = 8 over 6 slots: q=1, r=2 -> starts 0,1,2,3,4,6.
    assert plan64.tolist() == [[0, 0], [1, 0], [1, 1], [2, 0], [2, 1], [3, 1], [4, 0]]


# --------------------------------------------------------------------------- kernel port


@pytest.mark.parametrize("sm_major", [9, 10])
def test_matches_literal_kernel_port(sm_major: int) -> None:
    rng = random.Random(1234 + sm_major)
    for _ in range(300):
        batch = rng.randint(1, 40)
        next_n = rng.choice([1, 2, 3, 4])
        max_len = rng.choice([300, 5000, 131072])
        slots = rng.randint(1, 140)
        lens = _random_lens(rng, batch, next_n, max_len)
        expected = _kernel_port(lens.tolist(), slots, num_next_n_atoms(next_n, sm_major))
        got = plan_paged_mqa_schedule(lens, 64, slots, sm_major=sm_major)
        assert got.dtype == torch.int32 and tuple(got.shape) == (slots + 1, 2)
        assert got.tolist() == expected, (lens.tolist(), slots)


# --------------------------------------------------------------------------- invariants


@pytest.mark.parametrize("sm_major", [9, 10])
def test_invariants_every_segment_once_and_balanced(sm_major: int) -> None:
    rng = random.Random(99 + sm_major)
    for _ in range(150):
        batch = rng.randint(1, 24)
        next_n = rng.choice([1, 2, 4])
        slots = rng.randint(1, 70)
        lens = _random_lens(rng, batch, next_n, rng.choice([600, 20000]))
        atoms = num_next_n_atoms(next_n, sm_major)
        plan = plan_paged_mqa_schedule(lens, 64, slots, sm_major=sm_major).tolist()
        segs = _segments(lens)

        assert plan[slots] == [batch * atoms, 0]  # end fence
        assert all(plan[i] <= plan[i + 1] for i in range(slots)), "cursors not monotone"
        per_slot = _walk(plan, segs, atoms)
        flat = [seg for slot in per_slot for seg in slot]
        every = [(a, kv) for a in range(batch * atoms) for kv in range(segs[a // atoms])]
        assert flat == every, "segments not covered exactly once, in order"

        total = len(every)
        q, r = divmod(total, slots)
        sizes = [len(s) for s in per_slot]
        assert sizes == [q] * (slots - r) + [q + 1] * r


def test_only_last_next_n_column_is_read() -> None:
    base = torch.tensor([[5, 6, 7, 900], [1, 2, 3, 70000]], dtype=torch.int32)
    other = base.clone()
    other[:, :3] = torch.tensor([[99999, 0, 1], [0, 0, 0]], dtype=torch.int32)
    assert plan_paged_mqa_schedule(base, 64, 9).tolist() == plan_paged_mqa_schedule(other, 64, 9).tolist()
    longer = base.clone()
    longer[0, 3] = 5000
    assert plan_paged_mqa_schedule(base, 64, 9).tolist() != plan_paged_mqa_schedule(longer, 64, 9).tolist()


def test_runs_on_tensor_device_and_is_vectorized_for_large_batches() -> None:
    lens = torch.randint(0, 131072, (4096, 1), dtype=torch.int32)
    plan = plan_paged_mqa_schedule(lens, 64, 132)
    assert plan.device == lens.device and tuple(plan.shape) == (133, 2)
    assert plan[-1].tolist() == [4096, 0]


# --------------------------------------------------------------------------- slot rule


def test_schedule_slots_sm90_next_n_4_is_one_slot_per_cluster() -> None:
    assert schedule_slots(132, 4) == 66
    assert schedule_slots(131, 4) == 65
    assert schedule_slots(112, 4) == 56
    assert schedule_slots(2, 4) == 1
    assert num_kv_multicast(4) == 2 and num_kv_multicast(2) == 1
    for next_n in (1, 2, 3):
        assert schedule_slots(132, next_n) == 132
    assert schedule_slots(132, 4, sm_major=10) == 132
    assert schedule_slots(148, 4, sm_major=12) == 148


@pytest.fixture()
def vllm_capability(monkeypatch: pytest.MonkeyPatch) -> Callable[[int, int], None]:
    """Pretend the (absent) GPU has a compute capability; vLLM's own logic does the rest."""
    from vllm.platforms import current_platform
    from vllm.platforms.interface import DeviceCapability

    def set_capability(major: int, minor: int) -> None:
        cap = DeviceCapability(major, minor)
        monkeypatch.setattr(
            type(current_platform), "get_device_capability", classmethod(lambda cls, device_id=0: cap)
        )

    return set_capability


@pytest.mark.parametrize(("major", "minor"), [(9, 0), (10, 0), (12, 0)])
def test_slot_rule_matches_vllm_0_33(vllm_capability: Callable[[int, int], None], major: int, minor: int) -> None:
    import vllm.utils.deep_gemm as vdg

    vllm_capability(major, minor)
    for next_n in range(1, 9):
        for num_sms in (2, 3, 66, 112, 131, 132, 148):
            assert schedule_slots(num_sms, next_n, major) == vdg._paged_mqa_logits_schedule_slots(num_sms, next_n)


class FakeDeepGemmPlanner:
    """Stands in for DeepGEMM's planner (absent on CPU): records calls, answers with the reference.

    Twin: tests/gpu/test_reference_planner_gpu.py compares the reference with the real kernel.
    """

    def __init__(self) -> None:
        self.calls: list[tuple[int, int]] = []

    def __call__(self, context_lens: torch.Tensor, block_kv: int, num_sms: int) -> torch.Tensor:
        self.calls.append((block_kv, num_sms))
        return plan_paged_mqa_schedule(context_lens, block_kv, num_sms)


def test_vllm_wrapper_passes_slots_as_num_sms(
    vllm_capability: Callable[[int, int], None], monkeypatch: pytest.MonkeyPatch
) -> None:
    import vllm.utils.deep_gemm as vdg

    vllm_capability(9, 0)
    fake = FakeDeepGemmPlanner()
    monkeypatch.setattr(vdg, "_lazy_init", lambda: None)
    monkeypatch.setattr(vdg, "_get_paged_mqa_logits_metadata_impl", fake)
    lens = torch.tensor([[100, 101, 102, 103], [5000, 5001, 5002, 5003]], dtype=torch.int32)
    got = vdg.get_paged_mqa_logits_metadata(lens, 64, 112)
    assert fake.calls == [(64, 56)]
    assert got.tolist() == plan_paged_mqa_schedule(lens, 64, schedule_slots(112, 4)).tolist()
