"""``dbo-runtime tune [options] MODEL [vllm serve engine arguments]``: which ``VLLM_DBO_COMM_SMS`` is fastest for my deployment?

vLLM's default comm share (20 SMs with DeepEP high-throughput) fits no model or workload in particular. ``tune``
keeps one DBO engine per value alive on your model and gives them interleaved turns at your workload's shape, so
every value runs under the same conditions. Exit 0 measured, 2 bad arguments, 3 could not run, 4 inconclusive."""

from __future__ import annotations

import argparse
import math
import os
from typing import Any

from dbo_runtime.cli._common import EXIT_INCONCLUSIVE, EXIT_NO_DEVICE, int_in, print_json, print_table, say
from dbo_runtime.cli._engine import add_engine_command, engine_arg, has_flag, prepare, same_runner_env, start
from dbo_runtime.core.budget import DEEPEP_HT_MANAGER_NUM_SMS
from dbo_runtime.core.comm_sweep import ALPHA, DEFAULT_VALUES, Sweep, choose, measurement, plan_sweep, rounds_needed
from dbo_runtime.core.errors import ConfigError

SCHEMA = "dbo-runtime/tune/v1"
ENGINE_ARGS = True
MEMORY_SHARE = 0.9
"""Of each GPU's memory, what the live engines share between them when the operator sets no memory flag."""
KV_CACHE_BYTES = 4 << 30
"""Each engine's KV cache when the operator sets none: profiling free memory races the other engines' loads."""


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = add_engine_command(subparsers, "tune", __doc__, "measure the DBO step time for each VLLM_DBO_COMM_SMS value and say which to use", 3600.0, "seconds for the whole sweep")
    p.add_argument("--shape", default="prefill", choices=("prefill", "decode"), help="the workload timed (default prefill, HT's regime)")
    p.add_argument("--prefill-tokens", type=int_in(64, 1 << 20), default=8192, metavar="N", help="prefill tokens per rank per step (default 8192)")
    p.add_argument("--prompt-len", type=int_in(1, 1 << 20), default=1024, metavar="N", help="tokens per prompt (default 1024)")
    p.add_argument("--decode-batch", type=int_in(1, 65536), default=128, metavar="B", help="decode requests per rank (default 128)")
    p.add_argument("--values", default=",".join(map(str, DEFAULT_VALUES)), metavar="LIST", help=f"comm-SM values to try: 0 and even numbers in [2, {DEEPEP_HT_MANAGER_NUM_SMS}], comma-separated, or 'all' (default %(default)s)")
    p.add_argument("--reps", type=int_in(1, 100), metavar="N", help="measured rounds (default: what confirming a value against the others needs, at least 7)")
    p.add_argument("--warmup", type=int_in(1, 100), default=1, metavar="N", help="unmeasured rounds first (default 1)")
    p.add_argument("--steps", type=int_in(1, 64), default=4, metavar="N", help="prefill steps per turn (default 4)")
    p.add_argument("--min-gain", type=float, default=0.02, metavar="F", help="a value replaces today's only if this much faster (default 0.02)")
    return p


def options(args: argparse.Namespace) -> argparse.Namespace:
    if not (math.isfinite(args.min_gain) and 0 <= args.min_gain < 1):
        raise ConfigError("--min-gain", args.min_gain, "a number in [0, 1), e.g. 0.02 for 2 %")
    if not (math.isfinite(args.timeout) and args.timeout > 0):
        raise ConfigError("--timeout", args.timeout, "a positive number of seconds")
    return args


def check_reps(opts: argparse.Namespace, sweep: Sweep) -> argparse.Namespace:
    """``--reps`` (default: what the sign test needs): fewer rounds could only ever say "keep today's"."""
    need = rounds_needed(len(sweep.values) - 1, ALPHA)
    if opts.reps is None:
        return argparse.Namespace(**{**vars(opts), "reps": max(7, need)})
    if opts.reps < need:
        raise ConfigError("--reps", opts.reps, f">= {need} to confirm one of {len(sweep.values)} values at {ALPHA:.0%}; or fewer --values")
    return opts


