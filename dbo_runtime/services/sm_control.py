"""SMControl: the single owner of the compute/comm SM knobs of one device.

Why a service and not vLLM's ``SMControlContextManager``: vLLM flips
process-global library state (DeepGEMM's device runtime, DeepEP's static
``Buffer.num_sms``) and tells nobody. The DSA indexer plans its paged-MQA
schedule for one SM count and DeepGEMM later asserts it against another (vLLM
PR #60732). Whoever depends on the SM count must learn about a change *before*
the first kernel runs under it, so the knob turning and the publication happen
here, in one place, in a fixed order:

* ``partition()`` pushes a budget, turns the comm knob then the compute knob
  (vLLM's order), publishes ``entered`` to subscribers, runs the body, and on
  exit turns the knobs back to the **previous** budget (not "all SMs"), then
  publishes ``exited``. Nesting, exceptions and non-LIFO exits from other
  threads all restore the budget that is still in force.
* ``announce()`` lets an integration publish a budget that *will* be entered
  later (vLLM builds its context at model load), so a subscriber can compile
  what it needs outside any step and outside any CUDA-graph capture.
* ``active`` is one attribute read: the two microbatch threads read it while
  the main thread holds the partition.

Subscribers that raise: on enter, the knobs are rolled back to the previous
budget, subscribers already told are told ``exited``, and a ``SubscriberError``
naming the subscriber is raised -- the body never runs half-partitioned. On
exit, the knobs are restored first; every subscriber is still told; a
subscriber error is raised only when the body itself did not raise.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Literal, Protocol

from dbo_runtime.core.budget import SMBudget, full_budget
from dbo_runtime.core.errors import ConfigError, SubscriberError
from dbo_runtime.core.log import get_logger

logger = get_logger(__name__)

EventKind = Literal["announced", "entered", "exited"]


class SMKnob(Protocol):
    """Something that sets an SM count in a third-party library."""

    @property
    def name(self) -> str: ...

    def set(self, num_sms: int) -> None: ...


@dataclass(frozen=True)
class FunctionKnob:
    """An ``SMKnob`` around a plain setter (what vLLM hands its context)."""

    name: str
    setter: Callable[[int], None]

    def set(self, num_sms: int) -> None:
        self.setter(num_sms)


@dataclass(frozen=True, slots=True)
class BudgetEvent:
    """What subscribers receive. ``budget`` is the one in force after the event."""

    kind: EventKind
    budget: SMBudget
    previous: SMBudget
    control: SMControl


Subscriber = Callable[[BudgetEvent], None]


@dataclass
class Subscription:
    """Handle returned by ``subscribe``; ``close()`` (or ``with``) unsubscribes."""

    control: SMControl
    name: str
    callback: Subscriber
    token: int

    def close(self) -> None:
        self.control.unsubscribe(self)

    def __enter__(self) -> Subscription:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass
class SMControlStats:
    """Counters a Prometheus exporter or the CLI reads."""

    switches: int = 0
    """Knob applications (enter and restore both count)."""
    partitions_entered: int = 0
    subscriber_errors: int = 0
    seconds_by_budget: dict[tuple[int, int], float] = field(default_factory=dict)
    """Wall time spent under each ``(compute, comm)`` split, the unpartitioned one included."""


@dataclass
class _Frame:
    budget: SMBudget
    comm_knob: SMKnob | None
    compute_knob: SMKnob | None
    token: int


class SMControl:
    """Owner of one device's SM split. Get the process-wide one with ``sm_control_for``."""

    def __init__(self, device: int, total_sms: int, *, clock: Callable[[], float] = time.perf_counter) -> None:
        self.device = device
        self.total_sms = total_sms
        self._root = full_budget(total_sms, device)
        self._stack: list[_Frame] = []
        self._active: SMBudget = self._root
        self._lock = threading.RLock()
        self._subscribers: dict[int, Subscription] = {}
        self._tokens = itertools.count(1)
        self._clock = clock
        self._since = clock()
        self.stats = SMControlStats()
        self.announced: list[SMBudget] = []

    # -- reads -----------------------------------------------------------------------------
    @property
    def active(self) -> SMBudget:
        """The budget in force now; a single attribute read, safe from any thread."""
        return self._active

    @property
    def depth(self) -> int:
        return len(self._stack)

    # -- subscribers -----------------------------------------------------------------------
    def subscribe(self, callback: Subscriber, *, name: str | None = None, replay: bool = True) -> Subscription:
        """Register ``callback``; with ``replay`` it is told every budget announced so far."""
        with self._lock:
            label = name or str(getattr(callback, "__qualname__", None) or repr(callback))
            sub = Subscription(self, label, callback, next(self._tokens))
            self._subscribers[sub.token] = sub
            announced = list(self.announced) if replay else []
        for budget in announced:
            callback(BudgetEvent("announced", budget, self._active, self))
        return sub

    def unsubscribe(self, sub: Subscription) -> None:
        with self._lock:
            self._subscribers.pop(sub.token, None)

    def _publish(self, kind: EventKind, budget: SMBudget, previous: SMBudget) -> list[tuple[Subscription, BaseException]]:
        event = BudgetEvent(kind, budget, previous, self)
        errors: list[tuple[Subscription, BaseException]] = []
        for sub in list(self._subscribers.values()):
            try:
                sub.callback(event)
            except Exception as exc:
                self.stats.subscriber_errors += 1
                errors.append((sub, exc))
        return errors

    # -- announce --------------------------------------------------------------------------
    def announce(self, budget: SMBudget) -> None:
        """Publish a budget a partition will use later (at model load, outside any step).

        Subscriber errors here propagate: this runs at start-up, where a clear
        failure is better than a crash in the first DBO step.
        """
        self._check_device(budget)
        with self._lock:
            if budget not in self.announced:
                self.announced.append(budget)
        errors = self._publish("announced", budget, self._active)
        if errors:
            sub, exc = errors[0]
            raise SubscriberError(sub.name, "announce", exc)

    # -- partition -------------------------------------------------------------------------
    @contextmanager
    def partition(
        self,
        budget: SMBudget,
        *,
        comm_knob: SMKnob | None = None,
        compute_knob: SMKnob | None = None,
    ) -> Iterator[SMBudget]:
        """Hold ``budget`` for the body; restore the budget below it on exit."""
        token = self._enter(budget, comm_knob, compute_knob)
        body_raised = False
        try:
            yield budget
        except BaseException:
            body_raised = True
            raise
        finally:
            self._exit(token, body_raised)

    def enter(self, budget: SMBudget, *, comm_knob: SMKnob | None = None, compute_knob: SMKnob | None = None) -> int:
        """Non-``with`` form for integrations whose enter and exit live in different calls."""
        return self._enter(budget, comm_knob, compute_knob)

    def exit(self, token: int, *, body_raised: bool = False) -> None:
        self._exit(token, body_raised)

    def _check_device(self, budget: SMBudget) -> None:
        if budget.device != self.device or budget.total != self.total_sms:
            raise ConfigError(
                "budget",
                f"device {budget.device} with {budget.total} SMs",
                f"device {self.device} with {self.total_sms} SMs (the SMControl it was given to)",
            )

    def _apply(self, budget: SMBudget, comm_knob: SMKnob | None, compute_knob: SMKnob | None) -> None:
        # vLLM's order: comm first, then compute. The unpartitioned budget hands the comm
        # side the full count, as vLLM's __exit__ does (DeepEP HT clamps it to its own 20).
        if comm_knob is not None:
            comm_knob.set(budget.comm if budget.partitioned else budget.total)
        if compute_knob is not None:
            compute_knob.set(budget.compute)
        self.stats.switches += 1

    def _account(self) -> None:
        now = self._clock()
        key = (self._active.compute, self._active.comm)
        self.stats.seconds_by_budget[key] = self.stats.seconds_by_budget.get(key, 0.0) + (now - self._since)
        self._since = now

    def _enter(self, budget: SMBudget, comm_knob: SMKnob | None, compute_knob: SMKnob | None) -> int:
        self._check_device(budget)
        with self._lock:
            previous = self._active
            frame = _Frame(budget, comm_knob, compute_knob, next(self._tokens))
            try:
                self._apply(budget, comm_knob, compute_knob)
            except BaseException:
                # A knob failed half-way: put both back to what was in force.
                self._restore_knobs(previous, comm_knob, compute_knob)
                raise
            self._account()
            self._stack.append(frame)
            self._active = budget
            self.stats.partitions_entered += 1
            errors = self._publish("entered", budget, previous)
            if errors:
                self._stack.pop()
                self._account()
                self._active = previous
                self._restore_knobs(previous, comm_knob, compute_knob)
                self._publish("exited", previous, budget)
                sub, exc = errors[0]
                raise SubscriberError(sub.name, "enter", exc)
            return frame.token

    def _restore_knobs(self, budget: SMBudget, comm_knob: SMKnob | None, compute_knob: SMKnob | None) -> None:
        try:
            self._apply(budget, comm_knob, compute_knob)
        except Exception:
            logger.exception("dbo_runtime: restoring SM knobs to %s failed", budget.describe())

    def _exit(self, token: int, body_raised: bool) -> None:
        with self._lock:
            index = next((i for i, f in enumerate(self._stack) if f.token == token), None)
            if index is None:
                raise RuntimeError(f"SMControl: partition token {token} is not active (exited twice?)")
            frame = self._stack.pop(index)
            if index != len(self._stack):
                # A partition below the top exited (another thread's scope ended first):
                # the top one stays in force, nothing to turn.
                return
            self._account()
            left = frame.budget
            restored = self._stack[-1].budget if self._stack else self._root
            self._active = restored
            self._apply(restored, frame.comm_knob, frame.compute_knob)
            errors = self._publish("exited", restored, left)
        if errors and not body_raised:
            sub, exc = errors[0]
            raise SubscriberError(sub.name, "exit", exc)
        for sub, exc in errors:
            logger.error("dbo_runtime: subscriber %s raised on exit: %r", sub.name, exc)


_CONTROLS: dict[int, SMControl] = {}
_CONTROLS_LOCK = threading.Lock()


def sm_control_for(device: int, total_sms: int) -> SMControl:
    """The process's SMControl for ``device`` (created on first use)."""
    with _CONTROLS_LOCK:
        control = _CONTROLS.get(device)
        if control is None:
            control = _CONTROLS[device] = SMControl(device, total_sms)
        elif control.total_sms != total_sms:
            raise ConfigError("total_sms", total_sms, f"{control.total_sms} (device {device} was registered with it)")
        return control


def existing_controls() -> dict[int, SMControl]:
    """Snapshot of the per-device controls created so far."""
    with _CONTROLS_LOCK:
        return dict(_CONTROLS)


def reset_controls_for_tests() -> None:
    """Forget every SMControl; only tests call this."""
    with _CONTROLS_LOCK:
        _CONTROLS.clear()
