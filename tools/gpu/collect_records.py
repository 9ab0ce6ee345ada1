"""Turn the raw run directories of a GPU session (``tests/e2e/.out``, ``DBO_E2E_OUT`` or a benchmark's
``*_runs`` folder) into compact records appended to ``docs/records/<family>.jsonl``.

    python tools/gpu/collect_records.py RUN_DIR --date YYYY-MM-DD --command "CMD" [--records docs/records]

One JSON object per line and run: ``device``, ``vllm`` (release), ``date``, ``command``, ``dp_emulated`` and the
run's numbers. A benchmark engine (``bench_host_cost``) goes to ``host-cost.jsonl``, every other run to
``e2e.jsonl``. Comparisons are recomputed from the per-request tokens and logprobs; the tokens themselves, logs
and engine arguments are not kept (the command reproduces them).
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from dbo_runtime.harness.compare import Request, compare
from tests.harness.runs import reassemble, record_facts

PAIRS: dict[str, str] = {}
"""test label -> reference label, for the comparisons the tests make."""
for model in ("deepseek-v32", "shared-topk"):
    for mode in ("eager", "graphs"):
        for runner in ("v1", "v2"):
            PAIRS[f"1gpu-{model}-{mode}-{runner}-plugin"] = f"1gpu-{model}-{mode}-{runner}-vanilla"
for k in (1, 3):
    PAIRS[f"1gpu-mtp{k}-plugin"] = f"1gpu-mtp{k}-vanilla"
for mode in ("eager", "graphs"):
    PAIRS[f"1gpu-deepseek-v32-{mode}-v2-vanilla2"] = f"1gpu-deepseek-v32-{mode}-v2-vanilla"
PAIRS.update(
    {
        "dp2-ht-dbo-deepseek-v32-v1-plugin": "dp2-ht-ref-deepseek-v32-v1",
        "dp2-ht-dbo-deepseek-v32-v1-vanilla-comm0": "dp2-ht-ref-deepseek-v32-v1",
        "dp2-ht-dbo-shared-topk-v2-plugin": "dp2-ht-ref-shared-topk-v2",
        "dp2-ht-dbo-mtp1-v1-plugin": "dp2-ht-ref-mtp1-v1",
        "dp2-ht-dbo-deepseek-v32-v2-plugin": "dp2-ht-ref-deepseek-v32-v1",
        "verify-shared-topk-plugin/dbo-on": "verify-shared-topk-plugin/dbo-off",
        "verify-shared-topk-vanilla-comm0/dbo-on": "verify-shared-topk-vanilla-comm0/dbo-off",
        "verify-deepseek-v32-vanilla-crash/dbo-on": "verify-deepseek-v32-vanilla-crash/dbo-off",
    }
)
for model, runners in (("deepseek-v32-h2048", ("v1",)), ("shared-topk-h2048", ("v1", "v2"))):
    for runner in runners:
        for variant in ("plugin", "vanilla"):
            PAIRS[f"dp2-ll-dbo-{model}-{runner}-{variant}"] = f"dp2-ll-ref-{model}-{runner}"

DROPPED = (
    "requests", "log_tail", "stderr_tail", "plugin_log_lines", "engine_args", "versions", "vllm_version", "session",
    "workdir", "start_s", "import_s", "generate_s", "run",
)  # fmt: skip
"""Keys a compact record leaves out: tokens, logs and paths are raw data; the command reproduces them."""
REP_KEYS = (
    "rep", "warmup", "prefill_s", "prefill_passes_s", "total_s", "decode_step_ms", "jit_in_step", "microbatched_builds", "decode_partitions",
    "plugin_self_us_per_step", "plugin_self_net_us_per_step", "plugin_self_in_situ_net_us_per_step", "plugin_calls_per_step", "plugin_calls_per_step_by_patch",
    "plugin_self_us_per_step_by_patch", "armed_patches",
)  # fmt: skip
"""What a compact record keeps of each timed rep of a benchmark engine (warm-up reps are left out)."""
TEXT = 240
"""Longest free text a record keeps (an error, a refusal): its first line names the cause."""


def _small(value: Any) -> Any:
    """``value`` with floats at 4 significant digits, long text cut and zero entries of per-patch maps dropped."""
    if isinstance(value, float):
        return None if value != value else float(f"{value:.4g}")
    if isinstance(value, str):
        return value if len(value) <= TEXT else value[:TEXT] + "..."
    if isinstance(value, dict):
        return {k: _small(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_small(v) for v in value]
    return value


def _rep(rep: dict[str, Any]) -> dict[str, Any]:
    kept = {k: rep[k] for k in REP_KEYS if k in rep and not (k in ("microbatched_builds", "decode_partitions") and not rep[k])}
    for key in ("plugin_calls_per_step_by_patch", "plugin_self_us_per_step_by_patch"):
        if isinstance(kept.get(key), dict):
            kept[key] = {name: v for name, v in kept[key].items() if v}
    return kept


def _base(rec: dict[str, Any]) -> dict[str, Any]:
    versions = rec.get("versions") if isinstance(rec.get("versions"), dict) else {}
    doc = {k: v for k, v in rec.items() if k not in DROPPED}
    doc["device"] = rec.get("device") or versions.get("device")
    doc["vllm"] = rec.get("vllm_version") or versions.get("vllm")
    doc["dp_emulated"] = bool(rec.get("dp_emulated", False))
    if isinstance(rec.get("meta"), dict):
        doc["meta"] = {k: v for k, v in rec["meta"].items() if k == "what"}
    if isinstance(rec.get("plugin_log_lines"), list):
        doc["plugin_log_lines"] = len(rec["plugin_log_lines"])
    return doc


def compact_e2e(rec: dict[str, Any]) -> dict[str, Any]:
    """An engine, verify or job run's compact record: its outcome, counters and comparison, no tokens or logs."""
    doc = _base(rec)
    if isinstance(doc.get("bench"), list):
        doc["bench"] = [{**{k: v for k, v in rank.items() if k != "reps"}, "reps": [_rep(r) for r in rank.get("reps", [])]} for rank in doc["bench"]]
    if isinstance(doc.get("verify"), dict):
        doc["verify"] = {k: v for k, v in doc["verify"].items() if k != "runs"}
    return _small(doc)


