"""dbo_runtime vs vanilla vLLM in the real engine on one GPU: start-up and decode cost.

Fresh engines alternate plugin / vanilla (``DBO_RUNTIME_DISABLE=1``) so drift hits both alike, after untimed
warm-up engines that fill the JIT caches; decode step = (T-token pass - faster 1-token pass) / (T - 1). One more
self-timed plugin engine gives the plugin's own host time per step. Goals: decode overhead <= 1 %, start <= +3 s.

    python graphs/bench_real_engine.py [--reps 5] [--model shared-topk] [--graphs] [--out graphs/results]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from graphs._args import EXIT_NO_DEVICE, add_out, integer, positive_seconds, progress, say_written  # noqa: E402
from graphs._plotting import pyplot  # noqa: E402
from tests.harness.machine import refuse_without_engine  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench_real_engine", description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=integer(1), default=5, help="engine starts per variant (default 5)")
    parser.add_argument("--decode-reps", type=integer(1), default=2, help="timed decode reps per engine after one warm-up (default 2)")
    parser.add_argument("--steps", type=integer(2), default=64, help="decode steps per timed pass (default 64)")
    parser.add_argument("--model", default="shared-topk", choices=["shared-topk", "deepseek-v32"], help="tiny test model (default shared-topk)")
    parser.add_argument("--graphs", action="store_true", help="CUDA graphs (default: eager, the host-bound worst case)")
    parser.add_argument("--warmup-engines", type=integer(0), default=1, help="untimed engines started first to fill the JIT caches (default 1)")
    parser.add_argument("--budget-s", type=positive_seconds, default=1e9, help="stop starting new pairs after this many seconds (default: no limit)")
    add_out(parser)
    args = parser.parse_args(argv)
    refused = refuse_without_engine("bench_real_engine", 1)
    if refused is not None:
        return EXIT_NO_DEVICE

    from dbo_runtime.harness.launch import launch
    from dbo_runtime.harness.prompts import PromptSpec
    from tests.e2e import plan
    from tests.harness.engine_runner import E2ESpec

    work = Path(args.out) / "bench_real_engine_runs"
    prompts = PromptSpec(num=32, min_len=300, max_len=600, seed=11)
    bench = {"max_tokens": args.steps, "reps": args.decode_reps, "warmup": 1, "prefill_twice": True}

    def spec(label: str, env: dict[str, str]) -> E2ESpec:
        return E2ESpec(label=label, engine_args=plan.tiny_args(args.model, eager=not args.graphs), env=plan.bench_env(env), prompts=prompts, max_tokens=4,
                       bench=bench, timeout_s=900, meta={"model": args.model, "issue": 8, "what": "bench_real_engine"})  # fmt: skip

    from tests.harness.report import environment

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runs: list[dict] = []
    env_facts = environment()  # once: it initialises CUDA in this process, which must not happen between engines

    def write(done: bool) -> dict:
        """The JSON after every engine, so a time limit that stops the benchmark keeps what ran."""
        summary = _summary(runs)
        doc = {"bench": "bench_real_engine", "complete": done, "args": vars(args), "environment": env_facts, "summary": summary, "runs": runs}
        (out / "bench_real_engine.json").write_text(json.dumps(doc, indent=1, default=str) + "\n")
        return summary

    def run(variant: str, rep: int, env: dict[str, str]) -> None:
        label = f"{variant}-{rep}"
        rec = launch(spec(label, env), work, progress=progress)
        runs.append({"variant": variant, "rep": rep, **_slim(rec)})
        write(False)

    started = time.monotonic()  # the budget covers the warm-up engines too (session-bench.sh sizes it from its limit)
    for i in range(args.warmup_engines):
        run("warmup", i, {} if i % 2 == 0 else {"DBO_RUNTIME_DISABLE": "1"})
    for rep in range(args.reps):
        if time.monotonic() - started > args.budget_s:
            print(f"budget reached after {rep} pairs", file=sys.stderr)
            break
        for variant, env in (("plugin", {}), ("vanilla", {"DBO_RUNTIME_DISABLE": "1"})):
            run(variant, rep, env)
    run("plugin-selftime", 0, {"DBO_RUNTIME_SELF_TIME": "1"})

    summary = write(True)
    _plot(runs, summary, out / "bench_real_engine.png")
    say_written("bench_real_engine", out / "bench_real_engine.json", out / "bench_real_engine.png")
    print(json.dumps(summary, indent=1))
    return 0


def _slim(rec: dict) -> dict:
    bench = (rec.get("bench") or [{}])[0]
    timed = [r for r in bench.get("reps", []) if not r.get("warmup")]
    return {
        "ok": rec.get("ok"), "error": rec.get("error"), "start_s": (rec.get("start_s") or [None])[0],
        "decode_step_ms": [r["decode_step_ms"] for r in timed], "decode_tok_per_s": [r["decode_tok_per_s"] for r in timed],
        "plugin_self_us_per_step": [r.get("plugin_self_us_per_step") for r in timed], "vllm_version": rec.get("vllm_version"), "device": rec.get("device"),
    }  # fmt: skip


def _median(xs: list[float]) -> float | None:
    xs = [x for x in xs if isinstance(x, (int, float))]
    return statistics.median(xs) if xs else None


def _values(runs: list[dict], variant: str, key: str) -> list[float]:
    """Every measured value of ``key`` over the variant's good engines (an unmeasurable rep, None, left out)."""
    out: list[float] = []
    for r in runs:
        if r["variant"] == variant and r["ok"]:
            v = r[key]
            out.extend(v if isinstance(v, list) else [v])
    return [x for x in out if isinstance(x, (int, float))]


