"""IndexerScheduleCache on CPU, with the DeepGEMM boundary fake (tests/fakes/fake_deep_gemm.py).

No vLLM import: the service must work without it. The fake performs DeepGEMM's host assertion,
so "the logits call succeeds" below is a real check of the rows the cache handed over. GPU twin:
tests/gpu/test_indexer_schedule_gpu.py (real DeepGEMM, real CUDA graphs).
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

from dbo_runtime.core.budget import compute_budget
from dbo_runtime.core.errors import ConfigError
from dbo_runtime.core.planner_shapes import align_batch, aligned_buckets, dbo_planner_shapes, ubatch_split
from dbo_runtime.core.settings import WARM_MAX_BATCH_ENV, warm_max_batch, warm_policy
from dbo_runtime.services.planner_warmup import PlannerProfile
from dbo_runtime.services.schedule_cache import STATE_ATTR, IndexerScheduleCache
from dbo_runtime.sim.sm_scope import SMControl
from tests.fakes.fake_deep_gemm import FakeDeepGemm, FakeSchedulePlanner

BLOCK = 64
LAYERS = 21


def _lens(next_n: int = 1, batch: int = 13) -> torch.Tensor:
    # GLM-5.3 indexer case: 13 requests with contexts 1..32768; row j of request b sees L_b - next_n + j + 1.
    last = torch.tensor([1, 7, 64, 65, 255, 256, 257, 1000, 4096, 8191, 16384, 30000, 32768][:batch], dtype=torch.int32)
    offs = torch.arange(next_n, dtype=torch.int32) - (next_n - 1)
    return (last[:, None] + offs[None, :]).clamp(min=1).contiguous()


def _setup(next_n: int = 1, sm_major: int = 9) -> tuple[FakeDeepGemm, FakeSchedulePlanner, IndexerScheduleCache]:
    dg = FakeDeepGemm(total_sms=132, sm_major=sm_major)
    planner = FakeSchedulePlanner(dg)
    return dg, planner, IndexerScheduleCache(planner)


def _build(
    cache: IndexerScheduleCache, planner: FakeSchedulePlanner, lens: torch.Tensor, sms: int
) -> torch.Tensor:
    """What the patched builder does: plan for ``sms`` and record it."""
    schedule = planner.plan(lens, BLOCK, sms)
    cache.track(schedule, planned_sms=sms, block_kv=BLOCK, next_n=int(lens.shape[1]))
    return schedule


def _logits(dg: FakeDeepGemm, lens: torch.Tensor, schedule: torch.Tensor) -> torch.Tensor:
    return dg.fp8_fp4_paged_mqa_logits(None, torch.empty(0), torch.empty(0), lens, torch.empty(0), schedule, 8)


def test_fake_raises_deepgemm_assertion_without_cache() -> None:
    dg, planner, cache = _setup()
    lens = _lens()
    schedule = _build(cache, planner, lens, 132)
    dg.set_num_sms(112)
    with pytest.raises(RuntimeError, match="_schedule_meta_size == num_sms"):
        _logits(dg, lens, schedule)


def test_unchanged_count_returns_planned_tensor_without_kernel() -> None:
    dg, planner, cache = _setup()
    lens = _lens()
    schedule = _build(cache, planner, lens, 132)
    calls = len(dg.plan_calls)
    for _ in range(LAYERS):
        assert cache.resolve(schedule, lens, None, BLOCK) is schedule
    assert len(dg.plan_calls) == calls
    assert cache.stats.replans == 0


def test_replans_once_per_count_and_reuses_across_layers() -> None:
    dg, planner, cache = _setup()
    lens = _lens()
    schedule = _build(cache, planner, lens, 132)
    dg.set_num_sms(112)
    got = [cache.resolve(schedule, lens, None, BLOCK) for _ in range(LAYERS)]
    assert all(g is got[0] for g in got)
    assert tuple(got[0].shape) == (113, 2)
    assert cache.stats.replans == 1
    assert dg.plan_calls[-1][0] == 112
    _logits(dg, lens, got[0])  # the fake's DeepGEMM assertion accepts it
    assert torch.equal(got[0], planner.plan(lens, BLOCK, 112))

    dg.set_num_sms(110)
    other = cache.resolve(schedule, lens, None, BLOCK)
    assert tuple(other.shape) == (111, 2) and cache.stats.replans == 2
    dg.set_num_sms(112)
    assert cache.resolve(schedule, lens, None, BLOCK) is got[0]
    assert cache.stats.replans == 2
    dg.set_num_sms(132)
    assert cache.resolve(schedule, lens, None, BLOCK) is schedule


def test_external_set_num_sms_is_seen_at_call_site() -> None:
    """Nothing but DeepGEMM's live count is consulted: no SMControl involved at all."""
    dg, planner, cache = _setup()
    lens = _lens()
    schedule = _build(cache, planner, lens, 132)
    dg.set_num_sms(96)
    out = cache.resolve(schedule, lens, None, BLOCK)
    assert tuple(out.shape) == (97, 2)
    _logits(dg, lens, out)


