"""Indexer schedule cache on a GPU: host cost, planner kernels per DBO step, first-step JIT latency.

Real DeepGEMM, GLM-5.3 indexer shapes: (1) the cache lookup's host cost per indexer layer against a bare
``get_num_sms()``; (2) planner kernels per microbatch per step, re-plan at the call site vs plan-ahead, under the
DBO budget; (3) the first DBO step at an SM count never used in the process, warmed at model load vs cold.

    python3 graphs/bench_indexer_schedule.py [--out graphs/results] [--steps 20]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import graphs._torch  # noqa: F401  (exits 3 with one line when torch is missing)

# isort: split

import time
from types import SimpleNamespace
from typing import Any

import torch

from dbo_runtime.sim.backends import logits_options
from graphs._args import EXIT_NO_DEVICE, add_out, integer, say_written
from graphs._plotting import bar_panels

HEADS, DIM, BLOCK = 32, 128, 64
CONTEXTS = [1, 7, 64, 65, 255, 256, 257, 1000, 4096, 8191, 16384, 30000, 32768]
MAX_CTX = 32768


def _inputs(device: torch.device, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    batch, per_req = len(CONTEXTS), MAX_CTX // BLOCK
    num_blocks = batch * per_req
    values = (torch.randn((num_blocks, BLOCK * DIM), generator=gen) * 0.5).to(torch.float8_e4m3fn)
    scales = torch.rand((num_blocks, BLOCK), generator=gen) + 0.5
    fused = torch.empty((num_blocks, BLOCK * (DIM + 4)), dtype=torch.uint8)
    fused[:, : BLOCK * DIM] = values.view(torch.uint8)
    fused[:, BLOCK * DIM :] = scales.contiguous().view(torch.uint8)
    return {
        "kv_cache": fused.view(num_blocks, BLOCK, 1, DIM + 4).to(device),
        "q": (torch.randn((batch, 1, HEADS, DIM), generator=gen) * 0.5).to(torch.float8_e4m3fn).to(device),
        "weights": torch.rand((batch, HEADS), generator=gen).to(device),
        "context_lens": torch.tensor(CONTEXTS, dtype=torch.int32).view(-1, 1).to(device),
        "block_table": torch.randperm(num_blocks, generator=gen).view(batch, per_req).to(torch.int32).to(device),
    }


def _logits(dg: Any, x: dict[str, torch.Tensor], schedule: torch.Tensor) -> torch.Tensor:
    return dg.fp8_fp4_paged_mqa_logits(
        (x["q"], None), x["kv_cache"], x["weights"], x["context_lens"], x["block_table"], schedule, MAX_CTX,
        **logits_options(dg.fp8_fp4_paged_mqa_logits),
    )


def _per_call_ns(fn: Any, calls: int, repeats: int = 5) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter_ns()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter_ns() - t0) / calls)
    return best


def host_cost(dg: Any, x: dict[str, torch.Tensor], calls: int) -> dict[str, Any]:
    from dbo_runtime.adapters.deep_gemm import DeepGemmPlanner, num_sms_reader
    from dbo_runtime.integration.indexer_hooks import _make_logits
    from dbo_runtime.services import schedule_cache as sc

    planner = DeepGemmPlanner()
    cache = sc.IndexerScheduleCache(planner)
    previous, sc._CACHE = sc._CACHE, cache
    try:
        live = int(dg.get_num_sms())
        schedule = planner.plan(x["context_lens"], BLOCK, live)
        cache.track(schedule, planned_sms=live, block_kv=BLOCK, next_n=1)
        ctx, kv = x["context_lens"], x["kv_cache"]
        reader = num_sms_reader()
        capturing = torch.cuda.is_current_stream_capturing
        def noop(q: Any, kv_cache: Any, weights: Any, context_lens: Any, block_tables: Any, schedule_metadata: Any,
                 max_model_len: int, indices: Any = None) -> None:  # fmt: skip
            return None  # stands for the kernel launch, in vLLM's parameters (the call site checks them)

        wrapper = _make_logits(noop)
        q = (x["q"], None)
        assert cache.resolve(schedule, ctx, None, kv) is schedule

        def resolve() -> Any:
            return cache.resolve(schedule, ctx, None, kv)

        def wrapped() -> Any:
            return wrapper(q, kv, None, ctx, None, schedule, max_model_len=MAX_CTX, indices=None)

        res = {
            "calls_per_repeat": calls, "repeats": 5, "empty_call_ns": _per_call_ns(noop, calls), "get_num_sms_ns": _per_call_ns(reader, calls),
            "is_current_stream_capturing_ns": _per_call_ns(capturing, calls), "resolve_ns": _per_call_ns(resolve, calls),
            "bare_call_site_ns": _per_call_ns(lambda: noop(q, kv, None, ctx, None, schedule, MAX_CTX, indices=None), calls),
            "wrapped_call_site_ns": _per_call_ns(wrapped, calls),
        }  # fmt: skip
        # resolve() is called through a lambda here, so subtract one empty call to compare with get_num_sms().
        res["resolve_above_get_num_sms_ns"] = res["resolve_ns"] - res["empty_call_ns"] - res["get_num_sms_ns"]
        res["wrapper_overhead_ns"] = res["wrapped_call_site_ns"] - res["bare_call_site_ns"]
        # As installed by the plugin: the capture counter replaces the precise capture probe.
        from dbo_runtime.integration import capture_hooks
        from dbo_runtime.integration.patching import PatchSet

        counting = PatchSet(capture_hooks.patches())
        counting.install()
        try:
            res["with_capture_counter"] = {"resolve_ns": _per_call_ns(resolve, calls), "wrapped_call_site_ns": _per_call_ns(wrapped, calls)}
        finally:
            counting.uninstall()
        wc = res["with_capture_counter"]
        wc["resolve_above_get_num_sms_ns"] = wc["resolve_ns"] - res["empty_call_ns"] - res["get_num_sms_ns"]
        wc["wrapper_overhead_ns"] = wc["wrapped_call_site_ns"] - res["bare_call_site_ns"]
        res["replans_during_measurement"] = cache.stats.replans
        return res
    finally:
        sc._CACHE = previous


def steady_state(dg: Any, x: dict[str, torch.Tensor], steps: int, layers: int, dbo_sms: int) -> dict[str, Any]:
    from dbo_runtime.adapters.deep_gemm import DeepGemmPlanner
    from dbo_runtime.services.schedule_cache import IndexerScheduleCache
    from dbo_runtime.sim.sm_scope import SMControl

    total = int(dg.get_num_sms())
    out: dict[str, Any] = {"steps": steps, "microbatches": 2, "layers": layers, "dbo_sms": dbo_sms}
    for approach in ("upstream_replan_at_call_site", "plan_ahead"):
        planner = DeepGemmPlanner()
        cache = IndexerScheduleCache(planner)
        control = SMControl(torch.cuda.current_device(), total)
        cache.attach(control)
        budget = _budget(total, dbo_sms)
        control.announce(budget)
        knob = SimpleNamespace(name="deep_gemm.set_num_sms", set=dg.set_num_sms)
        plan_ms: list[float] = []
        step_ms: list[float] = []
        replans: list[int] = []
        planner_kernels: list[int] = []
        for step in range(steps + 1):  # step 0 is a warm-up, not recorded
            before, kernels, plan_time = cache.stats.replans, 0, 0.0
            e0, e1, e_step0, e_step1 = (torch.cuda.Event(enable_timing=True) for _ in range(4))
            e_step0.record()
            for _ub in range(2):
                e0.record()
                with cache.microbatched_build():
                    sms = (cache.plan_ahead_sms(control.device) if approach == "plan_ahead" else None) or total
                    schedule = planner.plan(x["context_lens"], BLOCK, sms)  # the builder's planner
                    kernels += 1
                cache.track(schedule, planned_sms=sms, block_kv=BLOCK, next_n=1)
                with control.partition(budget, compute_knob=knob):
                    r0 = cache.stats.replans
                    first = cache.resolve(schedule, x["context_lens"], None, BLOCK)
                    kernels += cache.stats.replans - r0
                    e1.record()
                    _logits(dg, x, first)
                    for _ in range(layers - 1):
                        _logits(dg, x, cache.resolve(schedule, x["context_lens"], None, BLOCK))
                torch.cuda.synchronize()
                plan_time += e0.elapsed_time(e1)
            e_step1.record()
            torch.cuda.synchronize()
            if step > 0:
                plan_ms.append(plan_time)
                step_ms.append(e_step0.elapsed_time(e_step1))
                replans.append(cache.stats.replans - before)
                planner_kernels.append(kernels)
        out[approach] = {
            "replans_per_step": replans,
            "replans_per_microbatch_step": sum(replans) / (2 * steps),
            "planner_kernels_per_microbatch_step": sum(planner_kernels) / (2 * steps),
            "planning_ms_per_step_median": sorted(plan_ms)[len(plan_ms) // 2],
            "step_ms_median": sorted(step_ms)[len(step_ms) // 2],
            "planning_timing": "CUDA events from the builder's planner to after the call site's lookup, both microbatches, host launch included",
        }
    return out


def _budget(total: int, sms: int) -> Any:
    """The DBO budget that leaves DeepGEMM ``sms`` SMs (DeepEP high-throughput)."""
    from dbo_runtime.core.budget import compute_budget

    return compute_budget(
        total_sms=total, platform="cuda", enable_dbo=True, expert_parallel=True, all2all_backend="deepep_high_throughput", env_comm_sms=total - sms
    )


def first_step(dg: Any, x: dict[str, torch.Tensor], warm_sms: int, cold_sms: int) -> dict[str, Any]:
    from dbo_runtime.adapters.deep_gemm import DeepGemmPlanner
    from dbo_runtime.services.planner_warmup import PlannerProfile
    from dbo_runtime.services.schedule_cache import IndexerScheduleCache
    from dbo_runtime.services.sm_control import SMControl

    total = int(dg.get_num_sms())
    device = torch.cuda.current_device()
    result: dict[str, Any] = {"jit_cache_dir": os.environ.get("DG_JIT_CACHE_DIR")}

    def one_step(cache: IndexerScheduleCache, planner: DeepGemmPlanner, sms: int) -> float:
        schedule = planner.plan(x["context_lens"], BLOCK, total)  # upstream build: whole GPU
        cache.track(schedule, planned_sms=total, block_kv=BLOCK, next_n=1)
        torch.cuda.synchronize()
        dg.set_num_sms(sms)
        t0 = time.perf_counter()
        _logits(dg, x, cache.resolve(schedule, x["context_lens"], None, BLOCK))
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - t0
        dg.set_num_sms(total)
        return elapsed * 1e3

    for label, sms, warm in (("with_warmup", warm_sms, True), ("without_warmup", cold_sms, False)):
        planner = DeepGemmPlanner()
        cache = IndexerScheduleCache(planner)
        control = SMControl(device, total)
        cache.attach(control)
        cache.warmup.register_profile(device, PlannerProfile(device=torch.device("cuda", device), block_kv=BLOCK, shapes=((len(CONTEXTS), 1),)))
        budget, t0 = _budget(total, sms), time.perf_counter()
        if warm:
            control.announce(budget)  # model load: compiles the planner for `sms`
            torch.cuda.synchronize()
        warm_ms = (time.perf_counter() - t0) * 1e3 if warm else 0.0
        first, second = one_step(cache, planner, sms), one_step(cache, planner, sms)
        result[label] = {"sms": sms, "warmup_ms_at_model_load": warm_ms, "warmup_planner_kernels": cache.stats.warmups,
                         "first_step_ms": first, "second_step_ms": second}  # fmt: skip
    return result


def _plot(doc: dict[str, Any], path: Path) -> bool:
    h, s, f, env = doc["host_cost"], doc["steady_state"], doc["first_step"], doc["environment"]
    return bar_panels(path, f"Indexer schedule cache - {env.get('device')} - {env.get('deep_gemm')} - torch {env.get('torch')}", [
        (["get_num_sms", "resolve", "resolve - get_num_sms"], [h["get_num_sms_ns"], h["resolve_ns"] - h["empty_call_ns"],
         h["resolve_above_get_num_sms_ns"]], "ns per indexer layer (host)"),
        (["upstream #60732", "plan-ahead"], [s[n]["planner_kernels_per_microbatch_step"] for n in ("upstream_replan_at_call_site", "plan_ahead")],
         "planner kernels per microbatch per step"),
        ([f"{f['with_warmup']['sms']} SMs, warmed", f"{f['without_warmup']['sms']} SMs, cold"],
         [f["with_warmup"]["first_step_ms"], f["without_warmup"]["first_step_ms"]], "first DBO step, indexer layer 0 (ms)"),
    ])  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench_indexer_schedule", description=(__doc__ or "").split("\n\n")[0])
    add_out(ap)
    ap.add_argument("--steps", type=integer(1), default=20, help="DBO steps per variant (default 20)")
    ap.add_argument("--layers", type=integer(1), default=21, help="indexer layers per step (default 21)")
    ap.add_argument("--calls", type=integer(1), default=200_000, help="host calls timed for the cache lookup (default 200000)")
    ap.add_argument("--dbo-sms", type=integer(2, multiple=2), default=112, help="even SM count under DBO, below the GPU's (default 112)")
    ap.add_argument("--cold-sms", type=integer(2, multiple=2), default=110, help="even SM count never planned before, not --dbo-sms (default 110)")
    args = ap.parse_args(argv)
    if args.cold_sms == args.dbo_sms:
        ap.error(f"argument --cold-sms: {args.cold_sms} is not allowed; allowed values: an even count other than --dbo-sms ({args.dbo_sms})")
    from graphs._torch import refuse_without_kernels

    # a fresh JIT cache where the kernels can run: "cold" must mean a compile (DeepGEMM reads it on import, below)
    made = None
    if torch.cuda.is_available() and "DG_JIT_CACHE_DIR" not in os.environ:
        made = os.environ["DG_JIT_CACHE_DIR"] = tempfile.mkdtemp(prefix="dg_jit_bench_")
    try:
        refused = refuse_without_kernels("bench_indexer_schedule")
        if refused is not None:
            return EXIT_NO_DEVICE
        total = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
        for flag, value in (("--dbo-sms", args.dbo_sms), ("--cold-sms", args.cold_sms)):
            if value >= total:  # the whole GPU lowers nothing for DBO, and the cold count would hit the fast path
                ap.error(f"argument {flag}: {value} is not allowed; allowed values: an even count below this GPU's {total} SMs")
        return _run(args)
    finally:
        if made is not None:
            import shutil

            shutil.rmtree(made, ignore_errors=True)
            os.environ.pop("DG_JIT_CACHE_DIR", None)


def _run(args: Any) -> int:
    import deep_gemm as dg

    from tests.harness.report import environment, write_json

    device = torch.device("cuda", torch.cuda.current_device())
    x = _inputs(device, seed=0)
    total = int(dg.get_num_sms())
    # Compile what every approach needs anyway (planner @ total, logits kernel) before measuring.
    from dbo_runtime.adapters.deep_gemm import DeepGemmPlanner

    _logits(dg, x, DeepGemmPlanner().plan(x["context_lens"], BLOCK, total))
    torch.cuda.synchronize()

    doc: dict[str, Any] = {"environment": environment(), "case": {"heads": HEADS, "dim": DIM, "block": BLOCK, "contexts": CONTEXTS}}
    # First-step latency first: its SM counts must not have been used in this process yet.
    doc["first_step"] = first_step(dg, x, args.dbo_sms, args.cold_sms)
    doc["host_cost"] = host_cost(dg, x, args.calls)
    doc["steady_state"] = steady_state(dg, x, args.steps, args.layers, args.dbo_sms)
    dg.set_num_sms(total)

    h, s, f = doc["host_cost"], doc["steady_state"], doc["first_step"]
    print(
        f"host: get_num_sms {h['get_num_sms_ns']:.0f} ns, resolve +{h['resolve_above_get_num_sms_ns']:.0f} ns above it, "
        f"wrapper +{h['wrapper_overhead_ns']:.0f} ns (precise capture probe); with the plugin's capture counter "
        f"resolve +{h['with_capture_counter']['resolve_above_get_num_sms_ns']:.0f} ns, wrapper "
        f"+{h['with_capture_counter']['wrapper_overhead_ns']:.0f} ns | replans/ubatch/step upstream "
        f"{s['upstream_replan_at_call_site']['replans_per_microbatch_step']:.2f} vs plan-ahead "
        f"{s['plan_ahead']['replans_per_microbatch_step']:.2f} | first step {f['with_warmup']['first_step_ms']:.2f} ms "
        f"warmed vs {f['without_warmup']['first_step_ms']:.2f} ms cold",
        flush=True,
    )
    write_json(args.out / "bench_indexer_schedule.json", doc)
    _plot(doc, args.out / "bench_indexer_schedule.png")
    say_written("bench_indexer_schedule", args.out / "bench_indexer_schedule.json", args.out / "bench_indexer_schedule.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
