"""Patches put in force at the process's first microbatched run (``Patch.armed_at_first_microbatch``).

The per-access top-k hooks (the index-group methods and the ``topk_indices_buffer`` descriptors) hand back
vLLM's own object whenever no thread of the process is a microbatch thread, and the indexer's logits call site
hands vLLM's call through while every schedule was planned for the SM count in force; yet as Python frames they
still cost about 0.3-3 us per access, some 480 accesses per eager step at GLM-5.3 depth (78 call sites alone
with DeepSeek-V3.2's), in every engine that never microbatches: DBO off, DP 1 (vLLM 0.33.0 splits no step
there), or a DBO engine before its first split step. So those patches are prepared, fingerprinted and shielded
at install like any other, but their targets keep vLLM's originals until the first of: a runner's join point
(``ubatch_guard``, on the main thread before the first microbatch thread starts), a microbatched metadata build
(plan-ahead leaves its schedule to the call site), a write to DeepGEMM's SM count (before the count changes),
an indexer builder registered while such a write could go unseen, and, as the net for any other path to a
microbatch thread, ``UBatchContext.__enter__`` on the thread itself once it holds the CPU hand-off, before the
model runs there. From then on they stay in force for the life of the installation.

Why once and not per run: putting the originals back after every join would change the classes twice per
step, and every class change spends one of the type version tags CPython gives a class (1000 per class from
3.13, after which attribute lookups on it lose their cache for good); a long-running server would lose more
than it saved. A target that cannot be set raises on the main thread before any microbatch runs (the step stops
with the cause), and is recorded on a microbatch thread and raised after the join (``ubatch_failures``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

from dbo_runtime.core.errors import PatchError


@dataclass(eq=False)
class ArmedEntry:
    """One target: ``arm`` sets the replacement in place of vLLM's original."""

    name: str
    arm: Callable[[], None]
    on_failure: Callable[[str], None] | None = None
    """Told (the message) when the target cannot be set, outside the arming lock: the owning ``PatchSet`` marks
    the patch broken and tells its failure listeners, so the guard's refusal names what is missing."""
    armed: bool = False


class MicrobatchArming:
    """The armed-at-first-microbatch patches of the installed set, and whether they are in force yet."""

    def __init__(self) -> None:
        self._entries: list[ArmedEntry] = []
        self._lock = threading.Lock()
        self.armed = False
        """Read without the lock on every microbatched run: set once, under the lock, after every entry is armed."""
        self.armed_by: str | None = None
        """Which path armed them (the ``where`` of the first ``arm`` that set every target)."""

    # -- PatchSet's side ----------------------------------------------------------------------------
    def register(self, entry: ArmedEntry) -> None:
        """Add a target; once armed, it is armed at once (a lazy module imported after the first run)."""
        with self._lock:
            if self.armed:
                entry.arm()
                entry.armed = True
            self._entries.append(entry)

    def unregister(self, entry: ArmedEntry) -> bool:
        """Forget a target (uninstall); True when its replacement is in place and the caller must restore it.
        With no target left the process is unarmed again, so a later installation starts with vLLM's originals."""
        with self._lock:
            self._entries = [e for e in self._entries if e is not entry]
            if not self._entries:
                self.armed = False
                self.armed_by = None
            return entry.armed

    # -- the runners' side --------------------------------------------------------------------------
    def arm(self, where: str) -> None:
        """Put every target in force; ``where`` names the path (``armed_by``). A target that cannot be set raises:
        the caller's step must not run microbatches with it missing."""
        if self.armed:
            return
        with self._lock:
            if self.armed:
                return
            failed: tuple[ArmedEntry, Exception] | None = None
            for entry in self._entries:
                if entry.armed:
                    continue
                try:
                    entry.arm()
                except Exception as exc:
                    # What was armed stays (correct, only slower) and uninstall restores it; the next run tries the rest.
                    failed = (entry, exc)
                    break
                entry.armed = True
            else:
                self.armed = True
                self.armed_by = where
                return
        entry, error = failed
        message = f"{entry.name} could not be put in force at the first microbatched run ({error!r})"
        if entry.on_failure is not None:
            try:
                entry.on_failure(message)
            except Exception:  # a listener must not hide the failure itself
                pass
        raise PatchError(
            f"dbo_runtime: {message}; the step stops here instead of running its microbatches on vLLM's shared "
            "top-k state"
        ) from error

    # -- introspection ------------------------------------------------------------------------------
    def names(self) -> list[str]:
        with self._lock:
            return [e.name for e in self._entries]

    def armed_names(self) -> list[str]:
        with self._lock:
            return [e.name for e in self._entries if e.armed]

    def counters(self) -> dict[str, int | str | None]:
        with self._lock:
            return {
                "armed_patches": sum(e.armed for e in self._entries),
                "armable_patches": len(self._entries),
                "armed_by": self.armed_by,
            }


ARMING = MicrobatchArming()
"""The process-wide registry every ``PatchSet`` registers with and every patched runner arms."""


__all__ = ["ARMING", "ArmedEntry", "MicrobatchArming"]
