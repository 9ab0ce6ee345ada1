"""``dbo-runtime verify [options] MODEL [vllm serve engine arguments]``: does DBO change my model's outputs?

Runs your model and parallel configuration with DBO off, then on, on the same prompts (greedy), compares the
runs request by request and prints a verdict; a DBO run that never microbatched proves nothing (inconclusive).
Exit 0 pass, 1 outputs differ, 2 bad arguments, 3 could not run, 4 inconclusive."""

from __future__ import annotations

import argparse
import json
import os
import shutil
from pathlib import Path
from typing import Any

from dbo_runtime.cli import _engine
from dbo_runtime.cli._common import EXIT_INCONCLUSIVE, EXIT_NO_DEVICE, int_in, print_json, print_table, say
from dbo_runtime.cli._engine import engine_arg, prepare
from dbo_runtime.core.cli_support import StateError
from dbo_runtime.core.errors import ConfigError
from dbo_runtime.harness.compare import FloorRule, Request, Thresholds, compare, verdict

SCHEMA = "dbo-runtime/verify/v1"
ENGINE_ARGS = True
"""``main`` hands the arguments verify does not know on to it: vLLM's engine arguments."""


def _len_range(text: str) -> tuple[int, int]:
    low, _, high = text.partition("-")
    if not (low.isdigit() and high.isdigit()):
        raise argparse.ArgumentTypeError(f"invalid value {text!r}: allowed MIN-MAX, two positive integers (e.g. 256-1024)")
    return int(low), int(high)


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = _engine.add_engine_command(subparsers, "verify", __doc__, "run the model with DBO off and on and say whether DBO changes its outputs", 1800.0, "seconds per engine run")
    p.add_argument("--prompts", type=int, default=64, metavar="N", help="synthetic prompts (default 64)")
    p.add_argument("--prompt-len", type=_len_range, default=(256, 1024), metavar="MIN-MAX", help="synthetic prompt lengths (default 256-1024)")
    p.add_argument("--prompt-file", metavar="PATH", help="prompts instead of synthetic ids: .jsonl / .json prompt objects, or one text prompt per line")
    p.add_argument("--prompt-seed", type=int, default=0, metavar="S", help="seed of the synthetic prompts")
    p.add_argument("--max-tokens", type=int_in(1, 4096), default=32, metavar="T", help="greedy tokens per prompt (default 32)")
    p.add_argument("--min-agreement", type=float, default=Thresholds.min_agreement, metavar="A", help=f"pass needs this fraction of tokens equal (default {Thresholds.min_agreement})")
    p.add_argument("--max-dlogprob", type=float, default=Thresholds.max_dlogprob, metavar="D", help=f"pass needs max |logprob difference| <= D (default {Thresholds.max_dlogprob})")
    p.add_argument("--noise-floor", action="store_true", help="also run DBO off with half the sequences at a time, and judge DBO against how much that batch-shape change alone moves the model instead of --min-agreement / --max-dlogprob")
    return p


def _int_flag(engine_args: list[str], flag: str) -> int | None:
    raw = engine_arg(engine_args, flag)
    return int(raw) if raw is not None and raw.isdigit() else None


def floor_args(engine_args: list[str], per_rank: int) -> tuple[list[str], str]:
    """Engine arguments for the noise-floor run: half the sequences a rank holds at a time (an active limit is halved)."""
    seqs, active = _int_flag(engine_args, "--max-num-seqs"), _int_flag(engine_args, "--max-num-active-seqs")
    concurrent = min(x for x in (seqs, active, per_rank) if x is not None)
    if concurrent // 2 < 1:
        raise StateError(
            "--noise-floor", f"given with {concurrent} sequence per DP rank at a time (the floor halves it)",
            "runs where each DP rank holds at least 2 sequences at a time (more --prompts, or a larger --max-num-seqs)",
        )  # fmt: skip
    flag = "--max-num-active-seqs" if active else "--max-num-seqs"
    half = concurrent // 2
    return [flag, str(half)], f"noise floor: DBO off with {flag} {half} (half of the {concurrent} sequences per rank held at a time)"


