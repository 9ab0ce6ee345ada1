"""Measurement of dbo_runtime's own host time inside a real engine (``DBO_RUNTIME_SELF_TIME=1``).

A bench harness, not part of the wheel: ``selftime_site/sitecustomize.py`` (on the run's ``PYTHONPATH``,
``tests.e2e.plan.bench_env``) calls ``install()`` in every process, which hands the plugin this module as
its ``PatchSet`` instrument and adds a ``self_time`` section to the worker stats. The plugin's cost per step is smaller than the run-to-run noise of a whole-engine A/B, so every
patched function, descriptor and property is wrapped at install time and the time spent *in plugin
code* is accumulated, with calls per patch. Time inside the vLLM original a wrapper calls is
excluded; a kernel the plugin launches counts. The wrappers' own cost is measured and reported
beside the totals, which are therefore an upper bound: warm (``_calibrate``) and in situ (``SAMPLE_EVERY``).
"""

from __future__ import annotations

import functools
import gc
import random
import sys
import threading
import time
import types
from typing import Any

from dbo_runtime.core.switches import parse_switch

ENV = "DBO_RUNTIME_SELF_TIME"
ROW_HOOK = f"{__name__}:bench_row"
"""What a self-timed run names in ``DBO_HARNESS_ROW_HOOK``, so its bench rows carry the figures per step."""

_clock = time.perf_counter_ns


class _ThreadClock:
    """One thread's clock and tables since its last fold; only this thread writes them."""

    __slots__ = ("calls", "counts", "gc_count", "gc_ns", "gc_since", "in_plugin", "long", "name", "ns", "since", "tick", "total_ns")

    def __init__(self) -> None:
        self.in_plugin = False
        self.since = 0
        self.total_ns = 0
        self.calls = 0
        self.name = ""
        self.counts: dict[str, int] = {}
        self.ns: dict[str, int] = {}
        self.long: dict[str, list[int]] = {}
        self.gc_count = 0
        self.gc_ns = 0
        self.gc_since = 0
        """When a collection that started inside plugin code began (0: none under way)."""
        self.tick = random.randrange(SAMPLE_EVERY)
        """Outermost timed calls and accesses on this thread, for ``SAMPLE_EVERY``; a random phase, so threads
        that live one step each do not sample the same hooks every step."""


class _Local(threading.local):
    clock: _ThreadClock | None = None  # a class default: a missing attribute costs an AttributeError


_tls = _Local()
_totals = [0, 0, 0, 0]
"""[ns, calls, gc collections, gc ns] of all threads, folded in when a thread's outermost plugin call
returns (vLLM starts new microbatch threads every step)."""
_totals_lock = threading.Lock()
_untimed: set[str] = set()
_by_patch: dict[str, int] = {}
"""Calls (functions) and accesses (descriptors) per patch name, folded in under ``_totals_lock``."""
_kinds: dict[str, str] = {}
_ns_by_patch: dict[str, int] = {}
"""Exclusive plugin time per patch."""
MEASUREMENT = frozenset({"stats.worker_rpc"})
"""Patches that only read the measurement out: left unwrapped, so reading costs no step time."""
LONG_NS = 20_000
SAMPLE_EVERY = 8
"""Every 8th outermost hook on a thread is preceded, at its own site, by an empty timed hook of its kind
(``NULL_CALL`` calls an original, as a patched function does; ``NULL_ACCESS``): the clock's own charge in the
caches a hook really meets, which the warm calibration misses. Null hooks stay out of the totals; ``snapshot``
reports them as ``in_situ_null``, less their charges over ``LONG_NS`` (a lost GIL is no clock cost)."""
NULL_CALL, NULL_ACCESS = "selftime.null_call", "selftime.null_access"
_long_by_patch: dict[str, list[int]] = {}
"""[count, ns] per patch of single charges over ``LONG_NS`` (a kernel launch, a lost GIL), kept apart."""


def enabled() -> bool:
    return parse_switch(ENV)


