"""Fixes from the vLLM-maintainer review of 2026-11-30: optional work at model load never stops the
engine, a failing warm-up is not retried on every DBO step, and vLLM's own error at a microbatch join
is named in dbo_runtime's report."""

from __future__ import annotations

from typing import Any

import pytest

from dbo_runtime.core.budget import compute_budget
from dbo_runtime.core.errors import MicrobatchFailure
from dbo_runtime.services.planner_warmup import PlannerProfile
from dbo_runtime.services.schedule_cache import IndexerScheduleCache
from dbo_runtime.services.sm_control import SMControl
from tests.fakes.fake_deep_gemm import FakeDeepGemm, FakeSchedulePlanner


class FailingJit(FakeSchedulePlanner):
    calls = 0

    def plan(self, context_lens: Any, block_kv: int, num_sms: int, indices: Any | None = None) -> Any:
        FailingJit.calls += 1
        raise RuntimeError("DeepGEMM JIT: nvcc failed")


def _budget() -> Any:
    return compute_budget(
        total_sms=132, platform="cuda", enable_dbo=True, expert_parallel=True, all2all_backend="deepep_high_throughput",
        env_comm_sms=None, has_all2all_manager=True, max_sms_used=20, has_deep_gemm=True, device=0,
    )  # fmt: skip


def test_failing_warm_up_neither_raises_at_model_load_nor_retries_every_step() -> None:
    FailingJit.calls = 0
    control = SMControl(0, 132)
    cache = IndexerScheduleCache(FailingJit(FakeDeepGemm(total_sms=132)))
    cache.attach(control)
    control.announce(_budget())
    cache.register_profile(0, PlannerProfile(device="cpu", block_kv=64, shapes=((32, 1), (64, 1))))  # model load: no raise
    first = FailingJit.calls
    assert first == 2 and cache.stats.warm_failures == 2 and cache.stats.warmups == 0
    for _ in range(3):
        with control.partition(_budget()):
            pass
    assert FailingJit.calls == first  # not retried per DBO step
    assert control.stats.subscriber_errors == 0


def test_builder_registration_failure_does_not_stop_vllms_builder(monkeypatch: pytest.MonkeyPatch, caplog: Any) -> None:
    from dbo_runtime.integration import indexer_hooks

    def broken(builder: Any, device_index: int | None = None) -> None:
        raise RuntimeError("warm-up exploded")

    monkeypatch.setattr(indexer_hooks, "register_builder", broken)
    monkeypatch.setattr(indexer_hooks, "_logged", set())
    built: list[Any] = []

    class Builder:
        def __init__(self, value: int) -> None:
            built.append(value)

    Builder.__init__ = indexer_hooks._make_builder_init(Builder.__init__)  # type: ignore[method-assign]
    Builder(1)
    Builder(2)
    assert built == [1, 2]
    assert caplog.text.count("planner profile not registered") == 1


def test_metrics_failure_does_not_stop_the_sm_context(monkeypatch: pytest.MonkeyPatch, caplog: Any) -> None:
    from dbo_runtime.integration import sm_hooks

    def broken(control: Any) -> None:
        raise FileNotFoundError("PROMETHEUS_MULTIPROC_DIR vanished")

    monkeypatch.setattr(sm_hooks, "export_to_prometheus", broken)
    monkeypatch.setattr(sm_hooks, "budget_from_vllm", lambda parallel_config: (_budget(), None, None))
    ctx = sm_hooks.create_sm_control_context(object())
    assert ctx.compute_sms == 112 and "Prometheus metrics not exported" in caplog.text


def test_microbatch_failure_names_vllms_own_error() -> None:
    failure = MicrobatchFailure([("indexer logits call site", 1, ValueError("plugin"))], also=RuntimeError("vLLM join failed"))
    assert "vLLM then raised: RuntimeError('vLLM join failed')" in str(failure)
    assert isinstance(failure.__cause__, ValueError)
