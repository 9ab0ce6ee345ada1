"""IndexerScheduleCache: DeepGEMM's paged-MQA schedule, kept valid for the SM count in force (vllm#60732).

vLLM's DSA indexer builder plans the schedule for the whole GPU, but under DBO the logits kernel runs while
``deep_gemm.set_num_sms(total - comm)`` is in force and DeepGEMM asserts ``rows == slots(num_sms) + 1``; inside
a FULL CUDA graph the check never runs at replay, and a schedule planned for another count reads wrong logits
silently. So every schedule tensor carries what it was planned for (``track``: the count is recorded, never
inferred from the rows -- SM90 ``next_n == 4`` plans ``num_sms // 2 + 1``), and the call site resolves it for
DeepGEMM's *live* count (whoever turned the knob; the call-site hook is in force from the process's first
watched write, microbatched build or microbatched run on, and vLLM's own function before, when every schedule
was planned for the count in force: ``integration/microbatch_arming``): untouched when they match and no capture
is underway,
else re-planned once per count for the rest of the forward; while capturing, the planner is recorded into the
graph (it reads the persistent ``context_lens``) and shared only within that capture. Plan-ahead: a runner
building microbatch metadata knows the step is microbatched, so the build plans for the announced DBO count
(zero call-site re-plans in steady state), or defers the planner to the first eager call site
(``track_deferred``: a FULL-graph replay re-plans inside itself and never reads the build's plan).
``update_draft_decode_metadata`` rewrites ``seq_lens`` in place, so ``invalidate`` drops the re-plans.
The kernels come through a ``SchedulePlanner`` (DeepGEMM's by default, a fake on CPU); warm-up lives in
``planner_warmup``.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from dbo_runtime.adapters.cuda_graph import CAPTURES
from dbo_runtime.adapters.deep_gemm import next_n_of
from dbo_runtime.core.log import get_logger
from dbo_runtime.services.planner_warmup import PlannerProfile, PlannerWarmup
from dbo_runtime.services.sm_control import BudgetEvent, SMControl, Subscription, sm_control_for

logger = get_logger(__name__)

STATE_ATTR = "_dbo_schedule_state"
"""Attribute set on a tracked schedule tensor (torch tensors carry a ``__dict__``)."""

_ITSELF = object()
"""``in_graph`` value meaning "the tracked schedule itself was produced inside this capture"."""

DEFERRED = -1
"""``ScheduleState.planned_sms`` while the tensor holds no plan yet (``track_deferred``). No live SM
count equals it, so the call site's fast path (``live == planned_sms``) always falls through to
``resolve``, which plans it first."""



class SchedulePlanner(Protocol):
    """DeepGEMM's side of the cache: live SM count, slot rule, planner kernel, capture probes."""

    name: str

    def get_num_sms(self) -> int: ...

    def slots(self, num_sms: int, next_n: int) -> int: ...

    def plan(self, context_lens: Any, block_kv: int, num_sms: int, indices: Any | None = None) -> Any: ...

    def capturing(self) -> bool: ...

    def capture_id(self) -> int | None:
        """CUDA capture-sequence id of the current stream (None: unknown or not capturing)."""
        ...


@dataclass(frozen=True, eq=False)
class DeferredPlan:
    """The planner call a build skipped: its SM count and inputs (views of persistent buffers)."""

    sms: int
    context_lens: Any
    indices: Any | None


@dataclass(eq=False)
class ScheduleState:
    """What one schedule tensor was planned for, plus its re-plans."""

    planned_sms: int
    """The count the tensor's contents were planned for; ``DEFERRED`` while they are not planned yet."""
    block_kv: int
    next_n: int
    ahead: bool = False
    """Planned for the DBO count by plan-ahead rather than for the builder's own count."""
    generation: int = 0
    replans: dict[int, Any] = field(default_factory=dict)
    """Eager re-plans by SM count; valid until ``invalidate``."""
    in_graph: dict[tuple[int, int], Any] = field(default_factory=dict)
    """Re-plans recorded into a capture, by ``(capture id, SM count)``."""
    deferred: DeferredPlan | None = None
    """The build's skipped planner call, run by the first eager call site (``track_deferred``)."""

    @property
    def intended_sms(self) -> int:
        """The count the tensor is (or will be, once its deferred plan runs) planned for."""
        return self.deferred.sms if self.deferred is not None else self.planned_sms