def install() -> None:
    """Time every replacement the plugin installs in this process from now on, and publish the totals in
    each worker-stats snapshot (``snap["self_time"]`` and the ``self_time_*`` summary counters)."""
    from dbo_runtime.integration import plugin, worker_stats

    plugin.INSTRUMENT = sys.modules[__name__]
    if _publish not in worker_stats.EXTENSIONS:
        worker_stats.EXTENSIONS.append(_publish)


def _publish(snap: dict[str, Any]) -> None:
    timed = snap["self_time"] = snapshot(calibrate=True)
    snap["summary"].update(
        self_time_ns=timed["total_ns"], self_time_calls=timed["calls"], self_time_gc_count=timed["gc_count"], self_time_gc_ns=timed["gc_ns"],
        **{f"self_time_null_{kind}_{unit}": timed["in_situ_null"][kind][i] for kind in ("call", "access") for i, unit in enumerate(("n", "ns"))},
    )


def _mine() -> _ThreadClock:
    clock = _tls.clock
    if clock is None:
        clock = _ThreadClock()
        _tls.clock = clock
    return clock


def _fold(clock: _ThreadClock) -> None:
    with _totals_lock:
        _totals[0] += clock.total_ns
        _totals[1] += clock.calls
        _totals[2] += clock.gc_count
        _totals[3] += clock.gc_ns
        for mine, table in ((clock.counts, _by_patch), (clock.ns, _ns_by_patch)):
            for name, value in mine.items():
                table[name] = table.get(name, 0) + value
            mine.clear()
        for name, (count, ns) in clock.long.items():
            total = _long_by_patch.get(name)
            if total is None:
                _long_by_patch[name] = [count, ns]
            else:
                total[0] += count
                total[1] += ns
        clock.long.clear()
    clock.total_ns = 0
    clock.calls = 0
    clock.gc_count = 0
    clock.gc_ns = 0


def _on_gc(phase: str, info: dict[str, Any]) -> None:
    """Count apart a garbage collection that starts inside plugin code: the clock charges it to the plugin."""
    clock = _tls.clock
    if clock is None:
        return
    if phase == "start":
        clock.gc_since = _clock() if clock.in_plugin else 0
    elif clock.gc_since:
        clock.gc_count += 1
        clock.gc_ns += _clock() - clock.gc_since
        clock.gc_since = 0


def _watch_gc() -> None:
    if _on_gc not in gc.callbacks:
        gc.callbacks.append(_on_gc)


def time_plugin(fn: Any, name: str, *, fold: bool = True) -> Any:
    """Wrap a replacement so its exclusive time is accumulated; ``fold=False`` keeps it thread-local."""
    _watch_gc()
    if name in MEASUREMENT:
        _kinds[name] = "measurement"
        return fn
    if isinstance(fn, property):
        _kinds[name] = "property"
        timed_get = _timed(fn.fget, name, fold) if fn.fget is not None else None
        return property(timed_get, fn.fset, fn.fdel, fn.__doc__)
    if not isinstance(fn, types.FunctionType):
        if hasattr(type(fn), "__get__") and hasattr(type(fn), "__set__"):
            _kinds[name] = "descriptor"
            return TimedDescriptor(fn, name, fold)
        _untimed.add(name)
        return fn
    _kinds[name] = "function"
    return _timed(fn, name, fold)


def _timed(fn: Any, name: str, fold: bool, sample: bool = True) -> Any:
    @functools.wraps(fn)
    def timed(*args: Any, **kwargs: Any) -> Any:
        clock = _mine()
        if sample and not clock.in_plugin:
            clock.tick += 1
            if clock.tick % SAMPLE_EVERY == 0:
                _null_call()
        was = _switch(clock, True)
        outer, clock.name = clock.name, name
        clock.calls += 1
        counts = clock.counts
        counts[name] = counts.get(name, 0) + 1
        try:
            return fn(*args, **kwargs)
        finally:
            _switch(clock, was)
            clock.name = outer
            if fold and not was:
                _fold(clock)

    return timed


