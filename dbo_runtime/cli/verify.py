"""``dbo-runtime verify [options] VLLM_ENGINE_ARGS...``: does DBO change my model's outputs?

The operator's canary before turning ``--enable-dbo`` on in production. It runs
the operator's own model and parallel configuration twice -- DBO off, then DBO
on -- on the same fixed prompts with greedy decoding, compares the two runs
request by request (``harness.compare``) and prints a verdict. Data parallelism
runs the way vLLM runs it offline: one process per DP rank with ``VLLM_DP_*``
(so ``--data-parallel-size N`` is taken off the engine arguments and becomes N
rank processes on this node).

Why it checks that DBO really happened: with data-parallel size 1 vLLM never
microbatches, and below ``--dbo-decode-token-threshold`` tokens per rank it
does not either; a "pass" from two identical non-DBO runs would be a lie. With
dbo_runtime installed the per-worker counters say how many microbatched steps
ran; 0 makes the verdict *inconclusive* (non-zero exit).

Exit codes: 0 pass, 1 outputs differ (fail), 2 bad arguments, 3 could not run (too
few GPUs, or an engine run failed -- e.g. vLLM 0.33.0's DeepGEMM schedule
assertion under DBO), 4 inconclusive (DBO never microbatched).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from dbo_runtime.cli._common import EXIT_OK, EXIT_PROBLEM, CliError, print_json, print_table
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
from dbo_runtime.cli._paths import check_dir, make_dir
from dbo_runtime.cli._progress import Progress
from dbo_runtime.core.errors import ConfigError
from dbo_runtime.core.settings import StateError, setting_problems, vllm_setting_problems
from dbo_runtime.harness.compare import FloorRule, Thresholds

SCHEMA = "dbo-runtime/verify/v1"

ACCEPTS_EXTRA_ARGS = True
"""``main`` hands every argument verify does not know to it: they are vLLM's engine arguments."""

def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "verify",
        help="run the model with DBO off and on and say whether DBO changes its outputs",
        description=(
            "Run VLLM_ENGINE_ARGS (your `vllm serve` engine arguments, e.g. --model M --data-parallel-size 2 "
            "--enable-expert-parallel --all2all-backend deepep_high_throughput) twice, DBO off and DBO on, on the "
            "same prompts with greedy decoding, and compare the outputs token by token. Put verify's own options "
            "first. Exit 0 pass, 1 outputs differ, 2 bad arguments, 3 an engine run failed, 4 inconclusive "
            "(DBO never microbatched)."
        ),
        allow_abbrev=False,
    )
    parser.add_argument("--prompts", type=str, default=None, metavar="N", help="synthetic prompts (default 64)")
    parser.add_argument(
        "--prompt-len", default=None, metavar="MIN-MAX", help="synthetic prompt lengths in tokens (default 256-1024)"
    )
    parser.add_argument(
        "--prompt-file",
        metavar="PATH",
        help="prompts instead of synthetic ids: .jsonl or .json (any case) with one prompt_token_ids or prompt object per line (a .json file may be one array of them), or one text prompt per line",
    )
    parser.add_argument("--prompt-seed", type=str, default=None, metavar="S", help="seed of the synthetic prompts (default 0)")
    parser.add_argument("--max-tokens", type=str, default=32, metavar="T", help="greedy tokens per prompt (default 32)")
    parser.add_argument(
        "--min-agreement",
        type=str,
        default=Thresholds.min_agreement,
        metavar="A",
        help=f"pass needs at least this fraction of tokens equal to the DBO-off run (default {Thresholds.min_agreement})",
    )
    parser.add_argument(
        "--max-dlogprob",
        type=str,
        default=Thresholds.max_dlogprob,
        metavar="D",
        help=(
            "pass needs max |logprob difference| of the reference tokens on the shared prefix <= D; where a reference "
            f"token left the DBO run's returned top-k its lower bound counts (default {Thresholds.max_dlogprob})"
        ),
    )
    parser.add_argument(
        "--noise-floor",
        action="store_true",
        help=(
            "also run DBO off with half as many sequences at a time (--max-num-seqs), and judge DBO against how much "
            "that batch-shape change alone moves the model instead of against --min-agreement/--max-dlogprob "
            "(one more engine run; for models whose greedy output reacts to batch shapes)"
        ),
    )
    parser.add_argument("--timeout", type=str, default=1800.0, metavar="S", help="seconds per engine run (default 1800)")
    parser.add_argument("--workdir", metavar="DIR", help="keep logs and records here (default: a temporary directory)")
    parser.add_argument("--json", action="store_true", help="print the result as JSON on stdout (progress stays on stderr)")
    return parser


