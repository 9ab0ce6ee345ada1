"""SMControl, the single owner of one device's compute/comm SM knobs, since vLLM flips process-global counts
(DeepGEMM, DeepEP) telling no one. ``enter()`` turns comm then compute and publishes ``entered``; ``exit()`` restores
the previous budget (``exited``); ``announce()`` publishes one at load. Subscriber errors are logged, never raised."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal, Protocol

from dbo_runtime.core.budget import SMBudget, full_budget
from dbo_runtime.core.errors import ConfigError
from dbo_runtime.core.log import get_logger

logger = get_logger(__name__)

EventKind = Literal["announced", "entered", "exited"]


class SMKnob(Protocol):
    """Something that sets an SM count in a third-party library."""

    @property
    def name(self) -> str: ...

    def set(self, num_sms: int) -> None: ...


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
    """Handle returned by ``subscribe``; ``close()`` unsubscribes."""

    control: SMControl
    name: str
    callback: Subscriber
    token: int

    def close(self) -> None:
        self.control.unsubscribe(self)


@dataclass
class SMControlStats:
    """Counters a Prometheus exporter or the CLI reads."""

    switches: int = 0
    """Knob applications, enter and restore."""
    partitions_entered: int = 0
    subscriber_errors: int = 0
    """Subscriber callbacks that raised (caught: subscribers are best effort)."""
    subscriber_errors_by_name: dict[str, int] = field(default_factory=dict)
    partition_seconds: float = 0.0
    """Host time inside partitions (the microbatched forward of each DBO step); ``dbo-runtime tune``'s measure."""


@dataclass
class _Frame:
    budget: SMBudget
    comm_knob: SMKnob | None
    compute_knob: SMKnob | None
    token: int
    started: float = 0.0


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
        self.stats = SMControlStats()
        self.announced: list[SMBudget] = []
        self._logged_failures: set[str] = set()

    @property
    def active(self) -> SMBudget:
        """The budget in force now; a single attribute read, safe from any thread."""
        return self._active

    def subscribe(self, callback: Subscriber, *, name: str | None = None, replay: bool = True) -> Subscription:
        """Register ``callback``; with ``replay`` it is told the budget announced last."""
        with self._lock:
            label = name or str(getattr(callback, "__qualname__", None) or repr(callback))
            sub = Subscription(self, label, callback, next(self._tokens))
            self._subscribers[sub.token] = sub
            announced = self.announced[-1:] if replay else []
        for budget in announced:
            self._deliver(sub, BudgetEvent("announced", budget, self._active, self))
        return sub

    def unsubscribe(self, sub: Subscription) -> None:
        with self._lock:
            self._subscribers.pop(sub.token, None)

    def _deliver(self, sub: Subscription, event: BudgetEvent) -> None:
        try:
            sub.callback(event)
        except Exception as exc:
            with self._lock:
                self.stats.subscriber_errors += 1
                by_name = self.stats.subscriber_errors_by_name
                by_name[sub.name] = by_name.get(sub.name, 0) + 1
                first = sub.name not in self._logged_failures
                self._logged_failures.add(sub.name)
            if first:
                logger.error(
                    "dbo_runtime: SM budget subscriber %r raised on %r (%s) and is skipped for this event; the SM "
                    "partition is unaffected. Further failures of this subscriber are counted in "
                    "SMControl.stats.subscriber_errors_by_name and logged at DEBUG: %r",
                    sub.name, event.kind, event.budget.describe(), exc, exc_info=exc,
                )
            else:
                logger.debug("dbo_runtime: SM budget subscriber %r raised on %r again: %r", sub.name, event.kind, exc)

    def _publish(self, kind: EventKind, budget: SMBudget, previous: SMBudget) -> None:
        event = BudgetEvent(kind, budget, previous, self)
        for sub in list(self._subscribers.values()):
            self._deliver(sub, event)

    def announce(self, budget: SMBudget) -> None:
        """Publish a budget a partition will use later (at model load, outside any step)."""
        self._check_device(budget)
        with self._lock:
            # Latest last: a subscriber that joins later is told the budget in force (``subscribe``).
            if budget in self.announced:
                self.announced.remove(budget)
            self.announced.append(budget)
        self._publish("announced", budget, self._active)

    def _check_device(self, budget: SMBudget) -> None:
        if budget.device != self.device or budget.total != self.total_sms:
            raise ConfigError(
                "budget", f"device {budget.device} with {budget.total} SMs",
                f"device {self.device} with {self.total_sms} SMs (the SMControl it was given to)",
            )

    def _apply(self, budget: SMBudget, comm_knob: SMKnob | None, compute_knob: SMKnob | None) -> None:
        # vLLM's order: comm first, then compute; unpartitioned, comm gets the full count as in vLLM.
        if comm_knob is not None:
            comm_knob.set(budget.comm if budget.partitioned else budget.total)
        if compute_knob is not None:
            compute_knob.set(budget.compute)
        self.stats.switches += 1

    def enter(self, budget: SMBudget, *, comm_knob: SMKnob | None = None, compute_knob: SMKnob | None = None) -> int:
        """Hold ``budget`` until ``exit`` of the returned token; the budget below it is restored then."""
        self._check_device(budget)
        with self._lock:
            previous = self._active
            frame = _Frame(budget, comm_knob, compute_knob, next(self._tokens), self._clock())
            try:
                self._apply(budget, comm_knob, compute_knob)
            except BaseException:
                try:  # a knob failed half-way: put both back to what was in force
                    self._apply(previous, comm_knob, compute_knob)
                except Exception:
                    logger.exception("dbo_runtime: restoring SM knobs to %s failed", previous.describe())
                raise
            self._stack.append(frame)
            self._active = budget
            self.stats.partitions_entered += 1
            self._publish("entered", budget, previous)
            return frame.token

    def exit(self, token: int) -> None:
        with self._lock:
            index = next((i for i, f in enumerate(self._stack) if f.token == token), None)
            if index is None:
                raise RuntimeError(f"SMControl: partition token {token} is not active (exited twice?)")
            frame = self._stack.pop(index)
            self.stats.partition_seconds += self._clock() - frame.started
            if index != len(self._stack):
                # A partition below the top exited first: the top one stays in force.
                return
            left = frame.budget
            restored = self._stack[-1].budget if self._stack else self._root
            self._active = restored
            self._apply(restored, frame.comm_knob, frame.compute_knob)
            self._publish("exited", restored, left)


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