class TimedDescriptor:
    """A data descriptor whose ``__get__`` / ``__set__`` / ``__delete__`` are timed and counted like a call."""

    def __init__(self, inner: Any, name: str, fold: bool = True, sample: bool = True) -> None:
        self.inner = inner
        self.name = name
        self.fold = fold
        self.sample = sample

    def _enter(self) -> tuple[_ThreadClock, bool, str]:
        clock = _mine()
        if self.sample and not clock.in_plugin:
            clock.tick += 1
            if clock.tick % SAMPLE_EVERY == 0:
                _NULL_HOLDER.x  # noqa: B018
        was = _switch(clock, True)
        outer, clock.name = clock.name, self.name
        clock.calls += 1
        counts = clock.counts
        counts[self.name] = counts.get(self.name, 0) + 1
        return clock, was, outer

    def _leave(self, clock: _ThreadClock, was: bool, outer: str) -> None:
        _switch(clock, was)
        clock.name = outer
        if self.fold and not was:
            _fold(clock)

    def __get__(self, obj: Any, objtype: type | None = None) -> Any:
        if obj is None:
            return self
        clock, was, outer = self._enter()
        try:
            return self.inner.__get__(obj, objtype)
        finally:
            self._leave(clock, was, outer)

    def __set__(self, obj: Any, value: Any) -> None:
        clock, was, outer = self._enter()
        try:
            self.inner.__set__(obj, value)
        finally:
            self._leave(clock, was, outer)

    def __delete__(self, obj: Any) -> None:
        clock, was, outer = self._enter()
        try:
            self.inner.__delete__(obj)
        finally:
            self._leave(clock, was, outer)


def _switch(clock: _ThreadClock, in_plugin: bool) -> bool:
    """Charge the time since the last switch, enter ``in_plugin`` mode, return the mode left."""
    now = _clock()
    was = clock.in_plugin
    if was:
        spent = now - clock.since
        clock.total_ns += spent
        name = clock.name
        ns = clock.ns
        ns[name] = ns.get(name, 0) + spent
        if spent > LONG_NS:
            long = clock.long.get(name)
            if long is None:
                clock.long[name] = [1, spent]
            else:
                long[0] += 1
                long[1] += spent
    clock.in_plugin = in_plugin
    clock.since = now
    return was


def pause_for_original(original: Any) -> Any:
    """Wrap the vLLM original so time inside it is not charged to the plugin."""
    if not isinstance(original, types.FunctionType):
        return original

    @functools.wraps(original)
    def untimed(*args: Any, **kwargs: Any) -> Any:
        clock = _mine()
        was = _switch(clock, False)
        try:
            return original(*args, **kwargs)
        finally:
            _switch(clock, was)

    return untimed


class _Plain:
    """A minimal data descriptor: the calibration's untimed baseline for an access."""

    def __get__(self, obj: Any, objtype: type | None = None) -> Any:
        return obj.__dict__["x"]

    def __set__(self, obj: Any, value: Any) -> None:
        obj.__dict__["x"] = value


class _NullHolder:
    x = TimedDescriptor(_Plain(), NULL_ACCESS, sample=False)


_NULL_HOLDER = _NullHolder()
_NULL_HOLDER.__dict__["x"] = None  # set untimed: the import is no sample
_null_original = pause_for_original(lambda: None)
_null_call = _timed(lambda: _null_original(), NULL_CALL, True, sample=False)


