"""``dbo-runtime simulate``: the DBO + DSA scenario at small scale, with a verdict.

Runs the GLM-5.3 layer pattern as two microbatches under DBO's SM budget with dbo_runtime's fixes, each step
checked bit for bit against an unsplit run (reference kernels on CPU, DeepGEMM's on CUDA), and unless --no-contrast
vLLM without them. Exit 1 also where the fixes are not in force on the installed vLLM."""

from __future__ import annotations

import argparse
import dataclasses
import os
from typing import Any

from dbo_runtime.cli import _common
from dbo_runtime.cli._common import EXIT_NO_DEVICE, CliError, int_in, print_json, print_table, say, warn, wrapped
from dbo_runtime.cli._split import budget_for, comm_sms, split_warnings
from dbo_runtime.core.cli_support import H200_SMS
from dbo_runtime.core.errors import ConfigError
from dbo_runtime.core.switches import switch_problems

SCHEMA = "dbo-runtime/simulate/v2"
GLM53_CPU_STEPS, GLM53_CPU_REQUESTS = 2, 8
"""``--preset glm53`` on the CPU: both bugs show on the first step, the second shows steady state needs no re-plan."""


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser("simulate", help="run the DBO + DSA scenario and print a verdict", description=__doc__.split("\n\n")[1].replace("``", ""))
    p.add_argument("--backend", default="auto", choices=("auto", "cpu", "deep_gemm"), help="auto: real DeepGEMM where CUDA and deep_gemm load, else cpu")
    p.add_argument("--mode", default="eager", choices=("eager", "mrv1", "mrv2"), help="eager, or FULL CUDA-graph capture as MRV1/MRV2 (GPU)")
    p.add_argument("--preset", default="small", choices=("small", "glm53"), help="small: toy widths (default, seconds); glm53: GLM-5.3 indexer shapes (a minute on a CPU)")
    p.add_argument("--steps", type=int_in(1, 1000), metavar="N", help="DBO steps per run (default: the preset's)")
    p.add_argument("--requests", type=int_in(2, 1024), metavar="N", help="requests per step, split in two microbatches")
    p.add_argument("--comm-sms", type=int_in(0, 1024), metavar="N", help="comm SMs (default: $VLLM_DBO_COMM_SMS, else 20)")
    p.add_argument("--total-sms", type=int_in(2, 1024), metavar="N", help=f"SMs of the simulated SM90 device (CPU backend; default {H200_SMS})")
    p.add_argument("--topk-layout", choices=("windows", "copies"), help="per-microbatch top-k layout (default: $DBO_RUNTIME_TOPK_LAYOUT, else windows)")
    p.add_argument("--seed", type=int_in(0, 2**63 - 1), default=0, metavar="N", help="seed of the random inputs")
    p.add_argument("--no-contrast", action="store_true", help="skip the runs that reproduce vLLM without dbo_runtime")
    p.add_argument("--json", action="store_true", help=f"print the result as JSON ({SCHEMA})")
    return p


def _backend(kind: str, mode: str, total_sms: int) -> Any:
    """The kernel backend; exit 3 where this machine cannot run what was asked."""
    from dbo_runtime.sim.backends import DeepGemmBackend, SimulatedDeepGemm, real_kernels_missing

    if kind == "cpu" and mode != "eager":
        raise ConfigError("--mode", mode, "eager with --backend cpu (CUDA graphs capture the real kernels: --backend auto)")
    missing = None if kind == "cpu" else real_kernels_missing()
    if kind == "deep_gemm" and missing is not None:
        raise CliError(f"--backend deep_gemm needs a CUDA GPU and DeepGEMM: {missing}; --backend cpu runs the CPU simulation", EXIT_NO_DEVICE)
    backend = SimulatedDeepGemm(total_sms) if kind == "cpu" or missing else DeepGemmBackend()
    if mode != "eager" and backend.simulated:
        raise CliError(f"--mode {mode} needs a CUDA GPU and DeepGEMM (FULL CUDA-graph capture); --mode eager runs here", EXIT_NO_DEVICE)
    return backend


def run(args: argparse.Namespace) -> int:
    try:
        return _run(args)
    except ConfigError:
        raise  # a bad value (a RuntimeError too): exit 2 in main
    except (RuntimeError, MemoryError) as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise CliError(f"error: the scenario could not be set up: {first}", EXIT_NO_DEVICE) from None


