"""dbo_runtime's host cost at production depth, in the real engine on one GPU: step time, self time, hooked calls.

With DeepEP high-throughput and DP > 1 every DBO step runs eager, so every hooked call is paid on every layer. Tiny-width
models at 6, 61 and 78 layers (GLM-5.3 or DeepSeek-V3.2 pattern), eager and CUDA graphs; DBO off, ``dp1`` (armed at DP
1, never microbatched) or ``emu`` (every decode step microbatched by the test harness's one-GPU DBO emulation, cold
DeepGEMM JIT cache). Three engines per configuration (dbo_runtime, vanilla, dbo_runtime self-timed) are timed in
interleaved turns; under ``emu`` the paired two run with 0 comm SMs (vanilla crashes with more), the self-timed with 20.
Reported: the paired step-time ratio, self time and hooked calls per step and per layer, planner compilations in steps.

    python graphs/bench_host_cost.py [--models glm53,v32] [--depths 6,61,78] [--modes eager,graphs] [--dbo off,dp1,emu]
    python graphs/bench_host_cost.py --from-runs DIR [--only ...] [--out DIR]   (no engines: a stopped run's records)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from graphs._args import EXIT_NO_DEVICE, add_out, integer, progress, say_written  # noqa: E402
from graphs._plotting import pyplot  # noqa: E402
from tests.harness.machine import gpu_gib  # noqa: E402

MODELS = {"glm53": ("shared-topk", {"index_topk_freq": 4, "index_skip_topk_offset": 3}), "v32": ("deepseek-v32", {})}
MODES = ("eager", "graphs")
DBO = ("off", "dp1", "emu")
EMU_COMM_SMS = {"plugin": 0, "vanilla": 0, "selftime": 20}
MAX_STEPS = 3000  # decode steps per pass: prompts of up to 600 tokens, --max-model-len 4096
VARIANTS = (("plugin", {}), ("vanilla", {"DBO_RUNTIME_DISABLE": "1"}), ("selftime", {"DBO_RUNTIME_SELF_TIME": "1"}))
ENGINE_GIB = ((6, 7.0), (78, 16.0))  # (layers, GiB) one engine holds after its first prefill; depths between on the line
ENGINE_ONLY = ("reps", "steps", "graphs_steps", "at_once")  # shape the engines' runs: not in a --from-runs summary
AT_ONCE = 1  # configurations alive together: twelve deep engines outgrow one H200 and compete for the host's cores


def _choices(parser: argparse.ArgumentParser, name: str, raw: str, allowed: tuple[str, ...]) -> list[str]:
    items = [v.strip() for v in raw.split(",")]
    bad = [v for v in items if v not in allowed]
    if bad:
        parser.error(f"argument --{name}: invalid value {bad[0]!r}: allowed {', '.join(allowed)} (comma-separated)")
    return items


def _depths(parser: argparse.ArgumentParser, raw: str) -> list[int]:
    items = [v.strip() for v in raw.split(",")]
    if not all(v.isdigit() and int(v) >= 1 for v in items):
        parser.error(f"argument --depths: invalid value {raw!r}: allowed comma-separated layer counts >= 1")
    return [int(v) for v in items]


def configurations(models: list[str], depths: list[int], modes: list[str], dbo: list[str]) -> list[dict]:
    """Every (model, depth, mode, DBO) the run measures, with its label."""
    return [{"label": f"{m}-{d}L-{mode}-dbo-{b}", "model": m, "depth": d, "mode": mode, "dbo": b} for m in models for d in depths for mode in modes for b in dbo]


def specs_for(config: dict, steps: int, reps: int) -> list:
    from dbo_runtime.harness.prompts import PromptSpec
    from tests.e2e import dp_emulation, plan
    from tests.harness.engine_runner import E2ESpec

    name, overrides = MODELS[config["model"]]
    extra = ["--hf-overrides", json.dumps({"num_hidden_layers": config["depth"], **overrides})]
    emu = config["dbo"] == "emu"  # dp1: --enable-dbo at DP 1 arms the hooks, never microbatches; emu microbatches every step
    extra += ["--enable-expert-parallel", "--all2all-backend", plan.HT, "--enable-dbo"] if config["dbo"] != "off" else []
    extra += ["--dbo-decode-token-threshold", "4", "--dbo-prefill-token-threshold", "32"] if emu else []
    bench = {"max_tokens": steps, "reps": reps, "warmup": 1, "coordinated": True, "prefill_twice": True}
    return [
        E2ESpec(label=f"{config['label']}-{variant}", engine_args=plan.tiny_args(name, eager=config["mode"] == "eager", extra=extra),
                env={**plan.bench_env(env), **(dp_emulation.engine_env(EMU_COMM_SMS[variant]) if emu else {})}, cold_jit_cache=emu,
                prompts=PromptSpec(num=32, min_len=300, max_len=600, seed=13), max_tokens=4, bench=bench, timeout_s=1500,
                meta={"model": name, "issue": 20, "what": "bench_host_cost", **config, "variant": variant})
        for variant, env in VARIANTS
    ]  # fmt: skip


def _reps(rec: dict) -> list[dict]:
    per_rank = rec.get("bench") or []
    return [r for r in (per_rank[0].get("reps", []) if per_rank else []) if not r.get("warmup")]


def _device(rec: dict) -> str | None:
    versions = rec.get("versions")
    return rec.get("device") or (versions.get("device") if isinstance(versions, dict) else None)


def summarize(config: dict, records: dict[str, dict]) -> dict:
    """One configuration's row (pure: the CPU test feeds it synthetic records)."""
    label = config["label"]
    plugin, vanilla, selftime = (records.get(f"{label}-{v}", {}) for v, _ in VARIANTS)
    a = [r.get("decode_step_ms") for r in _reps(plugin)]
    b = [r.get("decode_step_ms") for r in _reps(vanilla)]
    paired = [x / y for x, y in zip(a, b, strict=False) if x and y]
    self_reps = _reps(selftime)

    def measured(key: str) -> list[float]:
        return [r[key] for r in self_reps if r.get(key) is not None]

    self_us, net_us, calls = measured("plugin_self_us_per_step"), measured("plugin_self_net_us_per_step"), measured("plugin_calls_per_step")
    gc_us, gc_n = measured("plugin_gc_us_per_step"), measured("plugin_gc_per_step")
    in_situ_us = measured("plugin_self_in_situ_net_us_per_step")
    def per_patch(key: str) -> dict[str, list[Any]]:
        out: dict[str, list[Any]] = {}
        for r in self_reps:
            for name, value in (r.get(key) or {}).items():
                out.setdefault(name, []).append(value)
        return dict(sorted(out.items()))

    by_patch, us_by_patch = per_patch("plugin_calls_per_step_by_patch"), per_patch("plugin_self_us_per_step_by_patch")
    long_by_patch = per_patch("plugin_long_per_step_by_patch")
    med = lambda xs: statistics.median(xs) if xs else None  # noqa: E731
    vanilla_ms = med([x for x in b if x])
    depth = int(config["depth"])
    self_med = med(self_us)
    calls_med = med(calls)
    devices = sorted({str(d) for v, _ in VARIANTS if (d := _device(records.get(f"{label}-{v}", {}))) is not None})
    return {
        **config,
        "device": " + ".join(devices) or None,
        "ok": {v: records.get(f"{label}-{v}", {}).get("ok") for v, _ in VARIANTS},
        "reps_done": {v: len(_reps(records.get(f"{label}-{v}", {}))) for v, _ in VARIANTS},
        "errors": {v: records.get(f"{label}-{v}", {}).get("error") for v, _ in VARIANTS if not records.get(f"{label}-{v}", {}).get("ok")},
        "plugin_step_ms": med([x for x in a if x]),
        "vanilla_step_ms": vanilla_ms,
        "plugin_over_vanilla_paired": {"median": med(paired), "min": min(paired) if paired else None, "max": max(paired) if paired else None, "n": len(paired)},
        "self_us_per_step": self_med,
        "self_us_per_layer": self_med / depth if self_med is not None else None,
        "self_share_of_step": self_med / 1e3 / vanilla_ms if self_med is not None and vanilla_ms else None,
        "hooked_calls_per_step": calls_med,
        "microbatched_builds_per_rep": med(measured("microbatched_builds")),
        "hooked_calls_per_layer": calls_med / depth if calls_med is not None else None,
        "self_ns_per_hooked_call": self_med * 1e3 / calls_med if self_med is not None and calls_med else None,
        "self_net_us_per_step": med(net_us),
        "self_net_ns_per_hooked_call": med(net_us) * 1e3 / calls_med if net_us and calls_med else None,
        "self_net_share_of_step": med(net_us) / 1e3 / vanilla_ms if net_us and vanilla_ms else None,
        "self_in_situ_net_us_per_step": med(in_situ_us),
        "self_in_situ_net_share_of_step": med(in_situ_us) / 1e3 / vanilla_ms if in_situ_us and vanilla_ms else None,
        "gc_in_plugin_per_step": med(gc_n),
        "gc_in_plugin_us_per_step": med(gc_us),
        "calls_per_step_by_patch": {name: med(v) for name, v in by_patch.items()},
        "self_us_per_step_by_patch": {name: med(v) for name, v in us_by_patch.items()},
        "long_per_step_by_patch": {name: {"count": med([x["count"] for x in v]), "us": med([x["us"] for x in v])} for name, v in long_by_patch.items()},
        "jit_in_step": {v: [r.get("jit_in_step") for r in _reps(records.get(f"{label}-{v}", {}))] for v, _ in VARIANTS[:1] + VARIANTS[2:]},
        "step_time_warnings": step_time_warnings({v: _reps(records.get(f"{label}-{v}", {})) for v, _ in VARIANTS}, len(paired)),
        "engine_failures": engine_failures({v: records.get(f"{label}-{v}") for v, _ in VARIANTS}),
    }