def workload(engine_args: list[str], dp: int, opts: argparse.Namespace) -> tuple[list[str], Any, dict[str, Any], str, str, list[str]]:
    """(engine arguments added, prompts, bench, metric, counter, notes) for the shape; only split steps count."""
    from dbo_runtime.harness.prompts import PromptSpec

    added: list[str] = []
    notes: list[str] = []
    bench: dict[str, Any] = {"reps": opts.reps, "warmup": opts.warmup, "coordinated": True}
    if opts.shape == "prefill":
        if opts.prompt_len > opts.prefill_tokens:
            raise ConfigError("--prompt-len", opts.prompt_len, f"at most --prefill-tokens ({opts.prefill_tokens})")
        given = engine_arg(engine_args, "--max-num-batched-tokens")
        if given is not None and given != str(opts.prefill_tokens):
            raise ConfigError("--max-num-batched-tokens", given, f"{opts.prefill_tokens} (= --prefill-tokens, the step tune times), or left out")
        added += [] if given else ["--max-num-batched-tokens", str(opts.prefill_tokens)]
        if not has_flag(engine_args, "--no-enable-prefix-caching"):
            added.append("--no-enable-prefix-caching")
            notes.append("prefix caching off: every turn prefills the same prompts again")
        num = opts.steps * (opts.prefill_tokens // opts.prompt_len) * dp
        bench["max_tokens"], metric, counter = 2, "prefill_partition_ms", "prefill_partitions"
    else:
        # a FULL CUDA-graph replay never enters SMControl's partition, whose counters tune reads (HT with DP runs eager)
        ht_dp = engine_arg(engine_args, "--all2all-backend") == "deepep_high_throughput" and dp > 1
        if not has_flag(engine_args, "--enforce-eager") and not ht_dp:
            added.append("--enforce-eager")
            notes.append("--enforce-eager added: a FULL CUDA-graph replay never enters the SM partition")
        seqs = engine_arg(engine_args, "--max-num-seqs")
        if seqs is not None and seqs.isdigit() and int(seqs) < opts.decode_batch:
            raise ConfigError("--decode-batch", opts.decode_batch, f"at most --max-num-seqs ({seqs}): one decode step holds them all")
        added += [] if seqs else ["--max-num-seqs", str(opts.decode_batch)]
        num = opts.decode_batch * dp
        bench["max_tokens"], metric, counter = 32, "decode_partition_ms", "decode_partitions"
    prompts = PromptSpec(num=num, min_len=opts.prompt_len, max_len=opts.prompt_len, seed=0)
    return added, prompts, bench, metric, counter, notes


def memory_args(engine_args: list[str], engines: int) -> tuple[list[str], list[str]]:
    """Every value's engine lives for the whole sweep on the same GPUs: split the memory, or check the split."""
    added: list[str] = []
    notes: list[str] = []
    if not has_flag(engine_args, "--kv-cache-memory-bytes"):
        added += ["--kv-cache-memory-bytes", str(KV_CACHE_BYTES)]
        notes.append(f"each engine's KV cache fixed at {KV_CACHE_BYTES >> 30} GiB (--kv-cache-memory-bytes sets another)")
    given = engine_arg(engine_args, "--gpu-memory-utilization")
    if given is None:
        share = math.floor(MEMORY_SHARE / engines * 1000) / 1000
        notes.append(f"{engines} engines share each GPU: --gpu-memory-utilization {share} each")
        return [*added, "--gpu-memory-utilization", f"{share}"], notes
    try:
        too_much = float(given) > MEMORY_SHARE / engines + 1e-9
    except ValueError:
        return added, notes  # vLLM's parser reports it
    if too_much:
        raise ConfigError("--gpu-memory-utilization", given, f"at most {MEMORY_SHARE / engines:.3f}: tune keeps {engines} engines alive on the same GPUs")
    return added, notes


def specs(engine_args: list[str], dp: int, sweep: Sweep, opts: argparse.Namespace, environ: Any) -> tuple[list[Any], str, str, list[str]]:
    """One coordinated DBO run per value (``harness.turns`` gives them turns)."""
    from dbo_runtime.harness.launch import RunSpec

    added, prompts, bench, metric, counter, notes = workload(engine_args, dp, opts)
    memory, memory_notes = memory_args(engine_args, len(sweep.values))
    env = same_runner_env(environ)
    out = [
        RunSpec(label=f"comm-{v:02d}", engine_args=[*engine_args, *added, *memory, "--enable-dbo"], dp=dp,
                env={**env, "VLLM_DBO_COMM_SMS": str(v)}, prompts=prompts, max_tokens=1, bench=dict(bench),
                timeout_s=opts.timeout, meta={"comm_sms": v, "shape": opts.shape})
        for v in sweep.values
    ]  # fmt: skip
    return out, metric, counter, notes + memory_notes


def gpus_needed(engine_args: list[str], dp: int) -> int:
    """One engine rank per DP rank, each tensor x pipeline parallel GPUs wide."""
    sizes = [engine_arg(engine_args, *names) for names in (("--tensor-parallel-size", "-tp"), ("--pipeline-parallel-size", "-pp"))]
    tp, pp = (int(s) if s and s.isdigit() and int(s) > 0 else 1 for s in sizes)
    return dp * tp * pp


def run(args: argparse.Namespace) -> int:
    from dbo_runtime.core.switches import read_switch
    from dbo_runtime.harness.turns import run_interleaved

    opts = options(args)
    switch = read_switch("DBO_RUNTIME_DISABLE")
    if switch.on:  # tune measures through dbo_runtime's counters, which a disabled plugin does not keep
        raise ConfigError("DBO_RUNTIME_DISABLE", switch.raw, "an off value or not set: tune measures through dbo_runtime's counters")
    engine_args, dp, notes = prepare(args.extra_args, "tune", expert_parallel=True)
    sweep = plan_sweep(args.values, backend=engine_arg(engine_args, "--all2all-backend"), platform="cuda", environ=os.environ)
    opts = check_reps(opts, sweep)
    plan, metric, counter, more = specs(engine_args, dp, sweep, opts, os.environ)
    notes = [*notes, *sweep.notes, *more]
    folder = start("tune", plan[0].engine_args, gpus_needed(engine_args, dp), f"data-parallel {dp} x tensor x pipeline parallel", notes, args.workdir)
    say("[tune]", f"starting {len(plan)} DBO engines of {dp} ranks (one per value), then {opts.warmup + opts.reps} turns each ...")
    records = run_interleaved(plan, folder, opts.reps, timeout_s=opts.timeout, progress=lambda line: say("[tune]", line))
    measured = [measurement(value, records.get(f"comm-{value:02d}", {}), metric, counter) for value in sweep.values]
    doc = choose(measured, sweep.default, min_gain=opts.min_gain)
    workload = {"prefill_tokens_per_step": opts.prefill_tokens, "steps_per_turn": opts.steps} if opts.shape == "prefill" else {"decode_batch_per_rank": opts.decode_batch}
    doc.update(
        schema=SCHEMA, shape=opts.shape, workload=workload, total_sms=sweep.total_sms, notes=notes, workdir=str(folder),
        measure="host ms per microbatched forward (SMControl partition), slowest rank, per paired round",
        turn_order=next(iter(records.values()), {}).get("turn_order"),
    )  # fmt: skip
    print_json(doc) if args.json else render(doc)
    return {"measured": 0, "inconclusive": EXIT_INCONCLUSIVE}.get(doc["verdict"], EXIT_NO_DEVICE)


def render(doc: dict[str, Any]) -> None:
    rows = []
    for r in doc["curve"]:
        compute = str(doc["total_sms"] - r["comm_sms"])
        if r["median_ms"] is None or r.get("error"):
            rows.append([str(r["comm_sms"]), compute, "-", "-", "-", str(r.get("error"))])
            continue
        ratio = r.get("paired_speedup")
        paired = f"{ratio:.3f}x ({r['faster_rounds']}/{r['rounds']} faster)" if ratio and r["comm_sms"] != doc["default"] else "-"
        rows.append([str(r["comm_sms"]), compute, f"{r['median_ms']:.2f}", f"{r['min_ms']:.2f}-{r['max_ms']:.2f}", paired, f"{r['microbatched_steps']} microbatched steps"])
    columns = ["comm SMs", "compute SMs", "median ms", "min-max ms", "vs today (paired)", "notes"]
    print_table(f"dbo-runtime tune: host ms per microbatched DBO {doc['shape']} step, per comm-SM value", columns, rows)
    if doc["verdict"] == "measured":
        print(f"fastest: {doc['best']} comm SMs, {doc['best_paired_speedup']:.3f}x vs {doc['default']} (in force today, paired median)")
        print(f"use: {doc['setting']} -- {doc['reason']}")
    else:
        print(f"verdict: {doc['verdict'].upper()} -- {doc.get('reason') or 'no value was measured with DBO microbatching (dbo_runtime counters present? `dbo-runtime doctor`)'}\nlogs and records: {doc['workdir']}")
    for note in doc.get("notes") or []:
        print(f"note: {note}")