@dataclass
class ScheduleCacheStats:
    replans: int = 0
    """Eager call-site planner kernels (the number plan-ahead drives to 0)."""
    captured_replans: int = 0
    """Planner kernels recorded into CUDA graphs."""
    capture_consistent: int = 0
    """Captured call sites that read the builder's schedule directly (count consistent at every replay)."""
    untracked_replans: int = 0
    """Re-plans of schedules no build was seen for (no per-forward reuse possible)."""
    planned_ahead: int = 0
    """Builds that planned for the DBO count directly (deferred or not)."""
    deferred: int = 0
    """Planned-ahead builds that launched no planner (``track_deferred``)."""
    deferred_plans: int = 0
    """Deferred plans run by an eager call site (a FULL-graph replay runs none)."""
    invalidations: int = 0
    warmups: int = 0
    """Planner kernels launched by warm-up (compiles when new)."""
    warm_skipped_in_capture: int = 0
    warm_failures: int = 0
    """Warm-up launches that raised (logged once; the variant is then compiled at first use)."""
    jit_in_step: int = 0
    """Planner variants first launched by a serving step instead of the warm-up: DeepGEMM JIT-compiles each one
    there (or loads it from ``DG_JIT_CACHE_DIR``) while the DP group waits. 0 is the goal."""
    jit_at_start: int = 0
    """The same, met by vLLM's own start-up runs (profiling, warm-up, graph capture) before serving began."""
    warm_ns: int = 0
    """Host time spent in warm-up (the load-time cost of keeping JIT out of steps)."""
    builders_stepped_aside: int = 0
    """Indexer builder registrations that found the hooks stepping aside (``IndexerScheduleCache.steps_aside``):
    engines that never microbatch. Planner launches of such engines are vLLM's own and not counted in ``jit_*``."""