BY_PATCH = {"plugin_calls_per_step_by_patch": "calls_per_step", "plugin_self_us_per_step_by_patch": "self_us_per_step"}
"""Per-patch maps a host-cost record keeps once per engine: per patch, the median over the timed reps that called
it (as ``graphs/bench_host_cost.py`` summarizes them)."""


def _host_cost_rank(rank: dict[str, Any]) -> dict[str, Any]:
    """Rank 0 of a benchmark engine: its timed reps in order (no ``rep``/``warmup`` keys: warm-ups are left out),
    the per-patch maps as medians over those reps."""
    reps = [_rep(r) for r in rank.get("reps", []) if not r.get("warmup")]
    medians = {}
    for key, name in BY_PATCH.items():
        maps = [r.pop(key) for r in reps if isinstance(r.get(key), dict)]
        if maps:
            medians[name] = {p: statistics.median(m[p] for m in maps if p in m) for p in sorted({p for m in maps for p in m})}
    for r in reps:
        for key in ("rep", "warmup"):
            r.pop(key, None)
    return {**{k: v for k, v in rank.items() if k != "reps"}, "reps": reps, **({"by_patch_median": medians} if medians else {})}


def compact_host_cost(rec: dict[str, Any]) -> dict[str, Any]:
    """A ``bench_host_cost`` engine's compact record: rank 0's timed reps (step time, self time, hooked calls) and
    its per-patch medians."""
    doc = _base(rec)
    bench = rec.get("bench") if isinstance(rec.get("bench"), list) else []
    doc["bench"] = [_host_cost_rank(rank) for rank in bench[:1]]
    doc.pop("meta", None)  # the label names model, depth, mode, DBO and variant
    return _small(doc)


def family_of(rec: dict[str, Any]) -> str:
    meta = rec.get("meta") if isinstance(rec.get("meta"), dict) else {}
    return "host-cost" if meta.get("what") == "bench_host_cost" else "e2e"


def write_family(path: Path, records: list[dict[str, Any]], append: bool = False) -> None:
    """Records as JSON lines, keys in a stable order (the common ones first)."""
    first = ("date", "device", "vllm", "dp_emulated", "command", "label")
    lines = []
    for rec in records:
        ordered = {k: rec[k] for k in first if k in rec} | {k: v for k, v in rec.items() if k not in first}
        lines.append(json.dumps(ordered, separators=(",", ":"), allow_nan=True, default=str))
    with path.open("a" if append else "w") as out:
        out.writelines(line + "\n" for line in lines)


