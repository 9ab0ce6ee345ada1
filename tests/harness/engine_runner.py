"""The e2e runs' rank child: ``harness.runner``'s run plus what only the project's proofs ask for.

A staggered decode (request i asks for i more tokens, so the decode batch takes every size down to 1), the
kernels a cold DeepGEMM JIT cache gains while serving, and a second pass mixing every prompt again with fresh
ones. An ``E2ESpec`` names this module, so ``harness.launch`` runs it per rank.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dbo_runtime.harness import runner
from dbo_runtime.harness.launch import RunSpec, engine_arg
from dbo_runtime.harness.prompts import PromptSpec, for_rank, load


@dataclass
class E2ESpec(RunSpec):
    repeat_mixed: PromptSpec | None = None
    """A second pass mixing every prompt again (one-token extends) with these fresh ones."""
    stagger_max_tokens: bool = False
    """Request i asks for ``max_tokens + i`` tokens, so the decode batch takes every size down to 1."""
    module: str = __name__

    def __post_init__(self) -> None:
        if isinstance(self.repeat_mixed, dict):  # as read back from a run's spec.json
            self.repeat_mixed = PromptSpec(**self.repeat_mixed)

    def record(self, ranks: list[dict[str, Any]], logs: list[str], wall_s: float) -> dict[str, Any]:
        """``RunSpec.record`` with what the proofs, benches and session records read."""
        record = super().record(ranks, logs, wall_s)
        text = "\n".join(logs)
        stats_end = [s for r in ranks for s in (r.get("stats_end") or [])]
        versions = next((r["versions"] for r in ranks if r.get("versions")), None)
        record.update(
            describe(self),
            vllm_version=versions.get("vllm") if versions else None,
            device=versions.get("device") if versions else None,
            versions=versions,
            import_s=[r.get("import_s") for r in ranks],
            num_requests=len(record["requests"]),
            max_tokens=self.max_tokens,
            counters=[s.get("summary") for s in stats_end] or None,
            runner_seen=sorted({s["worker"].get("runner") for s in stats_end if s.get("worker")}) or None,
            plugin_log_lines=[line.strip() for line in text.splitlines() if PLUGIN_LINE.search(line)][:60],
            tokens_identical_to=None,
            meta=self.meta,
            engine_args=self.engine_args,
            repeat_mixed=[r.get("repeat_mixed") for r in ranks if r.get("repeat_mixed")] or None,
            jit_cache=[r.get("jit_cache") for r in ranks if r.get("jit_cache")] or None,
            log_tail=text[-4000:] if not record["ok"] else None,
        )
        return record


PLUGIN_LINE = re.compile(r"dbo_runtime[:/]")


def describe(spec: RunSpec) -> dict[str, Any]:
    """The record's configuration keys, read from what the run was given."""
    args = spec.engine_args
    dbo = "--enable-dbo" in args
    v2 = {**os.environ, **spec.env}.get("VLLM_USE_V2_MODEL_RUNNER")
    model = engine_arg(args, "--model") or ""
    compilation = engine_arg(args, "--compilation-config", "-cc") or ""
    return {
        "model": spec.meta.get("model") or Path(model).name or model,
        "dp": spec.dp,
        "dbo": dbo,
        "runner": "v2" if v2 == "1" else ("v1" if v2 == "0" or dbo else "v2"),
        "graphs": "--enforce-eager" not in args,
        "cudagraph_mode": (json.loads(compilation).get("cudagraph_mode") if compilation.startswith("{") else None),
        "all2all_backend": engine_arg(args, "--all2all-backend"),
        "env": dict(spec.env),
    }


ROW_HOOK_ENV = "DBO_HARNESS_ROW_HOOK"
"""``module:function`` a measurement harness names, called as ``hook(row, s0, s1, s2, steps)`` after each bench rep
with the counter snapshots before, between and after its two passes: where it adds its own columns."""


def bench_row(requests: int) -> Callable[..., None]:
    """The bench rows' step time, throughput and plugin counters, then ``$DBO_HARNESS_ROW_HOOK``'s columns."""
    module, _, name = os.environ.get(ROW_HOOK_ENV, "").partition(":")
    more = getattr(importlib.import_module(module), name) if module else None

    def hook(row: dict[str, Any], s0: Any, s1: Any, s2: Any, steps: int) -> None:
        decode = row["total_s"] - row["prefill_s"]
        valid = decode > 0  # a loaded host can make the 1-token pass slower than the full one: no measurement
        row.update(
            decode_step_ms=decode / (steps - 1) * 1e3 if valid else None,
            decode_tok_per_s=requests * (steps - 1) / decode if valid else None,
            microbatched_builds=runner.summary_delta(s1, s2, "microbatched_builds"),
            prefill_microbatched_builds=runner.summary_delta(s0, s1, "microbatched_builds"),
            jit_in_step=runner.summary_delta(s0, s2, "jit_in_step"),
            armed_patches=max((w["summary"].get("armed_patches", 0) for w in s2 or []), default=0),
        )
        if more is not None:
            more(row, s0, s1, s2, steps)

    return hook


