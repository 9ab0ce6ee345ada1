"""FakeEngineRunner: a stand-in for ``dbo_runtime.harness.runner`` (boundary: no GPU, so no vLLM
engine can start in CI). It speaks the runner's file protocol (spec in, rank JSON out, exit code)
so the launcher's process handling -- merging ranks, killing a hung peer after a failure,
timeouts, failure signatures -- is tested on CPU. GPU twin: every test in ``tests/e2e`` (the real
runner, real engines).

Behaviour per rank from ``spec["meta"]["fake"]``: ``{"0": "ok", "1": "crash"}``; ``ok`` writes
two requests per rank, ``crash`` prints vLLM 0.33.0's DeepGEMM assertion and exits 1 without a
result, ``fail`` writes a failed result, ``hang`` logs the runner's "engine ready" line and sleeps forever, ``start-hang`` sleeps
forever before that line (a slow start), ``assert-hang`` prints the assertion from a microbatch thread and then hangs (what vanilla vLLM 0.33.0 does).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path


def _rep(rep: int, rank: int, bench: dict) -> dict:
    """One timed turn. ``DBO_FAKE_STEP_MS`` (JSON ``{"<VLLM_DBO_COMM_SMS>": ms}``) gives each comm-SM value its
    step time, the same for prefill and decode, with a per-rep wobble of 1 % and rank 1 slower by 0.5 %."""
    curve = json.loads(os.environ.get("DBO_FAKE_STEP_MS", "{}"))
    ms = float(curve.get(os.environ.get("VLLM_DBO_COMM_SMS", ""), 1.0)) * (1 + 0.01 * (rep % 3 - 1)) * (1 + 0.005 * rank)
    built = int(os.environ.get("DBO_FAKE_MICROBATCHED", "4"))
    return {
        "rep": rep,
        "warmup": rep < int(bench.get("warmup", 1)),
        "decode_step_ms": ms,
        "decode_tok_per_s": 10.0,
        "prefill_s": ms / 1e3,
        "microbatched_builds": built,
        "prefill_microbatched_builds": built,
        "prefill_partitions": built,
        "prefill_partition_ms": ms if built else None,
        "decode_partitions": built,
        "decode_partition_ms": ms if built else None,
    }


def main() -> int:
    spec = json.loads(Path(sys.argv[1]).read_text())
    out = Path(sys.argv[2])
    rank = int(os.environ.get("VLLM_DP_RANK", "0"))
    size = int(os.environ.get("VLLM_DP_SIZE", "1"))
    mode = (spec.get("meta") or {}).get("fake", {}).get(str(rank), "ok")  # no meta: a verify run, every rank ok
    if mode == "start-hang":
        time.sleep(3600)
    print(f"[dbo-harness rank {rank}] engine ready in 1.0 s", file=sys.stderr, flush=True)  # the runner's line
    if mode == "hang":
        time.sleep(3600)
    if mode == "assert-hang":  # vLLM 0.33 vanilla: the assertion kills a microbatch thread, the step hangs
        print('Exception in thread Thread-4 (_ubatch_thread):', flush=True)
        print("RuntimeError: Assertion error (csrc/apis/attention.hpp:272): _schedule_meta_size == num_sms / num_kv_multicast + 1", flush=True)
        time.sleep(3600)
    if mode == "crash":
        print(
            "RuntimeError: Assertion error (csrc/apis/attention.hpp:388): _schedule_meta_size == num_sms / "
            "num_kv_multicast + 1 and _meta_info_size == 2",
            flush=True,
        )
        return 1
    cache = os.environ.get("DG_JIT_CACHE_DIR")
    if cache is not None:  # what a cold-cache run finds there
        print(f"DG_JIT_CACHE_DIR={cache} entries={len(os.listdir(cache)) if os.path.isdir(cache) else 0}", flush=True)
    bench = spec.get("bench") or {}
    reps = []
    if bench.get("coordinated"):
        root = Path(os.environ["DBO_HARNESS_BARRIER_DIR"])
        for rep in range(int(bench.get("warmup", 1)) + int(bench["reps"])):
            (root / f"ready-rep{rep}.{rank}").touch()
            if mode == "exit-after-ready":  # an engine that dies while it waits for its first turn
                return 1
            waited = time.monotonic() + 120  # as the real runner's turn wait: never forever
            while not (root / f"go-rep{rep}").exists():
                if time.monotonic() > waited:
                    print(f"turn rep{rep} was never started by the coordinator", flush=True)
                    return 1
                time.sleep(0.01)
            if mode == "slow-rep":  # a turn that outlasts the coordinator's deadline
                time.sleep(float((spec.get("meta") or {}).get("fake_rep_s", 5)))
            reps.append(_rep(rep, rank, bench))
            (root / f"done-rep{rep}.{rank}").touch()
    if (spec.get("meta") or {}).get("fake_exit_s"):  # an engine whose shutdown outlasts the coordinator's deadline
        time.sleep(float(spec["meta"]["fake_exit_s"]))
    requests = [
        {"index": i, "tokens": [i, i + 1], "logprobs": [{str(i): -0.1}, {str(i + 1): -0.2}]}
        for i in range(rank, 2 * size, size)
    ]
    result = {
        "label": spec["label"],
        "rank": rank,
        "dp": size,
        "ok": mode == "ok",
        "error": None if mode == "ok" else "ValueError: fake failure",
        "start_s": 1.0 + rank,
        "versions": {"vllm": "0.33.0", "device": "FakeGPU"},
        "requests": requests,
        "stats_end": [{"summary": {"microbatched_builds": 5}, "worker": {"runner": "v1"}}],
        "microbatched_builds": 5,
        "bench": {"reps": reps} if reps else None,
    }
    print("(EngineCore_DP0 pid=1) INFO dbo_runtime: 25 patches installed for vLLM 0.33.0 (fake)", flush=True)
    out.write_text(json.dumps(result))
    return 0 if mode == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())
