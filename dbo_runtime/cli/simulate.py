"""``dbo-runtime simulate``: the DBO + DSA scenario at small scale, with a verdict.

Runs the GLM-5.3 layer pattern (78 layers, 21 indexer leaders) as two
microbatches on two threads under SMControl's DBO budget (132 -> 112 SMs on the
embedded H200 profile), with the indexer schedule cache and per-microbatch top-k
state active, and checks every request's logits, top-k and follower reads
bit-for-bit against an unsplit run. On a CPU the kernels are the reference
planner and an fp32 logits simulation with DeepGEMM's schedule assertion; with
CUDA and ``deep_gemm`` they are the real kernels (``--backend auto``).

Unless ``--no-contrast``, it also runs what vLLM 0.33.0 does without
dbo_runtime (schedule not re-planned: the assertion) and with only the
upstream schedule fix (shared top-k: follower mismatches), so the verdict shows
both bugs and their fixes.

JSON (``--json``), schema ``dbo-runtime/simulate/v1``::

    {"schema", "backend", "simulated", "mode", "budget", "verdict": "PASS"|"FAIL",
     "runs": [{"name", "expect", "ok", "as_expected", "error", "leaders", "followers",
               "replans_total", "steady_state_replans", "captured_replans", "planned_ahead",
               "warmups", "topk_extra_bytes", "jit_in_capture", "checks": [...],
               "timeline": [...], "step_ms": [...], "config": {...}}]}

Exit code 0 when every run behaved as expected (dbo_runtime: all checks pass;
contrasts: fail the way vLLM 0.33.0 fails), 1 otherwise.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from dbo_runtime.cli._common import (
    EXIT_OK,
    EXIT_PROBLEM,
    EXIT_USAGE,
    CliError,
    print_json,
    print_table,
    warn_switch_problems,
)
from dbo_runtime.cli._inputs import MAX_SMS, Input, budget_for, comm_input, parse_int
from dbo_runtime.core.errors import ConfigError

SCHEMA = "dbo-runtime/simulate/v1"
MAX_REQUESTS = 1024
MAX_STEPS = 1000
"""More steps add nothing a run of 20 does not show (and 1000 on the CPU already take hours)."""
MAX_SEED = 2**63 - 1
H200_SMS = 132

FLAG_FOR = {
    "steps": "--steps",
    "num_requests": "--requests",
    "backend": "--backend",
    "mode": "--mode",
}
"""Scenario parameter -> the flag an operator typed (errors name the flag)."""


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p: argparse.ArgumentParser = subparsers.add_parser(
        "simulate",
        help="run the DBO + DSA scenario (CPU simulation or real DeepGEMM) and print a verdict",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
    )
    p.add_argument("--backend", default="auto", choices=("auto", "cpu", "deep_gemm"), help="kernels (default: auto)")
    p.add_argument("--mode", default="eager", choices=("eager", "mrv1", "mrv2"), help="eager, or FULL CUDA-graph capture as MRV1/MRV2 (GPU)")
    p.add_argument("--preset", default="small", choices=("small", "glm53"), help="small: toy widths; glm53: GLM-5.3 indexer shapes")
    p.add_argument("--steps", metavar="N", default=None, help=f"DBO steps per run (1..{MAX_STEPS}; default: the preset's)")
    p.add_argument("--requests", metavar="N", default=None, help=f"requests per step, split in two microbatches (2..{MAX_REQUESTS})")
    p.add_argument("--comm-sms", metavar="N", default=None, help="comm SMs (default: $VLLM_DBO_COMM_SMS, else 20)")
    p.add_argument(
        "--total-sms", metavar="N", default=None, help=f"SMs of the simulated device (CPU backend; 1..{MAX_SMS}; default: H200, {H200_SMS})"
    )
    p.add_argument("--topk-layout", default="windows", choices=("windows", "copies"), help="per-microbatch top-k state layout")
    p.add_argument("--seed", metavar="N", default="0", help=f"seed of the random inputs (0..{MAX_SEED}; default 0)")
    p.add_argument("--no-contrast", action="store_true", help="skip the vLLM 0.33.0 comparison runs")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    return p


DISABLED_RUN = "dbo_runtime (DBO_RUNTIME_DISABLE)"


def _runs(args: argparse.Namespace, disabled: bool) -> list[Any]:
    """The dbo_runtime run and the contrasts.

    With ``DBO_RUNTIME_DISABLE`` in force (read as the plugin reads it) a server patches
    nothing, so the run that stands for dbo_runtime runs without its fixes: simulate answers
    "what will a server with this environment do", and the verdict says why it fails.
    """
    from dbo_runtime.sim.scenario import CONTRASTS, Contrast

    head = Contrast(DISABLED_RUN, "pass", {"fix_schedule": False, "isolate_topk": False}) if disabled else Contrast("dbo_runtime", "pass", {})
    return [head, *([] if args.no_contrast else CONTRASTS)]


def run(args: argparse.Namespace) -> int:
    try:
        return _run(args)
    except ConfigError as exc:
        flag = FLAG_FOR.get(exc.parameter)
        if flag is None:
            raise
        raise ConfigError(flag, exc.value, exc.allowed) from None
    except (RuntimeError, MemoryError) as exc:  # e.g. an allocation the machine cannot hold
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CliError(f"error: the scenario could not be set up: {first}", EXIT_USAGE) from None


class _NoProgress:
    """Stand-in for ``rich.progress.Progress`` where rich is absent (the GPU box may lack it)."""

    def __init__(self, **_: Any) -> None:
        pass

    def __enter__(self) -> _NoProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def add_task(self, *_: Any, **__: Any) -> int:
        return 0

    def update(self, *_: Any, **__: Any) -> None:
        return None


def _run(args: argparse.Namespace) -> int:
    try:
        from rich.progress import Progress
    except ImportError:
        Progress = _NoProgress  # type: ignore[assignment,misc]

    from dbo_runtime.core.switches import parse_switch
    from dbo_runtime.sim.backends import make_backend
    from dbo_runtime.sim.scenario import GLM53, SMALL, for_backend, run_scenario

    warn_switch_problems("simulate")
    disabled = parse_switch("DBO_RUNTIME_DISABLE")

    # Every flag is checked, and the split computed, before anything runs (sms uses the same rules).
    steps = None if args.steps is None else parse_int(args.steps, "--steps", 1, MAX_STEPS)
    requests = None if args.requests is None else parse_int(args.requests, "--requests", 2, MAX_REQUESTS)
    total_sms = H200_SMS if args.total_sms is None else parse_int(args.total_sms, "--total-sms", 1, MAX_SMS)
    seed = parse_int(args.seed, "--seed", 0, MAX_SEED)
    comm = comm_input(args.comm_sms, "cuda")
    base = SMALL if args.preset == "small" else GLM53
    overrides: dict[str, Any] = {"comm_sms": comm.value, "seed": seed, "topk_layout": args.topk_layout}
    if steps is not None:
        overrides["steps"] = steps
    if requests is not None:
        overrides["num_requests"] = requests
    config = dataclasses.replace(base, **overrides)
    config.validate()
    backend = make_backend(args.backend, total_sms=total_sms)
    if backend.simulated:
        total = Input(total_sms, "--total-sms" if args.total_sms is not None else "default", "the H200 profile")
    else:
        total = Input(backend.total_sms, "hardware", f"{backend.name} on this GPU")
    budget_for(
        total=total,
        comm=comm,
        max_sms_used=Input(None, "vllm-0.33.0-manager"),
        platform="cuda",
        all2all_backend="deepep_high_throughput",
        where="the simulated device" if backend.simulated else "this GPU",
    )
    config = for_backend(config, backend)
    results = []
    with Progress(transient=True, disable=args.json) as progress:
        for contrast in _runs(args, disabled):
            task = progress.add_task(contrast.name, total=config.steps)

            def advance(done: int, total: int, task: Any = task) -> None:
                progress.update(task, completed=done)

            res = run_scenario(dataclasses.replace(config, **contrast.overrides), backend, args.mode, progress=advance)
            results.append((contrast, res))
    verdict = all(c.as_expected(r) for c, r in results)
    head = results[0][1]
    if args.json:
        print_json(
            {
                "schema": SCHEMA,
                "backend": backend.name,
                "simulated": backend.simulated,
                "mode": args.mode,
                "budget": head.budget,
                "verdict": "PASS" if verdict else "FAIL",
                "dbo_runtime_disabled_by_env": disabled,
                "runs": [
                    {"name": c.name, "expect": c.expect, "as_expected": c.as_expected(r), **r.to_json()}
                    for c, r in results
                ],
            }
        )
        return EXIT_OK if verdict else EXIT_PROBLEM
    _print_human(backend, args, head, results, verdict, disabled)
    return EXIT_OK if verdict else EXIT_PROBLEM


def _print_human(backend: Any, args: argparse.Namespace, head: Any, results: list[Any], verdict: bool, disabled: bool) -> None:
    kind = "CPU simulation (reference planner, fp32 logits)" if backend.simulated else "real DeepGEMM kernels"
    cfg = head.config
    print(
        f"dbo-runtime simulate: {backend.name} — {kind}; mode {args.mode}\n"
        f"stack: {cfg['num_layers']} layers, {head.leaders} indexer leaders, {head.followers} followers; "
        f"{cfg['num_requests']} requests x next_n {cfg['next_n']} in 2 microbatches; contexts <= {cfg['max_context']}, "
        f"{cfg['heads']} heads x {cfg['head_dim']}, top-k {cfg['index_topk']}\n"
        f"DBO budget: {head.budget}"
    )
    timeline = [f"{e['t_ms']:>9.1f} ms  {e['event']:<9} compute {e['compute']:>3} / comm {e['comm']:>2}" for e in head.timeline[:8]]
    if len(head.timeline) > 8:
        timeline.append(f"   ... {len(head.timeline) - 8} more events")
    print("SM budget timeline (dbo_runtime run):\n  " + "\n  ".join(timeline))
    rows = []
    for contrast, r in results:
        bad_logits = sum(c.logits_mismatch_rows for c in r.checks)
        bad_topk = sum(c.topk_mismatch_rows for c in r.checks)
        bad_follow = sum(c.follower_mismatch for c in r.checks)
        outcome = "crash: " + r.error.split(":")[0] if r.error else ("bit-identical" if r.ok else "WRONG RESULTS")
        rows.append(
            [
                contrast.name,
                f"{len(r.checks)}/{cfg['steps']}",
                outcome,
                str(bad_logits),
                str(bad_topk),
                str(bad_follow),
                f"{r.replans_total} ({r.steady_state_replans} steady)",
                str(r.captured_replans),
                "yes" if contrast.as_expected(r) else "NO",
            ]
        )
    print_table(
        "Runs (each step checked against an unsplit run at full SMs)",
        ["run", "steps", "outcome", "logit rows≠", "top-k rows≠", "follower reads≠", "call-site re-plans", "in-graph re-plans", "as expected"],
        rows,
        [
            f"top-k state per extra microbatch: {head.topk_extra_bytes} bytes ({cfg['topk_layout']} layout); "
            f"planner warm-ups: {head.warmups}; JIT inside capture: {len(head.jit_in_capture)}",
        ],
    )
    for contrast, r in results:
        if r.error and not contrast.as_expected(r):
            print(f"{contrast.name}: {r.error}")
    if disabled:
        print(
            "verdict: FAIL: DBO_RUNTIME_DISABLE reads as on, so the plugin patches nothing and a DBO server "
            f"runs as the '{DISABLED_RUN}' row shows; unset it (or set 0) to run dbo_runtime"
        )
        return
    print(f"verdict: {'PASS' if verdict else 'FAIL'}")
