"""Opt-in measurement of dbo_runtime's own host time inside a real engine.

Why: the plugin's cost per decode step is the number operators ask for, and it
cannot be read off an A/B of whole engines (run-to-run noise of an eager step is
larger than the plugin). With ``DBO_RUNTIME_SELF_TIME=1`` every patched
function is wrapped at install time so that time spent *in plugin code* is
accumulated, and time spent inside the vLLM original it calls through is
excluded (the ``original`` handed to ``Patch.make`` is wrapped to pause the
clock). Kernels the plugin launches itself (a re-plan) count as plugin time;
that is the point.

Off by default: the wrapping adds two ``perf_counter_ns`` pairs per call, which
is itself measured (``overhead_ns_per_call``) and reported next to the total so
the number is an honest upper bound. Class data descriptors (the top-k buffer
attribute) and non-function replacements are not wrapped; ``untimed`` lists them.
"""

from __future__ import annotations

import functools
import threading
import time
import types
from typing import Any

from dbo_runtime.core.switches import parse_switch

ENV = "DBO_RUNTIME_SELF_TIME"

_clock = time.perf_counter_ns


class _ThreadClock:
    __slots__ = ("calls", "in_plugin", "since", "total_ns")

    def __init__(self) -> None:
        self.in_plugin = False
        self.since = 0
        self.total_ns = 0
        self.calls = 0


_tls = threading.local()
_all: list[_ThreadClock] = []
_all_lock = threading.Lock()
_untimed: set[str] = set()


def enabled() -> bool:
    try:
        return parse_switch(ENV)
    except Exception:
        return False


def _mine() -> _ThreadClock:
    clock = getattr(_tls, "clock", None)
    if clock is None:
        clock = _ThreadClock()
        _tls.clock = clock
        with _all_lock:
            _all.append(clock)
    return clock


def time_plugin(fn: Any, name: str) -> Any:
    """Wrap a replacement so its exclusive time is accumulated (functions only)."""
    if not isinstance(fn, types.FunctionType):
        _untimed.add(name)
        return fn

    @functools.wraps(fn)
    def timed(*args: Any, **kwargs: Any) -> Any:
        clock = _mine()
        now = _clock()
        was = clock.in_plugin
        if was:
            clock.total_ns += now - clock.since
        clock.in_plugin = True
        clock.since = now
        clock.calls += 1
        try:
            return fn(*args, **kwargs)
        finally:
            end = _clock()
            clock.total_ns += end - clock.since
            clock.in_plugin = was
            clock.since = end

    return timed


def pause_for_original(original: Any) -> Any:
    """Wrap the vLLM original so time inside it is not charged to the plugin."""
    if not isinstance(original, types.FunctionType):
        return original

    @functools.wraps(original)
    def untimed(*args: Any, **kwargs: Any) -> Any:
        clock = _mine()
        now = _clock()
        was = clock.in_plugin
        if was:
            clock.total_ns += now - clock.since
        clock.in_plugin = False
        try:
            return original(*args, **kwargs)
        finally:
            clock.in_plugin = was
            clock.since = _clock()

    return untimed


def _overhead_ns_per_call(samples: int = 2000) -> float:
    """Measured cost of the wrapper itself around an empty function (upper-bound correction)."""

    def empty() -> None:
        return None

    wrapped = time_plugin(empty, "calibration")
    start = _clock()
    for _ in range(samples):
        wrapped()
    timed = _clock() - start
    start = _clock()
    for _ in range(samples):
        empty()
    bare = _clock() - start
    return max(0.0, (timed - bare) / samples)


def snapshot(calibrate: bool = True) -> dict[str, Any]:
    """Totals over every thread that ran plugin code (main and microbatch threads)."""
    with _all_lock:
        clocks = list(_all)
    before = {id(c): (c.total_ns, c.calls) for c in clocks}
    overhead = _overhead_ns_per_call() if calibrate else 0.0
    # Calibration ran on this thread: report the counts from before it.
    total_ns = sum(v[0] for v in before.values())
    calls = sum(v[1] for v in before.values())
    return {
        "enabled": enabled(),
        "total_ns": total_ns,
        "calls": calls,
        "overhead_ns_per_call": overhead,
        "untimed": sorted(_untimed - {"calibration"}),
    }


__all__ = ["ENV", "enabled", "pause_for_original", "snapshot", "time_plugin"]