def _int_range(text: str, name: str) -> tuple[int, int]:
    from dbo_runtime.harness.prompts import MAX_PROMPT_LEN

    try:
        low, high = (int(x) for x in text.split("-", 1))
    except ValueError as exc:
        raise ConfigError(name, text, "MIN-MAX, two positive integers, e.g. 256-1024") from exc
    if not 1 <= low <= high <= MAX_PROMPT_LEN:
        raise ConfigError(name, text, f"MIN-MAX with 1 <= MIN <= MAX <= {MAX_PROMPT_LEN}")
    return low, high


def _flag_value(engine_args: list[str], flag: str) -> int | None:
    """The last integer given for ``flag``; None when absent or not an integer (vLLM's parser reports it)."""
    raw = engine_arg(engine_args, flag)
    try:
        return int(raw) if raw is not None else None
    except ValueError:
        return None


NVSHMEM_QP_DEPTH_DEFAULT = 1024
"""NVSHMEM's default queue-pair depth, which DeepEP low-latency reads at its first dispatch."""


def _batched_tokens(engine_args: list[str]) -> int | None:
    """``--max-num-batched-tokens`` as vLLM reads it: a human-readable integer (``2k``, ``4K``)."""
    raw = engine_arg(engine_args, "--max-num-batched-tokens")
    if raw is None:
        return None
    try:
        from vllm.utils.argparse_utils import human_readable_int

        return int(human_readable_int(raw))
    except ImportError:
        return _flag_value(engine_args, "--max-num-batched-tokens")
    except Exception:
        return None  # vLLM's parser reports it


def ll_qp_depth_problem(engine_args: list[str], environ: Any) -> ConfigError | None:
    """DeepEP LL asserts ``nvshmem_qp_depth >= (num_max_dispatch_tokens_per_rank + 1) * 2`` on its
    first dispatch, and vLLM 0.33 sizes that dispatch by ``max_num_batched_tokens``. Every LL engine
    with 2048 tokens dies at start-up (measured on two H200s, docs/accuracy.md). Said before any engine starts, instead of
    after minutes of start-up. LL kernels only run with expert parallelism; left unset, vLLM takes 256
    tokens for LL with EP (``use_batched_dp_moe``; verify always runs DP >= 2 there), doubled by
    ``--performance-mode throughput`` (``EngineArgs._set_default_max_num_seqs_and_batched_tokens_args``)."""
    if (engine_arg(engine_args, "--all2all-backend") or "") != "deepep_low_latency":
        return None
    if not has_flag(engine_args, "--enable-expert-parallel", "-ep"):
        return None
    tokens = _batched_tokens(engine_args)
    if tokens is None:
        tokens = 256 * (2 if (engine_arg(engine_args, "--performance-mode") or "") == "throughput" else 1)
    need = 2 * (tokens + 1)
    raw = environ.get("NVSHMEM_QP_DEPTH")
    try:
        depth = int(raw) if raw is not None else NVSHMEM_QP_DEPTH_DEFAULT
    except ValueError:
        return ConfigError("NVSHMEM_QP_DEPTH", raw, f"an integer >= {need} for DeepEP low-latency with --max-num-batched-tokens {tokens}")
    if depth >= need:
        return None
    allowed = (
        f"an integer >= {need} = 2 x (--max-num-batched-tokens {tokens} + 1) for DeepEP low-latency, "
        f"e.g. NVSHMEM_QP_DEPTH={max(8192, need)}; or --max-num-batched-tokens <= {depth // 2 - 1}"
    )
    if raw is None:
        return StateError("NVSHMEM_QP_DEPTH", f"unset (NVSHMEM default {NVSHMEM_QP_DEPTH_DEFAULT})", allowed)
    return ConfigError("NVSHMEM_QP_DEPTH", raw, allowed)


