"""Interleaved timing of several live engines: start them all, then let one run a rep at a time.

Why: comparing DBO on/off (or plugin/vanilla) needs the configurations measured under the same
conditions. Restarting engines per rep costs a minute each; keeping every engine alive and giving
them turns interleaves the reps at no start-up cost, while the engines that wait are idle (vLLM's
engine core blocks on its input queue). The order rotates by one each rep (A B C, B C A, C A B, ...)
so no configuration always runs first in a round; the cyclic neighbours stay the same.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from dbo_runtime.harness.launch import RunSpec, launch


def _wait(paths: Sequence[Path], deadline: float, give_up: Callable[[], bool]) -> bool:
    while not all(p.exists() for p in paths):
        if time.monotonic() > deadline or give_up():
            return False
        time.sleep(0.05)
    return True


def _clear_barrier(root: Path) -> None:
    """Before any engine starts: a directory reused from an earlier run (the same labels under the same
    ``--out``) still holds that run's ``ready-`` and ``done-`` files, which would pass for this run's engines
    while ``launch`` is still clearing them in its own thread."""
    if root.is_dir():
        for stale in root.iterdir():
            stale.unlink(missing_ok=True)


def _finished(records: dict[str, dict[str, Any]], label: str) -> Callable[[], bool]:
    return lambda: label in records


def run_interleaved(
    specs: Sequence[RunSpec],
    workdir: Path,
    reps: int,
    *,
    timeout_s: float = 1800.0,
    progress: Callable[[str], None] | None = None,
) -> dict[str, dict[str, Any]]:
    """Launch every spec (each with ``bench.coordinated``), then run turn ``rep r`` of each, the order
    rotated by ``r``."""
    records: dict[str, dict[str, Any]] = {}
    threads = []
    for spec in specs:
        if not (spec.bench and spec.bench.get("coordinated")):
            raise ValueError(f"{spec.label}: bench.coordinated must be set")
    for spec in specs:
        _clear_barrier(workdir / spec.label / "barrier")
    for spec in specs:

        def work(s: RunSpec = spec) -> None:
            records[s.label] = launch(s, workdir, progress)

        t = threading.Thread(target=work, daemon=True)
        t.start()
        threads.append(t)
    deadline = time.monotonic() + timeout_s
    total = int(specs[0].bench.get("warmup", 1)) + reps if specs and specs[0].bench else 0
    order: list[tuple[int, str]] = []
    for rep in range(total):
        shift = rep % len(specs)
        for spec in [*specs[shift:], *specs[:shift]]:
            root = workdir / spec.label / "barrier"
            finished = _finished(records, spec.label)
            ready = [root / f"ready-rep{rep}.{r}" for r in range(spec.dp)]
            if not _wait(ready, deadline, finished):
                if progress is not None:
                    progress(f"{spec.label}: never ready for rep {rep} (failed or timed out)")
                continue
            (root / f"go-rep{rep}").touch()
            done = [root / f"done-rep{rep}.{r}" for r in range(spec.dp)]
            if not _wait(done, deadline, finished):
                if progress is not None:
                    progress(f"rep {rep}: {spec.label} did not finish (failed or timed out)")
                continue
            order.append((rep, spec.label))
            if progress is not None:
                progress(f"rep {rep}: {spec.label} done")
    for t in threads:
        t.join(timeout=max(1.0, deadline - time.monotonic()))
    for spec in specs:
        records.setdefault(spec.label, {"label": spec.label, "ok": False, "error": "no record (timeout)"})
        records[spec.label]["turn_order"] = [label for _, label in order]
    return records


__all__ = ["run_interleaved"]
