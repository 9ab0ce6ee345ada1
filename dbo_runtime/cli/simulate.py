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
     "dbo_runtime_disabled_by_env": bool,   # DBO_RUNTIME_DISABLE as the plugin reads it
     "server_runs": "dbo_runtime"|"vanilla vLLM",   # what a server started with this environment runs
     "warnings": [str],   # every warning the text output shows: a mistyped DBO_RUNTIME_* switch
                          # (core.switches), a poor split (as `sms` warns), DBO_RUNTIME_DISABLE in force
     "runs": [{"name", "expect", "ok", "as_expected", "error", "leaders", "followers",
               "replans_total", "steady_state_replans", "captured_replans", "planned_ahead",
               "warmups", "topk_extra_bytes", "jit_in_capture", "checks": [...],
               "timeline": [...], "step_ms": [...], "config": {...}}]}

Exit code 0 when every run behaved as expected (dbo_runtime: all checks pass;
contrasts: fail the way vLLM 0.33.0 fails), 1 otherwise. ``DBO_RUNTIME_DISABLE`` in
force is what ``doctor`` says it is, in the same words (``_common.disabled_warning``): a
warning, not a failure. The dbo_runtime run still shows what the plugin does, and the
warning says that a server with this environment runs none of it (the contrast rows are
what it runs instead).

Progress goes to stderr (a bar on a terminal, a line per step otherwise); a CPU run
expected to take more than ``LONG_RUN_SECONDS`` says how long up front. The human
output fits 100 columns.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from typing import Any

from dbo_runtime.cli._common import (
    EXIT_NO_DEVICE,
    EXIT_OK,
    EXIT_PROBLEM,
    EXIT_USAGE,
    CliError,
    disabled_warning,
    print_json,
    print_table,
    warn_switch_problems,
)
from dbo_runtime.cli._inputs import (
    MAX_SMS,
    Input,
    budget_for,
    comm_input,
    parse_int,
    parse_total,
    shadowed_comm_env,
    split_warnings,
)
from dbo_runtime.cli._progress import Progress, seconds
from dbo_runtime.core.budget import H200_SMS
from dbo_runtime.core.errors import ConfigError

SCHEMA = "dbo-runtime/simulate/v1"
GLM53_CPU_STEPS, GLM53_CPU_REQUESTS = 2, 8
"""``--preset glm53`` on the CPU simulation, unless --steps/--requests say otherwise.

The GPU preset (20 steps x 32 requests) takes about 10 minutes on a 2-core CPU (about 8.5 s
per DBO step with its reference run, 3.5 runs' worth of steps). Both bugs show on the first
step, and a second one shows that steady state needs no re-plan, so the CPU default keeps the
GLM-5.3 indexer shapes and runs 2 steps of 8 requests: 14-32 s there (``docs/performance.md``)."""
GLM53_GPU_RUN = "20 steps x 32 requests"
GLM53_CPU_RUN = f"{GLM53_CPU_STEPS} steps x {GLM53_CPU_REQUESTS} requests"
WIDTH = 100
"""simulate's output fits 100 columns."""
LONG_RUN_SECONDS = 30.0
"""A CPU run expected to take longer says so up front."""
MAX_REQUESTS = 1024
MAX_STEPS = 1000
"""More steps add nothing a run of 20 does not show (and 1000 on the CPU already take hours)."""
MAX_SEED = 2**63 - 1

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
        description=(
            "Run the GLM-5.3 layer pattern as two DBO microbatches under vLLM's SM budget, with dbo_runtime's "
            "schedule cache and per-microbatch top-k state, check every step bit-for-bit against an unsplit run, "
            "and, for contrast, reproduce what vLLM 0.33.0 does without dbo_runtime."
        ),
    )
    p.add_argument("--backend", default="auto", choices=("auto", "cpu", "deep_gemm"), help="auto (default): real DeepGEMM where CUDA and deep_gemm load, else cpu, the CPU simulation")
    p.add_argument("--mode", default="eager", choices=("eager", "mrv1", "mrv2"), help="eager, or FULL CUDA-graph capture as MRV1/MRV2 (GPU)")
    p.add_argument(
        "--preset",
        default="small",
        choices=("small", "glm53"),
        help=(
            "small: toy widths (default); glm53: GLM-5.3 indexer shapes (32 heads x 128, contexts <= 16384, "
            f"top-k 2048), {GLM53_GPU_RUN} on a GPU, {GLM53_CPU_RUN} on the CPU simulation (15-45 s on 2 cores)"
        ),
    )
    p.add_argument("--steps", metavar="N", default=None, help=f"DBO steps per run (1..{MAX_STEPS}; default: the preset's)")
    p.add_argument("--requests", metavar="N", default=None, help=f"requests per step, split in two microbatches (2..{MAX_REQUESTS})")
    p.add_argument("--comm-sms", metavar="N", default=None, help="comm SMs (default: $VLLM_DBO_COMM_SMS, else 20)")
    p.add_argument(
        "--total-sms", metavar="N", default=None, help=f"SMs of the simulated device, an SM90 (Hopper) GPU: DeepGEMM's share is kept even, as on the worker (CPU backend; up to {MAX_SMS}, and more than the comm share plus 1: 22 or more at the default 20 comm SMs; default: H200, {H200_SMS}). `sms --total-sms` takes 132 as the H200 (SM90) and any other count as an unknown architecture"
    )
    p.add_argument(
        "--topk-layout",
        default=None,
        choices=("windows", "copies"),
        help="per-microbatch top-k state layout (default: $DBO_RUNTIME_TOPK_LAYOUT, as a server reads it, else windows)",
    )
    p.add_argument("--seed", metavar="N", default="0", help=f"seed of the random inputs (0..{MAX_SEED}; default 0)")
    p.add_argument("--no-contrast", action="store_true", help="skip the vLLM 0.33.0 comparison runs")
    p.add_argument(
        "--json", action="store_true", help=f"machine-readable output (JSON, schema {SCHEMA}; the warnings in its \"warnings\" list)"
    )
    return p


