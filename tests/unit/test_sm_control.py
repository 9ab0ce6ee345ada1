"""SMControl: knob order, restore-to-previous, nesting, exceptions, threads, subscribers."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import pytest

from dbo_runtime.core.budget import SMBudget, compute_budget
from dbo_runtime.core.errors import ConfigError
from dbo_runtime.services.sm_control import BudgetEvent
from dbo_runtime.sim.sm_scope import FunctionKnob, SMControl


class FakeKnobs:
    """Fake for the DeepGEMM/DeepEP SM knobs (GPU twin: tests/gpu/test_sm_control_gpu.py); logs (knob, value) calls."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []

    def knob(self, name: str, fail_on: int | None = None) -> FunctionKnob:
        def setter(n: int) -> None:
            if n == fail_on:
                raise RuntimeError(f"{name} refuses {n}")
            self.calls.append((name, n))

        return FunctionKnob(name, setter)


def budget(comm: int, total: int = 132) -> SMBudget:
    return compute_budget(
        total_sms=total,
        platform="cuda",
        enable_dbo=True,
        expert_parallel=True,
        all2all_backend="deepep_high_throughput",
        env_comm_sms=comm,
    )


@pytest.fixture
def rec() -> FakeKnobs:
    return FakeKnobs()


def test_enter_and_exit_match_vllm_sequence(rec: FakeKnobs) -> None:
    ctl = SMControl(0, 132)
    with ctl.partition(budget(20), comm_knob=rec.knob("comm"), compute_knob=rec.knob("compute")) as b:
        assert rec.calls == [("comm", 20), ("compute", 112)]
        assert ctl.active is b
    # vLLM's __exit__ hands both setters total_sms.
    assert rec.calls[2:] == [("comm", 132), ("compute", 132)]
    assert ctl.active.compute == 132 and ctl.depth == 0


def test_nested_restores_previous_not_all(rec: FakeKnobs) -> None:
    ctl = SMControl(0, 132)
    comm, compute = rec.knob("comm"), rec.knob("compute")
    with ctl.partition(budget(20), comm_knob=comm, compute_knob=compute):
        with ctl.partition(budget(32), comm_knob=comm, compute_knob=compute):
            assert ctl.active.compute == 100
        assert ctl.active.compute == 112
        assert rec.calls[-2:] == [("comm", 20), ("compute", 112)]
    assert rec.calls[-2:] == [("comm", 132), ("compute", 132)]


def test_body_exception_restores_and_propagates(rec: FakeKnobs) -> None:
    ctl = SMControl(0, 132)
    with pytest.raises(ValueError, match="boom"), ctl.partition(budget(20), compute_knob=rec.knob("compute")):
        raise ValueError("boom")
    assert rec.calls == [("compute", 112), ("compute", 132)]
    assert ctl.active.compute == 132 and ctl.depth == 0


def test_failing_knob_leaves_nothing_half_set(rec: FakeKnobs) -> None:
    ctl = SMControl(0, 132)
    with pytest.raises(RuntimeError, match="refuses 112"), ctl.partition(
        budget(20), comm_knob=rec.knob("comm"), compute_knob=rec.knob("compute", fail_on=112)
    ):
        pytest.fail("body must not run")
    # comm had been set to 20: both knobs are put back to the budget still in force.
    assert rec.calls == [("comm", 20), ("comm", 132), ("compute", 132)]
    assert ctl.active.compute == 132 and ctl.depth == 0


def test_subscriber_sees_budget_before_body_and_restore_after(rec: FakeKnobs) -> None:
    ctl = SMControl(0, 132)
    seen: list[tuple[str, int, list[tuple[str, int]]]] = []
    ctl.subscribe(lambda e: seen.append((e.kind, e.budget.compute, list(rec.calls))), name="probe")
    with ctl.partition(budget(20), compute_knob=rec.knob("compute")):
        assert seen == [("entered", 112, [("compute", 112)])]
    assert seen[-1] == ("exited", 132, [("compute", 112), ("compute", 132)])