def test_invalidate_drops_replans_and_new_build_is_new_entry() -> None:
    dg, planner, cache = _setup()
    lens = _lens()
    schedule = _build(cache, planner, lens, 132)
    dg.set_num_sms(112)
    first = cache.resolve(schedule, lens, None, BLOCK)
    # update_draft_decode_metadata rewrites seq_lens in place, then the schedule in place.
    lens.fill_(300)
    schedule.copy_(planner.plan(lens, BLOCK, 132))
    cache.invalidate(schedule)
    state = cache.state_of(schedule)
    assert state is not None and state.generation == 1 and not state.replans
    second = cache.resolve(schedule, lens, None, BLOCK)
    assert second is not first
    assert torch.equal(second, planner.plan(lens, BLOCK, 112))
    assert cache.stats.replans == 2 and cache.stats.invalidations == 1

    rebuilt = _build(cache, planner, lens, 132)
    assert cache.state_of(rebuilt) is not state
    cache.resolve(rebuilt, lens, None, BLOCK)
    assert cache.stats.replans == 3


def test_sm90_next_n4_rows_come_from_the_rule_not_the_shape() -> None:
    dg, planner, cache = _setup(sm_major=9)
    lens = _lens(next_n=4)
    schedule = _build(cache, planner, lens, 132)
    assert tuple(schedule.shape) == (67, 2)  # 132 // 2 + 1
    # Inferring "66 SMs" from 67 rows would re-plan here; the recorded count says no.
    assert cache.resolve(schedule, lens, None, BLOCK) is schedule
    dg.set_num_sms(112)
    out = cache.resolve(schedule, lens, None, BLOCK)
    assert tuple(out.shape) == (57, 2)
    _logits(dg, lens, out)
    # 113 and 112 SMs are both 56 slots: the schedule is the same, no re-plan needed.
    at_113 = _build(cache, planner, lens, 113)
    calls = len(dg.plan_calls)
    assert cache.resolve(at_113, lens, None, BLOCK) is at_113
    assert len(dg.plan_calls) == calls


def test_sm100_next_n4_keeps_one_slot_per_sm() -> None:
    dg, planner, cache = _setup(sm_major=10)
    lens = _lens(next_n=4)
    schedule = _build(cache, planner, lens, 132)
    assert tuple(schedule.shape) == (133, 2)
    dg.set_num_sms(112)
    assert tuple(cache.resolve(schedule, lens, None, BLOCK).shape) == (113, 2)


def test_untracked_schedule_passes_when_rows_match_and_replans_when_not() -> None:
    dg, planner, cache = _setup()
    lens = _lens()
    loose = planner.plan(lens, BLOCK, 132)
    assert not hasattr(loose, STATE_ATTR)
    assert cache.resolve(loose, lens, None, BLOCK) is loose
    dg.set_num_sms(112)
    kv_cache = torch.empty((4, BLOCK, 1, 132), dtype=torch.uint8)  # block size read from kv_cache.shape[1]
    out = cache.resolve(loose, lens, None, kv_cache)
    assert tuple(out.shape) == (113, 2) and dg.plan_calls[-1][1] == BLOCK
    assert cache.stats.untracked_replans == 1 and cache.stats.replans == 0


