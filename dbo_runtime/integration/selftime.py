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
_totals = [0, 0]
"""[ns, calls] of every thread, folded in when a thread's outermost plugin call returns: vLLM starts
two new microbatch threads per DBO step, so per-thread records would grow without bound."""
_totals_lock = threading.Lock()
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
    return clock


def _fold(clock: _ThreadClock) -> None:
    with _totals_lock:
        _totals[0] += clock.total_ns
        _totals[1] += clock.calls
    clock.total_ns = 0
    clock.calls = 0


def time_plugin(fn: Any, name: str, *, fold: bool = True) -> Any:
    """Wrap a replacement so its exclusive time is accumulated (functions only).

    ``fold=False`` keeps the time in the calling thread's clock (calibration runs on a
    throwaway thread, so it never reaches the totals)."""
    if not isinstance(fn, types.FunctionType):
        _untimed.add(name)
        return fn

    @functools.wraps(fn)
    def timed(*args: Any, **kwargs: Any) -> Any:
        clock = _mine()
        was = _switch(clock, True)
        clock.calls += 1
        try:
            return fn(*args, **kwargs)
        finally:
            _switch(clock, was)
            if fold and not was:
                _fold(clock)

    return timed


def _switch(clock: _ThreadClock, in_plugin: bool) -> bool:
    """Charge the plugin time since the last switch (if the thread was in plugin code), enter
    ``in_plugin`` mode and return the mode it left: the one step both wrappers take on entry and exit."""
    now = _clock()
    was = clock.in_plugin
    if was:
        clock.total_ns += now - clock.since
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


def _overhead_ns_per_call(samples: int = 2000) -> float:
    """Measured cost of the wrapper itself around an empty function (upper-bound correction).

    Runs on a throwaway thread with a non-folding wrapper: the calibration's calls never reach the
    plugin totals."""
    result: list[float] = [0.0]

    def empty() -> None:
        return None

    def measure() -> None:
        wrapped = time_plugin(empty, "calibration", fold=False)
        start = _clock()
        for _ in range(samples):
            wrapped()
        timed = _clock() - start
        start = _clock()
        for _ in range(samples):
            empty()
        bare = _clock() - start
        result[0] = max(0.0, (timed - bare) / samples)

    thread = threading.Thread(target=measure, name="dbo-runtime-selftime-calibration", daemon=True)
    thread.start()
    thread.join()
    return result[0]


def snapshot(calibrate: bool = True) -> dict[str, Any]:
    """Totals over every thread that ran plugin code (main and microbatch threads)."""
    with _totals_lock:
        total_ns, calls = _totals
    return {
        "enabled": enabled(),
        "total_ns": total_ns,
        "calls": calls,
        "overhead_ns_per_call": _overhead_ns_per_call() if calibrate else 0.0,
        "untimed": sorted(_untimed - {"calibration"}),
    }


__all__ = ["ENV", "enabled", "pause_for_original", "snapshot", "time_plugin"]
