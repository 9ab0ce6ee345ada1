"""Interleaved timing of several live engines: start them all, then let one run a rep at a time.

Why: comparing DBO on/off (or plugin/vanilla) needs the configurations measured under the same
conditions. Restarting engines per rep costs a minute each; keeping every engine alive and giving
them turns interleaves the reps at no start-up cost, while the engines that wait are idle (vLLM's
engine core blocks on its input queue). The order rotates by one each rep (A B C, B C A, C A B, ...)
so no configuration always runs first in a round; the cyclic neighbours stay the same.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from dbo_runtime.harness.launch import RunSpec, clear_dir, kill_all, launch


def _wait(paths: Sequence[Path], deadline: float, give_up: Callable[[], bool]) -> bool:
    while not all(p.exists() for p in paths):
        if time.monotonic() > deadline or give_up():
            return False
        time.sleep(0.05)
    return True


SHUTDOWN_S = 60.0
"""How long an engine may take to exit after its last turn, per rank (``launch`` waits 30 s a rank, then kills)."""


def _turn(root: Path, rep: int, dp: int, deadline: float, finished: Callable[[], bool]) -> str:
    """Run one turn: wait for every rank's ``ready``, start it, wait for every rank's ``done``. Returns ``done``,
    or what stopped it: ``never ready`` / ``did not finish``, with ``(it ended)`` or ``(time limit)``."""
    ready = [root / f"ready-rep{rep}.{r}" for r in range(dp)]
    if not _wait(ready, deadline, finished) or time.monotonic() > deadline:
        return f"never ready ({'time limit' if time.monotonic() > deadline else 'it ended'})"
    (root / f"go-rep{rep}").touch()
    if not _wait([root / f"done-rep{rep}.{r}" for r in range(dp)], deadline, finished):
        return f"did not finish ({'it ended' if finished() else 'time limit'})"
    return "done"


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
    rotated by ``r``.

    Each spec's turn files live in a folder made for this call (``<label>/barrier/run-<pid>-<ns>``), after every
    earlier run's are removed: a reused ``--out`` / ``--workdir`` keeps an earlier run's ``ready-`` and ``done-``
    files, and an engine of that run may still be alive and waiting for its turn. Past ``timeout_s`` no further turn
    starts (a turn that starts then would overlap the one still running) and every engine is killed. ``kill_all`` kills
    every engine this process launched: no caller runs another launch beside this one."""
    for spec in specs:
        if not (spec.bench and spec.bench.get("coordinated")):
            raise ValueError(f"{spec.label}: bench.coordinated must be set")
    labels = [spec.label for spec in specs]
    if len(set(labels)) != len(labels):
        raise ValueError(f"labels must be distinct (two runs would share one directory): {sorted(labels)}")
    token = f"run-{os.getpid()}-{time.monotonic_ns()}"
    barriers = {}
    for spec in specs:
        clear_dir(workdir / spec.label / "barrier")
        barriers[spec.label] = workdir / spec.label / "barrier" / token
        barriers[spec.label].mkdir()
    records: dict[str, dict[str, Any]] = {}
    threads = []
    for spec in specs:

        def work(s: RunSpec = spec) -> None:
            records[s.label] = launch(s, workdir, progress, barrier=barriers[s.label])

        t = threading.Thread(target=work, daemon=True)
        t.start()
        threads.append(t)
    deadline = time.monotonic() + timeout_s
    total = int(specs[0].bench.get("warmup", 1)) + reps if specs and specs[0].bench else 0
    order: list[tuple[int, str]] = []
    expired = False
    try:
        for rep in range(total):
            shift = rep % len(specs)
            for spec in [*specs[shift:], *specs[:shift]]:
                outcome = _turn(barriers[spec.label], rep, spec.dp, deadline, _finished(records, spec.label))
                if progress is not None:
                    progress(f"rep {rep}: {spec.label} {outcome}")
                if outcome == "done":
                    order.append((rep, spec.label))
                expired = outcome.endswith("(time limit)")
                if expired:
                    break
            if expired:
                break
    except BaseException:
        # Ctrl-C (or any failure) here: the engines run in sessions of their own, which a terminal's SIGINT does not
        # reach, and their launch threads are daemons whose clean-up never runs at exit. Kill them before leaving.
        kill_all()
        raise
    if expired:
        if progress is not None:
            progress(f"time limit of {timeout_s:.0f} s: no further turn started; every engine killed")
        kill_all()
    # After the last turn an engine still shuts down (its CUDA teardown, up to 30 s a rank in launch): wait for it,
    # then kill what is left, so no record is missing for a run that finished and no engine outlives this call.
    reap_s = max(SHUTDOWN_S * max((s.dp for s in specs), default=1) + SHUTDOWN_S, deadline - time.monotonic())
    for t in threads:
        t.join(timeout=max(1.0, reap_s))
    if any(t.is_alive() for t in threads):
        kill_all()
        for t in threads:
            t.join(timeout=SHUTDOWN_S)
    result = dict(records)
    for spec in specs:
        result.setdefault(spec.label, {"label": spec.label, "ok": False, "error": "no record (timeout)"})
        result[spec.label]["turn_order"] = [label for _, label in order]
    return result


__all__ = ["run_interleaved"]