def engine_gib(config: dict) -> float:
    (d0, g0), (d1, g1) = ENGINE_GIB
    return max(g0, g0 + (int(config["depth"]) - d0) * (g1 - g0) / (d1 - d0))


def memory_problem(configs: list[dict], at_once: int, gpu_gib: float) -> str | None:
    """Why ``--at-once`` cannot run these rows on a GPU of ``gpu_gib`` (None when every group fits): engines that
    outgrow the GPU die of CUDA OOM part-way, after minutes of start-up."""

    def worst(k: int) -> float:
        return max(sum(len(VARIANTS) * engine_gib(c) for c in configs[i : i + k]) for i in range(0, len(configs), k))

    if not configs or worst(at_once) <= gpu_gib:
        return None
    # groups are consecutive slices, so a smaller --at-once can group worse: name every value that fits
    fits = [k for k in range(1, at_once) if worst(k) <= gpu_gib]
    allowed = f"--at-once {', '.join(map(str, fits))}" if fits else "none: one configuration's three engines already outgrow this GPU"
    per_engine = ", ".join(f"{d} layers {engine_gib({'depth': d}):.1f}" for d in sorted({int(c["depth"]) for c in configs}))
    return (
        f"argument --at-once: {at_once} is not allowed for these rows on this GPU: a group needs about {worst(at_once):.1f} GiB "
        f"(three engines per configuration; GiB per engine: {per_engine}) of its {gpu_gib:.1f} GiB; allowed values: {allowed}"
    )


