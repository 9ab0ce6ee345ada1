"""SMControl: knob order, restore-to-previous, nesting, exceptions, threads, subscribers."""

from __future__ import annotations

import threading

import pytest

from dbo_runtime.core.budget import SMBudget, compute_budget
from dbo_runtime.core.errors import ConfigError, SubscriberError
from dbo_runtime.services.sm_control import BudgetEvent, FunctionKnob, SMControl


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


def test_subscriber_raising_on_enter_rolls_back(rec: FakeKnobs) -> None:
    ctl = SMControl(0, 132)
    events: list[str] = []
    ctl.subscribe(lambda e: events.append(f"ok:{e.kind}:{e.budget.compute}"), name="good")

    def bad(e: BudgetEvent) -> None:
        if e.kind == "entered":
            raise RuntimeError("cannot plan")

    ctl.subscribe(bad, name="bad")
    with pytest.raises(SubscriberError) as err, ctl.partition(budget(20), compute_knob=rec.knob("compute")):
        pytest.fail("body must not run")
    assert err.value.subscriber == "bad" and err.value.phase == "enter"
    assert rec.calls == [("compute", 112), ("compute", 132)]
    assert events == ["ok:entered:112", "ok:exited:132"]
    assert ctl.active.compute == 132 and ctl.stats.subscriber_errors == 1


def test_subscriber_raising_on_exit(rec: FakeKnobs) -> None:
    ctl = SMControl(0, 132)

    def bad(e: BudgetEvent) -> None:
        if e.kind == "exited":
            raise RuntimeError("late")

    ctl.subscribe(bad, name="bad")
    with pytest.raises(SubscriberError, match="late"), ctl.partition(budget(20), compute_knob=rec.knob("compute")):
        pass
    assert rec.calls[-1] == ("compute", 132) and ctl.active.compute == 132
    # When the body raised, its exception wins and the subscriber error is only logged.
    with pytest.raises(KeyError), ctl.partition(budget(20), compute_knob=rec.knob("compute")):
        raise KeyError("body")
    assert ctl.active.compute == 132


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
    with ctl.subscribe(lambda e: got.append(e.kind), replay=False):
        ctl.announce(budget(24))
    assert got[-1] == "announced"


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
    assert ctl.stats.seconds_by_budget == {(132, 0): 1.0, (112, 20): 2.5}


def test_budget_for_another_device_rejected() -> None:
    ctl = SMControl(1, 132)
    with pytest.raises(ConfigError, match="budget"), ctl.partition(budget(20)):
        pass
    with pytest.raises(ConfigError):
        SMControl(0, 78).enter(budget(20))


def test_rounded_sm90_budget_turns_even_and_restores_exactly(rec: FakeKnobs) -> None:
    """Issue 10 item 6: on an odd-SM SM90 device the partition gives DeepGEMM an even count (one SM idle);
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