def _counted_steps(record: dict[str, Any]) -> list[int]:
    """Microbatched steps per rank where the plugin's counters answered (empty: no counters)."""
    steps = record.get("microbatched_steps")
    return [x for x in (steps if isinstance(steps, list) else [steps]) if isinstance(x, int)]


def _microbatched(record: dict[str, Any]) -> bool:
    counted = _counted_steps(record)
    return not counted or min(counted) > 0


def run(args: argparse.Namespace) -> int:
    from dbo_runtime.harness.launch import RunSpec, launch
    from dbo_runtime.harness.prompts import PromptSpec, from_file

    (thresholds := Thresholds(args.min_agreement, args.max_dlogprob)).validate()
    if not args.timeout > 0:
        raise ConfigError("--timeout", args.timeout, "a positive number of seconds")
    prompts = PromptSpec(num=args.prompts, min_len=args.prompt_len[0], max_len=args.prompt_len[1], seed=args.prompt_seed, file=args.prompt_file)
    prompts.validate()
    loaded = from_file(args.prompt_file) if args.prompt_file is not None else []  # a bad file fails now, not after an engine start
    engine_args, dp, notes = prepare(args.extra_args, "verify", expert_parallel=False)
    count = len(loaded) if args.prompt_file is not None else args.prompts
    if count < dp and loaded:
        raise ConfigError("--prompt-file", args.prompt_file, f"a file with at least the data-parallel size ({dp}) of prompts ({count} here)")
    if count < dp:
        raise ConfigError("--prompts", count, f"at least the data-parallel size ({dp}): every rank needs prompts")
    plan: list[tuple[str, list[str]]] = [("dbo-off", []), ("dbo-on", ["--enable-dbo"])]
    if args.noise_floor:
        added, note = floor_args(engine_args, -(-count // dp))
        plan.append(("noise-floor", added))
        notes.append(note)
    folder = _engine.start("verify", engine_args, dp, f"one engine rank per GPU for data-parallel size {dp}", notes, args.workdir)
    env = _engine.same_runner_env(os.environ)
    records: dict[str, dict[str, Any]] = {}
    for label, added in plan:
        if label == "noise-floor" and not _microbatched(records["dbo-on"]):
            break  # inconclusive anyway: no need for another engine run
        spec = RunSpec(label=label, env=env, engine_args=[*engine_args, *added], dp=dp, prompts=prompts, max_tokens=args.max_tokens, timeout_s=args.timeout)
        say("[verify]", f"{label}: starting {dp} engine rank(s) and generating ...")
        rec = records[label] = launch(spec, folder)
        say("[verify]", f"{label}: {'done' if rec['ok'] else 'FAILED'} in {rec['wall_s']:.0f} s")
        if not rec["ok"]:
            break
    result = _result(records, thresholds, folder, notes, FloorRule() if args.noise_floor else None)
    print_json(result) if args.json else render(result)
    if args.workdir is None and result["exit_code"] == 0:
        shutil.rmtree(folder, ignore_errors=True)
    return int(result["exit_code"])


def _result(records: dict[str, dict[str, Any]], thresholds: Thresholds, folder: Path, notes: list[str], floor_rule: FloorRule | None = None) -> dict[str, Any]:
    """The verdict document, pure given the records; with ``floor_rule`` DBO-on is judged against the noise floor."""
    from dbo_runtime.harness.launch import SIGNATURE_HINTS

    keys = ("ok", "error", "failure_signatures", "start_s", "generate_s", "microbatched_steps", "plugin")
    runs = {label: {k: rec.get(k) for k in keys} for label, rec in records.items()}
    doc: dict[str, Any] = {"schema": SCHEMA, "runs": runs, "workdir": str(folder), "notes": notes, "thresholds": vars(thresholds)}
    failed = [label for label, rec in records.items() if not rec.get("ok")]
    if not failed and floor_rule is not None and "noise-floor" not in records and not _microbatched(records["dbo-on"]):
        floor_rule = None  # inconclusive below; the floor run was skipped
    if failed or len(records) < (3 if floor_rule is not None else 2):
        label = failed[0] if failed else "dbo-on"
        rec = records.get(label, {})
        known = [f"known failure: {s}" + (f" ({SIGNATURE_HINTS[s]})" if s in SIGNATURE_HINTS else "") for s in rec.get("failure_signatures") or []]
        reasons = [f"the {label} run failed: {rec.get('error')}", *known, f"logs: {folder / label}"]
        return {**doc, "verdict": "error", "exit_code": EXIT_NO_DEVICE, "reasons": reasons}
    ref = [Request.from_json(r) for r in records["dbo-off"]["requests"]]
    comparison = compare(ref, [Request.from_json(r) for r in records["dbo-on"]["requests"]])
    doc["judged_by"] = "thresholds"
    passed, reasons = verdict(comparison, thresholds)
    if floor_rule is not None:
        floor = compare(ref, [Request.from_json(r) for r in records["noise-floor"]["requests"]])
        doc["noise_floor"] = {k: v for k, v in floor.to_json().items() if k != "first_divergences"}
        doc["floor_rule"] = vars(floor_rule)
        if floor.missing_requests or floor.nonfinite_logprobs:
            why = f"{len(floor.missing_requests)} requests missing, {floor.nonfinite_logprobs} non-finite logprobs"
            return {**doc, "verdict": "error", "exit_code": EXIT_NO_DEVICE, "reasons": [f"the noise-floor run is unusable: {why}"]}
        if floor_rule.degenerate(floor):
            notes.append("the noise-floor run was identical to the DBO-off run: judged by --min-agreement / --max-dlogprob instead")
        else:
            doc["judged_by"] = "noise_floor"
            passed, reasons = floor_rule.judge(comparison, floor)
    doc["comparison"] = {k: v for k, v in comparison.to_json().items() if k != "first_divergences"}
    counted = _counted_steps(records["dbo-on"])
    if not _microbatched(records["dbo-on"]):
        need = "vLLM needs data-parallel size >= 2 and at least --dbo-decode-token-threshold tokens per rank in a decode step"
        reasons = [f"DBO never microbatched (microbatched steps per rank: {counted}): {need}; send more prompts or lower the threshold"]
        return {**doc, "verdict": "inconclusive", "exit_code": EXIT_INCONCLUSIVE, "reasons": reasons}
    if not counted:
        notes.append("dbo_runtime counters unavailable (plugin disabled?): cannot confirm that DBO microbatched")
    return {**doc, "verdict": "pass" if passed else "fail", "exit_code": 0 if passed else 1, "reasons": reasons}


def render(doc: dict[str, Any]) -> None:
    rows = []
    if comp := doc.get("comparison"):
        floor = doc.get("noise_floor") if doc.get("judged_by") == "noise_floor" else None
        bound = f"noise floor {floor['agreement']:.4f}" if floor else f"pass >= {doc['thresholds']['min_agreement']}"
        dbound = f"noise floor {floor['max_abs_dlogprob']:.4g}" if floor else f"pass <= {doc['thresholds']['max_dlogprob']}"
        rows += [
            ["requests compared", str(comp["requests"])],
            ["token agreement", f"{comp['agreement']:.4f}  ({bound})"],
            ["identical prefix (mean)", f"{comp['prefix_agreement']:.4f}"],
            ["identical requests", f"{comp['exact_requests']}/{comp['requests']}"],
            ["max |dlogprob| (shared prefix)", f"{comp['max_abs_dlogprob']:.4g}  ({dbound})"],
            ["mean |dlogprob| (reference token in top-k)", f"{comp['mean_abs_dlogprob_exact']:.3g}"],
        ]
    for label, run in doc["runs"].items():
        starts = ", ".join(f"{s:.0f}" for s in run.get("start_s") or [] if isinstance(s, (int, float)))
        state = "ok" if run.get("ok") else f"FAILED ({run.get('error')})"
        rows.append([f"{label} run", f"{state}; engine start {starts} s" if starts else state])
        if label == "dbo-on" and run.get("microbatched_steps") is not None:
            rows.append(["microbatched steps (per rank)", json.dumps(run["microbatched_steps"])])
    print_table("dbo-runtime verify: DBO off vs DBO on (greedy)", ["metric", "value"], rows)
    print(f"verdict: {doc['verdict'].upper()}" + (f" -- {'; '.join(doc['reasons'])}" if doc.get("reasons") else ""))
    for note in doc.get("notes") or []:
        print(f"note: {note}")
    if doc["verdict"] != "pass":
        print(f"logs and records: {doc['workdir']}")
