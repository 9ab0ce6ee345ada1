"""Cold-start cost of the paged-MQA planner warm-up: warming the shapes vLLM runs microbatched vs a bucket sweep.

DeepGEMM JIT-compiles one planner per (32-aligned batch, SM slots). ``before`` warms every 32-row bucket up to
min(max_num_seqs, 512); ``after`` exactly the shapes vLLM microbatches (``dbo_planner_shapes``), each in a fresh
process with an empty ``DG_JIT_CACHE_DIR``, for vLLM's default H200 configuration. Reported per set: planner
variants, new JIT cache entries, seconds, and the buckets ``before`` missed.

    python3 graphs/bench_planner_warmup.py [--spec-tokens 3] [--max-num-seqs 1024] [--out graphs/results]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import graphs._torch  # noqa: E402, F401  (exits 3 with one line when torch is missing)

# isort: split

from graphs._args import EXIT_NO_DEVICE, add_out, integer, say_written  # noqa: E402
from graphs._plotting import bar_panels  # noqa: E402

BLOCK = 64
OLD_CAP = 512


def capture_sizes(max_num_seqs: int, spec_tokens: int, max_graph: int = 512) -> list[int]:
    """vLLM 0.33.0's default capture sizes (``VllmConfig._set_cudagraph_sizes``) for an H200."""
    q = 1 + spec_tokens
    top = min(max_num_seqs * q * 2, max_graph)
    sizes = {n for n in (1, 2, 4) if n <= top} | set(range(8, min(top + 1, 256), 8)) | set(range(256, top + 1, 16))
    if q > 1:
        reqs = {1, 2, 4, *range(8, 256, 8), *range(256, min(max_num_seqs, max_graph) + 1, 16), min(max_num_seqs, max_graph)}
        sizes |= {n * q for n in reqs if n * q <= top}
    return sorted(sizes)


def shape_sets(max_num_seqs: int, max_tokens: int, spec_tokens: int) -> dict[str, list[list[int]]]:
    from dbo_runtime.core.planner_shapes import aligned_buckets, dbo_planner_shapes

    q = 1 + spec_tokens
    before = [[b, w] for w in sorted({1, q}) for b in aligned_buckets(min(max_num_seqs, OLD_CAP))]
    after = dbo_planner_shapes(
        max_num_seqs=max_num_seqs, max_num_batched_tokens=max_tokens, num_speculative_tokens=spec_tokens,
        capture_sizes=capture_sizes(max_num_seqs, spec_tokens), num_ubatches=2, decode_token_threshold=32,
        per_token_rows=False,
    )
    return {"before": before, "after": [list(s) for s in after]}


