"""Run many real-engine runs at once on one machine, within an engine budget.

Why: one engine start of even a tiny DSA model takes 35-70 s (imports, model
init, DeepGEMM JIT, graph capture), mostly on one CPU core, while the GPU is
nearly idle. The test plan has dozens of runs; running them in parallel (each
with a fixed KV-cache size, so concurrent memory profiling cannot mislead vLLM)
is what makes the plan fit in a bounded GPU session. Timed benchmarks never use this pool.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

from dbo_runtime.harness.launch import RunSpec, launch
from tests.harness.runs import reassemble

VISIBLE = "CUDA_VISIBLE_DEVICES"
"""A run pinned to physical GPUs sets it in its ``env``."""


def assign_gpus(specs: Sequence[RunSpec], gpus: Sequence[int] | None) -> list[RunSpec]:
    """Spread single-rank runs over ``gpus`` round robin; DP runs see every GPU (vLLM maps rank r to GPU r)."""
    if not gpus:
        return list(specs)
    out = []
    turn = 0
    for spec in specs:
        if VISIBLE not in spec.env and spec.dp == 1:
            spec = replace(spec, env={**spec.env, VISIBLE: str(gpus[turn % len(gpus)])})
            turn += 1
        out.append(spec)
    return out


MEMORY_BUDGET = 0.95
"""Of each GPU's memory, what the runs admitted at once may ask for together (their ``--gpu-memory-utilization``):
vLLM requires that share free when each engine starts (``v1/worker/utils.py:request_memory``)."""
DEFAULT_UTILIZATION = 0.92
"""vLLM 0.33.0's ``gpu_memory_utilization`` when a run does not set it."""


def memory_share(spec: RunSpec) -> float:
    from dbo_runtime.harness.launch import engine_arg

    raw = engine_arg(spec.engine_args, "--gpu-memory-utilization")
    try:
        return float(raw) if raw is not None else DEFAULT_UTILIZATION
    except ValueError:
        return DEFAULT_UTILIZATION


def gpus_of(spec: RunSpec, visible: Sequence[int] | None) -> list[int]:
    """The GPUs a run's ranks use: its assigned ones, or rank r on GPU r (vLLM's offline DP)."""
    if VISIBLE in spec.env:
        return [int(gpu) for gpu in spec.env[VISIBLE].split(",")]
    return list(range(spec.dp)) if visible is None else list(visible[: spec.dp])


Job = tuple[str, int, Callable[[], dict[str, Any]]]
"""(label, engines it runs at once, function returning its record): work that is not one RunSpec,
e.g. a ``dbo-runtime verify`` invocation or a ``vllm serve`` session."""


def run_all(
    specs: Sequence[RunSpec],
    workdir: Path,
    *,
    max_engines: int,
    gpus: Sequence[int] | None = None,
    progress: Callable[[str], None] | None = None,
    jobs: Sequence[Job] = (),
) -> dict[str, dict[str, Any]]:
    """Records by label. A run needs ``dp`` engine slots and its ``--gpu-memory-utilization`` share on each GPU it
    uses; runs start in the given order as both free up (``MEMORY_BUDGET`` per GPU)."""
    if max_engines < 1:
        raise ValueError("max_engines must be >= 1")
    labels = [s.label for s in specs] + [j[0] for j in jobs]
    if len(set(labels)) != len(labels):
        raise ValueError(f"duplicate run labels: {sorted({x for x in labels if labels.count(x) > 1})}")
    todo = assign_gpus(specs, gpus)
    free = [max_engines]
    committed: dict[int, float] = {}
    cond = threading.Condition()
    records: dict[str, dict[str, Any]] = {}

    def fits(devices: list[int], share: float) -> bool:
        # A run alone always starts (a share above the budget is its own engine's problem, not the pool's).
        return all(committed.get(d, 0.0) == 0.0 or committed.get(d, 0.0) + share <= MEMORY_BUDGET + 1e-9 for d in devices)

    def one(item: RunSpec | Job) -> None:
        devices: list[int] = []
        share = 0.0
        if isinstance(item, RunSpec):
            label, engines = item.label, item.dp
            spec = item
            devices, share = gpus_of(spec, gpus), memory_share(spec)

            def work() -> dict[str, Any]:
                return launch(spec, workdir, progress)
        else:
            label, engines, work = item
        need = min(engines, max_engines)
        with cond:
            cond.wait_for(lambda: free[0] >= need and fits(devices, share))
            free[0] -= need
            for d in devices:
                committed[d] = committed.get(d, 0.0) + share
        try:
            records[label] = work()
            if not isinstance(item, RunSpec):  # a RunSpec's record is on disk already (launch)
                target = workdir / label
                target.mkdir(parents=True, exist_ok=True)
                (target / "record.json").write_text(json.dumps(records[label], indent=1, default=str))
        except Exception as exc:  # a broken launch is a failed run, not a broken plan
            records[label] = {"label": label, "ok": False, "error": f"launcher: {exc!r}"}
            if progress is not None:
                progress(f"{label}: launcher error {exc!r}")
        finally:
            with cond:
                free[0] += need
                for d in devices:
                    committed[d] = max(0.0, committed.get(d, 0.0) - share)
                cond.notify_all()

    # Threads only wait on child processes; jobs (the longest: two runs each) go first.
    items: list[RunSpec | Job] = [*jobs, *todo]
    with ThreadPoolExecutor(max_workers=len(items) or 1) as pool:
        list(pool.map(one, items))
    return {label: records[label] for label in labels}


def replay_all(workdir: Path, labels: Sequence[str]) -> dict[str, dict[str, Any]]:
    """Records by label, read back from a finished session's run directories instead of run again.

    Why: a GPU session is scarce and its raw runs (``<workdir>/<label>/``: spec, rank results with
    every request's tokens and logprobs, logs) outlive it; when a test's criterion is corrected, the
    same evidence can be judged again on any machine. Each run is assembled again (``reassemble``),
    so what the current harness would conclude from those files counts, also for runs a time limit
    cut off. Nothing is started, so nothing new is proven about the engine. A label the session did
    not run is a failed record naming the missing directory; a job record's ``workdir`` (where a
    ``verify`` run keeps its per-run records) is moved to the replayed directory."""
    if not workdir.is_dir():
        raise ValueError(f"replay directory {workdir} does not exist (expected <dir>/<label>/record.json)")
    records: dict[str, dict[str, Any]] = {}
    for label in labels:
        record = reassemble(workdir / label)
        if record is None:
            records[label] = {"label": label, "ok": False, "error": f"replay: {workdir / label} holds no run (not started, or a job killed before it wrote its record)", "failure_signatures": []}
            continue
        if "workdir" in record:
            record["workdir"] = str(workdir / label)
        records[label] = record
    return records


__all__ = ["MEMORY_BUDGET", "assign_gpus", "gpus_of", "memory_share", "replay_all", "run_all"]