def _calibrate(samples: int = 2000) -> tuple[float, float, float, float]:
    """The wrappers' own cost per call and per access, and the part the clock charges to the plugin;
    measured on a throwaway thread, so nothing reaches the totals."""
    result = [0.0, 0.0, 0.0, 0.0]

    def empty() -> None:
        return None

    def measure() -> None:
        wrapped = _timed(empty, "calibration", False, sample=False)
        start = _clock()
        for _ in range(samples):
            wrapped()
        timed = _clock() - start
        start = _clock()
        for _ in range(samples):
            empty()
        result[0] = max(0.0, (timed - (_clock() - start)) / samples)

        plain_cls = type("Plain", (), {"x": _Plain()})
        timed_cls = type("Timed", (), {"x": TimedDescriptor(_Plain(), "calibration", fold=False, sample=False)})
        plain, timed_obj = plain_cls(), timed_cls()
        plain.x = timed_obj.x = 1
        start = _clock()
        for _ in range(samples):
            timed_obj.x  # noqa: B018
        timed = _clock() - start
        start = _clock()
        for _ in range(samples):
            plain.x  # noqa: B018
        result[1] = max(0.0, (timed - (_clock() - start)) / samples)

        clock = _mine()
        paused = pause_for_original(empty)
        hook = _timed(lambda: paused(), "calibration", False, sample=False)
        before = clock.total_ns
        for _ in range(samples):
            hook()
        result[2] = (clock.total_ns - before) / samples
        before = clock.total_ns
        for _ in range(samples):
            timed_obj.x  # noqa: B018
        result[3] = (clock.total_ns - before) / samples

    thread = threading.Thread(target=measure, name="dbo-runtime-selftime-calibration", daemon=True)
    thread.start()
    thread.join()
    for table in (_by_patch, _kinds, _ns_by_patch, _long_by_patch):
        table.pop("calibration", None)
    return result[0], result[1], result[2], result[3]


def snapshot(calibrate: bool = True) -> dict[str, Any]:
    """Totals over every thread that ran plugin code (main and microbatch threads), and calls per patch."""
    per_call, per_access, charged_call, charged_access = _calibrate() if calibrate else (0.0, 0.0, 0.0, 0.0)
    with _totals_lock:
        total_ns, calls, gc_count, gc_ns = _totals
        by_patch, ns_by_patch = dict(_by_patch), dict(_ns_by_patch)
        long_by_patch = {name: list(v) for name, v in _long_by_patch.items()}
    null = {}
    for kind, name in (("call", NULL_CALL), ("access", NULL_ACCESS)):
        n, ns, (long_n, long_ns) = by_patch.pop(name, 0), ns_by_patch.pop(name, 0), long_by_patch.pop(name, [0, 0])
        total_ns, calls, null[kind] = total_ns - ns, calls - n, [n - long_n, ns - long_ns]
    return {
        "enabled": enabled(),
        "total_ns": total_ns,
        "calls": calls,
        "gc_count": gc_count,
        "gc_ns": gc_ns,
        "by_patch": by_patch,
        "ns_by_patch": ns_by_patch,
        "long_by_patch": long_by_patch,
        "long_ns": LONG_NS,
        "kinds": dict(_kinds),
        "overhead_ns_per_call": per_call,
        "overhead_ns_per_access": per_access,
        "charged_ns_per_call": charged_call,
        "charged_ns_per_access": charged_access,
        "untimed": sorted(_untimed - {"calibration"}),
        "in_situ_null": null,
    }


