"""Planner kernels and schedule copies per FULL-graph DBO step, before and after deferred plan-ahead.

A FULL-graph DBO step is a metadata build and a graph replay; the graph re-plans inside itself, so what the
build planned is never read. ``plan_at_build`` plans at the build, ``deferred`` does not. Counted per step: on the
host, exactly (build planners, schedule copies, call-site plans), and by the torch profiler in separate build-only
and replay-only windows (CUPTI's count of graph nodes is unreliable: differing replay windows are reported as an
artefact). Build + replay GPU time is timed separately, each replay checked bit-for-bit against the unsplit run.

    python3 graphs/bench_replay_planning.py [--steps 10] [--out graphs/results]
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import graphs._torch  # noqa: F401  (exits 3 with one line when torch is missing)

# isort: split

from graphs._args import EXIT_NO_DEVICE, add_out, integer, say_written
from graphs._plotting import bar_panels

VARIANTS = {"plan_at_build": {"defer_plan_ahead": False}, "deferred": {"defer_plan_ahead": True}}
PLANNER_KERNEL = "paged_mqa_logits_metadata"
TOP_NAMES = 8
HOST_KEYS = ("build_planner_launches", "build_schedule_copies", "build_schedule_noop_copies", "call_site_deferred_plans", "call_site_replans")


def _gpu_or_exit() -> Any:
    """The DeepGEMM backend, or one clear line and exit code 3 (cannot run here)."""

    from dbo_runtime.sim.backends import DeepGemmBackend
    from graphs._torch import refuse_without_kernels

    refused = refuse_without_kernels("bench_replay_planning")
    if refused is not None:
        raise SystemExit(EXIT_NO_DEVICE)
    try:
        return DeepGemmBackend()
    except Exception as exc:  # a wheel built for another torch
        print(f"bench_replay_planning: needs a CUDA GPU and DeepGEMM: DeepGEMM does not load ({type(exc).__name__}: {exc}); nothing measured", file=sys.stderr)
        raise SystemExit(EXIT_NO_DEVICE) from None


def _count(events: Any, steps: int) -> dict[str, Any]:
    """Per-step device activity of one profiler window: planner kernels, memcpys by kind, top names."""
    planners = dtod = other_memcpy = 0
    names: collections.Counter[str] = collections.Counter()
    for event in events:
        name = event.name or ""
        if getattr(event, "device_type", None) is None or "cuda" not in str(event.device_type).lower():
            continue
        names[name] += 1
        lowered = name.lower()
        if PLANNER_KERNEL in name:
            planners += 1
        elif "memcpy" in lowered:
            if "dtod" in lowered.replace(" ", "").replace("_", ""):
                dtod += 1
            else:
                other_memcpy += 1  # HtoD / DtoH, or a graph memcpy node reported under another name
    return {"planner_kernels": planners / steps, "memcpy_dtod": dtod / steps, "memcpy_other": other_memcpy / steps,
            "top_device_events": {n: c / steps for n, c in names.most_common(TOP_NAMES)}}  # fmt: skip


def _profile(fn: Any, steps: int) -> dict[str, Any]:
    import torch

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    return _count(prof.events(), steps)


def _profiler_warmup() -> None:
    """Start the profiler once before any graph is captured: both variants run under the same profiler state."""
    import torch

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]):
        torch.empty(1024, device="cuda").copy_(torch.zeros(1024, device="cuda"))
        torch.cuda.synchronize()


def _load(sc: Any, step: tuple[Any, ...]) -> None:
    """Copy a step's inputs into the scenario's persistent buffers, as vLLM fills them before a replay."""
    for buffer, value in zip((sc.context_lens, sc.block_table, sc.q, sc.weights), step[:4], strict=True):
        buffer.copy_(value)


def host_counts(sc: Any, inputs: list[tuple[Any, ...]], replay: Any) -> dict[str, float]:
    """Exact per-step counts without a profiler: the build's planners and schedule copies, then ``replay``, for
    each step's ``(context_lens, block_table, q, weights)``."""
    from tests.copy_counter import CopyCounter

    targets = [*sc.sched_buf, sc.sched_full]
    totals = dict.fromkeys(HOST_KEYS, 0)
    stats = sc.cache.stats
    for step in inputs:
        _load(sc, step)
        planners, deferred, replans = sc.be.planner_launches, stats.deferred_plans, stats.replans
        with CopyCounter(targets) as copies:
            sc.build(microbatched=True)
        totals["build_planner_launches"] += sc.be.planner_launches - planners
        totals["build_schedule_copies"] += copies.into_targets
        totals["build_schedule_noop_copies"] += copies.noop
        replay()
        totals["call_site_deferred_plans"] += stats.deferred_plans - deferred
        totals["call_site_replans"] += stats.replans - replans
    return {k: v / len(inputs) for k, v in totals.items()}