def engine_failures(records: dict[str, dict | None]) -> list[str]:
    """A line per engine of the row that failed, with the causes the harness recognised in its log: a figure left
    empty or made of fewer reps must say why, not read as a quiet gap."""
    said = []
    for variant, rec in records.items():
        if rec is None:
            said.append(f"{variant}: no run")
        elif not rec.get("ok") and not rec.get("stopped_by_session_limit"):
            causes = ", ".join(rec.get("failure_signatures") or []) or (rec.get("error") or "no record")[:120]
            said.append(f"{variant}: the engine failed ({causes}) after {len(_reps(rec))} timed rep(s)")
    return said


MIN_PAIRS = 3
MAX_SPREAD = 1.5
MIN_DECODE_SHARE = 0.5


def step_time_warnings(reps: dict[str, list[dict]], pairs: int) -> list[str]:
    """Why a row's step times may not be a measurement (pure). A rep's decode step is the full pass less the faster of
    two 1-token passes, so a compile inside the full pass moves it, and passes of similar length leave mostly noise."""
    said = []
    if pairs < MIN_PAIRS:
        said.append(f"{pairs} plugin/vanilla pair(s) of reps (fewer than {MIN_PAIRS}): the step ratio is not a measurement")
    for variant, rows in reps.items():
        missing = sum(1 for r in rows if r.get("decode_step_ms") is None)
        if missing:
            said.append(f"{variant}: {missing} rep(s) without a decode step (the 1-token pass was not shorter than the full pass)")
        compiled = sum(r.get("jit_in_step") or 0 for r in rows)
        if compiled:
            said.append(f"{variant}: {compiled} planner compile(s) inside timed steps (jit_in_step)")
        steps = [r["decode_step_ms"] for r in rows if r.get("decode_step_ms")]
        if len(steps) >= 2 and max(steps) > MAX_SPREAD * min(steps):
            spread = f"{max(steps) / min(steps):.1f}x ({min(steps):.1f} to {max(steps):.1f} ms per step)"
            said.append(f"{variant}: reps differ {spread}: a compile inside a timed pass or a loaded host")
        shares = [(r["total_s"] - r["prefill_s"]) / r["total_s"] for r in rows if r.get("decode_step_ms") and r.get("total_s") and r.get("prefill_s") is not None]
        if shares and statistics.median(shares) < MIN_DECODE_SHARE:
            share = f"{statistics.median(shares):.0%} of the full pass (under {MIN_DECODE_SHARE:.0%})"
            said.append(f"{variant}: the decode steps are {share}: two passes of similar length; raise --steps (eager) or --graphs-steps (graphs)")
    return said


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench_host_cost", description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="glm53,v32", help="comma-separated: glm53, v32 (default both)")
    parser.add_argument("--depths", default="6,61,78", help="comma-separated layer counts (default 6,61,78)")
    parser.add_argument("--modes", default="eager,graphs", help="comma-separated: eager, graphs (default both)")
    parser.add_argument("--dbo", default="off,emu", help="comma-separated: off, dp1, emu (default off,emu)")
    parser.add_argument("--only", default=None, help="comma-separated configuration labels to keep, e.g. glm53-78L-eager-dbo-emu (default: all)")
    parser.add_argument("--reps", type=integer(1), default=5, help="timed reps per engine after one warm-up (default 5)")
    parser.add_argument("--steps", type=integer(2, MAX_STEPS), default=16, help="decode steps per timed pass, eager rows (default 16)")
    parser.add_argument("--graphs-steps", type=integer(2, MAX_STEPS), default=128, help="decode steps per timed pass, CUDA-graph rows (default 128)")
    parser.add_argument("--at-once", type=integer(1, 24), default=AT_ONCE, help=f"configurations whose three engines are alive together (default {AT_ONCE})")
    parser.add_argument("--from-runs", metavar="DIR", help="summarize the run directories a stopped benchmark left in DIR instead of running engines")
    parser.add_argument("--check", action="store_true", help="check the arguments and exit 0 without starting anything")
    add_out(parser)
    args = parser.parse_args(argv)
    configs = configurations(
        _choices(parser, "models", args.models, tuple(MODELS)),
        _depths(parser, args.depths),
        _choices(parser, "modes", args.modes, MODES),
        _choices(parser, "dbo", args.dbo if args.only is None else ",".join(DBO), DBO),  # --only names any row
    )
    if args.only is not None:
        keep = set(_choices(parser, "only", args.only, tuple(c["label"] for c in configs)))
        configs = [c for c in configs if c["label"] in keep]
    if args.check:
        print(f"bench_host_cost: arguments ok: {len(configs)} configuration(s)", file=sys.stderr)
        return 0

    specs_by_config = {c["label"]: specs_for(c, int(args.graphs_steps if c["mode"] == "graphs" else args.steps), args.reps) for c in configs}
    specs = [s for c in configs for s in specs_by_config[c["label"]]]
    out = Path(args.out)
    summarized = args.from_runs is not None
    if summarized:
        try:
            records, env_facts = from_runs(Path(args.from_runs), [s.label for s in specs])
        except RunsUnreadable as exc:
            print(f"bench_host_cost: error: --from-runs: {exc}", file=sys.stderr)
            return 2
    else:
        from tests.harness.machine import refuse_without_engine

        refused = refuse_without_engine("bench_host_cost", 1)
        if refused is not None:
            return EXIT_NO_DEVICE
        memory = gpu_gib()
        too_many = memory_problem(configs, args.at_once, memory) if memory is not None else None
        if too_many is not None:
            parser.error(too_many)
        from dbo_runtime.harness.turns import run_interleaved
        from tests.harness.report import environment
        from tests.harness.runs import kill_on_sigterm

        kill_on_sigterm()
        env_facts = environment()
        out.mkdir(parents=True, exist_ok=True)
        records = {}
        for first in range(0, len(configs), args.at_once):
            group = [s for c in configs[first : first + args.at_once] for s in specs_by_config[c["label"]]]
            records.update(run_interleaved(group, out / "bench_host_cost_runs", args.reps, timeout_s=1500, progress=progress))
    out.mkdir(parents=True, exist_ok=True)
    rows = [summarize(c, records) for c in configs if not summarized or any(f"{c['label']}-{v}" in records for v, _ in VARIANTS)]
    # a summary of stored runs records only the options it used: the engine options' defaults describe no run of it
    used = {k: v for k, v in vars(args).items() if not (summarized and k in ENGINE_ONLY)}
    doc = {"bench": "bench_host_cost", "args": used, "environment": env_facts, "configs": rows}
    (out / "bench_host_cost.json").write_text(json.dumps(doc, indent=1, default=str) + "\n")
    _plot(rows, out / "bench_host_cost.png")
    say_written("bench_host_cost", out / "bench_host_cost.json", out / "bench_host_cost.png")
    print(json.dumps([{k: r[k] for k in ("label", "device", "plugin_over_vanilla_paired", "self_us_per_step", "self_net_us_per_step", "self_in_situ_net_us_per_step", "hooked_calls_per_step", "self_ns_per_hooked_call", "self_net_ns_per_hooked_call", "jit_in_step", "step_time_warnings", "engine_failures")} for r in rows], indent=1, default=str))
    return 0