def _raising_on(kind: str, message: str = "cannot plan") -> Callable[[BudgetEvent], None]:
    def bad(e: BudgetEvent) -> None:
        if e.kind == kind:
            raise RuntimeError(message)

    return bad


@pytest.mark.parametrize("kind", ["entered", "exited"])
def test_failing_subscriber_never_fails_or_half_applies_the_step(rec: FakeKnobs, kind: str, caplog: Any) -> None:
    """Subscribers are best effort: the body runs under the whole partition, knobs return to the previous budget."""
    caplog.set_level(logging.DEBUG, logger="vllm.dbo_runtime")
    ctl = SMControl(0, 132)
    events: list[str] = []
    ctl.subscribe(_raising_on(kind), name="bad")
    ctl.subscribe(lambda e: events.append(f"{e.kind}:{e.budget.compute}"), name="good")
    ran = 0
    for _ in range(3):
        with ctl.partition(budget(20), comm_knob=rec.knob("comm"), compute_knob=rec.knob("compute")):
            assert ctl.active.compute == 112 and rec.calls[-2:] == [("comm", 20), ("compute", 112)]
            ran += 1
        assert rec.calls[-2:] == [("comm", 132), ("compute", 132)]
    assert ran == 3 and ctl.active.compute == 132 and ctl.depth == 0
    assert rec.calls == [("comm", 20), ("compute", 112), ("comm", 132), ("compute", 132)] * 3
    assert events == ["entered:112", "exited:132"] * 3  # later subscribers are still told
    assert ctl.stats.subscriber_errors == 3 and ctl.stats.subscriber_errors_by_name == {"bad": 3}
    logged = [r for r in caplog.records if "subscriber 'bad'" in r.getMessage() and r.levelno >= logging.WARNING]
    assert len(logged) == 1 and "cannot plan" in logged[0].getMessage()


def test_failing_subscriber_in_nested_partitions_restores_each_previous_budget(rec: FakeKnobs) -> None:
    ctl = SMControl(0, 132)
    ctl.subscribe(lambda e: (_ for _ in ()).throw(OSError("disk full")), name="always")
    comm, compute = rec.knob("comm"), rec.knob("compute")
    with ctl.partition(budget(20), comm_knob=comm, compute_knob=compute):
        with ctl.partition(budget(32), comm_knob=comm, compute_knob=compute):
            assert ctl.active.compute == 100
        assert ctl.active.compute == 112 and rec.calls[-2:] == [("comm", 20), ("compute", 112)]
    assert ctl.active.compute == 132 and rec.calls[-2:] == [("comm", 132), ("compute", 132)]
    assert ctl.stats.subscriber_errors == 4


def test_failing_subscriber_on_announce_and_replay_does_not_stop_model_load() -> None:
    ctl = SMControl(0, 132)
    ctl.subscribe(_raising_on("announced"), name="bad")
    ctl.announce(budget(20))  # model load goes on
    assert ctl.announced == [budget(20)]
    late = ctl.subscribe(_raising_on("announced"), name="late")  # replay of the announced budget
    assert late.name == "late" and ctl.stats.subscriber_errors_by_name == {"bad": 1, "late": 1}


def test_body_exception_still_wins_over_a_failing_subscriber(rec: FakeKnobs) -> None:
    ctl = SMControl(0, 132)
    ctl.subscribe(_raising_on("exited"), name="bad")
    with pytest.raises(KeyError), ctl.partition(budget(20), compute_knob=rec.knob("compute")):
        raise KeyError("body")
    assert ctl.active.compute == 132 and rec.calls == [("compute", 112), ("compute", 132)]


