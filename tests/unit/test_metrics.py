"""Prometheus export: budget gauges at announce, counters moved by per-step deltas at 'exited'."""

from __future__ import annotations

from typing import Any

import pytest

from dbo_runtime.core.budget import compute_budget
from dbo_runtime.services.metrics import MetricsExporter
from dbo_runtime.services.schedule_cache import ScheduleCacheStats
from dbo_runtime.sim.sm_scope import SMControl


class FakeCacheStats:
    """Only ``.stats`` of IndexerScheduleCache is read; the real cache is exercised in test_schedule_cache."""

    def __init__(self) -> None:
        self.stats = ScheduleCacheStats()


def _value(registry: object, name: str, labels: dict[str, str] | None = None) -> float:
    got = registry.get_sample_value(name, labels or {})  # type: ignore[attr-defined]
    assert got is not None, name
    return float(got)


def _exporter() -> tuple[Any, FakeCacheStats, MetricsExporter, SMControl, Any]:
    """A registry of its own, the exporter on it, and an SMControl for an H200 under DeepEP HT (112 compute SMs)."""
    import prometheus_client  # a vLLM dependency, pinned in the lock

    registry = prometheus_client.CollectorRegistry()
    cache = FakeCacheStats()
    exporter = MetricsExporter(registry=registry, cache=cache)
    control = SMControl(0, 132)
    budget = compute_budget(
        total_sms=132, platform="cuda", enable_dbo=True, expert_parallel=True, all2all_backend="deepep_high_throughput"
    )
    return registry, cache, exporter, control, budget


def test_exporter_reports_budget_and_step_deltas() -> None:
    registry, cache, exporter, control, budget = _exporter()
    exporter.attach(control)
    exporter.attach(control)  # idempotent: one subscription
    control.announce(budget)
    assert _value(registry, "dbo_runtime_dbo_compute_sms", {"device": "0"}) == 112
    assert _value(registry, "dbo_runtime_dbo_comm_sms", {"device": "0"}) == 20
    for step in range(3):
        cache.stats.replans += 2 if step == 0 else 0  # upstream-like first step, then plan-ahead
        cache.stats.planned_ahead += 2
        cache.stats.jit_at_start += 1 if step == 0 else 0
        cache.stats.jit_in_step += 1 if step == 2 else 0
        with control.partition(budget):
            pass
    assert _value(registry, "dbo_runtime_sm_partitions_total", {"device": "0"}) == 3
    assert _value(registry, "dbo_runtime_sm_knob_switches_total", {"device": "0"}) == 6
    assert _value(registry, "dbo_runtime_indexer_replans_total", {"kind": "call_site"}) == 2
    assert _value(registry, "dbo_runtime_indexer_planned_ahead_total") == 6
    assert _value(registry, "dbo_runtime_planner_jit_at_start_total") == 1
    assert _value(registry, "dbo_runtime_planner_jit_in_step_total") == 1


def test_a_failing_metrics_export_never_stops_the_sm_context(monkeypatch: pytest.MonkeyPatch, caplog: Any) -> None:
    """Prometheus export is optional: when it raises (here a vanished PROMETHEUS_MULTIPROC_DIR), vLLM still
    gets its SM control context with the DBO split, and the log says the metrics are not exported."""
    from dbo_runtime.integration import sm_hooks

    def broken(control: Any) -> None:
        raise FileNotFoundError("PROMETHEUS_MULTIPROC_DIR vanished")

    budget = compute_budget(
        total_sms=132, platform="cuda", enable_dbo=True, expert_parallel=True, all2all_backend="deepep_high_throughput",
        env_comm_sms=None, has_all2all_manager=True, max_sms_used=20, has_deep_gemm=True, device=0,
    )  # fmt: skip
    monkeypatch.setattr(sm_hooks, "export_to_prometheus", broken)
    monkeypatch.setattr(sm_hooks, "budget_from_vllm", lambda parallel_config: (budget, None, None))
    ctx = sm_hooks.create_sm_control_context(object())
    assert ctx.compute_sms == 112 and "Prometheus metrics not exported" in caplog.text


def test_a_step_touches_only_the_counters_that_moved_and_looks_each_child_up_once() -> None:
    """The export runs on the main thread inside every DBO step: a counter whose total did not move is not
    touched, and a labelled child is looked up once (``labels()`` takes a lock; multiprocess ``inc`` writes)."""
    registry, cache, exporter, control, budget = _exporter()
    exporter.attach(control)
    control.announce(budget)
    calls: list[str] = []
    for name in ("partitions", "knob_switches", "replans"):
        counter = getattr(exporter, name)
        real = counter.labels
        counter.labels = lambda *a, _real=real, _name=name: calls.append(_name) or _real(*a)  # type: ignore[method-assign]
    incs: list[str] = []
    for name in ("planned_ahead", "warmups", "jit_in_step", "jit_at_start"):
        counter = getattr(exporter, name)
        real_inc = counter.inc
        counter.inc = lambda amount=1, _real=real_inc, _name=name: incs.append(_name) or _real(amount)  # type: ignore[method-assign]
    for _ in range(4):
        with control.partition(budget):
            pass
    cache.stats.jit_in_step += 1
    with control.partition(budget):
        pass
    assert sorted(calls) == ["knob_switches", "partitions"]  # once each; the re-plan kinds never moved
    assert incs == ["jit_in_step"]
    assert _value(registry, "dbo_runtime_sm_partitions_total", {"device": "0"}) == 5
    assert _value(registry, "dbo_runtime_planner_jit_in_step_total") == 1
