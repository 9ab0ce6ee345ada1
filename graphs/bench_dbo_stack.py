"""Step time, planner kernels and memory of the GLM-5.3-shaped DBO stack, side by side in one run.

Variants, interleaved on the same inputs: ``unsplit`` (one batch, all SMs), ``dbo_runtime`` (DBO, plan-ahead),
``upstream`` (DBO, re-plan at the call site) and ``no_partition`` (DBO with comm 0, the path that never needed a
fix). Each timed eager (host wall) and as a FULL graph replay (CUDA events); memory per extra microbatch for
GLM-5.3 / GLM-5.1 with both top-k layouts.

    python graphs/bench_dbo_stack.py [--reps 20] [--out graphs/results]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import graphs._torch  # noqa: F401  (exits 3 with one line when torch is missing)
from graphs._torch import refuse_without_kernels

# isort: split

import torch

from dbo_runtime.sim.backends import DeepGemmBackend
from dbo_runtime.sim.scenario import GLM53, Scenario, capture_dbo_graph
from graphs._args import EXIT_NO_DEVICE, add_out, integer
from graphs._plotting import bar_panels
from tests.harness.report import environment, write_json
from tests.harness.topk_memory import topk_memory_bytes

VARIANTS = {"dbo_runtime": {}, "upstream": {"plan_ahead": False}, "no_partition": {"comm_sms": 0}}


def eager_dbo_step(sc: Scenario) -> None:
    sc.build(microbatched=True)
    with sc.control.partition(sc.budget, compute_knob=sc.knob):
        sc.join(sc.start())


def eager_unsplit_step(sc: Scenario) -> None:
    sc.build(microbatched=False)
    sc.forward(None, None)


def time_host(fn, sc: Scenario, reps: int) -> list[float]:  # type: ignore[no-untyped-def]
    out = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn(sc)
        torch.cuda.synchronize()
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def time_graph(graph, reps: int) -> list[float]:  # type: ignore[no-untyped-def]
    out = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        out.append(start.elapsed_time(end))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench_dbo_stack", description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=integer(1), default=40, help="timed reps per variant (default 40)")
    ap.add_argument("--requests", type=integer(2), default=GLM53.num_requests, help=f"decode requests, split over two microbatches (default {GLM53.num_requests})")
    ap.add_argument("--max-context", type=integer(GLM53.block_kv, multiple=GLM53.block_kv), default=GLM53.max_context, help=f"longest context in tokens (default {GLM53.max_context})")
    add_out(ap)
    args = ap.parse_args(argv)
    refused = refuse_without_kernels("bench_dbo_stack")
    if refused is not None:
        return EXIT_NO_DEVICE
    be = DeepGemmBackend()
    base = dataclasses.replace(GLM53, num_requests=args.requests, max_context=args.max_context)
    scen = {name: Scenario(dataclasses.replace(base, **kw), be) for name, kw in VARIANTS.items()}
    unsplit = scen["no_partition"]
    for sc in scen.values():  # inputs, and every kernel variant warmed before timing or capture
        sc.new_inputs()
        eager_dbo_step(sc)
    eager_unsplit_step(unsplit)
    torch.cuda.synchronize()

    eager: dict[str, list[float]] = {k: [] for k in [*VARIANTS, "unsplit"]}
    planners: dict[str, list[int]] = {k: [] for k in [*VARIANTS, "unsplit"]}
    for _ in range(args.reps):  # interleaved, so drift hits every variant alike
        for name, sc in scen.items():
            before = be.planner_launches
            eager[name] += time_host(eager_dbo_step, sc, 1)
            planners[name].append(be.planner_launches - before)
        before = be.planner_launches
        eager["unsplit"] += time_host(eager_unsplit_step, unsplit, 1)
        planners["unsplit"].append(be.planner_launches - before)

    graphs = {}
    in_graph: dict[str, int] = {}
    for name, sc in scen.items():
        sc.build(microbatched=True)
        before = sc.cache.stats.captured_replans
        graphs[name] = capture_dbo_graph(sc, "mrv1")
        in_graph[name] = sc.cache.stats.captured_replans - before
    unsplit_graph = torch.cuda.CUDAGraph()
    unsplit.build(microbatched=False)
    before_unsplit = unsplit.cache.stats.captured_replans
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        unsplit.forward(None, None)  # warm on the side stream
    torch.cuda.current_stream().wait_stream(stream)
    with torch.cuda.graph(unsplit_graph):
        unsplit.forward(None, None)
    graphs["unsplit"] = unsplit_graph
    in_graph["unsplit"] = unsplit.cache.stats.captured_replans - before_unsplit
    replay: dict[str, list[float]] = {k: [] for k in graphs}
    for _ in range(args.reps):
        for name, g in graphs.items():
            replay[name] += time_graph(g, 1)

    def med(xs: list[float]) -> float:
        return round(statistics.median(xs), 3)

    def iqr(xs: list[float]) -> list[float]:
        q = statistics.quantiles(xs, n=4)
        return [round(q[0], 3), round(q[2], 3)]

    summary = {
        "eager_ms_median": {k: med(v) for k, v in eager.items()},
        "eager_ms_p25_p75": {k: iqr(v) for k, v in eager.items()},
        "graph_replay_ms_median": {k: med(v) for k, v in replay.items()},
        "graph_replay_ms_p25_p75": {k: iqr(v) for k, v in replay.items()},
        "planner_kernels_per_eager_step": {k: statistics.mean(v) for k, v in planners.items()},
        "planner_kernels_per_graph_replay": {**in_graph, "note": "planner kernels recorded into each captured graph"},
        "ratios": {
            "eager dbo_runtime / no_partition": round(med(eager["dbo_runtime"]) / med(eager["no_partition"]), 4),
            "eager dbo_runtime / upstream": round(med(eager["dbo_runtime"]) / med(eager["upstream"]), 4),
            "eager dbo_runtime / unsplit": round(med(eager["dbo_runtime"]) / med(eager["unsplit"]), 4),
            "graph dbo_runtime / no_partition": round(med(replay["dbo_runtime"]) / med(replay["no_partition"]), 4),
            "graph dbo_runtime / unsplit": round(med(replay["dbo_runtime"]) / med(replay["unsplit"]), 4),
        },
        "topk_memory_per_extra_microbatch_bytes": {
            name: topk_memory_bytes(num_layers=78, index_topk_freq=freq, index_skip_topk_offset=offset, index_topk=2048,
                                    max_num_batched_tokens=8192, max_num_seqs=1024)
            for name, freq, offset in (("GLM-5.3 (78 layers, freq 4, offset 3, top-k 2048, 8192 tok / 1024 seqs)", 4, 3), ("GLM-5.1 (freq 1)", 1, 2))
        },
    }
    doc = {
        "benchmark": "bench_dbo_stack", "environment": environment(), "config": dataclasses.asdict(base), "reps": args.reps, "summary": summary,
        "raw": {"eager_ms": eager, "graph_replay_ms": replay, "planner_kernels": planners},
        "note": "one compute stream and a stand-in all2all: no overlap gains; the figures isolate dbo_runtime's own cost",
    }  # fmt: skip
    path = write_json(args.out / "bench_dbo_stack.json", doc)
    _plot(doc, args.out / "bench_dbo_stack.png")
    print(summary)
    print(f"-> {path}")
    return 0


def _plot(doc: dict, path: Path) -> None:
    s, env = doc["summary"], doc["environment"]
    title = f"GLM-5.3-shaped DBO stack, {env.get('device')}, torch {env.get('torch')}, {env.get('deep_gemm')}"
    panels = [(list(s[k]), list(s[k].values()), label) for k, label in (
        ("eager_ms_median", "eager step (host wall, median ms)"), ("graph_replay_ms_median", "FULL-graph replay (CUDA events, median ms)"))]
    bar_panels(path, title, panels)


if __name__ == "__main__":
    raise SystemExit(main())