def measure(name: str, sc: Any, steps: int) -> dict[str, Any]:
    import torch

    from dbo_runtime.sim.scenario import capture_dbo_graph

    sc.new_inputs()
    sc.build(microbatched=True)  # eager warm-up step (vLLM runs one before each capture)
    with sc.control.partition(sc.budget, compute_knob=sc.knob):
        sc.join(sc.start())
    torch.cuda.synchronize()
    captured_before = sc.cache.stats.captured_replans
    graph = capture_dbo_graph(sc, "mrv1")
    torch.cuda.synchronize()
    in_graph = sc.cache.stats.captured_replans - captured_before

    refs = []
    for _ in range(steps):  # inputs and references first: the timed loop is build + replay only
        sc.new_inputs()
        refs.append((sc.context_lens.clone(), sc.block_table.clone(), sc.q.clone(), sc.weights.clone(), sc.run_reference()))
    inputs = [r[:4] for r in refs]

    gpu_ms: list[float] = []
    checks = []
    for step in refs:  # timing + correctness: no profiler, no counter
        _load(sc, step)
        sc.clear_outputs()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        sc.build(microbatched=True)  # vLLM rebuilds the metadata before every replay
        graph.replay()
        end.record()
        end.synchronize()
        gpu_ms.append(start.elapsed_time(end))
        checks.append(sc.snapshot())
    ok = [bool(torch.equal(got["logits"], ref["logits"]) and torch.equal(got["topk"], ref["topk"]))
          for got, (*_, ref) in zip(checks, refs, strict=True)]

    host = host_counts(sc, inputs, lambda: (graph.replay(), torch.cuda.synchronize()))
    build_window = _profile(lambda: sc.build(microbatched=True), steps)
    replay_window = _profile(graph.replay, steps)
    return {
        "variant": name,
        "config_overrides": VARIANTS[name],
        "graph_planners_recorded_at_capture": in_graph,
        "host_per_step": host,
        "profiler_build_window_per_step": build_window,
        "profiler_replay_window_per_step": replay_window,
        "build_plus_replay_gpu_ms_median": round(statistics.median(gpu_ms), 4),
        "replays_bit_identical": sum(ok), "steps": steps,
        "deferred_plans_total": sc.cache.stats.deferred_plans,
    }


def consistency_notes(rows: dict[str, dict[str, Any]]) -> list[str]:
    """Lines explaining counts that differ where they cannot (same graph nodes in both variants)."""
    notes = []
    replay = {n: r["profiler_replay_window_per_step"] for n, r in rows.items()}
    for key in ("planner_kernels", "memcpy_dtod", "memcpy_other"):
        values = {n: w[key] for n, w in replay.items()}
        if len(set(values.values())) > 1:
            notes.append(
                f"profiler artefact: replay-window {key} per step differs between variants ({values}) although both "
                "graphs hold the same nodes; CUPTI's reporting of graph nodes is unreliable here -- use host_per_step"
            )
    for n, r in rows.items():
        if r["host_per_step"]["call_site_deferred_plans"] or r["host_per_step"]["call_site_replans"]:
            notes.append(f"{n}: a replay step ran call-site planning ({r['host_per_step']}): replays run no Python")
    return notes


