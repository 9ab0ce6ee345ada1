"""GPU twin of tests/unit/test_schedule_cache.py and tests/vllm/test_indexer_hooks.py: real DeepGEMM, real CUDA graphs.

No vLLM on the GPU machine: the cache runs over ``dbo_runtime.adapters.deep_gemm.DeepGemmPlanner``,
which falls back to ``import deep_gemm`` and the SM90 ``next_n == 4`` slot rule of the adapter.

Shapes: GLM-5.3 indexer (32 heads x 128 dim, fp8 KV with fp32 scales, block 64), 13 requests with
contexts 1..32768; next_n 1, 2 and 4 (row j of request b sees ``L_b - next_n + j + 1`` tokens).
Correctness is bit-identity with the 132-SM reference on every valid column (a column is valid for
a row when it is below that row's context length); the logits kernel never writes the others.

Run on the GPU box (see tests/gpu/conftest.py):
    DBO_REQUIRE_GPU=1 python3 -m pytest tests/gpu/test_indexer_schedule_gpu.py -q
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import pytest
import torch

from dbo_runtime.adapters.cuda_graph import capture_id
from dbo_runtime.adapters.deep_gemm import DeepGemmPlanner, schedule_slots
from dbo_runtime.core.budget import compute_budget
from dbo_runtime.services.planner_warmup import PlannerProfile
from dbo_runtime.services.schedule_cache import IndexerScheduleCache
from dbo_runtime.services.sm_control import SMControl
from dbo_runtime.sim.backends import logits_options

HEADS, DIM, BLOCK = 32, 128, 64
CONTEXTS = [1, 7, 64, 65, 255, 256, 257, 1000, 4096, 8191, 16384, 30000, 32768]
MAX_CTX = 32768
BLOCKS_PER_REQ = MAX_CTX // BLOCK
LAYERS = 21
DBO_SMS = 112


@dataclass
class Case:
    """Persistent inputs (address-stable, as in a FULL graph); ``refresh`` rewrites them in place."""

    next_n: int
    q: torch.Tensor
    kv_cache: torch.Tensor
    weights: torch.Tensor
    context_lens: torch.Tensor
    block_table: torch.Tensor

    @property
    def batch(self) -> int:
        return int(self.context_lens.shape[0])

    def refresh(self, generator: torch.Generator, contexts: list[int] | None = None) -> None:
        if contexts is None:
            contexts = torch.randint(1, MAX_CTX + 1, (self.batch,), generator=generator).tolist()
        self.context_lens.copy_(_context_lens(contexts, self.next_n, self.context_lens.device))
        perm = torch.randperm(self.kv_cache.shape[0], generator=generator)[: self.batch * BLOCKS_PER_REQ]
        self.block_table.copy_(perm.view(self.batch, BLOCKS_PER_REQ).to(torch.int32))


def _context_lens(contexts: list[int], next_n: int, device: torch.device) -> torch.Tensor:
    last = torch.tensor(contexts, dtype=torch.int32)
    offs = torch.arange(next_n, dtype=torch.int32) - (next_n - 1)
    return (last[:, None] + offs[None, :]).clamp(min=1).contiguous().to(device)


def _make_case(next_n: int, device: torch.device, seed: int = 0) -> Case:
    gen = torch.Generator().manual_seed(seed)
    batch = len(CONTEXTS)
    num_blocks = batch * BLOCKS_PER_REQ + 64
    values = (torch.randn((num_blocks, BLOCK * DIM), generator=gen) * 0.5).to(torch.float8_e4m3fn)
    scales = torch.rand((num_blocks, BLOCK), generator=gen) + 0.5
    fused = torch.empty((num_blocks, BLOCK * (DIM + 4)), dtype=torch.uint8)
    fused[:, : BLOCK * DIM] = values.view(torch.uint8)
    fused[:, BLOCK * DIM :] = scales.contiguous().view(torch.uint8)
    kv_cache = fused.view(num_blocks, BLOCK, 1, DIM + 4).to(device)
    q = (torch.randn((batch, next_n, HEADS, DIM), generator=gen) * 0.5).to(torch.float8_e4m3fn).to(device)
    weights = torch.rand((batch * next_n, HEADS), generator=gen).to(device)
    case = Case(
        next_n,
        q,
        kv_cache,
        weights,
        torch.empty((batch, next_n), dtype=torch.int32, device=device),
        torch.empty((batch, BLOCKS_PER_REQ), dtype=torch.int32, device=device),
    )
    case.refresh(gen, CONTEXTS)
    return case


def _logits(dg: ModuleType, case: Case, schedule: torch.Tensor) -> torch.Tensor:
    return dg.fp8_fp4_paged_mqa_logits(
        (case.q, None),
        case.kv_cache,
        case.weights,
        case.context_lens,
        case.block_table,
        schedule,
        MAX_CTX,
        **logits_options(dg.fp8_fp4_paged_mqa_logits),
    )


def _valid_mask(case: Case) -> torch.Tensor:
    cols = torch.arange(MAX_CTX, device=case.context_lens.device)
    return cols[None, :] < case.context_lens.reshape(-1, 1)


def _mismatch(case: Case, got: torch.Tensor, ref: torch.Tensor) -> float:
    """Fraction of valid logits that differ bitwise (NaN-safe)."""
    mask = _valid_mask(case)
    same = got.view(torch.int32) == ref.view(torch.int32)
    bad = (~same & mask).sum().item()
    return float(bad) / float(mask.sum().item())


def _reference(dg: ModuleType, case: Case, planner: DeepGemmPlanner, total: int) -> torch.Tensor:
    dg.set_num_sms(total)
    out = _logits(dg, case, planner.plan(case.context_lens, BLOCK, total)).clone()
    torch.cuda.synchronize()
    return out


def _require_next_n(sm_major: int, next_n: int) -> None:
    if sm_major == 9 and next_n not in (1, 2, 4):
        pytest.skip(f"DeepGEMM SM90 has no native paged-MQA kernel for next_n={next_n}")


@pytest.fixture()
def planner(deep_gemm: ModuleType) -> DeepGemmPlanner:
    return DeepGemmPlanner()


@pytest.mark.parametrize("next_n", [1, 2, 4])
def test_kernel_table_reduced_sms(
    deep_gemm: ModuleType, planner: DeepGemmPlanner, cuda_device: torch.device, sm_major: int, next_n: int, out_dir: Any
) -> None:
    _require_next_n(sm_major, next_n)
    total = int(deep_gemm.get_num_sms())
    case = _make_case(next_n, cuda_device)
    ref = _reference(deep_gemm, case, planner, total)
    full = planner.plan(case.context_lens, BLOCK, total)
    assert full.shape[0] == schedule_slots(total, next_n) + 1

    deep_gemm.set_num_sms(DBO_SMS)
    with pytest.raises(Exception, match="_schedule_meta_size"):  # vLLM 0.33.0 under DBO
        _logits(deep_gemm, case, full)

    cache = IndexerScheduleCache(planner)
    cache.track(full, planned_sms=total, block_kv=BLOCK, next_n=next_n)
    fixed = cache.resolve(full, case.context_lens, None, BLOCK)
    assert fixed.shape[0] == schedule_slots(DBO_SMS, next_n) + 1
    got = _logits(deep_gemm, case, fixed)
    torch.cuda.synchronize()
    wrong = _mismatch(case, got, ref)
    if out_dir is not None:
        (out_dir / f"indexer_kernel_table_next_n{next_n}.json").write_text(
            json.dumps({"next_n": next_n, "total": total, "dbo_sms": DBO_SMS, "rows": int(fixed.shape[0]), "wrong": wrong})
        )
    print(f"indexer kernel table next_n={next_n}: rows {full.shape[0]}->{fixed.shape[0]}, wrong fraction {wrong}")
    assert wrong == 0.0


def test_one_replan_per_count_per_metadata(deep_gemm: ModuleType, planner: DeepGemmPlanner, cuda_device: torch.device) -> None:
    total = int(deep_gemm.get_num_sms())
    case = _make_case(1, cuda_device)
    cache = IndexerScheduleCache(planner)
    schedule = planner.plan(case.context_lens, BLOCK, total)
    cache.track(schedule, planned_sms=total, block_kv=BLOCK, next_n=1)
    assert cache.resolve(schedule, case.context_lens, None, BLOCK) is schedule
    deep_gemm.set_num_sms(DBO_SMS)
    first = [cache.resolve(schedule, case.context_lens, None, BLOCK) for _ in range(LAYERS)]
    assert all(f is first[0] for f in first) and cache.stats.replans == 1
    deep_gemm.set_num_sms(DBO_SMS - 2)  # someone else turned the knob: still seen
    other = cache.resolve(schedule, case.context_lens, None, BLOCK)
    assert other.shape[0] == DBO_SMS - 1 and cache.stats.replans == 2
    deep_gemm.set_num_sms(DBO_SMS)
    assert cache.resolve(schedule, case.context_lens, None, BLOCK) is first[0]
    deep_gemm.set_num_sms(total)
    assert cache.resolve(schedule, case.context_lens, None, BLOCK) is schedule
    assert cache.stats.replans == 2
    # A new build (new schedule object) is a new entry.
    rebuilt = planner.plan(case.context_lens, BLOCK, total)
    cache.track(rebuilt, planned_sms=total, block_kv=BLOCK, next_n=1)
    deep_gemm.set_num_sms(DBO_SMS)
    assert cache.resolve(rebuilt, case.context_lens, None, BLOCK) is not first[0]
    assert cache.stats.replans == 3


def _capture(fn: Any) -> tuple[torch.cuda.CUDAGraph, Any]:
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # eager warm-up on the side stream: JIT compiles happen here, never in the capture
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        out = fn()
    torch.cuda.synchronize()
    return graph, out


def test_capture_id_adapter(cuda_device: torch.device) -> None:
    assert capture_id() is None
    ids: list[int | None] = []
    for _ in range(2):
        graph = torch.cuda.CUDAGraph()
        x = torch.zeros(4, device=cuda_device)
        with torch.cuda.graph(graph):
            ids.append(capture_id())
            x.add_(1)
            ids.append(capture_id())
    assert ids[0] is not None and ids[0] == ids[1]
    assert ids[2] is not None and ids[2] == ids[3] and ids[2] != ids[0]


def test_graph_replans_inside_capture_and_replays_with_new_inputs(
    deep_gemm: ModuleType, planner: DeepGemmPlanner, cuda_device: torch.device, out_dir: Any
) -> None:
    total = int(deep_gemm.get_num_sms())
    case = _make_case(1, cuda_device, seed=1)
    cache = IndexerScheduleCache(planner)
    schedule = planner.plan(case.context_lens, BLOCK, total)  # the build, outside the graph, full GPU
    cache.track(schedule, planned_sms=total, block_kv=BLOCK, next_n=1)
    deep_gemm.set_num_sms(DBO_SMS)  # SM control is entered before the capture opens (both runners)

    def forward() -> torch.Tensor:
        out = None
        for _ in range(3):  # three indexer layers share one re-plan
            out = _logits(deep_gemm, case, cache.resolve(schedule, case.context_lens, None, BLOCK))
        assert out is not None
        return out

    captured_before = cache.stats.captured_replans
    graph, out = _capture(forward)
    assert cache.stats.captured_replans == captured_before + 1  # recorded once, reused by later layers
    gen = torch.Generator().manual_seed(7)
    worst = 0.0
    for _ in range(20):
        case.refresh(gen)
        graph.replay()
        torch.cuda.synchronize()
        got = out.clone()
        ref = _reference(deep_gemm, case, planner, total)
        deep_gemm.set_num_sms(DBO_SMS)
        worst = max(worst, _mismatch(case, got, ref))
    if out_dir is not None:
        (out_dir / "indexer_graph_replays.json").write_text(json.dumps({"replays": 20, "worst_wrong": worst}))
    print(f"indexer graph: 20 replays with new inputs, worst wrong fraction {worst}")
    assert worst == 0.0


def test_replay_after_build_for_other_count_is_correct(
    deep_gemm: ModuleType, planner: DeepGemmPlanner, cuda_device: torch.device, out_dir: Any
) -> None:
    """Plan-ahead wrote a 112-SM plan into the persistent buffer; a later build overwrites it for 132."""
    total = int(deep_gemm.get_num_sms())
    case = _make_case(1, cuda_device, seed=2)
    buffer = torch.zeros((total + 1, 2), dtype=torch.int32, device=cuda_device)  # builder.scheduler_metadata_buffer
    ahead = buffer[: DBO_SMS + 1]
    ahead.copy_(planner.plan(case.context_lens, BLOCK, DBO_SMS))
    cache = IndexerScheduleCache(planner)
    cache.track(ahead, planned_sms=DBO_SMS, block_kv=BLOCK, next_n=1, ahead=True)
    deep_gemm.set_num_sms(DBO_SMS)

    ours, ours_out = _capture(lambda: _logits(deep_gemm, case, cache.resolve(ahead, case.context_lens, None, BLOCK)))
    naive, naive_out = _capture(lambda: _logits(deep_gemm, case, ahead))  # what trusting the buffer records

    gen = torch.Generator().manual_seed(11)
    case.refresh(gen)
    deep_gemm.set_num_sms(total)
    buffer[: total + 1].copy_(planner.plan(case.context_lens, BLOCK, total))  # a non-DBO build, same buffer
    ours.replay()
    naive.replay()
    torch.cuda.synchronize()
    ref = _reference(deep_gemm, case, planner, total)
    ours_wrong = _mismatch(case, ours_out, ref)
    naive_wrong = _mismatch(case, naive_out, ref)
    if out_dir is not None:
        (out_dir / "indexer_replay_safety.json").write_text(
            json.dumps({"cache_wrong": ours_wrong, "naive_graph_wrong": naive_wrong})
        )
    print(f"indexer replay safety: cache {ours_wrong}, naive graph {naive_wrong} (measured hazard ~0.16)")
    assert ours_wrong == 0.0


class _CountingPlanner(DeepGemmPlanner):
    """The real planner, counting host-side planner launches."""

    def __init__(self) -> None:
        super().__init__()
        self.launches = 0

    def plan(self, context_lens: Any, block_kv: int, num_sms: int, indices: Any | None = None) -> Any:
        self.launches += 1
        return super().plan(context_lens, block_kv, num_sms, indices)


def test_replay_after_deferred_build_is_correct(deep_gemm: ModuleType, cuda_device: torch.device, out_dir: Any) -> None:
    """A plan-ahead build launches no planner (``track_deferred``) and leaves the
    builder buffer as it was. The graph records its own planner, so every replay is correct whatever the
    buffer holds (here: a later non-DBO build's 132-SM plan), and each FULL-graph step (build + replay)
    launches no host planner; an eager step plans the schedule before its first kernel, bit for bit."""
    planner = _CountingPlanner()
    total = int(deep_gemm.get_num_sms())
    case = _make_case(1, cuda_device, seed=4)
    buffer = torch.zeros((total + 1, 2), dtype=torch.int32, device=cuda_device)  # builder.scheduler_metadata_buffer
    rows = schedule_slots(DBO_SMS, 1) + 1
    cache = IndexerScheduleCache(planner)

    def deferred_build() -> torch.Tensor:
        view = buffer[:rows]
        cache.track_deferred(view, planned_sms=DBO_SMS, block_kv=BLOCK, next_n=1, context_lens=case.context_lens, indices=None)
        return view

    deep_gemm.set_num_sms(DBO_SMS)
    schedule = deferred_build()
    graph, out = _capture(lambda: _logits(deep_gemm, case, cache.resolve(schedule, case.context_lens, None, BLOCK)))
    assert cache.stats.captured_replans == 1  # the graph's own planner

    from tests.copy_counter import CopyCounter

    gen = torch.Generator().manual_seed(17)
    worst, launches, copies = 0.0, [], []
    for _ in range(10):
        case.refresh(gen)
        buffer[: total + 1].copy_(DeepGemmPlanner().plan(case.context_lens, BLOCK, total))  # a non-DBO build
        before = planner.launches
        with CopyCounter([buffer]) as counter:
            deferred_build()  # vLLM rebuilds every step before it replays
            graph.replay()
        launches.append(planner.launches - before)
        copies.append(counter.into_targets)
        torch.cuda.synchronize()
        got = out.clone()
        worst = max(worst, _mismatch(case, got, _reference(deep_gemm, case, DeepGemmPlanner(), total)))
        deep_gemm.set_num_sms(DBO_SMS)
    assert launches == [0] * 10 and copies == [0] * 10  # a FULL-graph step copies nothing into the schedule

    eager = deferred_build()  # an eager DBO step on the same builder
    before = planner.launches
    with CopyCounter([buffer]) as counter:
        first = cache.resolve(eager, case.context_lens, None, BLOCK)
        got = _logits(deep_gemm, case, first)
        for _ in range(20):  # the step's other indexer layers (GLM-5.3: 21 per microbatch) take the fast path
            assert cache.resolve(eager, case.context_lens, None, BLOCK) is eager
    torch.cuda.synchronize()
    assert first is eager and planner.launches == before + 1
    assert counter.into_targets == 1, f"schedule copies in an eager step of 21 layers: {counter.into_targets}"
    assert torch.equal(eager, DeepGemmPlanner().plan(case.context_lens, BLOCK, DBO_SMS))
    eager_wrong = _mismatch(case, got, _reference(deep_gemm, case, DeepGemmPlanner(), total))
    if out_dir is not None:
        (out_dir / "indexer_deferred_replay.json").write_text(
            json.dumps({"replays": 10, "worst_wrong": worst, "host_planners_per_replay_step": launches,
                        "schedule_copies_per_replay_step": copies, "eager_wrong": eager_wrong})
        )
    print(f"deferred plan-ahead: 10 replays worst wrong {worst}, host planners per replay step {launches}, eager wrong {eager_wrong}")
    assert worst == 0.0 and eager_wrong == 0.0


def test_announced_budget_warms_planner_outside_capture(
    deep_gemm: ModuleType, planner: DeepGemmPlanner, cuda_device: torch.device
) -> None:
    total = int(deep_gemm.get_num_sms())
    cache = IndexerScheduleCache(planner)
    control = SMControl(cuda_device.index or 0, total)
    cache.attach(control)
    cache.warmup.register_profile(control.device, PlannerProfile(device=cuda_device, block_kv=BLOCK, shapes=((20, 1), (64, 1), (20, 4), (40, 4))))
    budget = compute_budget(
        total_sms=total, platform="cuda", enable_dbo=True, expert_parallel=True, all2all_backend="deepep_high_throughput"
    )
    control.announce(budget)
    torch.cuda.synchronize()
    with cache.microbatched_build():
        assert cache.plan_ahead_sms(control.device) == total - 20
    distinct_slots = {schedule_slots(total - 20, 1), schedule_slots(total - 20, 4)}  # SM90: 112 and 56
    assert cache.stats.warmups == 2 * len(distinct_slots)  # batch buckets 32 and 64


def test_capture_counter_with_real_graph(
    deep_gemm: ModuleType, planner: DeepGemmPlanner, cuda_device: torch.device
) -> None:
    """Twin of tests/unit/test_capture_counter.py: with the plugin's capture counter installed, the
    fast path still records the re-plan inside a real capture (the replay-safety case) and skips
    the capture probe outside it."""
    from dbo_runtime.adapters.cuda_graph import CAPTURES
    from dbo_runtime.integration import capture_hooks
    from dbo_runtime.integration.patching import PatchSet

    patches = PatchSet(capture_hooks.patches())
    patches.install()
    try:
        total = int(deep_gemm.get_num_sms())
        case = _make_case(1, cuda_device, seed=3)
        buffer = torch.zeros((total + 1, 2), dtype=torch.int32, device=cuda_device)
        ahead = buffer[: DBO_SMS + 1]
        ahead.copy_(planner.plan(case.context_lens, BLOCK, DBO_SMS))
        cache = IndexerScheduleCache(planner)
        cache.track(ahead, planned_sms=DBO_SMS, block_kv=BLOCK, next_n=1, ahead=True)
        deep_gemm.set_num_sms(DBO_SMS)
        assert CAPTURES.installed and CAPTURES.active == 0
        assert cache.resolve(ahead, case.context_lens, None, BLOCK) is ahead  # eager: planned tensor, no probe
        seen_active: list[int] = []

        def forward() -> torch.Tensor:
            seen_active.append(CAPTURES.active)
            return _logits(deep_gemm, case, cache.resolve(ahead, case.context_lens, None, BLOCK))

        graph, out = _capture(forward)
        # _capture runs forward once eagerly (warm-up, no capture) and once inside the capture.
        assert seen_active == [0, 1] and CAPTURES.active == 0
        assert cache.stats.captured_replans == 1
        gen = torch.Generator().manual_seed(13)
        case.refresh(gen)
        deep_gemm.set_num_sms(total)
        buffer[: total + 1].copy_(planner.plan(case.context_lens, BLOCK, total))  # a non-DBO build overwrote it
        graph.replay()
        torch.cuda.synchronize()
        assert _mismatch(case, out, _reference(deep_gemm, case, planner, total)) == 0.0
    finally:
        patches.uninstall()
    assert not CAPTURES.installed