def bench_row(row: dict[str, Any], s0: Any, s1: Any, s2: Any, steps: int) -> None:
    """The self-timer's columns of a bench rep (``engine_runner.ROW_HOOK_ENV``): each figure per decode step, as
    the T-token pass less the 1-token pass over ``steps - 1``, like the step time itself."""
    self_ns = _per_decode_step(s0, s1, s2, "self_time_ns", steps)
    if self_ns is None or not enabled():  # switched off, the counters measure nothing
        return
    row["plugin_self_us_per_step"] = self_ns / 1e3
    calls = _per_decode_step(s0, s1, s2, "self_time_calls", steps)
    if calls is None:
        return
    row["plugin_calls_per_step"] = calls
    row["plugin_calls_per_step_by_patch"] = per_step_by_patch(s0, s1, s2, steps)
    ns = per_step_by_patch(s0, s1, s2, steps, key="ns_by_patch")
    row["plugin_self_us_per_step_by_patch"] = {name: v / 1e3 for name, v in ns.items()}
    long_ns = per_step_by_patch(s0, s1, s2, steps, key="long_by_patch", index=1)
    row["plugin_long_per_step_by_patch"] = {
        name: {"count": n, "us": long_ns.get(name, 0.0) / 1e3}
        for name, n in per_step_by_patch(s0, s1, s2, steps, key="long_by_patch", index=0).items()
    }
    row["plugin_self_net_us_per_step"] = net_self_us(row["plugin_self_us_per_step"], row["plugin_calls_per_step_by_patch"], s2)
    null = {kind: [_per_decode_step(s0, s1, s2, f"self_time_null_{kind}_{unit}", steps) for unit in ("n", "ns")] for kind in ("call", "access")}
    row["plugin_self_in_situ_net_us_per_step"] = net_self_us(row["plugin_self_us_per_step"], row["plugin_calls_per_step_by_patch"], s2, null)
    gc_ns = _per_decode_step(s0, s1, s2, "self_time_gc_ns", steps)
    gc_count = _per_decode_step(s0, s1, s2, "self_time_gc_count", steps)
    if gc_ns is not None and gc_count is not None:
        row["plugin_gc_us_per_step"] = gc_ns / 1e3
        row["plugin_gc_per_step"] = gc_count


def _per_decode_step(s0: Any, s1: Any, s2: Any, key: str, steps: int) -> float | None:
    from dbo_runtime.harness.runner import summary_delta

    one, full = summary_delta(s0, s1, key), summary_delta(s1, s2, key)
    if one is None or full is None:
        return None
    return max(0.0, (full - one) / (steps - 1))


def net_self_us(
    self_us: float, per_step: dict[str, float], snap: list[dict[str, Any]] | None, null: dict[str, list[float | None]] | None = None
) -> float | None:
    """``self_us`` less what the self-timer's own clock charged: as calibrated warm, or, given ``null`` (``kind ->
    [count, ns]`` of the empty hooks in the same decode steps), as charged to them at the hooks' own sites."""
    timers = [w["self_time"] for w in snap or [] if w.get("self_time")]
    per: dict[str, float | None]
    if null is not None:
        per = {k: ns / n if n and ns is not None and n > 0 else None for k, (n, ns) in (("function", null["call"]), ("descriptor", null["access"]))}
        if per["function"] is None and per["descriptor"] is None:
            return None
    else:
        timer = next((t for t in timers if t.get("charged_ns_per_call") is not None), None)
        if timer is None:
            return None
        per = {"function": timer["charged_ns_per_call"], "descriptor": timer["charged_ns_per_access"]}
    kinds = {name: kind for t in timers for name, kind in t.get("kinds", {}).items()}
    each = [(n, per["descriptor" if kinds.get(name) == "descriptor" else "function"]) for name, n in per_step.items() if n]
    charged = [n * ns for n, ns in each if ns is not None]
    return None if len(charged) < len(each) else max(0.0, self_us - sum(charged) / 1e3)


def per_step_by_patch(s0: Any, s1: Any, s2: Any, steps: int, key: str = "by_patch", index: int | None = None) -> dict[str, float]:
    """A self-timer table per decode step, per patch (the T-token pass minus the 1-token pass)."""

    def counts(snap: list[dict[str, Any]] | None) -> dict[str, int]:
        out: dict[str, int] = {}
        for worker in snap or []:
            for name, n in (worker.get("self_time") or {}).get(key, {}).items():
                out[name] = out.get(name, 0) + int(n if index is None else n[index])
        return out

    c0, c1, c2 = counts(s0), counts(s1), counts(s2)
    return {
        name: max(0.0, ((c2.get(name, 0) - c1.get(name, 0)) - (c1.get(name, 0) - c0.get(name, 0))) / (steps - 1))
        for name in sorted(set(c2))
    }


__all__ = ["ENV", "MEASUREMENT", "TimedDescriptor", "bench_row", "enabled", "install", "pause_for_original", "snapshot", "time_plugin"]