def _plot(doc: dict[str, Any], path: Path) -> bool:
    rows, env = doc["variants"], doc["environment"]
    counts = {f"{n}: {k}": r["host_per_step"][f"build_{k}"] for n, r in rows.items() for k in ("planner_launches", "schedule_copies")}
    return bar_panels(path, f"Deferred plan-ahead, {env.get('device')}, {env.get('deep_gemm')}, {env.get('date')}", [
        (list(counts), list(counts.values()), "per FULL-graph DBO step (host-counted, exact)"),
        (list(rows), [r["build_plus_replay_gpu_ms_median"] for r in rows.values()], "build + replay, GPU ms (median)"),
    ])  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench_replay_planning", description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--steps", type=integer(1), default=10, help="replay steps per variant (default 10)")
    ap.add_argument("--requests", type=integer(2), default=16, help="decode requests, split over two microbatches (default 16)")
    ap.add_argument("--max-context", type=integer(64, multiple=64), default=8192, help="longest context in tokens, a multiple of 64 (default 8192)")
    add_out(ap)
    args = ap.parse_args(argv)
    try:
        be = _gpu_or_exit()
    except SystemExit as exc:
        return int(exc.code or 2)

    from dbo_runtime.sim.scenario import GLM53, Scenario
    from tests.harness.report import environment, write_json

    base = dataclasses.replace(GLM53, num_requests=args.requests, max_context=args.max_context)
    rows = {}
    try:
        _profiler_warmup()
        for name, overrides in VARIANTS.items():
            rows[name] = measure(name, Scenario(dataclasses.replace(base, **overrides), be), args.steps)
    finally:
        be.set_num_sms(be.total_sms)
    before, after = (rows[n]["host_per_step"]["build_planner_launches"] for n in ("plan_at_build", "deferred"))
    gpu_before, gpu_after = (rows[n]["build_plus_replay_gpu_ms_median"] for n in ("plan_at_build", "deferred"))
    doc = {
        "benchmark": "bench_replay_planning", "environment": environment(),
        "config": {k: v for k, v in dataclasses.asdict(base).items() if k not in VARIANTS["deferred"]}, "variants": rows,
        "ratios": {
            "build planner launches per step, deferred / plan_at_build": round(after / max(before, 1e-9), 4),
            "build + replay GPU ms, deferred / plan_at_build": round(gpu_after / gpu_before, 4),
        },
        "notes": consistency_notes(rows),
    }  # fmt: skip
    path = write_json(args.out / "bench_replay_planning.json", doc)
    _plot(doc, args.out / "bench_replay_planning.png")
    for name, r in rows.items():
        h, b, g = r["host_per_step"], r["profiler_build_window_per_step"], r["profiler_replay_window_per_step"]
        print(f"{name:14s} build (host): planners {h['build_planner_launches']:.1f} copies {h['build_schedule_copies']:.1f} "
              f"(no-op {h['build_schedule_noop_copies']:.1f}); build (profiler): planners {b['planner_kernels']:.1f} dtod {b['memcpy_dtod']:.1f}; "
              f"replay (profiler): planners {g['planner_kernels']:.1f} dtod {g['memcpy_dtod']:.1f}; in-graph planners "
              f"{r['graph_planners_recorded_at_capture']}; build+replay {r['build_plus_replay_gpu_ms_median']:.3f} ms; "
              f"bit-identical {r['replays_bit_identical']}/{r['steps']}")  # fmt: skip
    for line in doc["notes"]:
        print(f"note: {line}")
    say_written("bench_replay_planning", path, args.out / "bench_replay_planning.png")
    ok = all(r["replays_bit_identical"] == r["steps"] for r in rows.values())
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