def floor_args(engine_args: list[str], per_rank: int) -> tuple[list[str], str]:
    """Engine arguments for the noise-floor run, and a note saying what they change. Pure: tested on CPU.

    The floor holds half as many sequences at a time per rank as the DBO-off run does (the smallest of
    ``--max-num-seqs``, ``--max-num-active-seqs`` and the rank's prompts). With an active-sequence limit
    the floor halves that one (vLLM refuses ``max_num_seqs`` below it; capture sizes stay as they were),
    otherwise ``--max-num-seqs``."""
    allowed = "an integer >= 1 (sequences a DP rank holds at a time)"
    for flag in ("--max-num-seqs", "--max-num-active-seqs"):
        raw = engine_arg(engine_args, flag)
        if raw is not None and _flag_value(engine_args, flag) is None:  # the floor halves it: read, so checked here
            raise ConfigError(flag, raw, allowed)
    seqs = _flag_value(engine_args, "--max-num-seqs")
    active = _flag_value(engine_args, "--max-num-active-seqs")
    for flag, value in (("--max-num-seqs", seqs), ("--max-num-active-seqs", active)):
        if value is not None and value < 1:  # 0 is a value given, not "unset": never read it as the default
            raise ConfigError(flag, value, allowed)
    concurrent = min(x for x in (seqs, active, per_rank) if x is not None)
    half = concurrent // 2
    if half < 1:
        raise StateError(
            "--noise-floor",
            f"given with {concurrent} sequence per DP rank at a time (the floor halves it)",
            "runs where each DP rank holds at least 2 sequences at a time (more --prompts, or a larger --max-num-seqs)",
        )
    flag = "--max-num-active-seqs" if active else "--max-num-seqs"
    return [flag, str(half)], f"noise floor: DBO off with {flag} {half} (half of the {concurrent} sequences per rank the DBO-off run holds at a time)"


def _counted_steps(record: dict[str, Any]) -> list[int]:
    """Microbatched steps per rank where the plugin's counters answered (empty: no counters)."""
    steps = record.get("microbatched_steps")
    return [x for x in (steps if isinstance(steps, list) else [steps]) if isinstance(x, int)]


def _known_failure(signature: str) -> str:
    """``known failure: <name>`` and, where one is known, what to do about it."""
    from dbo_runtime.harness.launch import SIGNATURE_HINTS

    hint = SIGNATURE_HINTS.get(signature)
    return f"known failure: {signature}" + (f" ({hint})" if hint else "")


def _microbatched(record: dict[str, Any]) -> bool:
    """False only when counters exist and some rank never microbatched (the inconclusive case)."""
    counted = _counted_steps(record)
    return not counted or min(counted) > 0


SYNTHETIC = {"prompts": 64, "prompt_len": "256-1024", "prompt_seed": 0}
"""The options that describe synthetic prompts, with their defaults."""


def _synthetic_defaults(args: argparse.Namespace) -> None:
    """A prompt file replaces the synthetic prompts: an option that describes them as well would be ignored, so it
    is refused (the operator meant one or the other); otherwise the unset ones take their defaults."""
    given = [dest for dest in SYNTHETIC if getattr(args, dest, None) is not None]
    if args.prompt_file is not None and given:
        flag = "--" + given[0].replace("_", "-")
        raise ConfigError(flag, getattr(args, given[0]), "not given with --prompt-file (it describes synthetic prompts)")
    for dest, default in SYNTHETIC.items():
        if getattr(args, dest, None) is None:
            setattr(args, dest, default)


