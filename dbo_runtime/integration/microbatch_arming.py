"""Patches put in force at the first microbatched run (``Patch.armed_at_first_microbatch``): per-access hooks
cost a frame per layer, so unsplit engines keep vLLM's originals. Never disarmed (docs/architecture.md)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

from dbo_runtime.core.errors import PatchError


@dataclass(eq=False)
class ArmedEntry:
    """One target; ``arm`` puts the replacement in place."""

    name: str
    arm: Callable[[], None]
    on_failure: Callable[[str], None] | None = None
    armed: bool = False


class MicrobatchArming:
    """The installed set's armable targets, and whether they are in force yet."""

    def __init__(self) -> None:
        self._entries: list[ArmedEntry] = []
        self._lock = threading.Lock()
        self.armed = False
        """Read without the lock; set under it once every entry is armed."""
        self.armed_by: str | None = None

    def register(self, entry: ArmedEntry) -> None:
        """Add a target, armed at once if the set already is."""
        with self._lock:
            if self.armed:
                entry.arm()
                entry.armed = True
            self._entries.append(entry)

    def unregister(self, entry: ArmedEntry) -> bool:
        """Forget a target; True when the caller must restore its original."""
        with self._lock:
            self._entries = [e for e in self._entries if e is not entry]
            if not self._entries:
                self.armed = False
                self.armed_by = None
            return entry.armed

    def arm(self, where: str) -> None:
        """Put every target in force; raises (the step must not run) if one cannot be set."""
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
                    failed = (entry, exc)
                    break
                entry.armed = True
            else:
                self.armed = True
                self.armed_by = where
                return
        entry, cause = failed
        message = f"{entry.name} could not be put in force at the first microbatched run ({cause!r})"
        if entry.on_failure is not None:
            try:
                entry.on_failure(message)
            except Exception:
                pass
        raise PatchError(
            f"dbo_runtime: {message}; the step stops here instead of running its microbatches on vLLM's shared "
            "top-k state"
        ) from cause

    def names(self) -> list[str]:
        with self._lock:
            return [e.name for e in self._entries]

    def counters(self) -> dict[str, int | str | None]:
        with self._lock:
            return {
                "armed_patches": sum(e.armed for e in self._entries),
                "armable_patches": len(self._entries),
                "armed_by": self.armed_by,
            }


ARMING = MicrobatchArming()