def test_capture_records_planner_even_when_counts_match() -> None:
    dg, planner, cache = _setup()
    lens = _lens()
    schedule = planner.plan(lens, BLOCK, 112)  # planned ahead for the DBO count, outside the graph
    cache.track(schedule, planned_sms=112, block_kv=BLOCK, next_n=1, ahead=True)
    dg.set_num_sms(112)
    planner.capturing_now, planner.current_capture = True, 7
    got = [cache.resolve(schedule, lens, None, BLOCK) for _ in range(LAYERS)]
    assert got[0] is not schedule  # the persistent buffer may hold another count at replay
    assert all(g is got[0] for g in got)  # one planner per capture, reused by later layers
    assert cache.stats.captured_replans == 1 and cache.stats.replans == 0
    planner.current_capture = 8  # a different graph must not read graph 7's pool tensor
    assert cache.resolve(schedule, lens, None, BLOCK) is not got[0]
    assert cache.stats.captured_replans == 2
    planner.current_capture = None  # capture identity unknown: record every time
    cache.resolve(schedule, lens, None, BLOCK)
    cache.resolve(schedule, lens, None, BLOCK)
    assert cache.stats.captured_replans == 4
    planner.capturing_now = False
    assert cache.resolve(schedule, lens, None, BLOCK) is schedule


def test_capture_reads_builder_schedule_directly_when_its_own_count_is_in_force() -> None:
    """A non-DBO FULL graph (or DBO with partitioning off): every replay follows a build for the same
    count into the same buffer, so no planner kernel is recorded (upstream replays stay unchanged)."""
    dg, planner, cache = _setup()
    lens = _lens()
    schedule = _build(cache, planner, lens, 132)
    planner.capturing_now, planner.current_capture = True, 9
    launches = len(dg.plan_calls)
    assert all(cache.resolve(schedule, lens, None, BLOCK) is schedule for _ in range(LAYERS))
    assert len(dg.plan_calls) == launches and cache.stats.captured_replans == 0
    assert cache.stats.capture_consistent == LAYERS
    dg.set_num_sms(112)  # a DBO capture reading a schedule planned for the whole GPU: recorded
    assert cache.resolve(schedule, lens, None, BLOCK) is not schedule
    assert cache.stats.captured_replans == 1


def _dbo_budget() -> object:
    return compute_budget(
        total_sms=132, platform="cuda", enable_dbo=True, expert_parallel=True, all2all_backend="deepep_high_throughput"
    )


def test_plan_ahead_uses_announced_dbo_budget_only_inside_microbatched_build() -> None:
    _, _, cache = _setup()
    control = SMControl(0, 132)
    cache.attach(control)
    assert cache.plan_ahead_sms(0) is None
    control.announce(_dbo_budget())  # type: ignore[arg-type]
    assert cache.plan_ahead_sms(0) is None  # a non-microbatched step plans for the whole GPU
    seen: list[int | None] = []
    with cache.microbatched_build():
        assert cache.plan_ahead_sms(0) == 112
        assert cache.plan_ahead_sms(1) is None
        worker = threading.Thread(target=lambda: seen.append(cache.plan_ahead_sms(0)))
        worker.start()
        worker.join()
    assert seen == [None]  # the flag is per thread
    assert cache.plan_ahead_sms(0) is None


def test_no_plan_ahead_for_budget_without_compute_knob() -> None:
    _, _, cache = _setup()
    control = SMControl(0, 132)
    cache.attach(control)
    low_latency = compute_budget(
        total_sms=132, platform="cuda", enable_dbo=True, expert_parallel=True, all2all_backend="deepep_low_latency",
        max_sms_used=0,  # DeepEPLLAll2AllManager.max_sms_used()
    )
    control.announce(low_latency)
    with cache.microbatched_build():
        assert cache.plan_ahead_sms(0) is None


def test_a_later_engine_without_compute_knob_ends_an_earlier_engines_plan_ahead() -> None:
    # Two engines in one process (an HT engine, then an LL one): the second leaves DeepGEMM's count at 132, so
    # planning its microbatched builds for the first engine's 112 would re-plan at every call site.
    _, _, cache = _setup()
    control = SMControl(0, 132)
    cache.attach(control)
    control.announce(_dbo_budget())  # type: ignore[arg-type]
    with cache.microbatched_build():
        assert cache.plan_ahead_sms(0) == 112
    low_latency = compute_budget(
        total_sms=132, platform="cuda", enable_dbo=True, expert_parallel=True, all2all_backend="deepep_low_latency",
        max_sms_used=0,
    )
    control.announce(low_latency)
    with cache.microbatched_build():
        assert cache.plan_ahead_sms(0) is None
    late_dg = FakeDeepGemm(total_sms=132)
    late = IndexerScheduleCache(FakeSchedulePlanner(late_dg))
    late.warmup.register_profile(0, PlannerProfile(device="cpu", block_kv=BLOCK, shapes=((32, 1),)))
    late.attach(control)  # a subscriber told both announcements ends where the live one did, and warms no 112
    with late.microbatched_build():
        assert late.plan_ahead_sms(0) is None
    assert late_dg.plan_calls == [] and late.stats.warmups == 0
    control.announce(_dbo_budget())  # type: ignore[arg-type]  # the HT engine again: the latest announcement wins
    later = IndexerScheduleCache(FakeSchedulePlanner(FakeDeepGemm(total_sms=132)))
    later.attach(control)
    with later.microbatched_build():
        assert later.plan_ahead_sms(0) == 112
    with cache.microbatched_build():
        assert cache.plan_ahead_sms(0) == 112


