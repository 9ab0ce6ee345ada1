"""``dbo-runtime tune [options] VLLM_ENGINE_ARGS...``: which ``VLLM_DBO_COMM_SMS`` is fastest for my deployment?

Under DBO with DeepEP high-throughput vLLM splits every GPU into compute SMs (DeepGEMM) and comm SMs (DeepEP),
20 comm SMs unless ``VLLM_DBO_COMM_SMS`` says otherwise, a default no model or workload chose. ``tune`` starts
one DBO engine per candidate value on the operator's own model and parallel configuration, keeps them all
alive, and gives them interleaved turns at the operator's workload shape (a prefill step of N tokens per rank,
or a decode batch of B requests per rank), so every value is measured under the same conditions. It prints the
curve, the fastest value against today's with the ratio, and the setting to use (``core.comm_sweep`` decides,
conservatively). Exit codes: 0 measured, 2 bad arguments, 3 could not run (too few GPUs, every engine failed),
4 inconclusive (DBO never microbatched).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dbo_runtime.cli._common import CliError, print_json, print_table
from dbo_runtime.cli._engine import (
    DP_SIZE_FLAGS,
    EXIT_INCONCLUSIVE,
    EXIT_RUN_FAILED,
    check_with_vllm,
    comm_sms_problem,
    engine_arg,
    has_flag,
    require_dbo_parallelism,
    same_runner_env,
    split_engine_args,
    switch_notes,
    visible_gpus,
)
from dbo_runtime.cli._paths import check_dir, check_png, make_dir
from dbo_runtime.cli._progress import Progress
from dbo_runtime.core.comm_sweep import (
    ALPHA,
    DEFAULT_VALUES,
    Measurement,
    Sweep,
    choose,
    measurement,
    plan_sweep,
    rounds_needed,
)
from dbo_runtime.core.errors import ConfigError
from dbo_runtime.core.settings import setting_problems, vllm_setting_problems

SCHEMA = "dbo-runtime/tune/v1"
ACCEPTS_EXTRA_ARGS = True
SHAPES = ("prefill", "decode")
MEMORY_SHARE = 0.9
"""Of each GPU's memory, what the live engines share between them when the operator sets no memory flag."""


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "tune",
        help="measure the DBO step time for each VLLM_DBO_COMM_SMS value and say which to use",
        description=(
            "Start one DBO engine per VLLM_DBO_COMM_SMS value on VLLM_ENGINE_ARGS (your `vllm serve` engine "
            "arguments: --model M --data-parallel-size 2 --enable-expert-parallel --all2all-backend "
            "deepep_high_throughput ...), time them in interleaved turns at your workload shape, and print the "
            "curve and the setting to use. Put tune's own options first. Exit 0 measured, 2 bad arguments, 3 "
            "could not run, 4 inconclusive (DBO never microbatched)."
        ),
        allow_abbrev=False,
    )
    parser.add_argument("--shape", default="prefill", metavar="SHAPE", help="prefill (HT's regime, default) or decode")
    parser.add_argument(
        "--prefill-tokens", default=None, metavar="N", help="prefill tokens per rank per step (default 8192; --shape prefill only)"
    )
    parser.add_argument("--prompt-len", default="1024", metavar="N", help="tokens per prompt (default 1024)")
    parser.add_argument("--decode-batch", default=None, metavar="B", help="decode requests per rank (default 128; --shape decode only)")
    parser.add_argument(
        "--values",
        default=",".join(str(v) for v in DEFAULT_VALUES),
        metavar="LIST",
        help="comm-SM values to try: a comma-separated list, each value once, or 'all' (lower case: every even count up to DeepEP HT's 20); "
        "the value in force today is always added (default 4,8,12,16,20)",
    )
    parser.add_argument(
        "--reps", default=None, metavar="N", help="measured rounds (one turn per value each; default 7, what confirming a "
        "better value against 4 others needs, or as many as more values need, e.g. 8 for --values all)"
    )
    parser.add_argument("--warmup", default="1", metavar="N", help="unmeasured rounds first, at least 1 (default 1)")
    parser.add_argument("--steps", default=None, metavar="N", help="prefill steps per turn (default 4; --shape prefill only)")
    parser.add_argument(
        "--min-gain", default="0.02", metavar="F", help="a value replaces today's only if this much faster (default 0.02)"
    )
    parser.add_argument("--timeout", default="3600", metavar="S", help="seconds for the whole sweep (default 3600)")
    parser.add_argument("--workdir", metavar="DIR", help="keep logs and records here (default: a temporary directory)")
    parser.add_argument("--png", metavar="PATH", help="also draw the curve here (needs matplotlib)")
    parser.add_argument("--json", action="store_true", help="print the result as JSON on stdout (progress stays on stderr)")
    return parser