def _runs(args: argparse.Namespace, comm_sms: int = 20) -> list[Any]:
    """The dbo_runtime run and the contrasts."""
    from dbo_runtime.sim.scenario import CONTRASTS, Contrast

    head = Contrast("dbo_runtime", "pass", {})
    contrasts = list(CONTRASTS)
    if comm_sms == 0:
        # No SM partition: vLLM 0.33.0 never changes DeepGEMM's count, so it does not assert, and the
        # shared top-k bug is all that is left (what VLLM_DBO_COMM_SMS=0 does on a real server).
        contrasts = [Contrast(c.name, "topk-mismatch", c.overrides) if c.expect == "assertion" else c for c in contrasts]
    return [head, *([] if args.no_contrast else contrasts)]


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


CPU_SECONDS_PER_UNIT = 1.8e-10
"""Seconds per (leader x request x next_n x context x head x dim) of a CPU step, its unsplit reference run
included: the fp32 logits einsum, the part that grows with the indexer's width.

Fitted with ``CPU_SECONDS_PER_ROW``, ``CPU_SECONDS_PER_RUN`` and ``CPU_START_SECONDS`` to the wall time of ``dbo-runtime simulate
--backend cpu`` on a 2-core CPU, with and without ``--no-contrast``: ``--preset small`` at 1-20 steps of 2-256
requests, and ``--preset glm53`` at 1-4 steps of 8-32 requests (``docs/performance.md``, "simulate's up-front
estimate, refit"), as the geometric mean of each command's timed runs: the same command varied up to 3x in
wall time there from one run to the next, with the host's load, so the estimate is the middle of that spread,
not a bound."""
CPU_SECONDS_PER_ROW = 3e-7
"""Seconds per (leader x request x next_n x context position) of a CPU step, whatever the indexer's width: the
per-position work of the mask, the top-k sort and the key gather, which the small preset's toy widths leave
dominant (fitted with ``CPU_SECONDS_PER_UNIT``)."""
CPU_SECONDS_PER_RUN = 0.8
"""Seconds each run (the dbo_runtime run, each contrast) costs besides its steps: building the scenario and its
planner warm-ups (fitted with ``CPU_SECONDS_PER_UNIT``)."""
CPU_START_SECONDS = 1.8
"""Seconds before the first run: the interpreter, torch's import and the checks of every flag (fitted with
``CPU_SECONDS_PER_UNIT``)."""


def step_seconds(config: Any, leaders: int) -> float:
    """A rough CPU time of one DBO step with its unsplit reference run."""
    rows = leaders * config.num_requests * config.next_n * config.max_context
    return rows * (CPU_SECONDS_PER_ROW + CPU_SECONDS_PER_UNIT * config.heads * config.head_dim)


def estimated_seconds(config: Any, leaders: int, runs: list[Any]) -> float:
    """A rough CPU wall time of the command, for the up-front line of a long simulation: the start, then each
    run's fixed cost and its steps (a contrast that crashes on its first DBO step costs half a step)."""
    step = step_seconds(config, leaders)
    return CPU_START_SECONDS + sum(CPU_SECONDS_PER_RUN + step * (0.5 if c.expect == "assertion" else config.steps) for c in runs)