class RunsUnreadable(Exception):
    """A ``--from-runs`` directory that holds none of the runs asked for, or a run that cannot be read back."""


def from_runs(runs: Path, labels: list[str]) -> tuple[dict[str, dict], dict]:
    """The records of a benchmark a time limit stopped, assembled again from its run directories (with the reps
    each engine finished, ``harness.runner.partial_path``), and the environment its engines reported."""
    from tests.harness.runs import reassemble

    records: dict[str, dict] = {}
    for label in labels:
        run = runs / label
        if not run.is_dir():
            continue
        try:
            record = reassemble(run)
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise RunsUnreadable(f"{run}: its spec.json, record.json or rank files cannot be read ({type(exc).__name__}: {exc})") from None
        except Exception as exc:  # reassemble reads any JSON shape: a foreign one is refused, never a traceback
            raise RunsUnreadable(f"{run}: not a run of this benchmark ({type(exc).__name__}: {exc})") from None
        if record is None:
            raise RunsUnreadable(f"{run}: holds neither a spec.json nor a record.json")
        records[label] = _checked(run, record, "a run directory", label)
    if not records:
        raise RunsUnreadable(
            f"{runs} holds none of the {len(labels)} engine runs asked for ({len(labels) // len(VARIANTS)} configurations x "
            f"{len(VARIANTS)} engines, e.g. {labels[0] if labels else '-'}): give the "
            "bench_host_cost_runs directory of a stopped run and the --only / --models / --depths / --modes / --dbo it ran with"
        )
    return records, {"from_runs": str(runs), **_said_of(records, labels, runs)}