class IndexerScheduleCache:
    """See the module docstring. One per process: ``schedule_cache()``."""

    def __init__(self, planner: SchedulePlanner | None = None, *, defer_plan_ahead: bool = True) -> None:
        self._planner = planner
        self.defer_plan_ahead = defer_plan_ahead
        """Planned-ahead builds skip their planner (``track_deferred``); False plans at build (the simulator and
        ``graphs/bench_replay_planning.py`` measure both modes side by side)."""
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
        """Every indexer builder of this process belongs to an engine that never microbatches (vLLM 0.33's
        ``parallel_config.use_ubatching`` false: no ``--enable-dbo``, ``--ubatch-size`` 1), vLLM's writers of
        DeepGEMM's count are watched and none has written it: the builder, planner and call-site hooks then hand
        vLLM's calls straight through. Why that is safe: in vLLM 0.33 only the microbatch SM control turns
        DeepGEMM's count (through ``ubatch_utils.deep_gemm_set_num_sms``), so such an engine plans and reads its
        schedules for one count, as vanilla does. A write that bypasses vLLM's wrapper (``deep_gemm.set_num_sms``
        itself) then meets vanilla's behaviour, not the live-count re-plan. Read without the lock on the hot paths;
        ``note_builder`` and ``stop_stepping_aside`` write it under the lock."""
        self._dbo_builders = 0
        self._pinned = False
        """A write to DeepGEMM's count was seen: never step aside again in this process."""

    # -- engines that never microbatch -------------------------------------------------------
    def note_builder(self, microbatches: bool, *, writers_watched: bool) -> bool:
        """An indexer builder was created; whether the hooks now step aside (``steps_aside``). A builder of an
        engine that may microbatch ends stepping aside for the process (its builds must be tracked), and so does
        a process where vLLM's writers of DeepGEMM's count are not all watched (a write could not end it)."""
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
        """Something writes DeepGEMM's SM count: from now on every build is tracked and every call site resolves
        (schedules built meanwhile are untracked; the call site checks their rows against the live count). Under
        the lock, so a builder being noted at the same time cannot turn stepping aside back on."""
        if self._pinned:  # every microbatched step writes twice: one read once pinned
            return
        with self._lock:
            self._pinned = True
            self.steps_aside = False

    # -- planner ---------------------------------------------------------------------------
    @property
    def planner(self) -> SchedulePlanner:
        if self._planner is None:
            from dbo_runtime.adapters.deep_gemm import DeepGemmPlanner

            self._planner = DeepGemmPlanner()
        return self._planner

    def _bind(self) -> None:
        planner = self.planner
        probes = getattr(planner, "hot_probes", None)
        if probes is not None:
            self._num_sms, self._capturing = probes()
        else:
            self._num_sms, self._capturing = planner.get_num_sms, planner.capturing

    # -- tracking --------------------------------------------------------------------------
    def track(
        self, schedule: Any, *, planned_sms: int, block_kv: int, next_n: int, ahead: bool = False
    ) -> ScheduleState:
        """Record what ``schedule`` was planned for (a new build: a fresh state).

        ``ahead``: planned for the DBO count by plan-ahead. A schedule planned for
        the builder's own count is re-planned for that same count before every
        replay of a graph that reads it (every step builds), so a capture at that
        count may read it directly; a planned-ahead one shares a builder buffer
        with non-microbatched steps and is always re-planned inside the graph.
        """
        state = ScheduleState(planned_sms=int(planned_sms), block_kv=int(block_kv), next_n=int(next_n), ahead=ahead)
        setattr(schedule, STATE_ATTR, state)
        return state

    def track_deferred(
        self, schedule: Any, *, planned_sms: int, block_kv: int, next_n: int, context_lens: Any, indices: Any | None
    ) -> ScheduleState:
        """Record a planned-ahead schedule whose build launched no planner (``schedule`` holds no plan yet).

        ``schedule`` must already have the shape of a plan for ``planned_sms``
        (``slots + 1`` rows). The first eager ``resolve`` plans it from
        ``context_lens`` / ``indices`` -- the tensors the build would have
        planned from, read when the kernel is about to read the schedule -- and
        copies the plan into ``schedule``; a capture records its own planner, as
        for any planned-ahead schedule (``ahead`` is set), so a replay never
        reads ``schedule``.
        """
        state = ScheduleState(
            planned_sms=DEFERRED,
            block_kv=int(block_kv),
            next_n=int(next_n),
            ahead=True,
            deferred=DeferredPlan(int(planned_sms), context_lens, indices),
        )
        setattr(schedule, STATE_ATTR, state)
        self.stats.deferred += 1
        return state

    def _run_deferred(self, state: ScheduleState, schedule: Any) -> None:
        """Plan a deferred schedule into its own tensor (eager only: never inside a capture).

        This runs at the first call site of a microbatched step, on a microbatch thread, and allocates: DeepGEMM's
        planner returns a new ``slots + 1``-row tensor (a few hundred bytes, from the caching allocator's small
        pool), which is copied into the builder's buffer. vLLM's own build would have made the same allocation on
        the main thread. An allocation failure here is caught by the call-site shield, which hands out the
        placeholder logits reserved at model load, and the step then raises after the join, naming the call
        site; the step neither hangs nor computes with a wrong schedule.
        """
        deferred = state.deferred
        assert deferred is not None
        plan = self._plan(deferred.context_lens, state.block_kv, deferred.sms, deferred.indices)
        state.deferred = None
        self.stats.deferred_plans += 1
        if tuple(plan.shape) == tuple(schedule.shape):
            schedule.copy_(plan)
            state.planned_sms = deferred.sms
        else:  # not reachable through the build hook (same slot rule); keep it correct anyway
            state.replans[deferred.sms] = plan

    @staticmethod
    def state_of(schedule: Any) -> ScheduleState | None:
        return getattr(schedule, STATE_ATTR, None)

    def invalidate(self, schedule: Any, *, planned_sms: int | None = None) -> None:
        """The inputs of ``schedule`` were rewritten in place: drop every re-plan of it."""
        state = self.state_of(schedule)
        if state is None:
            return
        state.replans.clear()
        state.in_graph.clear()
        state.generation += 1
        if planned_sms is not None:
            # The caller re-planned the tensor in place: a deferred plan is no longer owed.
            state.planned_sms = int(planned_sms)
            state.deferred = None
        self.stats.invalidations += 1

    # -- the call site ---------------------------------------------------------------------
    def fits(self, schedule: Any) -> bool:
        """The call site's fast path: ``schedule`` was planned for DeepGEMM's live count and no capture is
        underway (then ``resolve`` would return it untouched). One dict read, one counter read, one call."""
        state = schedule.__dict__.get(STATE_ATTR)
        live = self._num_sms
        captures = self._captures
        return (
            state is not None
            and live is not None
            and captures.installed
            and not captures.active
            and live() == state.planned_sms
        )

    def register_profile(
        self, device_index: int, profile: PlannerProfile, *, full_sms: int | None = None, microbatches: bool = True
    ) -> None:
        """An indexer builder exists: warm its planners (``PlannerWarmup.register_profile``)."""
        self.warmup.register_profile(device_index, profile, full_sms=full_sms, microbatches=microbatches)

    def warm(self, device_index: int, num_sms: int, *, dbo: bool = True) -> int:
        return self.warmup.warm(device_index, num_sms, dbo=dbo)

    def note_plan(self, context_lens: Any, block_kv: int, num_sms: int, indices: Any | None) -> None:
        self.warmup.note_plan(context_lens, block_kv, num_sms, indices)

    def _plan(self, context_lens: Any, block_kv: int, num_sms: int, indices: Any | None) -> Any:
        self.note_plan(context_lens, block_kv, num_sms, indices)
        return self.planner.plan(context_lens, block_kv, num_sms, indices)

    def resolve(self, schedule: Any, context_lens: Any, indices: Any | None, block_source: Any) -> Any:
        """The schedule the logits kernel must get for DeepGEMM's live SM count.

        ``block_source`` (an int, or the 4-D ``kv_cache`` whose ``shape[1]`` is
        the block size) is only read for schedules no build was seen for;
        tracked ones re-plan with their own block size. It is passed unevaluated
        because a ``.shape`` read costs as much as the whole fast path.
        """
        num_sms = self._num_sms
        if num_sms is None:
            self._bind()
            num_sms = self._num_sms
        current = num_sms()  # type: ignore[misc]
        state = schedule.__dict__.get(STATE_ATTR)
        if state is not None and current == state.planned_sms:
            # The precise capture probe costs 300-650 ns on an H200 host; the process-wide
            # capture counter (installed with the plugin) answers "no capture" in ~20 ns.
            captures = self._captures
            if (captures.installed and captures.active == 0) or not self._capturing():  # type: ignore[misc]
                return schedule
        block_kv = block_source if isinstance(block_source, int) else int(block_source.shape[1])
        return self._resolve_slow(state, schedule, context_lens, block_kv, indices, current)

    def live_num_sms(self) -> int:
        """DeepGEMM's SM count now (what the logits kernel will assert against)."""
        if self._num_sms is None:
            self._bind()
        return int(self._num_sms())  # type: ignore[misc]

    def _resolve_slow(
        self, state: ScheduleState | None, schedule: Any, context_lens: Any, block_kv: int, indices: Any, current: int
    ) -> Any:
        planner = self.planner
        if self._capturing():  # type: ignore[misc]
            return self._resolve_capturing(state, schedule, context_lens, block_kv, indices, current)
        if state is None:
            if int(schedule.shape[0]) == planner.slots(current, next_n_of(context_lens)) + 1:
                # Not ours to know what it was planned for; DeepGEMM's own check passes.
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
            # e.g. SM90 next_n=4 with 113 vs 112 SMs: same slot count, same schedule.
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
            # Builder's own count, in force at capture: every replay of this graph follows a
            # build that writes the same count's plan into the same buffer (a non-DBO FULL
            # decode graph, or DBO with partitioning off). No planner kernel in the graph.
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
        # Unknown capture identity or untracked schedule: record a planner for this call.
        self.stats.captured_replans += 1
        return self._plan(context_lens, state.block_kv if state is not None else block_kv, current, indices)

    # -- plan-ahead ------------------------------------------------------------------------
    @contextlib.contextmanager
    def microbatched_build(self) -> Iterator[None]:
        """Marks (on this thread) that the metadata being built is for a microbatched step."""
        depth = getattr(self._tls, "depth", 0)
        self._tls.depth = depth + 1
        try:
            yield
        finally:
            self._tls.depth = depth

    def in_microbatched_build(self) -> bool:
        return getattr(self._tls, "depth", 0) > 0

    def plan_ahead_sms(self, device: int) -> int | None:
        """The DBO compute count to plan for now, or None to keep the builder's own count."""
        if not self.in_microbatched_build():
            return None
        return self._dbo_sms.get(device)

    # -- SMControl subscriber --------------------------------------------------------------
    def attach(self, control: SMControl) -> None:
        """Subscribe to ``control`` once (replays budgets announced before)."""
        with self._lock:
            if control.device in self._subscriptions:
                return
            self._subscriptions[control.device] = control.subscribe(self.on_budget, name="indexer_schedule_cache")

    def attach_device(self, device: int, total_sms: int) -> SMControl:
        control = sm_control_for(device, total_sms)
        self.attach(control)
        return control

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
            # The latest DBO engine's split leaves DeepGEMM's count alone (LL, NIXL): a count an earlier engine
            # of this process announced must not be planned ahead for, or every build would re-plan.
            self._dbo_sms.pop(budget.device, None)
            return
        self._dbo_sms[budget.device] = budget.compute
        self.warm(budget.device, budget.compute)
        # A budget nobody announced is only met when it is entered, inside a live step while the DP peers wait in
        # all-to-all: nothing is warmed then; the call site compiles the one variant it needs (``jit_in_step``).

    # -- warm-up ---------------------------------------------------------------------------
_CACHE: IndexerScheduleCache | None = None
_CACHE_LOCK = threading.Lock()


def schedule_cache() -> IndexerScheduleCache:
    """The process's cache (created on first use, with the real DeepGEMM planner).

    Called once per indexer layer: the common case is one global read, no lock.
    """
    global _CACHE
    cache = _CACHE
    if cache is not None:
        return cache
    with _CACHE_LOCK:
        if _CACHE is None:
            _CACHE = IndexerScheduleCache()
        return _CACHE


def set_schedule_cache_for_tests(cache: IndexerScheduleCache | None) -> IndexerScheduleCache | None:
    """Swap the process cache (tests with a fake planner); returns the previous one."""
    global _CACHE
    with _CACHE_LOCK:
        previous, _CACHE = _CACHE, cache
        return previous