CPU_BASE_BYTES = 350 << 20
"""Resident bytes of a CPU simulation before its per-request tensors: the interpreter, torch and vLLM-free
services (measured peak RSS 302-336 MiB at the intercept of ``--steps 1 --no-contrast`` runs)."""
CPU_BYTES_MARGIN = 1.2
"""The per-request count below under-reads the measured peak RSS by 3-11 % (allocator slack, the random
inputs' temporaries); 1.2 keeps the estimate above it: ``--preset glm53`` measured 21.6 MiB per request
(16 and 64 requests), ``--preset small`` 0.9 MiB (64 and 1024), against 23.4 and 0.93 estimated."""


def estimated_bytes(config: Any, leaders: int) -> int:
    """Peak host memory of a CPU simulation: per request, the fp32 KV of its context, the same keys gathered
    for the logits, the per-head scores and logits of one pass, the leaders' persistent logits and top-k."""
    n, c = config.next_n, config.max_context
    per_request = c * (8 * config.head_dim + 4 * n * config.heads + 4 * leaders * n + 4 * n) + 4 * leaders * n * config.index_topk
    return int(CPU_BASE_BYTES + CPU_BYTES_MARGIN * config.num_requests * per_request)


def available_bytes() -> int | None:
    """What this process can still allocate: ``MemAvailable`` of ``/proc/meminfo``, lowered to what is left under a
    cgroup v2 memory limit (a container's OOM killer acts at ``memory.max``); None where the machine says neither."""
    found: list[int] = []
    try:
        with open("/proc/meminfo", encoding="ascii") as fh:
            found += [int(line.split()[1]) * 1024 for line in fh if line.startswith("MemAvailable:")]
    except (OSError, ValueError, IndexError):
        pass
    try:
        with open("/sys/fs/cgroup/memory.max", encoding="ascii") as fh:
            limit = fh.read().strip()
        with open("/sys/fs/cgroup/memory.current", encoding="ascii") as fh:
            current = int(fh.read().strip())
        if limit.isdigit():  # "max": no limit
            found.append(max(0, int(limit) - current))
    except (OSError, ValueError):
        pass
    return min(found) if found else None