def _numbers(args: argparse.Namespace, max_prompts: int) -> dict[str, object]:
    """Numeric options arrive as text so that a non-number gets the same one line as a bad number; the text
    comes back, by destination, so that a number out of range is echoed as typed (``0``, not ``0.0``)."""
    allowed = {
        "prompts": (int, f"an integer in [1, {max_prompts}]"),
        "prompt_seed": (int, "an integer"),
        "max_tokens": (int, "an integer in [1, 4096]"),
        "timeout": (float, "a positive number of seconds"),
        "min_agreement": (float, "a number in [0, 1]"),
        "max_dlogprob": (float, "a finite number >= 0"),
    }
    typed: dict[str, object] = {}
    for dest, (kind, what) in allowed.items():
        raw = typed[dest] = getattr(args, dest)
        if isinstance(raw, str):
            try:
                setattr(args, dest, kind(raw))
            except ValueError:
                raise ConfigError("--" + dest.replace("_", "-"), raw, what) from None
    return typed


def run(args: argparse.Namespace) -> int:
    from dbo_runtime.harness.compare import Request, Thresholds, compare, verdict
    from dbo_runtime.harness.launch import RunSpec, launch
    from dbo_runtime.harness.prompts import MAX_PROMPTS, PromptSpec

    # verify's own options first: a bad one is named as itself, not as whatever the engine arguments lack
    _synthetic_defaults(args)
    typed = _numbers(args, MAX_PROMPTS)
    low, high = _int_range(args.prompt_len, "--prompt-len")
    if not 1 <= args.prompts <= MAX_PROMPTS:
        raise ConfigError("--prompts", typed["prompts"], f"an integer in [1, {MAX_PROMPTS}]")
    if not 1 <= args.max_tokens <= 4096:
        raise ConfigError("--max-tokens", typed["max_tokens"], "an integer in [1, 4096]")
    if not (math.isfinite(args.timeout) and args.timeout > 0):
        raise ConfigError("--timeout", typed["timeout"], "a positive number of seconds")
    thresholds = Thresholds(args.min_agreement, args.max_dlogprob)
    try:
        thresholds.validate()
    except ConfigError as exc:
        raise ConfigError(exc.parameter, typed.get(exc.parameter[2:].replace("-", "_"), exc.value), exc.allowed) from None
    prompts = PromptSpec(num=args.prompts, min_len=low, max_len=high, seed=args.prompt_seed, file=args.prompt_file)
    prompts.validate()
    loaded: list[Any] = []
    if args.prompt_file is not None:
        from dbo_runtime.harness.prompts import from_file

        loaded = from_file(args.prompt_file)  # fail on a bad file now, not after an engine start
    # usage errors before vLLM's parser and the GPU check, which can only say "cannot run"; nothing is created yet
    workdir = check_dir(args.workdir, "--workdir", "verify") if args.workdir is not None else None
    extra = list(getattr(args, "extra_args", []) or [])
    engine_args, dp, notes = split_engine_args(extra)
    require_dbo_parallelism(engine_args, dp, "verify", expert_parallel=False, dp_given=has_flag(extra, *DP_SIZE_FLAGS))
    notes = [*switch_notes(), *(n for n in notes if "data-parallel size 1" not in n)]
    if args.prompts < dp and args.prompt_file is None:
        raise ConfigError("--prompts", typed["prompts"], f"at least the data-parallel size ({dp}): every rank needs prompts")
    if args.prompt_file is not None and len(loaded) < dp:
        raise ConfigError("--prompt-file", args.prompt_file, f"at least {dp} prompts (one per data-parallel rank)")
    for problem in (
        ll_qp_depth_problem(engine_args, os.environ),
        comm_sms_problem(engine_args, os.environ),
        *setting_problems(),
        *vllm_setting_problems(),
    ):
        if problem is not None:  # needs no vLLM: said on any machine, before any engine starts
            raise problem
    plan: list[tuple[str, list[str]]] = [("dbo-off", []), ("dbo-on", ["--enable-dbo"])]
    if args.noise_floor:
        per_rank = -(-(len(loaded) if args.prompt_file is not None else args.prompts) // dp)
        added, note = floor_args(engine_args, per_rank)
        plan.append(("noise-floor", added))
        notes.append(note)
    progress = Progress("[verify]")
    for note in notes:
        progress.say(f"note: {note}")
    check_with_vllm(engine_args)
    progress.say("engine arguments checked with vLLM's parser")
    visible = visible_gpus()
    if visible < dp:
        raise CliError(f"needs {dp} GPU(s) for data-parallel size {dp} (one engine rank per GPU); {visible} visible", EXIT_RUN_FAILED)
    # only once the engines will start: a refused run leaves nothing behind
    workdir = make_dir(workdir, "--workdir", "verify") if workdir is not None else Path(tempfile.mkdtemp(prefix="dbo-verify-"))

    records: dict[str, dict[str, Any]] = {}
    env = same_runner_env(os.environ)
    if env:
        notes.append(
            "VLLM_USE_V2_MODEL_RUNNER is not set: vLLM 0.33 runs DBO on the V1 model runner, so every run uses V1 "
            "(only DBO differs between them)"
        )
    with progress:
        for label, added in plan:
            if label == "noise-floor" and not _microbatched(records["dbo-on"]):
                break  # the verdict is inconclusive anyway: do not spend another engine run
            spec = RunSpec(
                label=label,
                env=env,
                engine_args=[*engine_args, *added],
                dp=dp,
                prompts=prompts,
                max_tokens=args.max_tokens,
                timeout_s=args.timeout,
            )
            progress.set(f"{label}: starting {dp} engine rank(s) and generating")
            records[label] = launch(spec, workdir)
            rec = records[label]
            progress.say(f"{label}: {'done' if rec['ok'] else 'FAILED'} in {rec['wall_s']:.0f} s")
            if not rec["ok"]:
                break
    floor_rule = FloorRule() if args.noise_floor else None
    result = _result(records, thresholds, workdir, notes, Request, compare, verdict, floor_rule)
    _print(result, args.json)
    if args.workdir is None and result["exit_code"] == EXIT_OK:
        shutil.rmtree(workdir, ignore_errors=True)
    return int(result["exit_code"])


def _result(
    records: dict[str, dict[str, Any]],
    thresholds: Any,
    workdir: Path,
    notes: list[str],
    request_cls: Any,
    compare_fn: Any,
    verdict_fn: Any,
    floor_rule: FloorRule | None = None,
) -> dict[str, Any]:
    """The verdict document (pure given the records: tested on CPU). With ``floor_rule`` the DBO-on
    comparison is judged against the noise-floor run's comparison instead of ``thresholds``."""
    runs = {
        label: {k: rec.get(k) for k in ("ok", "error", "failure_signatures", "start_s", "generate_s", "microbatched_steps", "plugin")}
        for label, rec in records.items()
    }
    doc: dict[str, Any] = {"schema": SCHEMA, "runs": runs, "workdir": str(workdir), "notes": notes, "thresholds": vars(thresholds)}
    failed = [label for label, rec in records.items() if not rec.get("ok")]
    if not failed and len(records) == 2 and floor_rule is not None and not _microbatched(records["dbo-on"]):
        floor_rule = None  # inconclusive below; the floor run was skipped
    if failed or len(records) < (3 if floor_rule is not None else 2):
        label = failed[0] if failed else "dbo-on"
        rec = records.get(label, {})
        doc.update(
            verdict="error",
            exit_code=EXIT_RUN_FAILED,
            reasons=[f"the {label} run failed: {rec.get('error')}"]
            + [_known_failure(s) for s in rec.get("failure_signatures") or []]
            + [f"logs: {workdir / label}"],
        )
        return doc
    ref = [request_cls.from_json(r) for r in records["dbo-off"]["requests"]]
    test = [request_cls.from_json(r) for r in records["dbo-on"]["requests"]]
    comparison = compare_fn(ref, test)
    doc["judged_by"] = "thresholds"
    if floor_rule is not None:
        floor = compare_fn(ref, [request_cls.from_json(r) for r in records["noise-floor"]["requests"]])
        doc["noise_floor"] = {k: v for k, v in floor.to_json().items() if k not in ("first_divergences",)}
        doc["floor_rule"] = vars(floor_rule)
        if floor.missing_requests or floor.nonfinite_logprobs:
            doc.update(
                verdict="error",
                exit_code=EXIT_RUN_FAILED,
                reasons=[f"the noise-floor run is unusable: {len(floor.missing_requests)} requests missing, "
                         f"{floor.nonfinite_logprobs} non-finite logprobs"],
            )  # fmt: skip
            return doc
        if floor_rule.degenerate(floor):
            notes.append(
                "the noise-floor run was identical to the DBO-off run (this model and vLLM ignore batch shapes here): "
                "judged by --min-agreement / --max-dlogprob instead"
            )
            passed, reasons = verdict_fn(comparison, thresholds)
        else:
            doc["judged_by"] = "noise_floor"
            passed, reasons = floor_rule.judge(comparison, floor)
    else:
        passed, reasons = verdict_fn(comparison, thresholds)
    doc["comparison"] = {k: v for k, v in comparison.to_json().items() if k not in ("first_divergences",)}
    counted = _counted_steps(records["dbo-on"])
    if not _microbatched(records["dbo-on"]):
        doc.update(
            verdict="inconclusive",
            exit_code=EXIT_INCONCLUSIVE,
            reasons=[
                f"DBO never microbatched (microbatched steps per rank: {counted}): vLLM needs data-parallel size >= 2 "
                "and at least --dbo-decode-token-threshold tokens per rank in a decode step; send more prompts or "
                "lower the threshold"
            ],
        )
        return doc
    if not counted:
        notes.append("dbo_runtime counters unavailable (plugin disabled?): cannot confirm that DBO microbatched")
    doc.update(verdict="pass" if passed else "fail", exit_code=EXIT_OK if passed else EXIT_PROBLEM, reasons=reasons)
    return doc


def _print(doc: dict[str, Any], as_json: bool) -> None:
    if as_json:
        print_json(doc)
        return
    rows = []
    comp = doc.get("comparison")
    if comp:
        floor = doc.get("noise_floor") if doc.get("judged_by") == "noise_floor" else None
        if floor:
            agree = f"{comp['agreement']:.4f}  (noise floor {floor['agreement']:.4f})"
            dmax = f"{comp['max_abs_dlogprob']:.4g}  (noise floor {floor['max_abs_dlogprob']:.4g})"
            dmean = (
                f"{comp['mean_abs_dlogprob_exact']:.3g}  (noise floor {floor['mean_abs_dlogprob_exact']:.3g}; "
                f"pass <= {doc['floor_rule']['dlogprob_factor']:g}x)"
            )
        else:
            agree = f"{comp['agreement']:.4f}  (pass >= {doc['thresholds']['min_agreement']})"
            dmax = f"{comp['max_abs_dlogprob']:.4g}  (pass <= {doc['thresholds']['max_dlogprob']})"
            dmean = f"{comp['mean_abs_dlogprob_exact']:.3g}"
        rows += [
            ["requests compared", str(comp["requests"])],
            ["token agreement", agree],
            ["identical prefix (mean)", f"{comp['prefix_agreement']:.4f}"],
            ["identical requests", f"{comp['exact_requests']}/{comp['requests']}"],
            ["max |dlogprob| (shared prefix)", dmax],
            ["mean |dlogprob| (reference token in top-k)", dmean],
        ]
    for label, run in doc["runs"].items():
        start = run.get("start_s") or []
        starts = ", ".join(f"{s:.0f}" for s in start if isinstance(s, (int, float)))
        state = "ok" if run.get("ok") else f"FAILED ({run.get('error')})"
        rows.append([f"{label} run", f"{state}; engine start {starts} s" if starts else state])
        if label == "dbo-on" and run.get("microbatched_steps") is not None:
            rows.append(["microbatched steps (per rank)", json.dumps(run["microbatched_steps"])])
    print_table("dbo-runtime verify: DBO off vs DBO on (greedy)", ["metric", "value"], rows)
    verdict = doc["verdict"].upper()
    sys.stdout.write(f"verdict: {verdict}" + (f" -- {'; '.join(doc['reasons'])}" if doc.get("reasons") else "") + "\n")
    for note in doc.get("notes") or []:
        sys.stdout.write(f"note: {note}\n")
    if doc["verdict"] != "pass":
        sys.stdout.write(f"logs and records: {doc['workdir']}\n")


__all__ = ["EXIT_RUN_FAILED", "add_parser", "check_with_vllm", "run", "same_runner_env", "split_engine_args"]