def test_planner_warm_up_failing_at_announce_fails_neither_model_load_nor_the_step(rec: FakeKnobs) -> None:
    """The real schedule-cache subscriber: a planner JIT compile that fails when the DBO budget is announced."""
    from dbo_runtime.services.planner_warmup import PlannerProfile
    from dbo_runtime.services.schedule_cache import IndexerScheduleCache
    from tests.fakes.fake_deep_gemm import FakeDeepGemm, FakeSchedulePlanner

    class FailingJit(FakeSchedulePlanner):
        def plan(self, context_lens: Any, block_kv: int, num_sms: int, indices: Any | None = None) -> Any:
            raise RuntimeError("DeepGEMM JIT: nvcc failed")

    ctl = SMControl(0, 132)
    cache = IndexerScheduleCache(FailingJit(FakeDeepGemm(total_sms=132)))
    cache.attach(ctl)
    cache.warmup.register_profile(0, PlannerProfile(device="cpu", block_kv=64, shapes=((32, 1),)))
    ctl.announce(budget(20))
    with ctl.partition(budget(20), compute_knob=rec.knob("compute")):
        pass
    assert rec.calls == [("compute", 112), ("compute", 132)]
    # The warm-up handles its own failure (counted, logged once, never retried per step), so no
    # subscriber error reaches SMControl at all.
    assert cache.stats.warm_failures == 1 and ctl.stats.subscriber_errors == 0


def test_prometheus_exporter_losing_its_multiprocess_dir_does_not_stop_model_load_or_steps(
    rec: FakeKnobs, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The real exporter in prometheus_client's multiprocess mode; the directory vanishes after it was created
    (a tmp cleaner): the budget gauges' file cannot be created at announce."""
    import shutil

    import prometheus_client
    from prometheus_client import values

    from dbo_runtime.services.metrics import MetricsExporter
    from tests.unit.test_metrics import FakeCacheStats

    prom = tmp_path / "prom"
    prom.mkdir()
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(prom))
    monkeypatch.setattr(values, "ValueClass", values.MultiProcessValue())
    registry = prometheus_client.CollectorRegistry()
    exporter = MetricsExporter(registry=registry, cache=FakeCacheStats())  # opens the counters' file
    shutil.rmtree(prom)
    ctl = SMControl(0, 132)
    exporter.attach(ctl)
    ctl.announce(budget(20))  # the gauges' file cannot be created: logged and counted, model load goes on
    assert ctl.stats.subscriber_errors_by_name == {"prometheus_metrics": 1}
    for _ in range(2):
        with ctl.partition(budget(20), compute_knob=rec.knob("compute")):
            pass
    assert rec.calls == [("compute", 112), ("compute", 132)] * 2 and ctl.active.compute == 132
    assert registry.get_sample_value("dbo_runtime_sm_partitions_total", {"device": "0"}) == 2  # steps still exported


def test_unsubscribe_and_replay_of_announced() -> None:
    ctl = SMControl(0, 132)
    ctl.announce(budget(20))
    got: list[str] = []
    sub = ctl.subscribe(lambda e: got.append(f"{e.kind}:{e.budget.compute}"))
    assert got == ["announced:112"]
    sub.close()
    with ctl.partition(budget(20)):
        pass
    assert got == ["announced:112"]
    quiet = ctl.subscribe(lambda e: got.append(e.kind), replay=False)
    ctl.announce(budget(24))
    quiet.close()
    assert got[-1] == "announced"
    late: list[int] = []
    ctl.subscribe(lambda e: late.append(e.budget.compute))
    assert late == [108]  # only the budget announced last; the superseded 112 stays history in ``announced``
    assert [b.compute for b in ctl.announced] == [112, 108]


def test_active_readable_from_microbatch_threads_while_main_holds(rec: FakeKnobs) -> None:
    ctl = SMControl(0, 132)
    seen: list[int] = []
    start = threading.Barrier(3)

    def ubatch() -> None:
        start.wait()
        for _ in range(1000):
            seen.append(ctl.active.compute)

    with ctl.partition(budget(20), compute_knob=rec.knob("compute")):
        threads = [threading.Thread(target=ubatch) for _ in range(2)]
        for t in threads:
            t.start()
        start.wait()
        for t in threads:
            t.join()
    assert len(seen) == 2000 and set(seen) == {112}


