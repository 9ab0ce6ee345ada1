"""One-off: turn the raw ``docs/gpu-runs`` tree into compact ``docs/records/<family>.jsonl`` records.

    python tools/gpu/convert_gpu_runs.py docs/gpu-runs docs/records

Families: ``e2e`` (real-engine runs), ``host-cost`` (bench_host_cost engines), ``twins`` (GPU twin suite runs),
``hook-calls`` (bench_hook_calls / bench_sm_count_read), ``kernels`` (early standalone twin and benchmark JSON).
Logs, text dumps and ``doctor`` documents are dropped: raw logs are not committed.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tools.gpu.collect_records import compact_e2e, compact_host_cost, write_family

H200 = "NVIDIA H200"
H100 = "NVIDIA H100 80GB HBM3"
NAME = re.compile(r"^(\d{4}-\d{2}-\d{2})-(?:(run|lease)(\d+)-?)?(.*)$")


def _env(folder: Path) -> tuple[str | None, str | None]:
    """(device, vllm) from a session's env.txt."""
    env = folder / "env.txt"
    if not env.is_file():
        return None, None
    text = env.read_text()
    dev = re.search(r"GPU 0: (.+?) \(UUID", text)
    vllm = re.search(r"vllm (\S+)", text)
    return (dev.group(1) if dev else None), (vllm.group(1) if vllm and vllm.group(1) != "None" else None)


def _default_device(date: str, run: str) -> str:
    """Every session up to the twentieth ran on one H200; later ones (12-05) on H100s."""
    return H100 if date >= "2026-12-05" else H200