def child(spec: dict[str, Any]) -> None:
    """Runs in a fresh process with an empty DG_JIT_CACHE_DIR: prime, then time the warm-up."""
    import torch

    from dbo_runtime.adapters.deep_gemm import DeepGemmPlanner
    from dbo_runtime.services.planner_warmup import PlannerProfile
    from dbo_runtime.services.schedule_cache import IndexerScheduleCache

    cache_dir = Path(os.environ["DG_JIT_CACHE_DIR"])
    device = torch.device("cuda", torch.cuda.current_device())
    planner = DeepGemmPlanner()
    # Prime DeepGEMM's JIT (CUDA context, compiler discovery) with a variant in neither set.
    planner.plan(torch.ones((1, 1), dtype=torch.int32, device=device), BLOCK, spec["prime_sms"])
    torch.cuda.synchronize()
    entries_before = set(os.listdir(cache_dir)) if cache_dir.exists() else set()
    cache = IndexerScheduleCache(planner)
    cache.warmup.register_profile(device.index or 0, PlannerProfile(device, BLOCK, tuple(tuple(s) for s in spec["shapes"])))
    t0 = time.perf_counter()
    launched = cache.warmup.warm(device.index or 0, spec["sms"])
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    entries = set(os.listdir(cache_dir)) if cache_dir.exists() else set()
    variants = sorted({(b - 1) // 32 * 32 + 32 for b, _ in spec["shapes"]})
    result = {"planner_variants_launched": launched, "new_jit_cache_entries": len(entries - entries_before), "seconds": round(seconds, 3)}
    print("RESULT " + json.dumps({**result, "aligned_batches": variants}), flush=True)


def run_child(shapes: list[list[int]], sms: int, prime_sms: int) -> dict[str, Any]:
    env = {**os.environ, "DG_JIT_CACHE_DIR": tempfile.mkdtemp(prefix="dg_jit_warmup_"),
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    env.pop("DBO_RUNTIME_PLANNER_WARM_MAX_BATCH", None)  # the sets are explicit here
    spec = json.dumps({"shapes": shapes, "sms": sms, "prime_sms": prime_sms})
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, __file__, "--child", spec], env=env, capture_output=True, text=True, check=False)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise RuntimeError(f"warm-up child failed (rc {proc.returncode}): {proc.stderr.strip()[-2000:]}")
    out: dict[str, Any] = json.loads(lines[-1][len("RESULT "):])
    out["process_seconds"] = round(time.perf_counter() - t0, 2)
    return out


def _plot(doc: dict[str, Any], path: Path) -> bool:
    rows, env, cfg = doc["sets"], doc["environment"], doc["config"]
    title = f"Planner warm-up, {cfg['sms']} SMs, max_num_seqs {cfg['max_num_seqs']}, spec tokens {cfg['spec_tokens']} - {env.get('device')}"
    return bar_panels(path, title, [
        (list(rows), [r["planner_variants_launched"] for r in rows.values()], "planner JIT variants compiled at model load"),
        (list(rows), [r["seconds"] for r in rows.values()], "warm-up seconds, empty JIT cache"),
    ])  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench_planner_warmup", description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--spec-tokens", type=integer(0, 3), default=3, help="speculative tokens (3: MTP, next_n 4; 0: none; default 3)")
    ap.add_argument("--max-num-seqs", type=integer(1), default=1024, help="vLLM max_num_seqs (default 1024)")
    ap.add_argument("--max-num-batched-tokens", type=integer(1), default=8192, help="vLLM max_num_batched_tokens (default 8192)")
    ap.add_argument("--comm-sms", type=integer(0), default=20, help="VLLM_DBO_COMM_SMS (DBO count = SMs - this; default 20)")
    add_out(ap)
    args = ap.parse_args(argv)
    if args.child:
        child(json.loads(args.child))
        return 0
    from graphs._torch import refuse_without_kernels

    refused = refuse_without_kernels("bench_planner_warmup")
    if refused is not None:
        return EXIT_NO_DEVICE

    import torch

    from tests.harness.report import environment, write_json

    total = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    sms = total - args.comm_sms
    sets = shape_sets(args.max_num_seqs, args.max_num_batched_tokens, args.spec_tokens)
    rows = {name: run_child(shapes, sms, prime_sms=sms - 2) for name, shapes in sets.items()}
    before_b, after_b = set(rows["before"]["aligned_batches"]), set(rows["after"]["aligned_batches"])
    doc = {
        "benchmark": "bench_planner_warmup", "environment": environment(),
        "config": {"sms": sms, "max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens,
                   "spec_tokens": args.spec_tokens, "capture_sizes": capture_sizes(args.max_num_seqs, args.spec_tokens)},
        "shapes": sets, "sets": rows, "after_buckets_before_missed": sorted(after_b - before_b),
        "before_buckets_vllm_never_microbatches_as_graphs_or_full_batch": sorted(before_b - after_b),
        "ratios": {
            "variants after / before": round(rows["after"]["planner_variants_launched"] / max(rows["before"]["planner_variants_launched"], 1), 4),
            "seconds after / before": round(rows["after"]["seconds"] / max(rows["before"]["seconds"], 1e-9), 4),
        },
    }  # fmt: skip
    path = write_json(args.out / "bench_planner_warmup.json", doc)
    _plot(doc, args.out / "bench_planner_warmup.png")
    for name, r in rows.items():
        print(f"{name:6s} variants {r['planner_variants_launched']:3d}  jit entries {r['new_jit_cache_entries']:3d}  "
              f"{r['seconds']:7.2f} s  aligned batches {r['aligned_batches']}")
    print(f"after covers buckets before missed: {doc['after_buckets_before_missed']}")
    say_written("bench_planner_warmup", path, args.out / "bench_planner_warmup.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
