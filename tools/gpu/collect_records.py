"""Turn the raw run directories of a GPU session (``tests/e2e/.out`` or ``DBO_E2E_OUT``) into the
``docs/gpu-runs/<date>-real-engine-<label>.json`` records, also for runs a time limit stopped.

    python tools/gpu/collect_records.py RUN_DIR DOCS_DIR --date YYYY-MM-DD [--run runNN] [--session NOTE]

With ``--run`` the files are ``<date>-<run>-real-engine-<label>.json``, so several sessions of one day
do not overwrite each other.

Each record keeps the issue's keys (vllm_version, device, dp, runner, graphs, dbo, plugin, model, ok,
error, tokens_identical_to, plugin_log_lines, all2all_backend, microbatched_steps, counters, agreement,
max_abs_dlogprob, reference); comparisons are recomputed from the per-request tokens and logprobs.
Microbatched steps are recomputed from the per-worker counters in the rank files.
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from dbo_runtime.harness.compare import Request, compare
from dbo_runtime.harness.launch import reassemble

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


TAG = re.compile(r"[A-Za-z0-9_-]+")


def _is_date(raw: str) -> bool:
    if not re.fullmatch(r"[0-9]{4}-[0-9]{2}-[0-9]{2}", raw):
        return False
    try:
        datetime.date.fromisoformat(raw)
    except ValueError:
        return False
    return True


def _doc(label: str, rec: dict[str, Any], runs: dict[str, dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    """One run's record, compared with its reference run where the tests make that comparison."""
    doc = {k: v for k, v in rec.items() if k not in ("requests", "log_tail")}
    doc.setdefault("reference", None)
    doc.setdefault("agreement", None)
    doc.setdefault("max_abs_dlogprob", None)
    doc.setdefault("tokens_identical_to", None)
    ref_label = PAIRS.get(label)
    ref = runs.get(ref_label) if ref_label else None
    if ref_label and ref and ref.get("requests") and rec.get("requests"):
        c = compare([Request.from_json(r) for r in ref["requests"]], [Request.from_json(r) for r in rec["requests"]])
        doc.update(c.record_facts(ref_label, len(ref["requests"])))
    elif ref_label:
        doc["reference"] = ref_label
        doc["comparison_missing"] = f"{ref_label if not ref or not ref.get('requests') else label} has no tokens"
    doc["date"] = args.date
    if args.run:
        doc["run"] = args.run
    if args.session:
        doc["session"] = args.session
    return doc


def main() -> int:
    ap = argparse.ArgumentParser(
        description="Turn the raw run directories of a GPU session (tests/e2e/.out, DBO_E2E_OUT, or a benchmark's "
        "*_runs folder) into DOCS_DIR/<date>[-<run>]-real-engine-<label>.json records, also for runs a time limit stopped."
    )
    ap.add_argument("run_dir", type=Path, help="the folder holding one directory per run (each with spec.json)")
    ap.add_argument("docs_dir", type=Path, help="where the records go (docs/gpu-runs)")
    ap.add_argument("--date", required=True, help="the session's date, YYYY-MM-DD, the records' name prefix")
    ap.add_argument("--session", default="", help="a free-text note stored in every record (default none)")
    ap.add_argument("--run", default="", help="a tag for this session's files, e.g. runNN")
    ap.add_argument("--repo-root", default="/work/main", help="the checkout's path on the GPU machine (made relative)")
    args = ap.parse_args()
    # Everything is checked before anything is read or written: a file name is built from --date and --run.
    if not _is_date(args.date):
        ap.error(f"argument --date: {args.date!r} is not allowed; allowed values: a date YYYY-MM-DD")
    if args.run and not TAG.fullmatch(args.run):
        ap.error(f"argument --run: {args.run!r} is not allowed; allowed values: letters, digits, '-' and '_' (e.g. lease13)")
    if not args.run_dir.is_dir():
        ap.error(f"argument run_dir: {str(args.run_dir)!r} is not allowed; allowed values: an existing folder of run directories")
    if args.docs_dir.exists() and not args.docs_dir.is_dir():
        ap.error(f"argument docs_dir: {str(args.docs_dir)!r} is not allowed; allowed values: a folder (it is a file)")
    runs: dict[str, dict[str, Any]] = {}
    try:
        for spec_path in sorted(args.run_dir.glob("**/spec.json")):
            label = str(spec_path.parent.relative_to(args.run_dir))
            rec = reassemble(spec_path.parent)  # assembled again from ranks and logs
            if rec is not None:
                runs[label] = rec
        for job in sorted(args.run_dir.glob("*/record.json")):
            label = job.parent.name
            if label not in runs:
                loaded = json.loads(job.read_text())
                if not isinstance(loaded, dict):
                    raise ValueError(f"{job}: a record is a JSON object, this is {type(loaded).__name__}")
                runs[label] = loaded
    except (OSError, ValueError, TypeError, AttributeError, KeyError) as exc:
        print(f"collect_records: run_dir {str(args.run_dir)!r}: a run cannot be read back ({type(exc).__name__}: {exc}); nothing written", file=sys.stderr)
        return 2
    if not runs:
        print(f"collect_records: run_dir {str(args.run_dir)!r} holds no run (no spec.json or record.json below it); nothing written", file=sys.stderr)
        return 2
    try:
        args.docs_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        print(f"collect_records: docs_dir {str(args.docs_dir)!r} cannot be created ({exc}); nothing written", file=sys.stderr)
        return 2
    try:
        docs = [(label, _doc(label, rec, runs, args)) for label, rec in runs.items()]
    except (ValueError, TypeError, AttributeError, KeyError) as exc:
        print(f"collect_records: run_dir {str(args.run_dir)!r}: a run's requests cannot be compared ({type(exc).__name__}: {exc}); nothing written", file=sys.stderr)
        return 2
    written = []
    stem = f"{args.date}-{args.run}" if args.run else args.date
    for label, doc in docs:  # every document is built before the first is written
        name = label.replace("/", "-")
        path = args.docs_dir / f"{stem}-real-engine-{name}.json"
        # Paths of the checkout on the GPU machine become repository-relative.
        text = json.dumps(doc, indent=1, default=str).replace(args.repo_root.rstrip("/") + "/", "")
        path.write_text(text + "\n")
        written.append((name, doc.get("ok"), doc.get("error"), doc.get("microbatched_steps"), doc.get("agreement"), doc.get("max_abs_dlogprob")))
    for row in written:
        print(*row, sep=" | ")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