def _twin_summary(log: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if not log.is_file():
        return out
    text = log.read_text(errors="replace")
    m = None
    for m in re.finditer(r"^=*\s*((?:\d+ \w+,? ?)+) in ([\d.]+)s", text, re.M):
        pass
    if m:
        for n, what in re.findall(r"(\d+) (\w+)", m.group(1)):
            out[what] = int(n)
        out["seconds"] = float(m.group(2))
    ex = re.findall(r"^exit (\d+)", text, re.M)
    if ex:
        out["exit"] = int(ex[-1])
    return out


def _round(v: Any) -> Any:
    if isinstance(v, float):
        return None if v != v else float(f"{v:.4g}")
    if isinstance(v, dict):
        return {k: _round(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_round(x) for x in v]
    return v


def main() -> int:
    src, dst = Path(sys.argv[1]), Path(sys.argv[2])
    fam: dict[str, list[dict[str, Any]]] = {k: [] for k in ("e2e", "host-cost", "twins", "hook-calls", "kernels")}
    for entry in sorted(src.iterdir()):
        m = NAME.match(entry.name if entry.is_dir() else entry.stem)
        if not m:
            continue
        date, kind, num, rest = m.groups()
        run = f"{num}" if num else ""
        base = {"date": date, "run": f"{date}/{run}" if run else date}
        if entry.is_dir():
            device, vllm = _env(entry)
            device = device or _default_device(date, run)
            if rest.startswith("twins"):
                twins_dir = entry / "twins" if (entry / "twins").is_dir() else entry
                rec: dict[str, Any] = {
                    **base, "device": device, "vllm": vllm, "dp_emulated": False,
                    "command": 'E2E=0 TWIN_BENCHES="" bash tools/gpu/session-e2e.sh',
                    "suite": "tests/gpu", **_twin_summary(entry / "gpu-twins.log"),
                }
                if (entry / "gpu-twins-with-vllm.log").is_file():
                    rec["with_vllm"] = _twin_summary(entry / "gpu-twins-with-vllm.log")
                results = {}
                for f in sorted(twins_dir.glob("*.json")):
                    if f.stem == "cli_doctor":
                        continue
                    results[f.stem] = _compact_twin(json.loads(f.read_text()))
                rec["results"] = results
                fam["twins"].append(_round(rec))
            elif rest.startswith("hook-calls"):
                host = (entry / "host.txt").read_text() if (entry / "host.txt").is_file() else ""
                cpu = re.search(r"Model name:\s*(.+)", host)
                for f in sorted(entry.glob("*.json")):
                    doc = json.loads(f.read_text())
                    tree = f.stem.split("-bench")[0] if "-bench" in f.stem else "current"
                    bench = "bench_sm_count_read" if "sm_count" in f.stem else "bench_hook_calls"
                    cold = f.stem.endswith("_cold")
                    cmd = (
                        "python graphs/bench_sm_count_read.py" if bench == "bench_sm_count_read"
                        else f"python graphs/bench_hook_calls.py --n {doc.get('n')} --reps {doc.get('reps')}"
                        + (f" --cold {doc.get('cold_reads')}" if cold else "")
                    )
                    rows = [{k: v for k, v in r.items() if not k.endswith("_samples_ns")} for r in doc.get("rows", [])]
                    fam["hook-calls"].append(_round({
                        **base, "device": device, "host_cpu": cpu.group(1).strip() if cpu else None, "vllm": "0.33.0",
                        "dp_emulated": False, "command": cmd, "bench": bench, "tree": tree, "cold": cold,
                        **{k: v for k, v in doc.items() if k not in ("rows",)}, "rows": rows,
                    }))
            # hostcost-logs and other folders: raw logs only
            continue
        if entry.suffix != ".json":
            continue
        doc = json.loads(entry.read_text())
        if "real-engine-" in rest:
            if "hostcost" in rest:
                rec = compact_host_cost(doc)
                rec["run"] = base["run"] + "-" + rest.split("-real-engine-")[0]
            else:
                rec = compact_e2e(doc)
                rec["run"] = base["run"]
            name = rest.split("real-engine-", 1)[1]
            inner = str(doc.get("label") or name)
            rec["label"] = name[: -len(inner) - 1] + "/" + inner if name != inner and name.endswith("-" + inner) else name
            if "hostcost" in rest:
                rec["command"] = f"python graphs/bench_host_cost.py --only {rec['label'].rsplit('-', 1)[0]}"
            else:
                mark = "e2e" if rec["label"].startswith("1gpu-") else "e2e_dp2"
                rec["command"] = f"python -m pytest tests/e2e -m {mark}"
            rec["date"] = date
            rec["device"] = rec.get("device") or _default_device(date, run)
            rec["vllm"] = rec.get("vllm") or "0.33.0"
            fam["host-cost" if "hostcost" in rest else "e2e"].append(_round(rec))
            continue
        if rest in ("cli_doctor",):
            continue
        rec = {**base, "device": doc.get("device") if isinstance(doc.get("device"), str) else H200, "vllm": None,
               "dp_emulated": False, "command": _kernel_command(rest), "name": rest, "result": _compact_twin(doc)}
        fam["kernels"].append(_round(rec))
    dst.mkdir(parents=True, exist_ok=True)
    for name, recs in fam.items():
        write_family(dst / f"{name}.jsonl", recs)
        print(name, len(recs), (dst / f"{name}.jsonl").stat().st_size)
    return 0


def _kernel_command(rest: str) -> str:
    if rest.startswith("bench_indexer_schedule"):
        return "python graphs/bench_indexer_schedule.py"
    if rest.startswith("scenario_suite") or rest.startswith("scenario-suite"):
        return "python graphs/scenario_suite.py --steps " + ("6" if "6steps" in rest else "20")
    if rest.startswith("cli_sms"):
        return "dbo-runtime sms --json"
    return "python -m pytest tests/gpu -q -s"


def _compact_twin(doc: Any) -> Any:
    if isinstance(doc, dict):
        return {k: _compact_twin(v) for k, v in doc.items() if k not in ("versions", "see", "torch", "cuda", "python")}
    if isinstance(doc, str) and len(doc) > 240:
        return doc[:240] + "..."
    return doc


if __name__ == "__main__":
    raise SystemExit(main())