def _run(args: argparse.Namespace) -> int:
    from dbo_runtime.core.cli_support import vllm_setting_problems
    from dbo_runtime.core.settings import LAYOUT_ENV, parse_layout, warm_max_batch
    from dbo_runtime.sim.scenario import CONTRASTS, GLM53, SMALL, Contrast, for_backend, run_scenario

    warnings = switch_problems()
    # the environment a server would read, refused here as a server would refuse it
    warm_max_batch()
    for problem in vllm_setting_problems():
        raise problem
    layout = args.topk_layout or parse_layout(os.environ.get(LAYOUT_ENV)).value
    comm = comm_sms(args.comm_sms, "cuda")
    backend = _backend(args.backend, args.mode, args.total_sms or H200_SMS)
    base = SMALL if args.preset == "small" else GLM53
    if backend.simulated and base is GLM53:
        base = dataclasses.replace(GLM53, steps=GLM53_CPU_STEPS, num_requests=GLM53_CPU_REQUESTS)
    config = dataclasses.replace(base, comm_sms=comm[0], seed=args.seed, topk_layout=layout,
                                 steps=args.steps or base.steps, num_requests=args.requests or base.num_requests)
    budget = budget_for(total=backend.total_sms, comm=comm, platform="cuda", all2all_backend="deepep_high_throughput", sm_major=backend.sm_major)
    warnings += split_warnings(budget)
    for line in warnings:
        warn("simulate", line)
    disabled = _common.disabled_warning()
    warnings += [disabled] if disabled else []
    config = for_backend(config, backend)
    # the dbo_runtime run and the contrasts; with comm 0 vLLM never lowers DeepGEMM's count: only the top-k bug
    contrasts = [Contrast(c.name, "topk-mismatch", c.overrides) if int(config.comm_sms) == 0 and c.expect == "assertion"
                 else c for c in CONTRASTS]
    runs = [Contrast("dbo_runtime", "pass", {}), *([] if args.no_contrast else contrasts)]
    results: list[tuple[Any, Any]] = []
    for c in runs:

        def progress(done: int, steps: int, name: str = c.name) -> None:
            say(f"dbo-runtime simulate: {name}:", f"step {done}/{steps}")

        results.append((c, run_scenario(dataclasses.replace(config, **c.overrides), backend, args.mode, progress=progress)))
    passed = all(c.as_expected(r) for c, r in results)
    vllm = _common.protection()
    code = 0 if passed and vllm["in_force"] and disabled is None else 1
    if args.json:
        runs_json = [{"name": c.name, "expect": c.expect, "as_expected": c.as_expected(r), **r.to_json()} for c, r in results]
        print_json({
            "schema": SCHEMA, "backend": backend.name, "simulated": backend.simulated, "mode": args.mode, "budget": results[0][1].budget,
            "verdict": "PASS" if code == 0 else "NOT PROTECTED" if passed else "FAIL", "simulation": "PASS" if passed else "FAIL", "vllm": vllm, "protected": vllm["in_force"] and disabled is None,
            "dbo_runtime_disabled_by_env": disabled is not None, "server_runs": "vanilla vLLM" if disabled else "dbo_runtime",
            "warnings": warnings, "exit_code": code, "runs": runs_json,
        })  # fmt: skip
    else:
        _print_human(backend, args.mode, results, passed, vllm, disabled)
    return code


def _outcome(r: Any) -> str:
    if r.error:
        return "crash: assertion" if r.error.startswith("DeepGEMM assertion") else "crash: " + r.error.split(":")[0]
    return "bit-identical" if r.ok else "WRONG RESULTS"


def _print_human(backend: Any, mode: str, results: list[Any], passed: bool, vllm: dict[str, Any], disabled: str | None) -> None:
    head = results[0][1]
    cfg = head.config
    kind = "a CPU simulation (reference planner, fp32 logits)" if backend.simulated else "real DeepGEMM"
    for line in (
        f"dbo-runtime simulate: {backend.name}, mode {mode}; kernels: {kind}",
        f"stack: {cfg['num_layers']} layers ({head.leaders} indexer leaders, {head.followers} followers), "
        f"{cfg['num_requests']} requests x next_n {cfg['next_n']} in 2 microbatches",
        f"indexer: contexts <= {cfg['max_context']}, {cfg['heads']} heads x {cfg['head_dim']}, top-k {cfg['index_topk']}",
        f"DBO budget: {head.budget}",
    ):
        print(wrapped(line))
    rows = []
    for c, r in results:
        ran = bool(r.checks)  # a run that crashed before its first check has no counts, not zero counts
        counts = [str(sum(getattr(k, f) for k in r.checks)) if ran else "-" for f in ("logits_mismatch_rows", "topk_mismatch_rows", "follower_mismatch")]
        replans = f"{r.replans_total} ({r.steady_state_replans})" if ran else "-"
        rows.append([c.name, f"{len(r.checks)}/{cfg['steps']}", _outcome(r), *counts, replans, "yes" if c.as_expected(r) else "NO"])
    caption = [
        "≠: rows that differ from the unsplit run (-: no step ran); re-plans: planner runs (after step 1)",
        wrapped(f"top-k state per extra microbatch: {head.topk_extra_bytes} bytes ({cfg['topk_layout']} layout); "
                f"planner warm-ups: {head.warmups}; first compiled inside a capture: {len(head.jit_in_capture)}"),
    ]  # fmt: skip
    columns = ["run", "steps", "outcome", "logits≠", "top-k≠", "reads≠", "re-plans", "expected"]
    print_table("Runs (each step checked against an unsplit run at full SMs)", columns, rows, caption)
    for c, r in results:
        if r.error and not c.as_expected(r):
            print(wrapped(f"{c.name}: {r.error}"))
    off = "" if disabled is None else ", but DBO_RUNTIME_DISABLE turns every fix off"
    print(wrapped(f"vLLM here: {vllm['installed'] or 'not installed'}; verified: {vllm['verified']}; {vllm['detail']}{off}"))
    if not passed:
        verdict = "FAIL: not as expected: " + ", ".join(c.name for c, r in results if not c.as_expected(r))
    elif not vllm["in_force"]:
        verdict = "NOT PROTECTED: this vLLM's fixes are not in force here (dbo-runtime doctor says why); the simulation of dbo_runtime's own logic passed (it checks dbo_runtime, not vLLM)"
    elif disabled is not None:
        verdict = "NOT PROTECTED: DBO_RUNTIME_DISABLE turns dbo_runtime off here (a server with this environment runs vanilla vLLM); the simulation of dbo_runtime's own logic passed"
    elif any(not r.ok for _, r in results):
        verdict = "PASS: bit-identical; fixes in force on this vLLM; the crash/WRONG rows are vLLM's bugs"
    else:
        verdict = "PASS: bit-identical at every step; dbo_runtime's fixes are in force on this vLLM"
    print(f"verdict: {verdict}")  # one line, however long: greppable in logs
    if disabled is not None:
        print(wrapped(f"WARNING: {disabled}"))