def test_steady_state_plan_ahead_needs_zero_replans_upstream_needs_one_per_step() -> None:
    dg, planner, cache = _setup()
    control = SMControl(0, 132)
    cache.attach(control)
    budget = _dbo_budget()
    control.announce(budget)  # type: ignore[arg-type]

    def step(plan_ahead: bool) -> None:
        for ubatch in range(2):  # each microbatch has its own builder and schedule
            lens = _lens(batch=6 + ubatch)
            with cache.microbatched_build():
                sms = (cache.plan_ahead_sms(0) if plan_ahead else None) or 132
                schedule = _build(cache, planner, lens, sms)
            with control.partition(budget, compute_knob=FakeKnob(dg)):  # type: ignore[arg-type]
                for _ in range(LAYERS):
                    _logits(dg, lens, cache.resolve(schedule, lens, None, BLOCK))

    before = cache.stats.replans
    for _ in range(5):
        step(plan_ahead=True)
    assert cache.stats.replans == before
    for _ in range(5):
        step(plan_ahead=False)
    assert cache.stats.replans == before + 5 * 2


class FakeKnob:
    """Fake for the DeepGEMM SM knob (GPU twin: tests/gpu/test_sm_control_gpu.py)."""

    name = "fake deep_gemm.set_num_sms"

    def __init__(self, dg: FakeDeepGemm) -> None:
        self.dg = dg

    def set(self, num_sms: int) -> None:
        self.dg.set_num_sms(num_sms)


def test_warm_up_on_announce_and_on_late_profile() -> None:
    dg, _planner, cache = _setup()
    control = SMControl(0, 132)
    cache.attach(control)
    shapes = ((5, 1), (30, 1), (33, 1), (70, 1), (70, 4), (96, 4))
    profile = PlannerProfile(device="cpu", block_kv=BLOCK, shapes=shapes)
    cache.warmup.register_profile(0, profile)
    assert dg.plan_calls == []  # nothing announced yet: nothing to warm
    control.announce(_dbo_budget())  # type: ignore[arg-type]
    # one launch per compiled variant: aligned batch x slots (112 for next_n 1, 56 for SM90 next_n 4)
    assert sorted((c[0], c[2]) for c in dg.plan_calls) == sorted(
        [(112, (32, 1)), (112, (64, 1)), (112, (96, 1)), (56, (96, 4))]
    )
    assert cache.stats.warmups == 4
    control.announce(_dbo_budget())  # type: ignore[arg-type]
    assert cache.stats.warmups == 4  # already compiled: not again

    dg2, _planner2, late = _setup()
    control2 = SMControl(0, 132)
    control2.announce(_dbo_budget())  # type: ignore[arg-type]
    late.attach(control2)  # subscribe after the announce: replayed
    assert dg2.plan_calls == []
    late.warmup.register_profile(0, PlannerProfile(device="cpu", block_kv=BLOCK, shapes=((32, 1),)))
    assert [c[0] for c in dg2.plan_calls] == [112]