def _checked(where: Path, record: Any, what: str, label: str) -> dict:
    """``record`` when it is the engine run ``label`` of this benchmark; else why not (``RunsUnreadable``). The
    label inside must be the one its place names: a run filed under another engine's name would swap plugin and
    vanilla in the ratio without a word."""
    if not isinstance(record, dict) or not record.get("label"):
        raise RunsUnreadable(f"{where}: its record names no run (no 'label'): not {what} of this benchmark")
    if record["label"] != label:
        raise RunsUnreadable(f"{where}: holds the run {record['label']!r}, not {label!r}: a run filed under another engine's name")
    bench = record.get("bench")
    if bench is not None and not (
        isinstance(bench, list) and all(isinstance(r, dict) and isinstance(r.get("reps", []), list) for r in bench)
        and all(isinstance(x, dict) for r in bench for x in r.get("reps", []))
    ):  # fmt: skip
        raise RunsUnreadable(f"{where}: its 'bench' is not a list of ranks with lists of reps: not a run of this benchmark")
    return record


def _said_of(records: dict[str, dict], labels: list[str], where: Any) -> dict:
    """What a summary of stored runs records: refused when no run finished a timed rep; the runs a limit stopped
    (also on stderr); the versions and device the engines reported, every value where they disagree."""
    if not any(_reps(r) for r in records.values()):
        raise RunsUnreadable(f"{where}: none of its {len(records)} run(s) finished a timed rep: there is nothing to summarize")
    seen: dict[str, list[Any]] = {}
    for r in records.values():
        reported = r.get("versions")
        for key, value in reported.items() if isinstance(reported, dict) else ():
            if value not in (values := seen.setdefault(key, [])):
                values.append(value)
    versions = {key: sorted(values, key=str) if len(values) > 1 else values[0] for key, values in seen.items()}
    stopped = sorted(label for label, r in records.items() if r.get("stopped_by_session_limit"))
    for label in stopped:
        print(f"bench_host_cost: {label} was stopped by the limit: {len(_reps(records[label]))} timed rep(s) kept", file=sys.stderr)
    return {"stopped_by_session_limit": bool(stopped), "stopped_runs": stopped, **versions}


