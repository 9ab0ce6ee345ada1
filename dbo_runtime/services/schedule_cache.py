"""DeepGEMM's paged-MQA schedule, kept valid for the SM count in force (vllm#60732): a schedule records the count
it was planned for (``track``); the call site keeps it where that is DeepGEMM's live count outside a capture, else
re-plans once per count or into the capture. A microbatched build plans ahead for the DBO count."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from dbo_runtime.adapters.cuda_graph import CAPTURES
from dbo_runtime.adapters.deep_gemm import next_n_of
from dbo_runtime.core.log import get_logger
from dbo_runtime.services.planner_warmup import PlannerWarmup
from dbo_runtime.services.sm_control import BudgetEvent, SMControl, Subscription

logger = get_logger(__name__)

STATE_ATTR = "_dbo_schedule_state"

_ITSELF = object()

DEFERRED = -1
"""``planned_sms`` of a tensor not planned yet: no live count equals it, so the call site always resolves."""


class SchedulePlanner(Protocol):
    """DeepGEMM's side: live SM count, slot rule, planner, capture probes."""

    name: str

    def get_num_sms(self) -> int: ...

    def slots(self, num_sms: int, next_n: int) -> int: ...

    def plan(self, context_lens: Any, block_kv: int, num_sms: int, indices: Any | None = None) -> Any: ...

    def capturing(self) -> bool: ...

    def capture_id(self) -> int | None:
        """None: unknown or not capturing."""
        ...


@dataclass(frozen=True, eq=False)
class DeferredPlan:
    sms: int
    context_lens: Any
    indices: Any | None


@dataclass(eq=False)
class ScheduleState:
    planned_sms: int
    block_kv: int
    next_n: int
    ahead: bool = False
    generation: int = 0
    replans: dict[int, Any] = field(default_factory=dict)
    """Eager re-plans by SM count."""
    in_graph: dict[tuple[int, int], Any] = field(default_factory=dict)
    """By ``(capture id, SM count)``."""
    deferred: DeferredPlan | None = None

    @property
    def intended_sms(self) -> int:
        return self.deferred.sms if self.deferred is not None else self.planned_sms


@dataclass
class ScheduleCacheStats:
    replans: int = 0
    """Eager call-site planner kernels."""
    captured_replans: int = 0
    capture_consistent: int = 0
    untracked_replans: int = 0
    planned_ahead: int = 0
    deferred: int = 0
    deferred_plans: int = 0
    invalidations: int = 0
    warmups: int = 0
    warm_skipped_in_capture: int = 0
    warm_failures: int = 0
    jit_in_step: int = 0
    """Planner variants first launched by a serving step, not the warm-up (goal 0)."""
    jit_at_start: int = 0
    """The same, in vLLM's start-up runs."""
    warm_ns: int = 0
    builders_stepped_aside: int = 0


