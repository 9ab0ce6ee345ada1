"""The one log line that tells an operator dbo_runtime is active in a process: vLLM loads plugins before it
configures logging and forks workers with them loaded, so an INFO line in ``register()`` is seen nowhere. The
line is pending per process (by pid) and emitted at the first trigger that finds vLLM's handler configured."""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from dbo_runtime.core.log import ROOT, get_logger

if TYPE_CHECKING:
    from dbo_runtime.integration.features import FeatureState
    from dbo_runtime.integration.patching import PatchSet

logger = get_logger(__name__)

_lock = threading.Lock()
_summary: Callable[[], str] | None = None
_emitted_pid: int | None = None


def vllm_logging_configured() -> bool:
    """True once some handler would print our INFO lines."""
    node: logging.Logger | None = logging.getLogger(ROOT)
    while node is not None:
        if node.handlers:
            return True
        if not node.propagate:
            return False
        node = node.parent
    return False


def set_summary(summary: Callable[[], str] | None) -> None:
    """Install the line's text (a callable: lazy patches applied later count)."""
    global _summary, _emitted_pid
    with _lock:
        _summary = summary
        _emitted_pid = None


def flush() -> bool:
    """Emit the pending line if logging is configured; True when emitted."""
    global _emitted_pid
    pid = os.getpid()
    if _emitted_pid == pid or _summary is None:
        return False
    with _lock:
        if _emitted_pid == pid or _summary is None or not vllm_logging_configured():
            return False
        _emitted_pid = pid
        text = _summary()
    logger.info("%s", text)
    return True


def emitted_in_this_process() -> bool:
    return _emitted_pid == os.getpid()


def summary_line(
    patch_set: PatchSet, features: Mapping[str, FeatureState], release: str, skipped: Mapping[str, str]
) -> str:
    """``dbo_runtime: N patches installed for <release> (...) -- feature (patches), ...; guard: on``."""
    from dbo_runtime import __version__

    groups: dict[str, list[str]] = {}
    states = patch_set.status()
    for status in states:
        groups.setdefault(status.patch.feature, []).append(status.patch.name.partition(".")[2] or status.patch.name)
    applied = sum(1 for s in states if s.state == "installed")
    waiting = sum(1 for s in states if s.state == "pending")
    broken = [s.patch.name for s in states if s.state == "broken"]
    armable = sum(1 for s in states if s.patch.armed_at_first_microbatch and s.state in ("installed", "pending"))
    optional = [s.patch.name for s in states if s.state == "skipped"] + sorted(skipped)
    listing = ", ".join(f"{feature} ({len(names)})" for feature, names in groups.items())
    others = [f"{name}: {state.describe()}" for name, state in features.items() if state.verdict != "verified"]
    text = (
        f"dbo_runtime: {len(patch_set.patches)} patches installed for {release} (dbo_runtime {__version__}; "
        f"{applied} applied in this process, {waiting} apply when vLLM imports their module"
        + (f", {armable} of them from the first microbatched run on" if armable else "")
        + (f", {len(optional)} optional skipped: {', '.join(optional)}" if optional else "")
        + (f", BROKEN: {', '.join(broken)}" if broken else "")
        + f") -- {listing}; guard: on"
    )
    if others:
        text += " -- " + "; ".join(others)
    return text
