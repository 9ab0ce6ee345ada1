"""Patches in force only while DBO microbatch threads can run (``Patch.while_microbatching``).

The per-access top-k hooks (the index-group methods and the ``topk_indices_buffer`` descriptors) hand back
vLLM's own object whenever no thread of the process is a microbatch thread, yet as Python frames they still
cost about 0.3-3 us per access, some 480 accesses per eager step at GLM-5.3 depth, in every engine and step
that never microbatches (DBO off, DP 1, steps under vLLM's DBO token threshold). vLLM 0.33.0 starts
microbatch threads in exactly three main-thread calls, each of which ``ubatch_guard`` already wraps: MRV1
``UBatchWrapper._run_ubatches`` and ``_capture_ubatches``, and MRV2 ``UBatchRunner.begin_capturable_run``
up to its ``finish()``. So those patches are prepared, fingerprinted and shielded at install like any other,
but their targets keep vLLM's originals until a window opens: ``open`` sets every replacement on the main
thread before the first microbatch thread starts, and ``close`` puts the originals back after the join, once
no microbatch thread is registered. Outside a window the targets are vLLM's own objects (``is``-identical).

A replacement that cannot be set makes ``open`` raise on the main thread, before any thread starts: the step
fails with the cause rather than running its microbatches on vLLM's shared state. An original that cannot be
put back is logged and its replacement stays: it is correct there, only slower.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

from dbo_runtime.core.errors import PatchError
from dbo_runtime.core.log import get_logger
from dbo_runtime.integration import ubatch_ids

logger = get_logger(__name__)


@dataclass(eq=False)
class WindowEntry:
    """One target: ``arm`` sets the replacement, ``disarm`` puts vLLM's original back."""

    name: str
    arm: Callable[[], None]
    disarm: Callable[[], None]
    armed: bool = False


class MicrobatchWindow:
    """The process's open microbatched runs (``depth``) and the patches armed for them."""

    def __init__(self, threads_registered: Callable[[], bool] = ubatch_ids.any_ubatch_thread) -> None:
        self._entries: list[WindowEntry] = []
        self._lock = threading.Lock()
        self._threads_registered = threads_registered
        self.depth = 0
        self.opened = 0
        """Windows opened in this process (one per microbatched run or capture)."""
        self.kept_armed = 0
        """Closes that found a microbatch thread still registered and left the patches armed."""

    # -- PatchSet's side ----------------------------------------------------------------------------
    def register(self, entry: WindowEntry) -> None:
        """Add a target; inside an open window it is armed at once (a module imported mid-run)."""
        with self._lock:
            if self.depth > 0:
                entry.arm()
                entry.armed = True
            self._entries.append(entry)

    def unregister(self, entry: WindowEntry) -> bool:
        """Forget a target (uninstall); True when its replacement is in place and the caller must restore it."""
        with self._lock:
            self._entries = [e for e in self._entries if e is not entry]
            return entry.armed

    # -- the runners' side --------------------------------------------------------------------------
    def open(self) -> None:
        """Arm every target before microbatch threads start; all or none (the error names the target)."""
        with self._lock:
            self.depth += 1
            self.opened += 1
            done: list[WindowEntry] = []
            try:
                for entry in self._entries:
                    if not entry.armed:
                        entry.arm()
                        entry.armed = True
                        done.append(entry)
            except BaseException as exc:
                for armed in reversed(done):
                    self._disarm(armed)
                self.depth -= 1
                if not isinstance(exc, Exception):
                    raise
                raise PatchError(
                    f"dbo_runtime could not put {entry.name} in force for a microbatched run ({exc!r}); the step "
                    "stops here instead of running its microbatches on vLLM's shared top-k state"
                ) from exc

    def close(self) -> None:
        """After the join: put the originals back once no run is open and no microbatch thread is registered."""
        with self._lock:
            self.depth = max(self.depth - 1, 0)
            if self.depth > 0 or not any(e.armed for e in self._entries):
                return
            try:
                busy = self._threads_registered()
            except Exception:
                busy = True
            if busy:  # a thread outlived its join (vLLM raised mid-run): correct armed, so stay armed
                self.kept_armed += 1
                return
            for entry in self._entries:
                self._disarm(entry)

    @staticmethod
    def _disarm(entry: WindowEntry) -> None:
        try:
            entry.disarm()
        except Exception as exc:
            logger.error("dbo_runtime: putting vLLM's original back for %s failed (%r); the hook stays", entry.name, exc)
        else:
            entry.armed = False

    # -- introspection ------------------------------------------------------------------------------
    def armed_names(self) -> list[str]:
        with self._lock:
            return [e.name for e in self._entries if e.armed]

    def names(self) -> list[str]:
        with self._lock:
            return [e.name for e in self._entries]

    def counters(self) -> dict[str, int]:
        with self._lock:
            return {
                "windows_opened": self.opened,
                "window_patches": len(self._entries),
                "window_patches_armed": sum(e.armed for e in self._entries),
                "window_kept_armed": self.kept_armed,
            }


WINDOW = MicrobatchWindow()
"""The process-wide window every ``PatchSet`` registers with and every patched runner opens."""


__all__ = ["WINDOW", "MicrobatchWindow", "WindowEntry"]