def _plot(rows: list[dict], path: Path) -> None:
    """Two panels, one bar per configuration; a value a row lacks is "n/a", never a zero bar ("costs nothing"). Bars
    are coloured by the records they came from: merged runs mix code versions."""
    plt = pyplot()
    if plt is None:
        return
    labels = [r["label"] for r in rows]
    sources = [(Path(r["source"]).name if r.get("source") else "this run") + (f" ({r['device']})" if r.get("device") else "") for r in rows]
    palette = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    colour_of = {s: palette[i % len(palette)] for i, s in enumerate(dict.fromkeys(sources))}
    colours = [colour_of[s] for s in sources]
    fig, axes = plt.subplots(1, 2, figsize=(13, 5))
    # a ratio of fewer than MIN_PAIRS pairs is not a measurement (step_time_warnings): no bar, the pairs named
    pairs = [r["plugin_over_vanilla_paired"] or {} for r in rows]
    measured = [p if (p.get("n") or 0) >= MIN_PAIRS else {} for p in pairs]
    ratios = [p.get("median") for p in measured]
    shares = [None if r["self_net_share_of_step"] is None else 100 * r["self_net_share_of_step"] for r in rows]
    panels = (
        (axes[0], ratios, "dbo_runtime / vanilla step (paired median)", [f"n/a: {p['n']} pair(s)" if p.get("n") else "n/a" for p in pairs]),
        (axes[1], shares, "plugin self time net of the timer,\n% of a vanilla step", ["n/a"] * len(rows)),
    )
    for ax, values, ylabel, missing in panels:
        ax.bar(range(len(rows)), [v or 0 for v in values], color=colours)
        for i, v in enumerate(values):
            if v is None:
                ax.text(i, 0, missing[i], ha="center", va="bottom", fontsize=7, rotation=90)
        ax.set_ylabel(ylabel)
        ax.set_xticks(range(len(rows)), labels, rotation=35, ha="right", fontsize=7)
    axes[0].axhline(1.0, color="k", lw=0.8)
    # the pairs' spread: fresh engines differ more than the plugin's cost, and a median alone hides that
    spread = [(i, p) for i, p in enumerate(measured) if None not in (p.get("median"), p.get("min"), p.get("max"))]
    if spread:
        low = [max(0.0, p["median"] - p["min"]) for _, p in spread]  # hand-merged records may disagree
        high = [max(0.0, p["max"] - p["median"]) for _, p in spread]
        axes[0].errorbar([i for i, _ in spread], [p["median"] for _, p in spread], yerr=[low, high], fmt="none", ecolor="k", elinewidth=0.8, capsize=3)
        axes[0].set_ylabel("dbo_runtime / vanilla step\n(paired median, min-max)")
    bottom = 0.0
    if len(colour_of) > 1:  # below the panels: inside one it covers bars
        handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colour_of.values()]
        columns = min(3, len(colour_of))
        fig.legend(handles, list(colour_of), loc="lower center", ncol=columns, fontsize=7, title="records", title_fontsize=7)
        bottom = 0.05 + 0.035 * -(-len(colour_of) // columns)
    devices = sorted({d for r in rows if r.get("device") for d in str(r["device"]).split(" + ")})
    unrecorded = sum(1 for r in rows if not r.get("device"))
    on = " / ".join(devices) or "not recorded"
    if devices and unrecorded:
        on += f" ({unrecorded} row(s) with no device recorded)"
    fig.suptitle(f"dbo_runtime host cost at depth, real vLLM engine, one GPU: {on}\n(three engines per configuration, timed in turns)", fontsize=10)
    fig.tight_layout(rect=(0, bottom, 1, 0.93))  # the two-line title above the panels
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    raise SystemExit(main())
