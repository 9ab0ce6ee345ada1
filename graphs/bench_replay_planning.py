"""Planner kernels per FULL-graph DBO step, before and after deferred plan-ahead (issue 10 item 7).

A FULL-graph DBO step is a metadata build followed by a graph replay. The graph re-plans the
paged-MQA schedule inside itself (from the persistent ``context_lens``) so every replay reads a
plan for the captured SM count; what the build planned for that step is never read. Two variants,
side by side in one run, same inputs, real DeepGEMM, real CUDA graph (MRV1-style capture of the
GLM-5.3-shaped stack from ``dbo_runtime.sim``, two microbatches, 132 -> 112 SMs on an H200):

* ``plan_at_build`` -- before: the plan-ahead build launches the planner (and copies the plan
  into the builder buffer) for each microbatch, then the graph launches its own planners.
* ``deferred``      -- after: the build launches nothing; only the graph's planners run.

Per replay step it reports planner kernels and schedule copies counted by the torch profiler
(kernel names containing ``paged_mqa_logits_metadata``; device-to-device memcpys), the host-side
planner launches of the build, the GPU time of build + replay (CUDA events) and whether every
replay is bit-identical to the unsplit full-SM reference. About 30 s on an H200.

    python3 graphs/bench_replay_planning.py [--steps 10] [--out graphs/results]

Writes ``bench_replay_planning.json`` (+ ``.png`` with matplotlib) to ``--out``.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

VARIANTS = {"plan_at_build": {"defer_plan_ahead": False}, "deferred": {"defer_plan_ahead": True}}
PLANNER_KERNEL = "paged_mqa_logits_metadata"


def _gpu_or_exit() -> Any:
    """The DeepGEMM backend, or one clear line and exit code 2."""

    from dbo_runtime.sim.backends import DeepGemmBackend, real_kernels_missing

    missing = real_kernels_missing()
    if missing is not None:
        print(f"bench_replay_planning: needs a CUDA GPU and DeepGEMM: {missing}; nothing measured", file=sys.stderr)
        raise SystemExit(2)
    try:
        return DeepGemmBackend()
    except Exception as exc:  # a wheel built for another torch
        print(f"bench_replay_planning: needs a CUDA GPU and DeepGEMM: DeepGEMM does not load ({type(exc).__name__}: {exc}); nothing measured", file=sys.stderr)
        raise SystemExit(2) from None


def _count(prof: Any) -> dict[str, int]:
    planners = copies = 0
    for event in prof.events():
        name = event.name or ""
        if getattr(event, "device_type", None) is None or "cuda" not in str(event.device_type).lower():
            continue
        if PLANNER_KERNEL in name:
            planners += 1
        elif "memcpy" in name.lower() and "dtod" in name.lower().replace(" ", "").replace("_", ""):
            copies += 1
    return {"planner_kernels": planners, "dtod_copies": copies}


def measure(name: str, sc: Any, steps: int) -> dict[str, Any]:
    import torch

    from dbo_runtime.sim.scenario import capture_dbo_graph

    be = sc.be
    sc.new_inputs()
    sc.build(microbatched=True)  # eager warm-up step (vLLM runs one before each capture)
    with sc.control.partition(sc.budget, compute_knob=sc.knob):
        sc.join(sc.start())
    torch.cuda.synchronize()
    captured_before = sc.cache.stats.captured_replans
    graph = capture_dbo_graph(sc, "mrv1")
    torch.cuda.synchronize()
    in_graph = sc.cache.stats.captured_replans - captured_before

    host_build_planners: list[int] = []
    gpu_ms: list[float] = []
    checks = []
    refs = []
    for _ in range(steps):  # inputs and references first: the profiled loop is build + replay only
        sc.new_inputs()
        refs.append((sc.context_lens.clone(), sc.block_table.clone(), sc.q.clone(), sc.weights.clone(), sc.run_reference()))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for lens, table, q, weights, _ref in refs:
            sc.context_lens.copy_(lens)
            sc.block_table.copy_(table)
            sc.q.copy_(q)
            sc.weights.copy_(weights)
            sc.clear_outputs()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            before = be.planner_launches
            start.record()
            sc.build(microbatched=True)  # vLLM rebuilds the metadata before every replay
            graph.replay()
            end.record()
            end.synchronize()
            host_build_planners.append(be.planner_launches - before)
            gpu_ms.append(start.elapsed_time(end))
            checks.append(sc.snapshot())
    counted = _count(prof)
    ok = [bool(torch.equal(got["logits"], ref["logits"]) and torch.equal(got["topk"], ref["topk"]))
          for got, (*_, ref) in zip(checks, refs, strict=True)]
    return {
        "variant": name,
        "planner_kernels_in_graph_recorded_at_capture": in_graph,
        "host_build_planner_launches_per_step": statistics.mean(host_build_planners),
        "profiler_planner_kernels_per_step": counted["planner_kernels"] / steps,
        "profiler_dtod_copies_per_step": counted["dtod_copies"] / steps,
        "build_plus_replay_gpu_ms_median": round(statistics.median(gpu_ms), 4),
        "replays_bit_identical": sum(ok),
        "steps": steps,
        "deferred_plans": sc.cache.stats.deferred_plans,
    }


def _plot(doc: dict[str, Any], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rows = doc["variants"]
    names = list(rows)
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    axes[0].bar(names, [rows[n]["profiler_planner_kernels_per_step"] for n in names], label="profiler: all planner kernels")
    axes[0].bar(names, [rows[n]["host_build_planner_launches_per_step"] for n in names], alpha=0.6, label="of which by the build")
    axes[0].set_ylabel("planner kernels per FULL-graph DBO step")
    axes[0].legend(fontsize=8)
    axes[1].bar(names, [rows[n]["build_plus_replay_gpu_ms_median"] for n in names], color="tab:green")
    axes[1].set_ylabel("build + replay, GPU ms (median)")
    env = doc["environment"]
    fig.suptitle(f"Deferred plan-ahead, {env.get('device')}, {env.get('deep_gemm')}, {env.get('date')}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=10, help="replay steps per variant (default 10)")
    ap.add_argument("--requests", type=int, default=16, help="decode requests, split over two microbatches")
    ap.add_argument("--max-context", type=int, default=8192, help="longest context (multiple of 64)")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results", help="output folder")
    args = ap.parse_args(argv)
    try:
        be = _gpu_or_exit()
    except SystemExit as exc:
        return int(exc.code or 2)

    from dbo_runtime.sim.report import environment, write_json
    from dbo_runtime.sim.scenario import GLM53, Scenario

    base = dataclasses.replace(GLM53, num_requests=args.requests, max_context=args.max_context)
    rows = {}
    try:
        for name, overrides in VARIANTS.items():
            rows[name] = measure(name, Scenario(dataclasses.replace(base, **overrides), be), args.steps)
    finally:
        be.set_num_sms(be.total_sms)
    before, after = rows["plan_at_build"], rows["deferred"]
    doc = {
        "benchmark": "bench_replay_planning",
        "environment": environment(),
        "config": dataclasses.asdict(base),
        "variants": rows,
        "ratios": {
            "profiler planner kernels per step, deferred / plan_at_build": round(
                after["profiler_planner_kernels_per_step"] / max(before["profiler_planner_kernels_per_step"], 1e-9), 4
            ),
            "build + replay GPU ms, deferred / plan_at_build": round(
                after["build_plus_replay_gpu_ms_median"] / before["build_plus_replay_gpu_ms_median"], 4
            ),
        },
        "note": "profiler counts include the planners recorded in the graph when the profiler traces graph kernels; "
        "host_build_planner_launches_per_step is counted by the backend and needs no profiler",
    }
    path = write_json(args.out / "bench_replay_planning.json", doc)
    plotted = _plot(doc, args.out / "bench_replay_planning.png")
    for name, r in rows.items():
        print(f"{name:14s} build planners/step {r['host_build_planner_launches_per_step']:.1f}  "
              f"profiler planners/step {r['profiler_planner_kernels_per_step']:.1f}  "
              f"dtod copies/step {r['profiler_dtod_copies_per_step']:.1f}  "
              f"in-graph {r['planner_kernels_in_graph_recorded_at_capture']}  "
              f"build+replay {r['build_plus_replay_gpu_ms_median']:.3f} ms  "
              f"bit-identical {r['replays_bit_identical']}/{r['steps']}")
    print(f"-> {path}" + (" + .png" if plotted else " (no matplotlib: no PNG)"))
    ok = all(r["replays_bit_identical"] == r["steps"] for r in rows.values())
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