def read_family(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _date(raw: str) -> str:
    try:
        return datetime.date.fromisoformat(raw).isoformat()
    except ValueError:
        raise argparse.ArgumentTypeError(f"{raw!r} is not a date YYYY-MM-DD") from None


def _compared(label: str, rec: dict[str, Any], runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """``rec`` with its comparison against its reference run, where the tests make that comparison."""
    doc = dict(rec)
    ref_label = PAIRS.get(label)
    ref = runs.get(ref_label) if ref_label else None
    if ref_label and ref and ref.get("requests") and rec.get("requests"):
        c = compare([Request.from_json(r) for r in ref["requests"]], [Request.from_json(r) for r in rec["requests"]])
        doc.update(record_facts(c, ref_label, len(ref["requests"])))
    elif ref_label:
        doc["reference"] = ref_label
        doc["comparison_missing"] = f"{ref_label if not ref or not ref.get('requests') else label} has no tokens"
    return doc


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="collect_records.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("run_dir", type=Path, help="the folder holding one directory per run (each with spec.json or record.json)")
    ap.add_argument("--date", required=True, type=_date, help="the session's date, YYYY-MM-DD")
    ap.add_argument("--command", required=True, help="the command that produced these runs (it reproduces them)")
    ap.add_argument("--records", type=Path, default=Path("docs/records"), help="where the <family>.jsonl files are (default docs/records)")
    ap.add_argument("--device", default=None, help="the GPU, for runs that stopped before reporting theirs")
    ap.add_argument("--vllm", default=None, help="the vLLM release, for runs that stopped before reporting theirs")
    ap.add_argument("--dp-emulated", action="store_true", help="the runs used the one-GPU DBO emulation")
    args = ap.parse_args(argv)
    if not args.run_dir.is_dir():
        ap.error(f"argument run_dir: {str(args.run_dir)!r} is not an existing folder of run directories")
    runs: dict[str, dict[str, Any]] = {}
    try:
        for spec_path in sorted(args.run_dir.glob("**/spec.json")):
            rec = reassemble(spec_path.parent)  # assembled again from ranks and logs, also when a limit stopped it
            if rec is not None:
                runs[str(spec_path.parent.relative_to(args.run_dir))] = rec
        for job in sorted(args.run_dir.glob("*/record.json")):
            if job.parent.name not in runs:
                loaded = json.loads(job.read_text())
                if not isinstance(loaded, dict):
                    raise ValueError(f"{job}: a record is a JSON object, this is {type(loaded).__name__}")
                runs[job.parent.name] = loaded
        docs = [_compared(label, rec, runs) | {"label": label} for label, rec in runs.items()]
    except (OSError, ValueError, TypeError, AttributeError, KeyError) as exc:
        print(f"collect_records: {args.run_dir}: a run cannot be read back ({type(exc).__name__}: {exc}); nothing written", file=sys.stderr)
        return 2
    if not runs:
        print(f"collect_records: {args.run_dir} holds no run (no spec.json or record.json below it); nothing written", file=sys.stderr)
        return 2
    families: dict[str, list[dict[str, Any]]] = {}
    for doc in docs:
        compact = compact_host_cost(doc) if family_of(doc) == "host-cost" else compact_e2e(doc)
        compact.update(date=args.date, command=args.command, dp_emulated=args.dp_emulated or compact["dp_emulated"])
        compact["device"] = compact["device"] or args.device
        compact["vllm"] = compact["vllm"] or args.vllm
        if not compact["device"] or not compact["vllm"]:
            missing = "--device" if not compact["device"] else "--vllm"
            print(f"collect_records: run {doc['label']} reported no {missing[2:]}: give {missing}; nothing written", file=sys.stderr)
            return 2
        families.setdefault(family_of(doc), []).append(compact)
    args.records.mkdir(parents=True, exist_ok=True)
    for family, recs in sorted(families.items()):
        write_family(args.records / f"{family}.jsonl", recs, append=True)
        for rec in recs:
            print(family, rec["label"], rec.get("ok"), rec.get("microbatched_steps"), rec.get("agreement"), sep=" | ")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