DEFAULT_REPS = 7
"""Rounds when ``--reps`` is left out and the values need no more (confirming one of 5 values)."""


@dataclass(frozen=True)
class Options:
    shape: str
    prefill_tokens: int
    prompt_len: int
    decode_batch: int
    reps: int
    warmup: int
    steps: int
    min_gain: float
    timeout: float
    reps_given: bool = True
    """False when ``--reps`` was left out: ``check_reps`` raises the default to what the sweep's values need."""


def _int(args: argparse.Namespace, dest: str, low: int, high: int) -> int:
    raw = getattr(args, dest)
    flag = "--" + dest.replace("_", "-")
    try:
        value = int(raw)
    except (TypeError, ValueError):
        raise ConfigError(flag, raw, f"an integer in [{low}, {high}]") from None
    if not low <= value <= high:
        raise ConfigError(flag, raw, f"an integer in [{low}, {high}]")
    return value


SHAPE_OPTIONS = {"prefill_tokens": ("prefill", "8192"), "steps": ("prefill", "4"), "decode_batch": ("decode", "128")}
"""tune's options that only one shape reads, with their defaults (the parser's default is None: not given)."""


def options(args: argparse.Namespace) -> Options:
    """Tune's own options, each checked with one line naming it. Pure: tested on CPU.

    An option the chosen shape does not read is refused: a sweep that silently ignored ``--prefill-tokens``
    under ``--shape decode`` would time a workload other than the one asked for."""
    from dbo_runtime.harness.prompts import MAX_PROMPT_LEN

    if args.shape not in SHAPES:
        raise ConfigError("--shape", args.shape, SHAPES)
    args = argparse.Namespace(**vars(args))
    for dest, (shape, default) in SHAPE_OPTIONS.items():
        raw = getattr(args, dest, None)
        if raw is not None and args.shape != shape:
            flag = "--" + dest.replace("_", "-")
            raise ConfigError(flag, raw, f"left out with --shape {args.shape} (it sets the {shape} workload only)")
        setattr(args, dest, default if raw is None else raw)
    min_gain = _float(args.min_gain, "--min-gain", "a number in [0, 1), e.g. 0.02 for 2 %")
    timeout = _float(args.timeout, "--timeout", "a positive number of seconds")
    if not (math.isfinite(min_gain) and 0 <= min_gain < 1):
        raise ConfigError("--min-gain", args.min_gain, "a number in [0, 1), e.g. 0.02 for 2 %")
    if not (math.isfinite(timeout) and timeout > 0):
        raise ConfigError("--timeout", args.timeout, "a positive number of seconds")
    return Options(
        shape=args.shape,
        prefill_tokens=_int(args, "prefill_tokens", 64, 1 << 20),
        prompt_len=_int(args, "prompt_len", 1, MAX_PROMPT_LEN),
        decode_batch=_int(args, "decode_batch", 1, 65536),
        reps=DEFAULT_REPS if args.reps is None else _int(args, "reps", 1, 100),
        reps_given=args.reps is not None,
        warmup=_int(args, "warmup", 1, 100),
        steps=_int(args, "steps", 1, 64),
        min_gain=min_gain,
        timeout=timeout,
    )


def _float(raw: Any, flag: str, allowed: str) -> float:
    try:
        return float(raw)
    except (TypeError, ValueError):
        raise ConfigError(flag, raw, allowed) from None


def _flag(args: list[str], *names: str) -> str | None:
    for name in names:
        value = engine_arg(args, name)
        if value is not None:
            return value
    return None


