"""Interleaved timing of several live engines: start them all, then let one run a rep at a time (same conditions
for every configuration, no restart per rep), the order rotated by one each rep so none always runs first."""

from __future__ import annotations

import functools
import itertools
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
"""How long an engine may take to exit after its last turn, per rank."""


def _turn(root: Path, rep: int, dp: int, deadline: float, finished: Callable[[], bool]) -> str:
    """Wait for every rank's ``ready``, start the turn, wait for ``done``; returns ``done`` or what stopped it."""
    ready = [root / f"ready-rep{rep}.{r}" for r in range(dp)]
    if not _wait(ready, deadline, finished) or time.monotonic() > deadline:
        return f"never ready ({'time limit' if time.monotonic() > deadline else 'it ended'})"
    (root / f"go-rep{rep}").touch()
    if not _wait([root / f"done-rep{rep}.{r}" for r in range(dp)], deadline, finished):
        return f"did not finish ({'it ended' if finished() else 'time limit'})"
    return "done"


def run_interleaved(
    specs: Sequence[RunSpec], workdir: Path, reps: int, *, timeout_s: float = 1800.0,
    progress: Callable[[str], None] | None = None,
) -> dict[str, dict[str, Any]]:  # fmt: skip
    """Launch every spec, then run turn ``rep r`` of each, the order rotated by ``r``. Turn files live in a
    folder made for this call, so an earlier run's engine cannot answer; past ``timeout_s`` no turn starts
    and every engine this process launched is killed."""
    for spec in specs:
        if not (spec.bench and spec.bench.get("coordinated")):
            raise ValueError(f"{spec.label}: bench.coordinated must be set")
    labels = [spec.label for spec in specs]
    if len(set(labels)) != len(labels):
        raise ValueError(f"labels must be distinct (two runs would share one directory): {sorted(labels)}")
    token = f"run-{os.getpid()}-{time.monotonic_ns()}"
    barriers = {spec.label: workdir / spec.label / "barrier" / token for spec in specs}
    for folder in barriers.values():
        clear_dir(folder.parent)
        folder.mkdir()
    records: dict[str, dict[str, Any]] = {}

    def work(s: RunSpec) -> None:
        records[s.label] = launch(s, workdir, progress, barrier=barriers[s.label])

    threads = [threading.Thread(target=work, args=(spec,), daemon=True) for spec in specs]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout_s
    total = int(specs[0].bench.get("warmup", 1)) + reps if specs and specs[0].bench else 0
    order: list[tuple[int, str]] = []
    expired = False
    try:
        for rep, i in itertools.product(range(total), range(len(specs))):
            spec = specs[(rep + i) % len(specs)]  # the order rotated by one each rep
            finished = functools.partial(records.__contains__, spec.label)
            outcome = _turn(barriers[spec.label], rep, spec.dp, deadline, finished)
            if progress is not None:
                progress(f"rep {rep}: {spec.label} {outcome}")
            if outcome == "done":
                order.append((rep, spec.label))
            if expired := outcome.endswith("(time limit)"):
                break
    except BaseException:
        # The engines run in sessions of their own that SIGINT does not reach: kill them before leaving.
        kill_all()
        raise
    if expired:
        if progress is not None:
            progress(f"time limit of {timeout_s:.0f} s: no further turn started; every engine killed")
        kill_all()
    # Let the engines shut down, then kill what is left: no engine outlives this call.
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