def test_warm_up_never_inside_capture_nor_inside_a_step_for_an_unannounced_budget() -> None:
    """Inside a capture a JIT compile would be fatal; a budget nobody announced is entered inside a live step,
    where the DP peers wait in all-to-all: the call site compiles only what it needs there."""
    dg, planner, cache = _setup()
    control = SMControl(0, 132)
    cache.attach(control)
    cache.warmup.register_profile(0, PlannerProfile(device="cpu", block_kv=BLOCK, shapes=((32, 1),)))
    planner.capturing_now = True
    control.announce(_dbo_budget())  # type: ignore[arg-type]
    assert dg.plan_calls == [] and cache.stats.warm_skipped_in_capture == 1
    planner.capturing_now = False
    other = compute_budget(
        total_sms=132,
        platform="cuda",
        enable_dbo=True,
        expert_parallel=True,
        all2all_backend="deepep_high_throughput",
        env_comm_sms=22,
    )
    with control.partition(other, compute_knob=FakeKnob(dg)):
        pass
    assert dg.plan_calls == []


@pytest.mark.parametrize(("raw", "batches"), [(None, [512]), ("0", []), ("64", [32, 64, 512])])
def test_warm_sweep_env(monkeypatch: pytest.MonkeyPatch, raw: str | None, batches: list[int]) -> None:
    """Unset: exactly the profile's shapes; N: also every bucket up to N; 0: no warm-up."""
    if raw is None:
        monkeypatch.delenv(WARM_MAX_BATCH_ENV, raising=False)
    else:
        monkeypatch.setenv(WARM_MAX_BATCH_ENV, raw)
    assert warm_max_batch() == (None if raw is None else int(raw))
    dg, _planner, cache = _setup()
    cache.warmup.register_profile(0, PlannerProfile(device="cpu", block_kv=BLOCK, shapes=((512, 1),)))
    control = SMControl(0, 132)
    cache.attach(control)
    control.announce(_dbo_budget())  # type: ignore[arg-type]
    assert sorted(c[2][0] for c in dg.plan_calls) == batches
    monkeypatch.setenv(WARM_MAX_BATCH_ENV, "many")
    with pytest.raises(ConfigError, match=WARM_MAX_BATCH_ENV):
        warm_max_batch()


@pytest.mark.parametrize("raw", ["1_000", "+64", "-1", "\uff16\uff14", "64 rows"])
def test_warm_sweep_env_takes_plain_digits_only(monkeypatch: pytest.MonkeyPatch, raw: str) -> None:
    """``int()`` also reads ``1_000``, ``+64`` and full-width digits: one error names the value and the range."""
    monkeypatch.setenv(WARM_MAX_BATCH_ENV, raw)
    with pytest.raises(ConfigError, match=f"{WARM_MAX_BATCH_ENV}=.*allowed values: a non-negative integer, digits only"):
        warm_max_batch()