def _summary(runs: list[dict]) -> dict:
    def pick(variant: str, key: str) -> list[float]:
        return _values(runs, variant, key)

    s: dict = {}
    for key in ("start_s", "decode_step_ms", "decode_tok_per_s"):
        a, b = _median(pick("plugin", key)), _median(pick("vanilla", key))
        s[key] = {"plugin": a, "vanilla": b, "plugin_over_vanilla": (a / b) if a and b else None, "n": [len(pick("plugin", key)), len(pick("vanilla", key))]}
    self_us = _median(pick("plugin-selftime", "plugin_self_us_per_step"))
    step_ms = s["decode_step_ms"]["vanilla"]
    s["plugin_self_us_per_step"] = self_us
    s["plugin_self_share_of_step"] = (self_us / 1e3 / step_ms) if self_us is not None and step_ms else None
    start_delta = (s["start_s"]["plugin"] - s["start_s"]["vanilla"]) if s["start_s"]["plugin"] and s["start_s"]["vanilla"] else None
    step_over = (s["decode_step_ms"]["plugin_over_vanilla"] - 1.0) if s["decode_step_ms"]["plugin_over_vanilla"] else None
    s["goals"] = {
        "decode_step_overhead": step_over, "decode_step_overhead_le_1pct": step_over is not None and step_over <= 0.01,
        "start_delta_s": start_delta, "start_delta_le_3s": start_delta is not None and start_delta <= 3.0,
    }
    s["failed_runs"] = [f"{r['variant']}-{r['rep']}: {r['error']}" for r in runs if not r["ok"]]
    return s


def _plot(runs: list[dict], summary: dict, path: Path) -> None:
    plt = pyplot()
    if plt is None:
        print("matplotlib missing: no PNG", file=sys.stderr)
        return
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    for ax, key, title in (
        (axes[0], "start_s", "engine start (s)"),
        (axes[1], "decode_step_ms", "decode step (ms)"),
        (axes[2], "decode_tok_per_s", "decode tokens/s"),
    ):
        for i, variant in enumerate(("plugin", "vanilla")):
            ys = _values(runs, variant, key)
            ax.scatter([i] * len(ys), ys, alpha=0.6)
            if ys:
                ax.hlines(statistics.median(ys), i - 0.25, i + 0.25, color="k")
        ax.set_xticks([0, 1], ["dbo_runtime", "vanilla"])
        ax.set_title(title)
    goals = summary["goals"]
    self_us = summary.get("plugin_self_us_per_step")
    self_text = f"{self_us:.1f} us/step" if isinstance(self_us, (int, float)) and self_us == self_us else "not measured"
    fig.suptitle(
        f"real vLLM engine, 1 GPU, DBO off: step overhead {100 * (goals['decode_step_overhead'] or 0):+.2f}% "
        f"(goal <= 1%), start delta {goals['start_delta_s'] or 0:+.1f} s (goal <= 3 s), "
        f"plugin self time {self_text}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    raise SystemExit(main())