def test_non_lifo_exit_from_another_thread_keeps_top(rec: FakeKnobs) -> None:
    ctl = SMControl(0, 132)
    knob = rec.knob("compute")
    outer = ctl.enter(budget(20), compute_knob=knob)
    inner = ctl.enter(budget(32), compute_knob=knob)
    t = threading.Thread(target=ctl.exit, args=(outer,))
    t.start()
    t.join()
    assert ctl.active.compute == 100  # the inner scope is still in force
    ctl.exit(inner)
    assert ctl.active.compute == 132 and rec.calls[-1] == ("compute", 132)
    with pytest.raises(RuntimeError, match="not active"):
        ctl.exit(inner)


def test_counters(rec: FakeKnobs) -> None:
    t = [0.0]
    ctl = SMControl(0, 132, clock=lambda: t[0])
    t[0] = 1.0
    with ctl.partition(budget(20), compute_knob=rec.knob("compute")):
        t[0] = 3.5
    assert ctl.stats.switches == 2 and ctl.stats.partitions_entered == 1
    assert ctl.stats.partition_seconds == 2.5


def test_budget_for_another_device_rejected() -> None:
    ctl = SMControl(1, 132)
    with pytest.raises(ConfigError, match="budget"), ctl.partition(budget(20)):
        pass
    with pytest.raises(ConfigError):
        SMControl(0, 78).enter(budget(20))


def test_rounded_sm90_budget_turns_even_and_restores_exactly(rec: FakeKnobs) -> None:
    """On an odd-SM SM90 device the partition gives DeepGEMM an even count (one SM idle);
    nesting and exit restore the exact count in force before, never a rounded or recomputed one."""

    def sm90(comm: int) -> SMBudget:
        return compute_budget(
            total_sms=131, platform="cuda", enable_dbo=True, expert_parallel=True,
            all2all_backend="deepep_high_throughput", env_comm_sms=comm, compute_multiple=2,
        )

    ctl = SMControl(0, 131)
    comm, compute = rec.knob("comm"), rec.knob("compute")
    with ctl.partition(sm90(20), comm_knob=comm, compute_knob=compute):
        assert rec.calls == [("comm", 20), ("compute", 110)]
        with ctl.partition(sm90(32), comm_knob=comm, compute_knob=compute):
            assert rec.calls[-2:] == [("comm", 32), ("compute", 98)]
        assert rec.calls[-2:] == [("comm", 20), ("compute", 110)]
    assert rec.calls[-2:] == [("comm", 131), ("compute", 131)]
    assert ctl.active.compute == 131 and ctl.depth == 0
    assert all(n % 2 == 0 for name, n in rec.calls[:-1] if name == "compute")


def test_partition_seconds_add_up_the_time_inside_partitions_only() -> None:
    """``dbo-runtime tune``'s measure: host time per microbatched forward, nested scopes counted once each."""
    now = [0.0]
    ctl = SMControl(0, 132, clock=lambda: now[0])
    now[0] = 5.0  # outside any partition: not counted
    with ctl.partition(budget(20)):
        now[0] += 0.25
    now[0] += 3.0
    with ctl.partition(budget(20)):
        now[0] += 0.5
    assert ctl.stats.partitions_entered == 2 and ctl.stats.partition_seconds == pytest.approx(0.75)


def test_the_runner_reads_ms_per_microbatched_forward_from_the_counters() -> None:
    from dbo_runtime.harness.runner import _per_partition_ms, summary_delta

    before = [{"summary": {"partitions": 3, "partition_s": 1.0}}]
    after = [{"summary": {"partitions": 7, "partition_s": 1.2}}]
    assert summary_delta(before, after, "partition_s") == pytest.approx(0.2)
    assert _per_partition_ms(summary_delta(before, after, "partition_s"), summary_delta(before, after, "partitions")) == pytest.approx(50.0)
    assert _per_partition_ms(0.0, 0) is None and _per_partition_ms(None, 3) is None