def decode_needs_eager(engine_args: list[str], dp: int) -> bool:
    """Whether a decode turn must run eager to be measured at all.

    vLLM captures uniform decode as FULL CUDA graphs, and a FULL-graph replay (MRV1's ``UBatchWrapper``
    replay branch, MRV2's ``run_fullgraph``) never enters SMControl's partition, so the counters tune
    times would read zero. vLLM keeps graphs unless they are off already: ``--enforce-eager``, or DeepEP
    high-throughput with data parallelism, for which it sets ``cudagraph_mode`` to NONE itself."""
    if has_flag(engine_args, "--enforce-eager"):
        return False
    return not (_flag(engine_args, "--all2all-backend") == "deepep_high_throughput" and dp > 1)


def workload(engine_args: list[str], dp: int, opts: Options) -> tuple[list[str], Any, dict[str, Any], str, str, list[str]]:
    """(engine args added, prompts, bench, metric, microbatch counter, notes) for the shape. Pure: tested on CPU.

    The metric is the host time of each microbatched forward, from SMControl's partition counters read around
    the turn (``harness.runner``): only steps DBO really split count, and the DP ranks' start skew does not.
    Prefill: every rank prefills ``steps`` x ``prefill_tokens`` in steps of ``prefill_tokens``
    (``--max-num-batched-tokens``; no prefix caching, or later turns would time the cache) in the turn's first
    pass (one token per prompt). Decode: ``decode_batch`` requests per rank, the 31 decode steps of a 32-token
    pass."""
    from dbo_runtime.harness.prompts import PromptSpec

    added: list[str] = []
    notes: list[str] = []
    bench: dict[str, Any] = {"reps": opts.reps, "warmup": opts.warmup, "coordinated": True}
    if opts.shape == "prefill":
        if opts.prompt_len > opts.prefill_tokens:
            raise ConfigError("--prompt-len", opts.prompt_len, f"at most --prefill-tokens ({opts.prefill_tokens})")
        per_rank = opts.steps * (opts.prefill_tokens // opts.prompt_len)
        given = _flag(engine_args, "--max-num-batched-tokens")
        if given is not None and given != str(opts.prefill_tokens):
            raise ConfigError(
                "--max-num-batched-tokens", given, f"{opts.prefill_tokens} (= --prefill-tokens, the step tune times), or leave it out"
            )
        if given is None:
            added += ["--max-num-batched-tokens", str(opts.prefill_tokens)]
        if not has_flag(engine_args, "--no-enable-prefix-caching"):
            added.append("--no-enable-prefix-caching")
            notes.append("prefix caching off: every turn prefills the same prompts again")
        prompts = PromptSpec(num=per_rank * dp, min_len=opts.prompt_len, max_len=opts.prompt_len, seed=0)
        bench["max_tokens"] = 2
        metric, counter = "prefill_partition_ms", "prefill_partitions"
    else:
        if decode_needs_eager(engine_args, dp):
            added.append("--enforce-eager")
            notes.append(
                "--enforce-eager added: a FULL CUDA-graph replay never enters the SM partition, so decode is timed "
                "eager (the measure is the host time per microbatched forward)"
            )
        seqs = _flag(engine_args, "--max-num-seqs")
        if seqs is not None and seqs.isdigit() and int(seqs) < opts.decode_batch:
            raise ConfigError("--decode-batch", opts.decode_batch, f"at most --max-num-seqs ({seqs}): one decode step holds them all")
        if seqs is None:
            added += ["--max-num-seqs", str(opts.decode_batch)]
        prompts = PromptSpec(num=opts.decode_batch * dp, min_len=opts.prompt_len, max_len=opts.prompt_len, seed=0)
        bench["max_tokens"] = 32
        metric, counter = "decode_partition_ms", "decode_partitions"
    return added, prompts, bench, metric, counter, notes


KV_CACHE_BYTES = 4 << 30
"""Each engine's fixed KV cache when the operator sets none: enough for a step of the workload on a DSA model."""


def memory_args(engine_args: list[str], engines: int) -> tuple[list[str], list[str]]:
    """Every value's engine lives for the whole sweep on the same GPUs: split the memory, or check the split.
    Each engine gets a fixed KV cache: vLLM sizes an unset one by profiling the device's free memory, which the
    other engines loading at the same time change under it (``utils/mem_utils.py``). And vLLM still requires
    ``gpu_memory_utilization`` x the GPU's memory free when each engine starts (``v1/worker/utils.py:request_memory``)."""
    added: list[str] = []
    notes: list[str] = []
    if not has_flag(engine_args, "--kv-cache-memory-bytes"):
        added += ["--kv-cache-memory-bytes", str(KV_CACHE_BYTES)]
        notes.append(f"each engine's KV cache fixed at {KV_CACHE_BYTES >> 30} GiB (--kv-cache-memory-bytes sets another)")
    given = _flag(engine_args, "--gpu-memory-utilization")
    if given is None:
        share = math.floor(MEMORY_SHARE / engines * 1000) / 1000
        notes.append(f"{engines} engines share each GPU: --gpu-memory-utilization {share} each")
        return [*added, "--gpu-memory-utilization", f"{share}"], notes
    try:
        value = float(given)
    except ValueError:
        return added, notes  # vLLM's parser reports it
    limit = MEMORY_SHARE / engines
    if value > limit + 1e-9:
        raise ConfigError(
            "--gpu-memory-utilization", given, f"at most {limit:.3f}: tune keeps {engines} engines (one per value) alive on the same GPUs"
        )
    return added, notes


def specs(engine_args: list[str], dp: int, sweep: Sweep, opts: Options, environ: Any) -> tuple[list[Any], str, str, list[str]]:
    """One coordinated DBO run per value (``harness.turns`` gives them turns). Pure: tested on CPU."""
    from dbo_runtime.harness.launch import RunSpec

    added, prompts, bench, metric, counter, notes = workload(engine_args, dp, opts)
    memory, memory_notes = memory_args(engine_args, len(sweep.values))
    notes += memory_notes
    env = same_runner_env(environ)
    out = [
        RunSpec(
            label=f"comm-{value:02d}",
            engine_args=[*engine_args, *added, *memory, "--enable-dbo"],
            dp=dp,
            env={**env, "VLLM_DBO_COMM_SMS": str(value)},
            prompts=prompts,
            max_tokens=1,
            bench=dict(bench),
            timeout_s=opts.timeout,
            meta={"comm_sms": value, "shape": opts.shape},
        )
        for value in sweep.values
    ]
    return out, metric, counter, notes


def measurements(records: dict[str, dict[str, Any]], sweep: Sweep, metric: str, counter: str) -> list[Measurement]:
    return [measurement(value, records.get(f"comm-{value:02d}", {}), metric, counter) for value in sweep.values]


def gpus_needed(engine_args: list[str], dp: int) -> int:
    """One engine rank per DP rank, each ``tensor x pipeline`` parallel GPUs wide."""
    sizes = []
    for names in (("--tensor-parallel-size", "-tp"), ("--pipeline-parallel-size", "-pp")):
        raw = _flag(engine_args, *names)
        sizes.append(int(raw) if raw is not None and raw.isdigit() and int(raw) > 0 else 1)
    return dp * sizes[0] * sizes[1]


def check_reps(opts: Options, sweep: Sweep) -> Options:
    """Refuse a sweep that cannot confirm any value before it starts: with ``k`` values besides today's, the
    all-faster sign test needs ``rounds_needed(k, ALPHA)`` rounds (``core.comm_sweep.choose``), and fewer
    could only ever say "keep today's" after the whole sweep ran. Left out, ``--reps`` becomes what is needed."""
    others = len(sweep.values) - 1
    need = rounds_needed(others, ALPHA)
    if not opts.reps_given and opts.reps < need:
        return dataclasses.replace(opts, reps=need)
    if opts.reps < need:
        raise ConfigError(
            "--reps",
            opts.reps,
            f">= {need} for {len(sweep.values)} values: confirming one against the {others} others at {ALPHA:.0%} "
            f"needs {need} rounds all faster ({others} x 2^-{need} <= {ALPHA}); or fewer --values",
        )
    return opts


def _require_plugin() -> None:
    """tune reads dbo_runtime's counters in every engine (partitions, their time): with the plugin switched off the
    whole sweep would end inconclusive, so it is refused before any engine starts."""
    from dbo_runtime.core.switches import read_switch

    switch = read_switch("DBO_RUNTIME_DISABLE")
    if switch.on or not switch.recognised:
        raise ConfigError(
            "DBO_RUNTIME_DISABLE", switch.raw, "an off value ('0', 'false', 'no', 'off', '', or not set): tune measures "
            "through dbo_runtime's counters, which a disabled plugin does not keep"
        )


def run(args: argparse.Namespace) -> int:
    from dbo_runtime.harness.turns import run_interleaved

    opts = options(args)
    # its own paths are usage errors checked before the engine arguments, as verify's options are; nothing is created yet
    workdir = check_dir(args.workdir, "--workdir", "tune") if args.workdir is not None else None
    png = check_png(args.png, "tune") if args.png is not None else None
    _require_plugin()
    extra = list(getattr(args, "extra_args", []) or [])
    engine_args, dp, notes = split_engine_args(extra, "tune")
    require_dbo_parallelism(engine_args, dp, "tune", dp_given=has_flag(extra, *DP_SIZE_FLAGS))
    environment = switch_notes()
    notes = [*environment, *(n for n in notes if "data-parallel size 1" not in n)]
    problem = comm_sms_problem(engine_args, os.environ)
    if problem is not None:  # the same words as verify and sms for the same value
        raise problem
    for setting in (*setting_problems(), *vllm_setting_problems()):  # read by the engines only at model load
        raise setting
    sweep = plan_sweep(args.values, backend=_flag(engine_args, "--all2all-backend"), platform=_platform(), environ=os.environ)
    opts = check_reps(opts, sweep)
    notes += list(sweep.notes)
    plan, metric, counter, more = specs(engine_args, dp, sweep, opts, os.environ)
    notes += more
    # where this machine cannot run the sweep, that one line is all tune prints of the sweep: its notes describe
    # a sweep that will not happen. The environment's (a misspelt DBO_RUNTIME_ name) come first, as verify's
    # do: they are true on any machine, and the operator fixing the machine would otherwise meet them later.
    progress = Progress("[tune]")
    for note in environment:
        progress.say(f"note: {note}")
    check_with_vllm(plan[0].engine_args, "tune")
    visible, need = visible_gpus(), gpus_needed(engine_args, dp)
    if visible < need:
        raise CliError(f"needs {need} GPU(s) (data-parallel {dp} x tensor x pipeline parallel); {visible} visible", EXIT_RUN_FAILED)
    for note in notes[len(environment) :]:
        progress.say(f"note: {note}")
    progress.say("engine arguments checked with vLLM's parser")
    # only once the engines will start: a refused run leaves nothing behind
    workdir = make_dir(workdir, "--workdir", "tune") if workdir is not None else Path(tempfile.mkdtemp(prefix="dbo-tune-"))
    with progress:
        progress.set(f"starting {len(plan)} DBO engines of {dp} ranks (one per value), then {opts.warmup + opts.reps} turns each")
        records = run_interleaved(plan, workdir, opts.reps, timeout_s=opts.timeout, progress=progress.say)
    doc = choose(measurements(records, sweep, metric, counter), sweep.default, min_gain=opts.min_gain)
    doc.update(
        schema=SCHEMA,
        shape=opts.shape,
        workload=(
            {"prefill_tokens_per_step": opts.prefill_tokens, "steps_per_turn": opts.steps}
            if opts.shape == "prefill"
            else {"decode_batch_per_rank": opts.decode_batch}
        ),
        measure="host ms per microbatched forward (SMControl partition), slowest rank, per paired round",
        total_sms=sweep.total_sms,
        notes=notes,
        workdir=str(workdir),
        turn_order=next(iter(records.values()), {}).get("turn_order"),
    )
    render(doc, args.json)  # the result first: nothing the drawing does can hide it
    if png is not None and doc["verdict"] == "measured":
        drawn = draw(doc, png)
        line = f"curve drawn: {drawn}" if drawn else f"note: {doc['notes'][-1]}"
        if args.json:
            progress.say(line)
        else:
            sys.stdout.write(line + "\n")
    return exit_code(doc)


def _platform() -> str:
    try:
        import torch

        return "rocm" if getattr(torch.version, "hip", None) else "cuda"
    except Exception:
        return "cuda"


def exit_code(doc: dict[str, Any]) -> int:
    return {"measured": 0, "inconclusive": EXIT_INCONCLUSIVE}.get(doc["verdict"], EXIT_RUN_FAILED)


def draw(doc: dict[str, Any], path: Path) -> str | None:
    """The curve as a PNG; None, and a note in ``doc``, where it cannot be drawn (matplotlib missing, the
    file system refusing the file): the measured result is already printed, and a drawing never hides it."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        doc["notes"].append("matplotlib is not installed: no PNG (pip install matplotlib)")
        return None
    try:
        return _savefig(plt, doc, path)
    except (OSError, ValueError) as exc:  # ValueError: a file name suffix matplotlib has no writer for
        doc["notes"].append(f"no PNG: --png {path} could not be written ({exc})")
        return None


def _savefig(plt: Any, doc: dict[str, Any], path: Path) -> str:
    rows = [r for r in doc["curve"] if r["median_ms"] is not None]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    xs = [r["comm_sms"] for r in rows]
    ax.errorbar(
        xs,
        [r["median_ms"] for r in rows],
        yerr=[[r["median_ms"] - r["min_ms"] for r in rows], [r["max_ms"] - r["median_ms"] for r in rows]],
        marker="o",
        capsize=3,
    )
    ax.axvline(doc["default"], color="grey", linestyle="--", label=f"in force today ({doc['default']})")
    ax.set_xlabel("VLLM_DBO_COMM_SMS (comm SMs per GPU)")
    ax.set_ylabel(f"DBO {doc['shape']} step (ms, median, min-max)")
    ax.set_title(f"dbo-runtime tune: fastest {doc['best']} ({doc['best_paired_speedup']:.3f}x vs {doc['default']}), use {doc['chosen']}")
    ax.legend()
    fig.tight_layout()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=120)
    finally:
        plt.close(fig)
    return str(path)


def render(doc: dict[str, Any], as_json: bool) -> None:
    if as_json:
        print_json(doc)
        return
    rows = []
    for r in doc["curve"]:
        if r["median_ms"] is None or r.get("error"):
            rows.append([str(r["comm_sms"]), f"{doc['total_sms'] - r['comm_sms']}", "-", "-", "-", str(r.get("error"))])
            continue
        ratio = r.get("paired_speedup")
        paired = f"{ratio:.3f}x ({r['faster_rounds']}/{r['rounds']} faster)" if ratio and r["comm_sms"] != doc["default"] else "-"
        rows.append([
            str(r["comm_sms"]),
            f"{doc['total_sms'] - r['comm_sms']}",
            f"{r['median_ms']:.2f}",
            f"{r['min_ms']:.2f}-{r['max_ms']:.2f}",
            paired,
            f"{r['microbatched_steps']} microbatched steps",
        ])  # fmt: skip
    print_table(
        f"dbo-runtime tune: host ms per microbatched DBO {doc['shape']} step, per comm-SM value",
        ["comm SMs", "compute SMs", "median ms", "min-max ms", "vs today (paired)", "notes"],
        rows,
    )
    out = sys.stdout
    if doc["verdict"] == "measured":
        out.write(
            f"fastest: {doc['best']} comm SMs, {doc['best_paired_speedup']:.3f}x vs {doc['default']} (in force today, paired median)\n"
        )
        out.write(f"use: {doc['setting']} -- {doc['reason']}\n")
    else:
        why = doc.get("reason") or (
            "no value was measured with DBO microbatching (are dbo_runtime's counters there? `dbo-runtime doctor`; "
            "vLLM microbatches a step only when every DP rank has enough tokens: --dbo-prefill-token-threshold, "
            "--dbo-decode-token-threshold)"
        )
        out.write(f"verdict: {doc['verdict'].upper()} -- {why}\n")
        out.write(f"logs and records: {doc['workdir']}\n")
    for note in doc.get("notes") or []:
        out.write(f"note: {note}\n")


__all__ = ["add_parser", "choose", "options", "run", "specs", "workload"]