class IndexerScheduleCache:
    """One per process: ``schedule_cache()``."""

    def __init__(self, planner: SchedulePlanner | None = None, *, defer_plan_ahead: bool = True) -> None:
        self._planner = planner
        self.defer_plan_ahead = defer_plan_ahead
        """False plans at build instead."""
        self._num_sms: Callable[[], int] | None = None
        self._capturing: Callable[[], bool] | None = None
        self.stats = ScheduleCacheStats()
        self._lock = threading.RLock()
        self._dbo_sms: dict[int, int] = {}
        self.warmup = PlannerWarmup(lambda: self.planner, self.stats, self._dbo_sms.get)
        self._subscriptions: dict[int, Subscription] = {}
        self._tls = threading.local()
        self._captures = CAPTURES
        self.steps_aside = False
        """No builder may microbatch and DeepGEMM's watched count was never written: hand vLLM's calls through.
        Read without the lock."""
        self._dbo_builders = 0
        self._pinned = False

    def note_builder(self, microbatches: bool, *, writers_watched: bool) -> bool:
        """A builder was created; whether the hooks now step aside."""
        with self._lock:
            if microbatches:
                self._dbo_builders += 1
            if not writers_watched:
                self._pinned = True
            self.steps_aside = not self._dbo_builders and not self._pinned
            if self.steps_aside:
                self.stats.builders_stepped_aside += 1
            return self.steps_aside

    def stop_stepping_aside(self) -> None:
        """DeepGEMM's count is being written: track every build from now on."""
        if self._pinned:
            return
        with self._lock:
            self._pinned = True
            self.steps_aside = False

    @property
    def planner(self) -> SchedulePlanner:
        if self._planner is None:
            from dbo_runtime.adapters.deep_gemm import DeepGemmPlanner

            self._planner = DeepGemmPlanner()
        return self._planner

    def _bind(self) -> Callable[[], int]:
        """Bind the hot probes (live SM count, capture probe); returns the first."""
        planner = self.planner
        probes = getattr(planner, "hot_probes", None)
        self._num_sms, self._capturing = probes() if probes is not None else (planner.get_num_sms, planner.capturing)
        return self._num_sms

    def track(
        self, schedule: Any, *, planned_sms: int, block_kv: int, next_n: int, ahead: bool = False
    ) -> ScheduleState:
        """Record what ``schedule`` was planned for; ``ahead`` (plan-ahead) ones are re-planned in any capture."""
        state = ScheduleState(planned_sms=int(planned_sms), block_kv=int(block_kv), next_n=int(next_n), ahead=ahead)
        setattr(schedule, STATE_ATTR, state)
        return state

    def track_deferred(
        self, schedule: Any, *, planned_sms: int, block_kv: int, next_n: int, context_lens: Any, indices: Any | None
    ) -> ScheduleState:
        """Record a planned-ahead schedule with no plan yet; the first eager ``resolve`` plans it in place."""
        state = self.track(schedule, planned_sms=DEFERRED, block_kv=block_kv, next_n=next_n, ahead=True)
        state.deferred = DeferredPlan(int(planned_sms), context_lens, indices)
        self.stats.deferred += 1
        return state

    def _run_deferred(self, state: ScheduleState, schedule: Any) -> None:
        """Plan a deferred schedule in place (eager; a failure is caught by the call-site shield)."""
        deferred = state.deferred
        assert deferred is not None
        plan = self._plan(deferred.context_lens, state.block_kv, deferred.sms, deferred.indices)
        state.deferred = None
        self.stats.deferred_plans += 1
        if tuple(plan.shape) == tuple(schedule.shape):
            schedule.copy_(plan)
            state.planned_sms = deferred.sms
        else:
            state.replans[deferred.sms] = plan

    @staticmethod
    def state_of(schedule: Any) -> ScheduleState | None:
        return getattr(schedule, STATE_ATTR, None)

    def invalidate(self, schedule: Any, *, planned_sms: int | None = None) -> None:
        """The inputs were rewritten in place: drop every re-plan."""
        state = self.state_of(schedule)
        if state is None:
            return
        state.replans.clear()
        state.in_graph.clear()
        state.generation += 1
        if planned_sms is not None:
            state.planned_sms = int(planned_sms)
            state.deferred = None
        self.stats.invalidations += 1

    def fits(self, schedule: Any) -> bool:
        """Fast path: planned for the live count, no capture underway."""
        state = schedule.__dict__.get(STATE_ATTR)
        live = self._num_sms
        captures = self._captures
        return (
            state is not None and live is not None and captures.installed and not captures.active
            and live() == state.planned_sms
        )

    def _plan(self, context_lens: Any, block_kv: int, num_sms: int, indices: Any | None) -> Any:
        self.warmup.note_plan(context_lens, block_kv, num_sms, indices)
        return self.planner.plan(context_lens, block_kv, num_sms, indices)

    def resolve(self, schedule: Any, context_lens: Any, indices: Any | None, block_source: Any) -> Any:
        """The schedule the logits kernel must get for DeepGEMM's live SM count; ``block_source`` (an int or the
        ``kv_cache``) is read only for untracked schedules."""
        current = (self._num_sms or self._bind())()
        state = schedule.__dict__.get(STATE_ATTR)
        if state is not None and current == state.planned_sms:
            # the counter is far cheaper than the precise probe
            captures = self._captures
            if (captures.installed and captures.active == 0) or not self._capturing():  # type: ignore[misc]
                return schedule
        block_kv = block_source if isinstance(block_source, int) else int(block_source.shape[1])
        return self._resolve_slow(state, schedule, context_lens, block_kv, indices, current)

    def live_num_sms(self) -> int:
        return int((self._num_sms or self._bind())())

    def _resolve_slow(
        self, state: ScheduleState | None, schedule: Any, context_lens: Any, block_kv: int, indices: Any, current: int
    ) -> Any:
        planner = self.planner
        if self._capturing():  # type: ignore[misc]
            return self._resolve_capturing(state, schedule, context_lens, block_kv, indices, current)
        if state is None:
            if int(schedule.shape[0]) == planner.slots(current, next_n_of(context_lens)) + 1:
                # not ours to know; DeepGEMM's own check passes
                return schedule
            self.stats.untracked_replans += 1
            return self._plan(context_lens, block_kv, current, indices)
        if state.deferred is not None:
            self._run_deferred(state, schedule)
        if current == state.planned_sms:
            return schedule
        if state.planned_sms != DEFERRED and planner.slots(current, state.next_n) == planner.slots(
            state.planned_sms, state.next_n
        ):
            return schedule
        replanned = state.replans.get(current)
        if replanned is None:
            replanned = self._plan(context_lens, state.block_kv, current, indices)
            state.replans[current] = replanned
            self.stats.replans += 1
        return replanned

    def _resolve_capturing(
        self, state: ScheduleState | None, schedule: Any, context_lens: Any, block_kv: int, indices: Any, current: int
    ) -> Any:
        if state is not None and not state.ahead and current == state.planned_sms:
            # every replay follows a build of this count's plan
            self.stats.capture_consistent += 1
            return schedule
        capture = self.planner.capture_id()
        if state is not None and capture is not None:
            key = (capture, current)
            replanned = state.in_graph.get(key)
            if replanned is _ITSELF:
                return schedule
            if replanned is None:
                replanned = self._plan(context_lens, state.block_kv, current, indices)
                state.in_graph[key] = replanned
                self.stats.captured_replans += 1
            return replanned
        self.stats.captured_replans += 1
        return self._plan(context_lens, state.block_kv if state is not None else block_kv, current, indices)

    @contextlib.contextmanager
    def microbatched_build(self) -> Iterator[None]:
        """Marks (on this thread) a build for a microbatched step."""
        depth = getattr(self._tls, "depth", 0)
        self._tls.depth = depth + 1
        try:
            yield
        finally:
            self._tls.depth = depth

    def in_microbatched_build(self) -> bool:
        return getattr(self._tls, "depth", 0) > 0

    def plan_ahead_sms(self, device: int) -> int | None:
        """The DBO count to plan for now, or None."""
        if not self.in_microbatched_build():
            return None
        return self._dbo_sms.get(device)

    def attach(self, control: SMControl) -> None:
        """Subscribe once (replays earlier budgets)."""
        with self._lock:
            if control.device in self._subscriptions:
                return
            self._subscriptions[control.device] = control.subscribe(self.on_budget, name="indexer_schedule_cache")

    def detach_all(self) -> None:
        with self._lock:
            for sub in self._subscriptions.values():
                sub.close()
            self._subscriptions.clear()

    def on_budget(self, event: BudgetEvent) -> None:
        budget = event.budget
        if event.kind != "announced":
            return
        if not budget.compute_knob:
            # this split leaves DeepGEMM's count alone
            self._dbo_sms.pop(budget.device, None)
            return
        self._dbo_sms[budget.device] = budget.compute
        self.warmup.warm(budget.device, budget.compute)
        # unannounced: the call site compiles (``jit_in_step``)


_CACHE: IndexerScheduleCache | None = None
_CACHE_LOCK = threading.Lock()


def schedule_cache() -> IndexerScheduleCache:
    """The process's cache, created on first use."""
    global _CACHE
    cache = _CACHE
    if cache is not None:
        return cache
    with _CACHE_LOCK:
        if _CACHE is None:
            _CACHE = IndexerScheduleCache()
        return _CACHE


def detach_schedule_cache() -> None:
    """Close the process cache's budget subscriptions (uninstall): SMControls that outlive the plugin publish to
    nobody. The cache itself stays, so what a harness configured survives a reinstall."""
    cache = _CACHE
    if cache is not None:
        cache.detach_all()