def test_a_warm_sweep_cap_above_the_largest_decode_step_warms_up_to_it(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A cap no step can reach would compile planners for minutes at start (1-2 s each, cold): warm up to the
    engine's largest decode step instead, and say so once with the range that applies."""
    import logging

    monkeypatch.setenv(WARM_MAX_BATCH_ENV, "100000000")
    profile = PlannerProfile(device="cpu", block_kv=BLOCK, shapes=((128, 1),), max_rows=256)
    with caplog.at_level(logging.WARNING):
        shapes = profile.warm_shapes(warm_policy(), dbo=True)
        profile.warm_shapes(warm_policy(), dbo=False)
    assert shapes == [(128, 1)] + [(rows, 1) for rows in range(32, 257, 32)]
    lines = [r.getMessage() for r in caplog.records if WARM_MAX_BATCH_ENV in r.getMessage()]
    assert len(lines) == 1 and "warming up to 256; allowed values: 0 to 256" in lines[0], lines


def test_a_bad_warm_sweep_env_is_logged_once_and_read_as_unset(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """``warm`` runs inside every DBO step's ``entered`` publish until a count is warm; a raise there would
    log a traceback per step (the SM control catches subscriber errors) and warm nothing. So: one warning,
    and the exact shapes are warmed as when unset."""
    import logging

    monkeypatch.setenv(WARM_MAX_BATCH_ENV, "many")
    dg, _planner, cache = _setup()
    cache.warmup.register_profile(0, PlannerProfile(device="cpu", block_kv=BLOCK, shapes=((512, 1),)))
    control = SMControl(0, 132)
    cache.attach(control)
    with caplog.at_level(logging.WARNING):
        control.announce(_dbo_budget())  # type: ignore[arg-type]
        cache.warmup.warm(0, 100)
    assert sorted({c[2][0] for c in dg.plan_calls}) == [512]
    lines = [r.getMessage() for r in caplog.records if WARM_MAX_BATCH_ENV in r.getMessage()]
    assert len(lines) == 1 and "read as unset" in lines[0], lines
    assert control.stats.subscriber_errors == 0


def test_aligned_buckets() -> None:
    assert aligned_buckets(1) == [32]
    assert aligned_buckets(32) == [32]
    assert aligned_buckets(33) == [32, 64]
    with pytest.raises(ConfigError, match="max_batch"):
        aligned_buckets(0)


def test_warm_returns_at_once_when_the_count_is_already_warm() -> None:
    """SMControl publishes 'entered' every DBO step; a warm count must cost no probe or bucket walk."""
    _dg, planner, cache = _setup()
    cache.warmup.register_profile(0, PlannerProfile(device="cpu", block_kv=BLOCK, shapes=((32, 1), (64, 1))))
    assert cache.warmup.warm(0, 112) == 2  # buckets 32 and 64
    probes = []
    planner.capturing = lambda: probes.append(1) or False  # type: ignore[method-assign]
    for _ in range(10):
        assert cache.warmup.warm(0, 112) == 0
    assert probes == []
    cache.warmup.register_profile(0, PlannerProfile(device="cpu", block_kv=BLOCK, shapes=((32, 2),)))
    assert cache.warmup.warm(0, 112) == 0 and len(probes) == 1  # new profile: walked again (already warm)


class FailingJit(FakeSchedulePlanner):
    """A planner whose DeepGEMM JIT compile fails on every call."""

    calls = 0

    def plan(self, context_lens: Any, block_kv: int, num_sms: int, indices: Any | None = None) -> Any:
        FailingJit.calls += 1
        raise RuntimeError("DeepGEMM JIT: nvcc failed")


def test_a_failing_warm_up_neither_raises_at_model_load_nor_retries_every_step() -> None:
    """The warm-up is optional work at model load: a planner that fails to compile must not stop the
    engine, and the failed variants are not tried again in every DBO step's ``entered`` publish."""
    FailingJit.calls = 0

    def budget() -> Any:
        return compute_budget(
            total_sms=132, platform="cuda", enable_dbo=True, expert_parallel=True, all2all_backend="deepep_high_throughput",
            env_comm_sms=None, has_all2all_manager=True, max_sms_used=20, has_deep_gemm=True, device=0,
        )  # fmt: skip

    control = SMControl(0, 132)
    cache = IndexerScheduleCache(FailingJit(FakeDeepGemm(total_sms=132)))
    cache.attach(control)
    control.announce(budget())
    cache.warmup.register_profile(0, PlannerProfile(device="cpu", block_kv=64, shapes=((32, 1), (64, 1))))  # model load: no raise
    first = FailingJit.calls
    assert first == 2 and cache.stats.warm_failures == 2 and cache.stats.warmups == 0
    for _ in range(3):
        with control.partition(budget()):
            pass
    assert FailingJit.calls == first  # not retried per DBO step
    assert control.stats.subscriber_errors == 0


# -- deferred plan-ahead ---------------------------------------------------------------


def _deferred_build(
    cache: IndexerScheduleCache, planner: FakeSchedulePlanner, lens: torch.Tensor, sms: int, buffer: torch.Tensor
) -> torch.Tensor:
    """What the patched builder does for a plan-ahead build: no planner, its buffer's rows, the inputs recorded."""
    schedule = buffer[: planner.slots(sms, int(lens.shape[1])) + 1]
    cache.track_deferred(schedule, planned_sms=sms, block_kv=BLOCK, next_n=int(lens.shape[1]), context_lens=lens, indices=None)
    return schedule


@pytest.mark.parametrize("next_n", [1, 4])
def test_deferred_plan_runs_once_at_the_first_eager_call_site(next_n: int) -> None:
    dg, planner, cache = _setup()
    lens = _lens(next_n)
    buffer = torch.full((133, 2), -7, dtype=torch.int32)  # stale contents: a replay must never need them
    schedule = _deferred_build(cache, planner, lens, 112, buffer)
    assert dg.plan_calls == [] and (schedule == -7).all()  # the build launched nothing
    dg.set_num_sms(112)
    got = [cache.resolve(schedule, lens, None, BLOCK) for _ in range(LAYERS)]
    assert all(g is schedule for g in got)  # planned into the build's own tensor, read by every layer
    assert len(dg.plan_calls) == 1 and cache.stats.deferred_plans == 1 and cache.stats.replans == 0
    assert torch.equal(schedule, planner.plan(lens, BLOCK, 112))  # exactly the plan the build would have made
    _logits(dg, lens, schedule)  # DeepGEMM's host assertion passes


def test_deferred_plan_inside_capture_records_the_graphs_own_planner() -> None:
    dg, planner, cache = _setup()
    lens = _lens()
    buffer = torch.full((133, 2), -7, dtype=torch.int32)
    schedule = _deferred_build(cache, planner, lens, 112, buffer)
    dg.set_num_sms(112)
    planner.capturing_now, planner.current_capture = True, 5
    got = [cache.resolve(schedule, lens, None, BLOCK) for _ in range(LAYERS)]
    assert got[0] is not schedule and all(g is got[0] for g in got)  # the graph reads its own plan
    assert cache.stats.captured_replans == 1 and cache.stats.deferred_plans == 0
    assert (schedule == -7).all()  # nothing was planned into the buffer: no replay reads it


def test_deferred_plan_then_a_knob_turned_by_someone_else() -> None:
    dg, planner, cache = _setup()
    lens = _lens()
    schedule = _deferred_build(cache, planner, lens, 112, torch.zeros((133, 2), dtype=torch.int32))
    dg.set_num_sms(100)
    other = cache.resolve(schedule, lens, None, BLOCK)
    assert other.shape[0] == 101 and cache.stats.replans == 1 and cache.stats.deferred_plans == 1
    dg.set_num_sms(112)
    assert cache.resolve(schedule, lens, None, BLOCK) is schedule
    assert torch.equal(schedule, planner.plan(lens, BLOCK, 112))


def test_invalidate_with_the_in_place_plan_settles_a_deferred_schedule() -> None:
    dg, planner, cache = _setup()
    lens = _lens()
    schedule = _deferred_build(cache, planner, lens, 112, torch.zeros((133, 2), dtype=torch.int32))
    state = cache.state_of(schedule)
    assert state is not None and state.intended_sms == 112 and state.planned_sms < 0
    cache.invalidate(schedule)  # inputs rewritten in place, nothing planned: still owed, from the new inputs
    assert state.deferred is not None
    schedule.copy_(planner.plan(lens, BLOCK, 112))  # update_draft_decode_metadata re-plans in place ...
    cache.invalidate(schedule, planned_sms=112)  # ... and says so
    assert state.deferred is None and state.planned_sms == 112
    calls = len(dg.plan_calls)
    dg.set_num_sms(112)
    assert cache.resolve(schedule, lens, None, BLOCK) is schedule and len(dg.plan_calls) == calls


def test_full_graph_dbo_steps_launch_only_the_graphs_planners() -> None:
    """Planner kernels per FULL-graph DBO step (build + replay, two microbatches): the build's plan is
    never read there, so with deferral the step launches none on the host (before: one per microbatch)."""
    dg, planner, cache = _setup()
    buffers = [torch.zeros((133, 2), dtype=torch.int32) for _ in range(2)]
    lens = [_lens(batch=6), _lens(batch=7)]

    def build(defer: bool) -> list[torch.Tensor]:
        if defer:
            return [_deferred_build(cache, planner, lens[u], 112, buffers[u]) for u in range(2)]
        out = []
        for u in range(2):
            view = buffers[u][:113]
            view.copy_(planner.plan(lens[u], BLOCK, 112))
            cache.track(view, planned_sms=112, block_kv=BLOCK, next_n=1, ahead=True)
            out.append(view)
        return out

    dg.set_num_sms(112)
    for defer, per_step in ((False, 2), (True, 0)):
        schedules = build(defer)
        planner.capturing_now, planner.current_capture = True, 11 + int(defer)  # the capture
        for u in range(2):
            for _ in range(LAYERS):
                cache.resolve(schedules[u], lens[u], None, BLOCK)
        planner.capturing_now = False
        calls = len(dg.plan_calls)
        for _ in range(5):  # replay steps: vLLM builds, then replays (no call site runs)
            build(defer)
        assert (len(dg.plan_calls) - calls) / 5 == per_step


# -- warm exactly the shapes vLLM will run ---------------------------------------------

#: vLLM 0.33.0's default capture sizes for ``vllm serve`` on an H200 without speculative decoding
#: (max_num_seqs 1024 -> largest graph min(2048, 512)): 1, 2, 4, multiples of 8 to 248, of 16 to 512.
H200_CAPTURE_SIZES = [1, 2, 4, *range(8, 256, 8), *range(256, 513, 16)]


def test_align_batch_and_buckets() -> None:
    assert [align_batch(n) for n in (1, 32, 33, 512, 513)] == [32, 32, 64, 512, 544]


def test_ubatch_split_two_microbatches() -> None:
    assert ubatch_split([1] * 64, 64, 2) == [(32, 32), (32, 32)]
    assert ubatch_split([4] * 9, 36, 2) == [(5, 18), (5, 18)]  # request 4 is cut by the split point: in both
    assert ubatch_split([1] * 60, 64, 2) == [(32, 32), (28, 32)]  # padded tokens go to the last one


def test_dbo_planner_shapes_h200_defaults_no_mtp() -> None:
    shapes = dbo_planner_shapes(
        max_num_seqs=1024, max_num_batched_tokens=8192, num_speculative_tokens=0, capture_sizes=H200_CAPTURE_SIZES,
        num_ubatches=2, decode_token_threshold=32, per_token_rows=False,
    )
    # graphs 32..512 tokens -> 16..256 requests per microbatch; the full batch (1024) -> 512 each
    assert {w for _, w in shapes} == {1}
    assert sorted({align_batch(r) for r, _ in shapes}) == [32, 64, 96, 128, 160, 192, 224, 256, 512]
    assert min(r for r, _ in shapes) == 16 and max(r for r, _ in shapes) == 512


def test_dbo_planner_shapes_mtp3_native_and_flattened() -> None:
    mtp_sizes = sorted({*H200_CAPTURE_SIZES, *(4 * n for n in (1, 2, 4, *range(8, 129, 8)))})
    native = dbo_planner_shapes(
        max_num_seqs=1024, max_num_batched_tokens=8192, num_speculative_tokens=3, capture_sizes=mtp_sizes,
        num_ubatches=2, decode_token_threshold=32, per_token_rows=False,
    )
    # uniform decode of 4 tokens per request: graphs 32..512 tokens -> 4..64 requests per microbatch, the
    # full batch 1024 requests (4096 tokens) -> 512; all at width 4 (SM90: half the slots)
    assert {w for _, w in native} == {4}
    assert sorted({align_batch(r) for r, _ in native}) == [32, 64, 512]
    flat = dbo_planner_shapes(
        max_num_seqs=1024, max_num_batched_tokens=8192, num_speculative_tokens=3, capture_sizes=mtp_sizes,
        num_ubatches=2, decode_token_threshold=32, per_token_rows=True,
    )
    assert {w for _, w in flat} == {1} and max(r for r, _ in flat) == 2048  # one row per token


def test_dbo_planner_shapes_eager_only_and_below_threshold() -> None:
    eager = dbo_planner_shapes(
        max_num_seqs=256, max_num_batched_tokens=2048, num_speculative_tokens=0, capture_sizes=(),
        num_ubatches=2, decode_token_threshold=32, per_token_rows=False,
    )
    assert eager == ((128, 1),)
    assert dbo_planner_shapes(
        max_num_seqs=16, max_num_batched_tokens=2048, num_speculative_tokens=0, capture_sizes=(8, 16),
        num_ubatches=2, decode_token_threshold=32, per_token_rows=False,
    ) == ()  # vLLM never microbatches a decode batch below the threshold


def test_h200_default_warm_up_compiles_fewer_variants_and_covers_the_full_batch() -> None:
    """Before: every bucket 32..512 per slot count (16 variants) whatever vLLM runs, and none above 512
    (a max_num_seqs above 1024 compiled its full batch's planner in a live step). After: the 9 vLLM runs."""
    dg, _planner, cache = _setup()
    shapes = dbo_planner_shapes(
        max_num_seqs=1024, max_num_batched_tokens=8192, num_speculative_tokens=0, capture_sizes=H200_CAPTURE_SIZES,
        num_ubatches=2, decode_token_threshold=32, per_token_rows=False,
    )
    cache.warmup.register_profile(0, PlannerProfile(device="cpu", block_kv=BLOCK, shapes=shapes))
    assert cache.warmup.warm(0, 112) == 9
    assert sorted(c[2][0] for c in dg.plan_calls) == [32, 64, 96, 128, 160, 192, 224, 256, 512]