def _run(args: argparse.Namespace) -> int:
    from dbo_runtime.core.settings import LAYOUT_ENV, parse_layout, vllm_setting_problems, warm_max_batch
    from dbo_runtime.core.topk_memory import index_leaders
    from dbo_runtime.sim.backends import make_backend
    from dbo_runtime.sim.scenario import GLM53, SMALL, for_backend, run_scenario

    warnings = warn_switch_problems("simulate")
    disabled = disabled_warning()
    # The environment a server would read, refused here like a bad flag (a server logs it and goes on).
    warm_max_batch()
    for problem in vllm_setting_problems():  # a value vLLM itself refuses at engine start
        raise problem
    try:
        env_layout = parse_layout(os.environ.get(LAYOUT_ENV)).value
    except ConfigError as exc:  # a bad value would stop a server: refused even with the flag, and said why
        raise ConfigError(
            exc.parameter,
            exc.value,
            f"{exc.allowed} (set in the environment: a server would read it and stop; unset it, --topk-layout "
            "does not override it)",
        ) from None
    layout = args.topk_layout or env_layout

    # Every flag is checked, and the split computed, before anything runs (sms uses the same rules).
    steps = None if args.steps is None else parse_int(args.steps, "--steps", 1, MAX_STEPS)
    requests = None if args.requests is None else parse_int(args.requests, "--requests", 2, MAX_REQUESTS)
    comm = comm_input(args.comm_sms, "cuda")
    total_sms = H200_SMS if args.total_sms is None else parse_total(args.total_sms, lambda sms: _split(Input(sms, "--total-sms"), comm, 9))
    seed = parse_int(args.seed, "--seed", 0, MAX_SEED)
    backend = _backend(args.backend, args.mode, total_sms, make_backend)
    base = SMALL if args.preset == "small" else GLM53
    if backend.simulated and base is GLM53:
        base = dataclasses.replace(GLM53, steps=GLM53_CPU_STEPS, num_requests=GLM53_CPU_REQUESTS)
    overrides: dict[str, Any] = {"comm_sms": comm.value, "seed": seed, "topk_layout": layout}
    if steps is not None:
        overrides["steps"] = steps
    if requests is not None:
        overrides["num_requests"] = requests
    config = dataclasses.replace(base, **overrides)
    config.validate()
    if backend.simulated:
        total = Input(total_sms, "--total-sms" if args.total_sms is not None else "default", "the H200 profile")
    else:
        total = Input(backend.total_sms, "hardware", f"{backend.name} on this GPU")
    budget = _split(total, comm, backend.sm_major, "the simulated device" if backend.simulated else "this GPU")
    shadowed = shadowed_comm_env(args.comm_sms)
    for warning in split_warnings(budget) + ([shadowed] if shadowed else []):  # the lines `sms` shows for the same split
        print(f"dbo-runtime simulate: warning: {warning}", file=sys.stderr)
        warnings.append(warning)
    if disabled is not None:
        warnings.append(disabled)
    config = for_backend(config, backend)
    runs = _runs(args, int(config.comm_sms))
    if backend.simulated:
        leaders = sum(index_leaders(config.num_layers, config.index_topk_freq, config.index_skip_topk_offset))
        need, have = estimated_bytes(config, leaders), available_bytes()
        if have is not None and need > have:  # refused before any tensor exists, not killed by the OOM killer later
            what = f"--requests {config.num_requests}" if args.requests is not None else f"{config.num_requests} requests"
            way_out = "lower --requests" + ("" if args.preset == "small" else ", or use --preset small")
            raise CliError(
                f"{what} with --preset {args.preset} needs about {need / 2**30:.1f} GiB of memory on the CPU "
                f"simulation; this machine has {have / 2**30:.1f} GiB available ({way_out})",
                EXIT_NO_DEVICE,
            )
        expected = estimated_seconds(config, leaders, runs)
        if expected > LONG_RUN_SECONDS:
            print(
                f"dbo-runtime simulate: {len(runs)} runs x {config.steps} steps of {config.num_requests} requests on the "
                f"CPU simulation: expect about {seconds(expected)} on a 2-core CPU; progress follows on stderr",
                file=sys.stderr,
                flush=True,
            )
    results = []
    with Progress("dbo-runtime simulate:", total_steps=len(runs) * config.steps) as progress:
        for contrast in runs:
            advance = progress.steps(contrast.name, config.steps)
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
                "dbo_runtime_disabled_by_env": disabled is not None,
                "server_runs": "vanilla vLLM" if disabled is not None else "dbo_runtime",
                "warnings": warnings,
                "runs": [
                    {"name": c.name, "expect": c.expect, "as_expected": c.as_expected(r), **r.to_json()}
                    for c, r in results
                ],
            }
        )
        return EXIT_OK if verdict else EXIT_PROBLEM
    _print_human(backend, args, head, results, verdict, disabled)
    return EXIT_OK if verdict else EXIT_PROBLEM


def _split(total: Input, comm: Input, sm_major: int | None, where: str = "the simulated device") -> Any:
    """The split the scenario runs under: vLLM's for DeepEP HT, through the rules ``sms`` uses."""
    return budget_for(
        total=total,
        comm=comm,
        max_sms_used=Input(None, "vllm-0.33.0-manager"),
        platform="cuda",
        all2all_backend="deepep_high_throughput",
        where=where,
        sm_major=sm_major,
    )


def _backend(kind: str, mode: str, total_sms: int, make_backend: Any) -> Any:
    """The kernel backend, or one line with exit 3 where this machine cannot run what was asked: real DeepGEMM,
    or a CUDA-graph mode, without a CUDA device is the machine's limit, not a bad argument."""
    from dbo_runtime.sim.backends import real_kernels_missing

    if kind == "cpu" and mode != "eager":  # a conflict on every machine, not this machine's limit
        raise ConfigError("--mode", mode, "eager with --backend cpu (CUDA graphs capture the real kernels: --backend auto)")
    if kind == "deep_gemm":
        missing = real_kernels_missing()
        if missing is not None:
            raise CliError(f"--backend deep_gemm needs a CUDA GPU and DeepGEMM: {missing}; --backend cpu runs the CPU simulation", EXIT_NO_DEVICE)
    backend = make_backend(kind, total_sms=total_sms)
    if mode != "eager" and backend.device.type != "cuda":
        import torch

        if not torch.cuda.is_available():
            raise CliError(
                f"--mode {mode} needs a CUDA GPU (FULL CUDA-graph capture): no CUDA device "
                "(torch.cuda.is_available() is False); --mode eager runs here",
                EXIT_NO_DEVICE,
            )
        raise ConfigError("--mode", mode, f"eager with --backend {kind} (CUDA graphs capture the real kernels: --backend auto)")
    return backend


