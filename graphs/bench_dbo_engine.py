"""DBO in the real engine on two GPUs: decode throughput and step time, DBO on vs off.

A tiny shared-top-k model, DP 2 + EP, in two groups run one after the other (``--backends``): ``ht`` (DeepEP
high-throughput, eager: off / dbo_runtime / self-timed; vanilla DBO crashes here) and ``ll`` (low-latency, FULL
decode graphs: off / dbo_runtime / vanilla / self-timed). Within a group the engines are timed in interleaved
turns. The tiny model shows no overlap gain: the point is the plugin's cost and no regression.

    python graphs/bench_dbo_engine.py [--reps 3] [--backends ht,ll] [--out graphs/results]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from graphs._args import EXIT_NO_DEVICE, add_out, integer, progress, say_written  # noqa: E402
from graphs._plotting import pyplot  # noqa: E402

GROUPS: dict[str, tuple[str, bool]] = {"ht": ("shared-topk", False), "ll": ("shared-topk-h2048", True)}
"""(model, FULL decode graphs) per group: DeepEP LL needs hidden >= 2048; vLLM runs HT with DP > 1 eager."""
CONFIGS: dict[str, list[tuple[str, bool, bool, dict[str, str]]]] = {
    "ht": [
        ("ht-dbo-off", False, True, {}), ("ht-dbo-plugin", True, True, {}),
        ("ht-dbo-plugin-selftime", True, True, {"DBO_RUNTIME_SELF_TIME": "1"}),
    ],
    "ll": [
        ("ll-dbo-off", False, True, {}), ("ll-dbo-plugin", True, True, {}), ("ll-dbo-vanilla", True, False, {}),
        ("ll-dbo-plugin-selftime", True, True, {"DBO_RUNTIME_SELF_TIME": "1"}),
    ],
}
"""(label, DBO on, dbo_runtime on, extra env) per group; the groups run one after the other (seven engines on one
GPU outgrow it), so ratios are within a group."""
RATIOS = {
    "ht": {"ht_dbo_plugin_over_off": ("ht-dbo-plugin", "ht-dbo-off")},
    "ll": {
        "ll_dbo_plugin_over_off": ("ll-dbo-plugin", "ll-dbo-off"),
        "ll_dbo_plugin_over_vanilla": ("ll-dbo-plugin", "ll-dbo-vanilla"),
    },
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench_dbo_engine", description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=integer(1), default=3, help="timed reps per configuration after one warm-up (default 3)")
    parser.add_argument("--steps", type=integer(2), default=64, help="decode steps per timed pass (default 64)")
    add_out(parser)
    parser.add_argument("--backends", default="ht,ll", help="comma-separated backend groups, run one after the other: ht, ll (default ht,ll)")
    args = parser.parse_args(argv)
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    unknown = [b for b in backends if b not in GROUPS]
    if unknown or not backends:
        shown = ", ".join(repr(b) for b in unknown) or repr(args.backends)
        parser.error(f"argument --backends: {shown} is not allowed; allowed values: ht, ll (comma-separated)")
    from tests.harness.machine import refuse_without_engine

    refused = refuse_without_engine("bench_dbo_engine", 2)
    if refused is not None:
        return EXIT_NO_DEVICE
    from tests.harness.report import environment

    env_facts = environment()  # before any engine: a failure here must not cost a measured group
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for group in backends:
        _run_group(args, group, out, env_facts)
    return 0


def _run_group(args: argparse.Namespace, group: str, out: Path, env_facts: dict) -> None:
    import dataclasses

    from dbo_runtime.harness.prompts import PromptSpec
    from dbo_runtime.harness.turns import run_interleaved
    from tests.e2e import plan

    model, graphs = GROUPS[group]
    backend = plan.HT if group == "ht" else plan.LL
    prompts = PromptSpec(num=64, min_len=300, max_len=600, seed=12)
    bench = {"max_tokens": args.steps, "reps": args.reps, "warmup": 1, "coordinated": True, "prefill_twice": True}
    specs = [
        dataclasses.replace(
            plan.dp_spec(label, model, backend, dbo=dbo, runner="v1", plugin=plugin, graphs=graphs, what="bench_dbo_engine", **env),
            prompts=prompts, max_tokens=4, bench=bench, timeout_s=1500,
        )
        for label, dbo, plugin, env in CONFIGS[group]
    ]
    work = out / "bench_dbo_engine_runs"
    records = run_interleaved(specs, work, args.reps, timeout_s=1500, progress=progress)
    rows = {label: _row(rec) for label, rec in records.items()}
    summary: dict[str, object] = {}
    for name, (a, b) in RATIOS[group].items():
        summary[name] = _ratio_of_medians(rows, a, b)
        summary[f"{name}_paired"] = _paired(rows, a, b)
    summary[f"{group}_plugin_self_us_per_step"] = rows.get(f"{group}-dbo-plugin-selftime", {}).get("plugin_self_us_per_step")
    doc = {"bench": "bench_dbo_engine", "group": group, "args": vars(args), "environment": env_facts, "summary": summary, "configs": rows}
    (out / f"bench_dbo_engine_{group}.json").write_text(json.dumps(doc, indent=1, default=str) + "\n")
    _plot(rows, summary, list(RATIOS[group]), out / f"bench_dbo_engine_{group}.png")
    say_written("bench_dbo_engine", out / f"bench_dbo_engine_{group}.json", out / f"bench_dbo_engine_{group}.png")
    print(json.dumps({"group": group, "summary": summary, "configs": {k: {kk: v[kk] for kk in ("ok", "median_step_ms", "median_tok_per_s")} for k, v in rows.items()}}, indent=1))


def _row(rec: dict) -> dict:
    """One configuration's timed reps: a rep's step is the slower rank's, its tok/s the sum of the ranks'. A rep
    any rank could not measure is dropped everywhere; ``decode_step_ms_by_rep`` keeps its place (None) for pairing."""
    per_rank = rec.get("bench") or []
    timed = [[r for r in b.get("reps", []) if not r.get("warmup")] for b in per_rank]
    n = min((len(rs) for rs in timed), default=0)
    kept = [i for i in range(n) if all(rs[i].get("decode_step_ms") is not None for rs in timed)]
    by_rep: list[float | None] = [None] * n
    for i in kept:
        by_rep[i] = max(rs[i]["decode_step_ms"] for rs in timed)
    steps = [by_rep[i] for i in kept]
    tps = [sum(rs[i]["decode_tok_per_s"] for rs in timed) for i in kept]
    selfs = [rs[i]["plugin_self_us_per_step"] for rs in timed for i in kept if rs[i].get("plugin_self_us_per_step") is not None]
    return {
        "ok": rec.get("ok"), "error": rec.get("error"), "decode_step_ms": steps, "decode_step_ms_by_rep": by_rep, "decode_tok_per_s": tps,
        "median_step_ms": statistics.median(steps) if steps else None, "median_tok_per_s": statistics.median(tps) if tps else None,
        "plugin_self_us_per_step": statistics.median(selfs) if selfs else None,
        "microbatched_builds_per_timed_pass": [r.get("microbatched_builds") for rs in timed for r in rs], "turn_order": rec.get("turn_order"),
    }  # fmt: skip


def _ratio_of_medians(rows: dict, a: str, b: str) -> float | None:
    x, y = rows.get(a, {}).get("median_step_ms"), rows.get(b, {}).get("median_step_ms")
    return x / y if x and y else None


def _paired(rows: dict, a: str, b: str) -> dict | None:
    """Rep i of ``a`` over rep i of ``b`` (interleaved turns: seconds apart), less exposed to host drift than a ratio
    of medians."""
    xs, ys = rows.get(a, {}).get("decode_step_ms_by_rep") or [], rows.get(b, {}).get("decode_step_ms_by_rep") or []
    ratios = [x / y for x, y in zip(xs, ys, strict=False) if x and y]
    if not ratios:
        return None
    return {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios), "n": len(ratios)}


def _plot(rows: dict, summary: dict, ratio_names: list[str], path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    labels = [k for k in rows if rows[k]["decode_step_ms"]]
    fig, ax = plt.subplots(figsize=(10, 4))
    for i, label in enumerate(labels):
        ys = rows[label]["decode_step_ms"]
        ax.scatter([i] * len(ys), ys, alpha=0.7)
        ax.hlines(statistics.median(ys), i - 0.3, i + 0.3, color="k")
    ax.set_xticks(range(len(labels)), labels, rotation=20)
    ax.set_ylabel("decode step (ms), slower DP rank")
    ratios = ", ".join(
        f"{name.replace('_over_', ' / ').replace('_', ' ')} {summary[name]:.3f}" for name in ratio_names if summary.get(name)
    )
    fig.suptitle(f"real vLLM engine, DP 2 + EP, tiny shared-top-k model: {ratios or 'no ratio'}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    raise SystemExit(main())