def jit_cache_kernels(root: str | None = None) -> set[str]:
    """The kernels DeepGEMM compiled into ``DG_JIT_CACHE_DIR``: listed before and after serving, a cold
    cache shows every compile inside a step."""
    base = root if root is not None else os.environ.get("DG_JIT_CACHE_DIR")
    if not base or not os.path.isdir(base):
        return set()
    return {os.path.relpath(d, base) for d, _, files in os.walk(base) if "kernel.cubin" in files}


def staggered(params: Any, n: int) -> list[Any]:
    """One copy of ``params`` per request, request i asking for ``i`` more tokens than request 0."""
    out = [params.clone() for _ in range(n)]
    for i, p in enumerate(out):
        p.max_tokens = params.max_tokens + i
    return out


def _repeat_mixed(
    llm: Any, params: Any, batch: list[Any], fresh_spec: PromptSpec, vocab: int, rank: int, size: int
) -> dict[str, Any]:
    """The first pass's prompts again (one-token extends) interleaved with fresh ones, in one generate."""
    fresh_all = load(fresh_spec, vocab)
    fresh = [fresh_all[i] for i in for_rank(fresh_all, rank, size)]
    mixed: list[Any] = []
    is_repeat: list[bool] = []
    for i in range(max(len(batch), len(fresh))):
        for group, repeat in ((batch, True), (fresh, False)):
            if i < len(group):
                mixed.append(group[i])
                is_repeat.append(repeat)
    s0 = runner._stats(llm)
    runner.barrier("repeat-mixed", rank, size)
    t = time.perf_counter()
    outputs = llm.generate(mixed, params, use_tqdm=False)
    elapsed = time.perf_counter() - t
    s1 = runner._stats(llm)
    cached = [getattr(o, "num_cached_tokens", None) for o in outputs]
    lengths = [len(p["prompt_token_ids"]) if isinstance(p, dict) and "prompt_token_ids" in p else None for p in mixed]
    return {
        "requests": len(mixed),
        "repeats": len(batch),
        "fresh": len(fresh),
        "completed": sum(1 for o in outputs if o.outputs and o.outputs[0].token_ids),
        "generate_s": elapsed,
        "microbatched_builds": runner.summary_delta(s0, s1, "microbatched_builds"),
        # the premise: every repeat hits the prefix cache for all but its last token, no fresh prompt does
        "repeat_cached_short_by": [
            n - c for n, c, r in zip(lengths, cached, is_repeat) if r and n is not None and c is not None
        ],
        "fresh_cached": [c for c, r in zip(cached, is_repeat) if not r],
    }


def run(spec: dict[str, Any], rank: int, size: int, result: dict[str, Any]) -> dict[str, Any]:
    """``runner.run`` with the staggered pass, the JIT-cache listing and the repeat pass where the spec asks."""
    llm, params, batch, mine, vocab = runner.start(spec, rank, size, result)
    first = params
    cache_at_ready = jit_cache_kernels() if spec.get("cold_jit_cache") else None  # start-up over, nothing served
    if spec.get("stagger_max_tokens"):
        # prefill first, so the staggered pass's decode batch starts whole and shrinks one per step
        one = type(params)(temperature=0.0, max_tokens=1, ignore_eos=True, detokenize=False)
        llm.generate(batch, one, use_tqdm=False)
        first = staggered(params, len(batch))
    runner.generate(llm, first, batch, mine, rank, size, result)
    if cache_at_ready is not None:
        result["jit_cache"] = {
            "at_ready": sorted(cache_at_ready),
            "new_in_serving": sorted(jit_cache_kernels() - cache_at_ready),
        }
    if spec.get("repeat_mixed"):
        result["repeat_mixed"] = _repeat_mixed(
            llm, params, batch, PromptSpec(**spec["repeat_mixed"]), vocab, rank, size
        )
    if spec.get("bench"):
        bench = spec["bench"]
        result["bench"] = runner.bench_reps(llm, type(params), batch, bench, rank, size, bench_row(len(batch)))
    result["ok"] = True
    return result


if __name__ == "__main__":
    runner.cli(run)
