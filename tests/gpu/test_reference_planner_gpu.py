"""GPU twin of tests/unit/test_reference_planner.py: the reference equals DeepGEMM bit-for-bit.

Runs ``deep_gemm.get_paged_mqa_logits_metadata(context_lens_2d_int32_cuda, block_kv, num_slots)``
on >= 1000 random cases and compares every row with ``plan_paged_mqa_schedule`` computed on the
CPU. ``num_slots`` is derived from an SM budget the way vLLM 0.33.0's wrapper does
(``schedule_slots``: SM90 next_n == 4 -> num_sms // 2), and that is what DeepGEMM receives as its
``num_sms`` argument.

DeepGEMM JIT-compiles one planner per (align(batch, 32), num_slots) pair (seconds each), so the
cases are grouped: a fixed set of slot counts x batch buckets, many random draws per compiled
kernel. Knobs (env): DBO_PLANNER_GPU_DRAWS (draws per kernel, default 42),
DBO_PLANNER_GPU_SEED (default 20261129). Prints one summary line; writes
``$OUT/reference_planner_gpu.json`` when OUT is set. No vLLM here (the GPU box has none).
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import platform
import random
import time
from datetime import UTC, datetime
from types import ModuleType
from typing import Any

import pytest
import torch

from dbo_runtime.sim.reference_planner import plan_paged_mqa_schedule, schedule_slots

SLOT_COUNTS = (1, 3, 33, 56, 65, 66, 112, 132)  # 65/66/56: SM90 next_n=4 budgets 130-132 / 112-113
BATCH_BUCKETS = (32, 160, 512)  # align(batch, 32); draws take batch in (bucket - 32, bucket]
MAX_CONTEXT = 131072
MIN_CASES = 1000


def _versions(deep_gemm: ModuleType) -> dict[str, str]:
    from importlib import metadata

    versions = {"torch": torch.__version__, "cuda": str(torch.version.cuda), "python": platform.python_version()}
    for dist in ("tokenspeed-deepgemm", "deep-gemm", "deep_gemm"):
        try:
            versions["deep_gemm"] = f"{dist}=={metadata.version(dist)}"
            break
        except metadata.PackageNotFoundError:
            continue
    else:
        versions["deep_gemm"] = str(getattr(deep_gemm, "__version__", "unknown"))
    return versions


def _draw_last_lens(rng: random.Random, batch: int, profile: str) -> list[int]:
    if profile == "loguniform":
        return [min(MAX_CONTEXT, int(math.exp(rng.uniform(0.0, math.log(MAX_CONTEXT))))) for _ in range(batch)]
    if profile == "uniform":
        return [rng.randint(1, MAX_CONTEXT) for _ in range(batch)]
    if profile == "short":  # often fewer segments than slots
        return [rng.randint(1, 1024) for _ in range(batch)]
    if profile == "boundaries":  # around multiples of SPLIT_KV = 256
        return [max(1, min(MAX_CONTEXT, 256 * rng.randint(1, 512) + rng.choice((-1, 0, 1)))) for _ in range(batch)]
    if profile == "with_zeros":  # padded / finished rows: the kernel reads 0 as "no segments"
        return [0 if rng.random() < 0.3 else rng.randint(1, MAX_CONTEXT) for _ in range(batch)]
    if profile == "all_zero":
        return [0] * batch
    raise AssertionError(profile)


PROFILES = ("loguniform", "uniform", "short", "boundaries", "with_zeros", "loguniform", "uniform")


def _context_lens(rng: random.Random, batch: int, next_n: int, profile: str) -> torch.Tensor:
    last = _draw_last_lens(rng, batch, profile)
    rows = []
    for value in last:
        if rng.random() < 0.5:  # vLLM MTP layout: position j sees last - (next_n - 1 - j) tokens
            rows.append([max(0, value - (next_n - 1 - j)) for j in range(next_n - 1)] + [value])
        else:  # arbitrary earlier columns: only the last one may matter
            rows.append([rng.randint(0, MAX_CONTEXT) for _ in range(next_n - 1)] + [value])
    return torch.tensor(rows, dtype=torch.int32)


def _build_cases(rng: random.Random, sm_major: int, device_sms: int, draws: int) -> list[dict[str, Any]]:
    cases = []
    for slots in SLOT_COUNTS:
        for bucket in BATCH_BUCKETS:
            for draw in range(draws):
                batch = rng.randint(max(1, bucket - 31), bucket)
                next_n = rng.choice((1, 2, 4))
                if next_n == 4 and sm_major == 9:
                    num_sms = 2 * slots + rng.choice((0, 1))
                    if num_sms > device_sms:
                        num_sms = 2 * slots
                    if num_sms > device_sms:
                        next_n, num_sms = rng.choice((1, 2)), slots
                else:
                    num_sms = slots
                profile = "all_zero" if draw == 0 else PROFILES[draw % len(PROFILES)]
                cases.append(
                    {
                        "slots": slots,
                        "num_sms": num_sms,
                        "batch": batch,
                        "next_n": next_n,
                        "block_kv": 32 if rng.random() < 0.2 else 64,
                        "profile": profile,
                        "context_lens": _context_lens(rng, batch, next_n, profile),
                    }
                )
    return cases


def test_reference_planner_matches_deep_gemm(
    deep_gemm: ModuleType, sm_major: int, cuda_device: torch.device, out_dir: pathlib.Path | None
) -> None:
    if sm_major not in (9, 10):
        pytest.skip(f"reference mirrors the SM90/SM100 planners; device is SM{sm_major}x")
    device_sms = torch.cuda.get_device_properties(cuda_device).multi_processor_count
    draws = int(os.environ.get("DBO_PLANNER_GPU_DRAWS", "42"))
    seed = int(os.environ.get("DBO_PLANNER_GPU_SEED", "20261129"))
    rng = random.Random(seed)
    cases = _build_cases(rng, sm_major, device_sms, draws)
    assert len(cases) >= MIN_CASES or draws < 42

    kernels: set[tuple[int, int]] = set()
    mismatches: list[dict[str, Any]] = []
    device_ref_checked = 0
    first_call_s: list[float] = []
    started = time.perf_counter()
    for index, case in enumerate(cases):
        # The slot rule the caller applies (vLLM's wrapper does this before calling DeepGEMM).
        slots = schedule_slots(case["num_sms"], case["next_n"], sm_major)
        assert slots == case["slots"], case
        lens_cpu = case["context_lens"]
        lens_gpu = lens_cpu.to(cuda_device)
        kernel = (32 * math.ceil(case["batch"] / 32), slots)
        t0 = time.perf_counter()
        got = deep_gemm.get_paged_mqa_logits_metadata(lens_gpu, case["block_kv"], slots)
        if kernel not in kernels:
            torch.cuda.synchronize()
            first_call_s.append(time.perf_counter() - t0)  # includes the JIT compile
            kernels.add(kernel)
        got_cpu = got.cpu()
        want = plan_paged_mqa_schedule(lens_cpu, case["block_kv"], slots, sm_major=sm_major)
        same = got_cpu.dtype == want.dtype and got_cpu.shape == want.shape and torch.equal(got_cpu, want)
        if index % 10 == 0:  # the reference is device-agnostic: same answer from CUDA tensors
            on_gpu = plan_paged_mqa_schedule(lens_gpu, case["block_kv"], slots, sm_major=sm_major)
            same = same and torch.equal(on_gpu.cpu(), want)
            device_ref_checked += 1
        if not same:
            rows = [
                i
                for i in range(min(got_cpu.shape[0], want.shape[0]))
                if not torch.equal(got_cpu[i], want[i])
            ]
            mismatches.append(
                {
                    "index": index,
                    "slots": slots,
                    "num_sms": case["num_sms"],
                    "batch": case["batch"],
                    "next_n": case["next_n"],
                    "block_kv": case["block_kv"],
                    "profile": case["profile"],
                    "got_shape": list(got_cpu.shape),
                    "want_shape": list(want.shape),
                    "first_bad_rows": [
                        {"row": i, "got": got_cpu[i].tolist(), "want": want[i].tolist()} for i in rows[:4]
                    ],
                    "last_col_lens": lens_cpu[:, -1].tolist()[:64],
                }
            )
    wall_s = time.perf_counter() - started

    summary = {
        "test": "reference_planner_gpu",
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(cuda_device),
        "sm_major": sm_major,
        "device_sms": device_sms,
        "versions": _versions(deep_gemm),
        "seed": seed,
        "cases": len(cases),
        "mismatches": len(mismatches),
        "distinct_kernels": len(kernels),
        "device_reference_checks": device_ref_checked,
        "next_n_counts": {str(n): sum(c["next_n"] == n for c in cases) for n in (1, 2, 4)},
        "block_kv32_cases": sum(c["block_kv"] == 32 for c in cases),
        "first_call_s_max": round(max(first_call_s), 3),
        "first_call_s_sum": round(sum(first_call_s), 3),
        "wall_s": round(wall_s, 3),
        "mismatch_examples": mismatches[:8],
    }
    print(
        f"\nreference_planner_gpu: cases={summary['cases']} mismatches={summary['mismatches']} "
        f"kernels={summary['distinct_kernels']} device={summary['device']} "
        f"deep_gemm={summary['versions']['deep_gemm']} wall={summary['wall_s']}s "
        f"jit_sum={summary['first_call_s_sum']}s"
    )
    if out_dir is not None:
        (out_dir / "reference_planner_gpu.json").write_text(json.dumps(summary, indent=2))

    assert len(kernels) == len(SLOT_COUNTS) * len(BATCH_BUCKETS)
    assert not mismatches, json.dumps(mismatches[:3], indent=1)


def test_reference_planner_rows_follow_the_slot_rule(
    deep_gemm: ModuleType, sm_major: int, cuda_device: torch.device
) -> None:
    """DeepGEMM sizes the plan from the argument it gets; the slot rule is the caller's job."""
    if sm_major not in (9, 10):
        pytest.skip(f"reference mirrors the SM90/SM100 planners; device is SM{sm_major}x")
    device_sms = torch.cuda.get_device_properties(cuda_device).multi_processor_count
    lens = torch.full((5, 4), 3000, dtype=torch.int32)
    slots = schedule_slots(device_sms, 4, sm_major)
    got = deep_gemm.get_paged_mqa_logits_metadata(lens.to(cuda_device), 64, slots)
    assert tuple(got.shape) == (slots + 1, 2) and got.dtype == torch.int32
    assert torch.equal(got.cpu(), plan_paged_mqa_schedule(lens, 64, slots, sm_major=sm_major))
    if sm_major == 9:
        assert slots == device_sms // 2
