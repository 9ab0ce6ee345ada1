"""Progress on stderr for the long-running commands (``verify``, ``simulate``), so stdout stays the result.

Why plain lines: piped or logged, a rich bar draws nothing, and a long run looked hung with no output for
minutes. On a terminal ``steps`` shows rich's transient bar; elsewhere one line per step. ``phase`` names what
runs and, while the context is entered, says every ``tick_s`` how long it has been running.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from typing import Any


def seconds(value: float) -> str:
    return f"{value:.0f} s" if value < 120 else f"{value / 60:.0f} min"


class Progress:
    def __init__(self, prefix: str, *, total_steps: int = 0, enabled: bool = True, tick_s: float = 15.0) -> None:
        self.prefix = prefix
        self.enabled = enabled
        self.tick_s = tick_s
        self.total = total_steps
        self.done = 0
        self.phase = ""
        self.started = time.monotonic()
        self._stop = threading.Event()
        self.bar: Any = None
        if total_steps and sys.stderr.isatty():
            try:
                from rich.console import Console
                from rich.progress import Progress as Bar
            except ImportError:
                return
            self.bar = Bar(transient=True, console=Console(stderr=True))

    def say(self, text: str) -> None:
        if self.enabled:
            sys.stderr.write(f"{self.prefix} {text}\n")
            sys.stderr.flush()

    def set(self, phase: str) -> None:
        self.phase = phase
        self.started = time.monotonic()
        self.say(f"{phase} ...")

    def __enter__(self) -> Progress:
        if self.bar is not None:
            self.bar.__enter__()
        elif not self.total:

            def tick() -> None:
                while not self._stop.wait(self.tick_s):
                    self.say(f"{self.phase}: {time.monotonic() - self.started:.0f} s")

            threading.Thread(target=tick, daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self.bar is not None:
            self.bar.__exit__(None, None, None)

    def steps(self, name: str, steps: int) -> Callable[[int, int], None]:
        """A callback ``advance(done, total)`` for one run of ``steps`` steps."""
        task = self.bar.add_task(name, total=steps) if self.bar is not None else None

        def advance(done: int, total: int) -> None:
            self.done += 1
            if self.bar is not None:
                self.bar.update(task, completed=done)
                return
            elapsed = time.monotonic() - self.started
            left = elapsed / self.done * max(self.total - self.done, 0)
            self.say(f"{name}: step {done}/{total} ({seconds(elapsed)} elapsed, about {seconds(left)} left)")

        return advance