def _outcome(r: Any) -> str:
    if r.error:
        return "crash: assertion" if r.error.startswith("DeepGEMM assertion") else "crash: " + r.error.split(":")[0]
    return "bit-identical" if r.ok else "WRONG RESULTS"


def _print_human(backend: Any, args: argparse.Namespace, head: Any, results: list[Any], verdict: bool, disabled: str | None) -> None:
    kind = "a CPU simulation (reference planner, fp32 logits)" if backend.simulated else "real DeepGEMM"
    cfg = head.config
    print(
        f"dbo-runtime simulate: {backend.name}, mode {args.mode}\n"
        f"kernels: {kind}\n"
        f"stack: {cfg['num_layers']} layers ({head.leaders} indexer leaders, {head.followers} followers), "
        f"{cfg['num_requests']} requests x next_n {cfg['next_n']} in 2 microbatches\n"
        f"indexer: contexts <= {cfg['max_context']}, {cfg['heads']} heads x {cfg['head_dim']}, top-k {cfg['index_topk']}\n"
        f"DBO budget: {head.budget}"
    )
    timeline = [f"{e['t_ms']:>9.1f} ms  {e['event']:<9} compute {e['compute']:>3} / comm {e['comm']:>2}" for e in head.timeline[:8]]
    if len(head.timeline) > 8:
        timeline.append(f"   ... {len(head.timeline) - 8} more events")
    print(f"SM budget timeline ({results[0][0].name} run):\n  " + "\n  ".join(timeline))
    rows, styles = [], []
    for contrast, r in results:
        ran = bool(r.checks)  # a run that crashed before its first check has no counts, not zero counts
        rows.append(
            [
                contrast.name,
                f"{len(r.checks)}/{cfg['steps']}",
                _outcome(r),
                str(sum(c.logits_mismatch_rows for c in r.checks)) if ran else "-",
                str(sum(c.topk_mismatch_rows for c in r.checks)) if ran else "-",
                str(sum(c.follower_mismatch for c in r.checks)) if ran else "-",
                f"{r.replans_total} ({r.steady_state_replans})" if ran else "-",
                "yes" if contrast.as_expected(r) else "NO",
            ]
        )
        styles.append(None if r.ok else "red")
    caption = [
        "≠: logit rows, top-k rows and follower reads that differ from the unsplit run (-: no step ran);",
        "re-plans: call-site planner runs (after step 1); red: the run crashed or gave wrong results.",
        f"top-k state per extra microbatch: {head.topk_extra_bytes} bytes ({cfg['topk_layout']} layout); "
        f"planner warm-ups: {head.warmups};",
        f"planner or logits kernels first compiled inside a CUDA-graph capture: {len(head.jit_in_capture)}",
    ]
    if args.mode != "eager":
        caption.append("re-plans recorded inside the FULL graph: " + ", ".join(f"{c.name} {r.captured_replans}" for c, r in results))
    print_table(
        "Runs (each step checked against an unsplit run at full SMs)",
        ["run", "steps", "outcome", "logits≠", "top-k≠", "reads≠", "re-plans", "expected"],
        rows,
        caption,
        compact=True,
        width=WIDTH,
        styles=styles,
    )
    for contrast, r in results:
        if r.error and not contrast.as_expected(r):
            print(f"{contrast.name}: {r.error}")
    print(_verdict_line(results, verdict, disabled=disabled is not None))
    if disabled is not None:  # with the verdict, as doctor shows it: stdout alone must not read as a clean PASS
        print(f"WARNING (not a failure): {disabled}")


def _verdict_line(results: list[Any], verdict: bool, *, disabled: bool = False) -> str:
    """The verdict, and why rows that failed can still mean PASS: the contrasts reproduce vLLM's bugs on purpose.
    Under ``DBO_RUNTIME_DISABLE`` the line itself says whose PASS it is: a server with this environment runs none
    of dbo_runtime (the warning that follows says what it runs)."""
    if not verdict:
        wrong = ", ".join(c.name for c, r in results if not c.as_expected(r))
        return f"verdict: FAIL: not as expected: {wrong}"
    if disabled:
        return "verdict: PASS for dbo_runtime, which DBO_RUNTIME_DISABLE turns off here: a server with this environment runs vanilla vLLM"
    if any(not r.ok for _, r in results):
        return (
            "verdict: PASS: dbo_runtime is bit-identical; the red rows are vLLM 0.33.0's failures, reproduced"
        )
    return "verdict: PASS: dbo_runtime is bit-identical at every step"
