"""What one hooked access costs, measured against the same access in vanilla vLLM, side by side in one run.

Every hook on vLLM's per-layer path is paid on every layer of every eager DBO step, on both microbatch threads.
This times each on the real vLLM classes (instances made without their CUDA ``__init__``): blocks of N accesses
alternate between the plugin installed and uninstalled, R times, on the threads of ``THREADS``; the median ns per
access of each side and their difference are reported (a CPU measurement: read the differences).
``--cold K`` precedes every access with K random reads over a 40 MB pool (the caches vLLM's own work evicts).

    python graphs/bench_hook_calls.py [--n 200000] [--reps 7] [--cold K] [--out graphs/results]
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from graphs._args import EXIT_NO_DEVICE, add_out, integer, say_written  # noqa: E402
from graphs._plotting import bar_panels  # noqa: E402

MODULES = (
    "vllm.model_executor.layers.sparse_attn_indexer", "vllm.model_executor.layers.attention.sparse_mla_attention",
    "vllm.models.deepseek_v32.attention", "vllm.v1.attention.backends.mla.index_group",
    "vllm.models.deepseek_v41.nvidia.model",
)


def _instance(cls: type, **attrs: Any) -> Any:
    import torch.nn as nn

    obj = object.__new__(cls)
    nn.Module.__init__(obj) if issubclass(cls, nn.Module) else None
    for name, value in attrs.items():
        setattr(obj, name, value)  # as vLLM's __init__ assigns it: through a descriptor where one is installed
    return obj


def cases() -> dict[str, Callable[[], Callable[[], Any]]]:
    """Each case builds, under the current install state, a zero-argument access to time."""
    import torch
    from vllm.model_executor.layers.attention.sparse_mla_attention import SharedTopkIndicesBuffer
    from vllm.model_executor.layers.sparse_attn_indexer import SparseAttnIndexer
    from vllm.models.deepseek_v32.attention import DeepseekV32Attention, DeepseekV32Indexer
    from vllm.models.deepseek_v41.nvidia.model import DeepseekV4Model
    from vllm.v1.attention.backends.mla.index_group import SparseMLAIndexGroup

    from dbo_runtime.integration import ubatch_ids

    buffer = torch.zeros((64, 8), dtype=torch.int32)

    def read(cls: type, attr: str = "topk_indices_buffer", **attrs: Any) -> Callable[[], Callable[[], Any]]:
        def build() -> Callable[[], Any]:
            obj = _instance(cls, **(attrs or {"topk_indices_buffer": buffer}))
            return lambda: getattr(obj, attr)

        return build

    def shared_buffer(leader: bool) -> Callable[[], Callable[[], Any]]:
        def build() -> Callable[[], Any]:
            impl = object.__new__(SharedTopkIndicesBuffer)
            indexer = _instance(DeepseekV32Indexer, topk_indices_buffer=buffer) if leader else None
            impl.init_topk_indices_buffer(indexer, None if leader else buffer)
            return lambda: impl.topk_indices_buffer

        return build


    def ready_early_exit() -> Callable[[], Any]:
        group = _instance(SparseMLAIndexGroup, has_indexer=True)
        return lambda: group.set_logical_topk_ready(3)

    def convert_once() -> Callable[[], Any]:
        group = _instance(SparseMLAIndexGroup, has_indexer=True)
        t = buffer
        return lambda: group._convert_once(1, t, t, t, 64, block_stride_rows=None, return_valid_counts=False)

    def logits_call_site() -> Callable[[], Any]:
        import vllm.model_executor.layers.sparse_attn_indexer as call_site

        from dbo_runtime.services.schedule_cache import schedule_cache

        schedule = torch.zeros((133, 2), dtype=torch.int32)
        schedule_cache().track(schedule, planned_sms=_StubPlanner.SMS, block_kv=64, next_n=1)
        t = buffer
        return lambda: call_site.fp8_fp4_paged_mqa_logits((t, None), t, t, t, t, schedule, max_model_len=4096, indices=None)

    def builder_build(dbo: bool = True) -> Callable[[], Any]:
        from vllm.config import DeviceConfig, VllmConfig
        from vllm.v1.attention.backends.mla.indexer import DeepseekV32IndexerMetadataBuilder
        from vllm.v1.attention.backends.utils import CommonAttentionMetadata
        from vllm.v1.kv_cache_interface import FullAttentionSpec

        config = VllmConfig(device_config=DeviceConfig(device="cpu"))
        object.__setattr__(config, "model_config", SimpleNamespace(max_model_len=40960, hf_text_config=None))  # no HF config here
        object.__setattr__(config.parallel_config, "enable_dbo", dbo)
        config.attention_config.sparse_mla_prefill_workspace_factor = 5
        spec = FullAttentionSpec(block_size=64, num_kv_heads=1, head_size=132, dtype=torch.uint8)
        builder = DeepseekV32IndexerMetadataBuilder(spec, ["indexer.0"], config, torch.device("cpu"), block_table_width=64)
        builder.device = torch.device("cuda", 0)  # the hooks read the device index; the buffers stay on the CPU
        rows = 32  # a 32-request decode step, as in the engine benchmark
        starts = torch.arange(rows + 1, dtype=torch.int32)
        common = CommonAttentionMetadata(
            query_start_loc=starts, query_start_loc_cpu=starts.clone(), seq_lens=torch.full((rows,), 300, dtype=torch.int32),
            num_reqs=rows, num_actual_tokens=rows, max_query_len=1, max_seq_len=300,
            block_table_tensor=torch.zeros((rows, 64), dtype=torch.int32), slot_mapping=torch.arange(rows, dtype=torch.int64),
        )  # fmt: skip
        if dbo:
            return lambda: builder.build(0, common)
        from dbo_runtime.services.schedule_cache import schedule_cache

        cache = schedule_cache()

        def aside() -> Any:
            # what register_builder decides for an engine without DBO (the builder's device is the CPU here, so it
            # registers nothing); both sides pay the two stores, the plugin side alone reads the flag
            cache.steps_aside = True
            try:
                return builder.build(0, common)
            finally:
                cache.steps_aside = False

        return aside

    return {
        "SharedTopkIndicesBuffer.topk_indices_buffer (follower)": shared_buffer(False),
        "SharedTopkIndicesBuffer.topk_indices_buffer (leader)": shared_buffer(True),
        "DeepseekV32Attention.topk_indices_buffer": read(DeepseekV32Attention),
        "DeepseekV32Indexer.topk_indices_buffer": read(DeepseekV32Indexer),
        "SparseAttnIndexer.topk_indices_buffer": read(SparseAttnIndexer),
        "DeepseekV4Model.topk_indices_buffer": read(DeepseekV4Model, topk_indices_buffer=buffer, _mtp_hidden_buffer=buffer),
        "DeepseekV4Model._mtp_hidden_buffer": read(DeepseekV4Model, "_mtp_hidden_buffer", topk_indices_buffer=buffer, _mtp_hidden_buffer=buffer),
        "SparseMLAIndexGroup.set_logical_topk_ready (layer 3)": ready_early_exit,
        "ubatch_ids.current_ubatch": lambda: ubatch_ids.current_ubatch,
        "SparseMLAIndexGroup._convert_once (stub kernel)": convert_once,
        "fp8_fp4_paged_mqa_logits call site (stub kernel)": logits_call_site,
        BUILD: builder_build,
        BUILD_ASIDE: lambda: builder_build(dbo=False),
    }


BUILD = "DeepseekV32IndexerMetadataBuilder.build (stub planner)"
"""vLLM's decode-metadata build of a 32-request step (planner kernel stubbed): its hooks run once per step."""
BUILD_ASIDE = "DeepseekV32IndexerMetadataBuilder.build, no DBO (hooks step aside)"
MAIN_ONLY = {BUILD, BUILD_ASIDE}
"""Cases that never run on a microbatch thread (vLLM builds a step's metadata on the main thread)."""
THREADS = (
    ("main", None, False, "main thread of an engine that has never split a step (DBO off, or DP 1): per-access hooks not in force"),
    ("main, armed", None, True, "main thread of an engine that has split a step, in a step vLLM does not split: hooks armed"),
    ("ubatch 1", 1, True, "a DBO microbatch thread (vLLM's thread table says microbatch 1): hooks armed"),
)
"""(label, microbatch id or None for the main thread, whether the first-microbatch patches are armed, meaning)."""
SLOW = {BUILD: 200, BUILD_ASIDE: 200}
"""Cases a back-to-back block runs ``n // SLOW`` of (at least 100): a build costs some 100 buffer reads."""


class _StubPlanner:
    """The call-site case's planner: DeepGEMM's SM count and capture probe as plain callables; nothing planned."""

    SMS = 132

    def hot_probes(self) -> tuple[Callable[[], int], Callable[[], bool]]:
        return (lambda: self.SMS), (lambda: False)

    def slots(self, num_sms: int, next_n: int) -> int:
        from dbo_runtime.sim.reference_planner import schedule_slots

        return schedule_slots(num_sms, next_n)


_ABSENT = object()


def _stub_kernels() -> Callable[[], None]:
    """No-op kernels under vLLM's two kernel-calling hooks, on both sides: the hook is timed, not the kernel (which
    needs a GPU). Returns the undo."""
    import vllm.model_executor.layers.sparse_attn_indexer as call_site
    from vllm.v1.attention.backends.mla.index_group import SparseMLAIndexGroup

    from dbo_runtime.services import schedule_cache

    def _convert_once(self: Any, layer_index: int, logical_topk_indices: Any, req_id_per_token: Any, block_table: Any,
                      block_size: int, *, block_stride_rows: int | None, return_valid_counts: bool,
                      idx_mapping: Any = None) -> Any:  # fmt: skip
        return logical_topk_indices

    def fp8_fp4_paged_mqa_logits(q: Any, kv_cache: Any, weights: Any, context_lens: Any, block_tables: Any,
                                 schedule_metadata: Any, max_model_len: int, indices: Any = None) -> Any:  # fmt: skip
        return weights

    import torch
    import vllm.v1.attention.backends.mla.indexer as ix
    from vllm.platforms import current_platform

    plans: dict[int, Any] = {}

    def get_paged_mqa_logits_metadata(context_lens: Any, block_size: int, num_sms: int, indices: Any = None) -> Any:
        return plans.setdefault(num_sms, torch.zeros((num_sms + 1, 2), dtype=torch.int32))

    # The builder plans only on CUDA with DeepGEMM (no GPU here): vLLM's own checks answered as on an H200.
    platform = {
        (current_platform, "is_cuda"): lambda: True,
        (current_platform, "is_device_capability_family"): lambda family, device_id=0: family == 90,
        (ix, "num_compute_units"): lambda device_id=0: _StubPlanner.SMS,
        (ix, "has_deep_gemm"): lambda: True,
        (ix, "get_paged_mqa_logits_metadata"): get_paged_mqa_logits_metadata,
    }
    # What each name was in its owner's own namespace (a platform method lives on the class: undo deletes the
    # instance attribute again rather than leaving a bound method there).
    saved_platform = {key: vars(key[0]).get(key[1], _ABSENT) for key in platform}
    saved = (SparseMLAIndexGroup.__dict__["_convert_once"], call_site.fp8_fp4_paged_mqa_logits)
    cache = schedule_cache.IndexerScheduleCache(_StubPlanner())  # type: ignore[arg-type]

    def undo() -> None:
        SparseMLAIndexGroup._convert_once, call_site.fp8_fp4_paged_mqa_logits = saved  # type: ignore[method-assign]
        for (owner, name), value in saved_platform.items():
            if value is _ABSENT:
                if name in vars(owner):
                    delattr(owner, name)
            else:
                setattr(owner, name, value)
        schedule_cache._CACHE = previous

    previous, schedule_cache._CACHE = schedule_cache._CACHE, cache
    SparseMLAIndexGroup._convert_once = _convert_once  # type: ignore[method-assign]
    call_site.fp8_fp4_paged_mqa_logits = fp8_fp4_paged_mqa_logits
    for (owner, name), value in platform.items():
        setattr(owner, name, value)

    return undo


PER_STEP_78L = {
    "SharedTopkIndicesBuffer.topk_indices_buffer (follower)": 156 - 21,
    "SharedTopkIndicesBuffer.topk_indices_buffer (leader)": 21,
    "DeepseekV32Attention.topk_indices_buffer": 99,
    "DeepseekV32Indexer.topk_indices_buffer": 42,
    "SparseMLAIndexGroup.set_logical_topk_ready (layer 3)": 57,
    "SparseMLAIndexGroup._convert_once (stub kernel)": 76 + 21,
    "fp8_fp4_paged_mqa_logits call site (stub kernel)": 22,
}
"""Hooked calls per eager decode step of the 78-layer GLM-5.3 pattern, as the self-timer counted them in the real
engine (``calls_per_step_by_patch``); a leader's ``set_logical_topk_ready`` is priced as a ``_convert_once`` call.
The builder's per-step hooks are priced apart, by one whole build (``BUILD``, ``per_step``'s ``with_build_us``)."""

VANILLA_ONLY = {"ubatch_ids.current_ubatch"}
"""dbo_runtime's own lookup: no vanilla counterpart (its cost is inside every resolving access above)."""


def _time(access: Callable[[], Any], n: int) -> float:
    started = time.perf_counter_ns()
    for _ in range(n):
        access()
    return (time.perf_counter_ns() - started) / n


class Evictor:
    """K random reads over about 40 MB of small objects: what vLLM's work between two accesses does to the caches."""

    def __init__(self, reads: int, size: int = 300_000, seed: int = 0) -> None:
        import random

        self.reads = reads
        self.pool = [{"a": i, "b": str(i)} for i in range(size)]
        rng = random.Random(seed)
        self.order = [rng.randrange(size) for _ in range(max(reads, 1) * 16)]
        self.at = 0

    def __call__(self) -> int:
        pool, order, total = self.pool, self.order, 0
        at = self.at
        for _ in range(self.reads):
            total += pool[order[at]]["a"]
            at = at + 1 if at + 1 < len(order) else 0
        self.at = at
        return total


def _time_cold(access: Callable[[], Any], n: int, evict: Evictor) -> float:
    """The median of ``n`` accesses timed one by one after an eviction each, the collector paused (a pass over the
    pool inside one access would swamp the difference)."""
    clock = time.perf_counter_ns
    times = []
    enabled = gc.isenabled()
    gc.disable()
    try:
        for _ in range(n):
            evict()
            started = clock()
            access()
            times.append(clock() - started)
    finally:
        if enabled:
            gc.enable()
    return float(statistics.median(times))


def _on_thread(fn: Callable[[], float], ubatch: int | None) -> float:
    """Run ``fn`` on a fresh thread, registered as microbatch ``ubatch`` in vLLM's thread table."""
    from vllm.v1.worker import ubatching

    out: list[float] = []

    def body() -> None:
        if ubatch is not None:
            ubatching._THREAD_ID_TO_CONTEXT[threading.get_ident()] = ubatch
            ubatching._CURRENT_CONTEXTS[ubatch] = SimpleNamespace(token_offset=32, id=ubatch)
        try:
            out.append(fn())
        finally:
            if ubatch is not None:
                ubatching._CURRENT_CONTEXTS[ubatch] = None
                del ubatching._THREAD_ID_TO_CONTEXT[threading.get_ident()]

    thread = threading.Thread(target=body)
    thread.start()
    thread.join()
    return out[0]


def measure(n: int, reps: int, cold: int = 0) -> dict[str, Any]:
    import importlib

    from vllm.config import DeviceConfig, ParallelConfig, VllmConfig, set_current_vllm_config
    from vllm.v1.worker import ubatching

    from dbo_runtime.integration import plugin, ubatch_ids

    for module in MODULES:
        importlib.import_module(module)
    ubatch_ids._ubatching()  # bound as in a worker, where the first resolved read binds vLLM's thread table
    if len(ubatching._CURRENT_CONTEXTS) < 2:
        ubatching._CURRENT_CONTEXTS.extend([None] * (2 - len(ubatching._CURRENT_CONTEXTS)))
    parallel = ParallelConfig(enable_dbo=True, enable_expert_parallel=True, all2all_backend="deepep_low_latency", data_parallel_size=2)
    config = VllmConfig(device_config=DeviceConfig(device="cpu"), parallel_config=parallel)
    evict = Evictor(cold) if cold else None
    gc.freeze()  # as vLLM freezes its start-up heap: the plugin's uninstall collects, which would scan all of vLLM
    plugin.uninstall()
    undo = _stub_kernels()
    try:
        with set_current_vllm_config(config):  # V4.1's buffers register per-microbatch views under DBO
            rows = _measure_cases(n, reps, evict)
        armable = _armable_patches()
    finally:
        undo()
    return {
        "n": n, "reps": reps, "cold_reads": cold, "rows": rows, "per_step_78l": per_step(rows),
        "armable_patches": armable, "threads": {label: meaning for label, _, _, meaning in THREADS},
    }  # fmt: skip


def _armable_patches() -> list[str]:
    """The patches armed at the first microbatched run, of the modules this benchmark imports."""
    from dbo_runtime.integration import plugin
    from dbo_runtime.integration.microbatch_arming import ARMING

    plugin.register()
    try:
        return ARMING.names()
    finally:
        plugin.uninstall()


def _measure_cases(n: int, reps: int, evict: Evictor | None) -> list[dict[str, Any]]:
    from dbo_runtime.integration import plugin
    from dbo_runtime.integration.microbatch_arming import ARMING

    rows: list[dict[str, Any]] = []
    for name, build in cases().items():
        block = n if evict is not None else max(100, n // SLOW.get(name, 1))
        for thread, ubatch, armed, _ in THREADS:
            if name in MAIN_ONLY and thread != "main":  # builds are not armable: "main, armed" would repeat "main"
                continue
            samples: dict[str, list[float]] = {"plugin": [], "vanilla": []}
            for _ in range(reps):
                for side in ("plugin", "vanilla"):
                    if side == "vanilla" and name in VANILLA_ONLY:
                        continue
                    if side == "plugin":
                        plugin.register()
                        if plugin.installed_patch_set() is None:  # register() logs and leaves vLLM vanilla
                            raise RuntimeError("bench_hook_calls: the plugin did not install: the 'plugin' side would time vanilla")
                    if side == "plugin" and armed:
                        ARMING.arm("bench_hook_calls")  # as the engine's first microbatched run does
                    access = build()
                    access()  # first access outside the timed block (caches, views)
                    timer = (lambda a=access, k=block: _time_cold(a, k, evict)) if evict is not None else (lambda a=access, k=block: _time(a, k))
                    samples[side].append(_on_thread(timer, ubatch))
                    plugin.uninstall()  # the last target withdrawn: the next install starts unarmed
            plugin_ns = statistics.median(samples["plugin"])
            vanilla_ns = statistics.median(samples["vanilla"]) if samples["vanilla"] else None
            rows.append({
                "access": name, "thread": thread, "plugin_ns": plugin_ns, "vanilla_ns": vanilla_ns,
                "added_ns": plugin_ns - vanilla_ns if vanilla_ns is not None else plugin_ns,
                "plugin_samples_ns": samples["plugin"], "vanilla_samples_ns": samples["vanilla"],
            })  # fmt: skip
    return rows


def per_step(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Added µs per 78-layer eager step from ``PER_STEP_78L``, per thread; ``with_build_us`` adds the step's build."""
    build = next((r["added_ns"] for r in rows if r["access"] == BUILD and r["thread"] == "main"), None)
    out: dict[str, Any] = {}
    for thread, *_ in THREADS:
        added = {r["access"]: r["added_ns"] for r in rows if r["thread"] == thread}
        counted = {name: n for name, n in PER_STEP_78L.items() if name in added}
        added_us = sum(n * added[name] for name, n in counted.items()) / 1e3
        build_us = build / 1e3 if build is not None else None
        out[thread] = {"accesses": sum(counted.values()), "added_us": added_us, "build_added_us": build_us,
                       "with_build_us": added_us + build_us if build_us is not None else None}  # fmt: skip
    return out


def _environment_refusal() -> str | None:
    """The plugin settings that would make the "plugin" side time something else: one line, or None."""
    from dbo_runtime.core.errors import ConfigError
    from dbo_runtime.core.settings import LAYOUT_ENV, parse_layout
    from dbo_runtime.core.switches import parse_switch, switch_problems

    problems = switch_problems()
    if problems:  # the plugin would warn and go on; a benchmark must not time a setting the user did not mean
        return f"error: the plugin would warn and go on, this benchmark stops (fix or unset it): {problems[0]}"
    for name, why in (
        ("DBO_RUNTIME_DISABLE", "leaves vLLM as shipped, so the plugin side would time vanilla"),
        ("DBO_RUNTIME_SELF_TIME", "wraps every hook in the self-timer, whose clock would be timed with it"),
    ):
        if parse_switch(name):
            return f"{name}={os.environ.get(name)} {why}; unset it to run this benchmark"
    try:
        parse_layout(os.environ.get(LAYOUT_ENV))
    except ConfigError as exc:
        return str(exc)
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench_hook_calls", description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=integer(100, 10_000_000), help="accesses per timed block (default 200000; 200 with --cold)")
    parser.add_argument("--reps", type=integer(1, 99), default=7, help="blocks per side, alternating (default 7)")
    parser.add_argument("--cold", type=integer(0, 1_000_000), default=0, metavar="K", help="random reads over a 40 MB pool before each access (default 0)")
    add_out(parser)
    args = parser.parse_args(argv)
    if args.n is None:
        args.n = 200 if args.cold else 200_000
    refusal = _environment_refusal()
    if refusal is not None:  # before anything runs: a setting that would change what is timed
        print(f"bench_hook_calls: {refusal}", file=sys.stderr)
        return 2
    try:
        import vllm  # noqa: F401
    except ImportError as exc:
        print(f"bench_hook_calls needs vLLM 0.33.0 or 0.34.0 importable here ({exc})", file=sys.stderr)
        return EXIT_NO_DEVICE
    out = Path(args.out)
    from tests.harness.report import environment, write_json

    doc = {**measure(args.n, args.reps, args.cold), "environment": {**environment(), "cpus": os.cpu_count()}}
    stem = "bench_hook_calls" + ("_cold" if args.cold else "")
    write_json(out / f"{stem}.json", doc)
    width = max(len(r["access"]) for r in doc["rows"])
    print(f"{'access':<{width}}  {'thread':<11}  plugin ns  vanilla ns  added ns")
    for r in doc["rows"]:
        vanilla = f"{r['vanilla_ns']:10.0f}" if r["vanilla_ns"] is not None else f"{'-':>10}"
        print(f"{r['access']:<{width}}  {r['thread']:<11} {r['plugin_ns']:10.0f}  {vanilla}  {r['added_ns']:8.0f}")
    for thread, row in doc["per_step_78l"].items():
        build = f", {row['with_build_us']:.1f} us with the step's metadata build" if row["with_build_us"] is not None else ""
        print(f"78-layer eager step, {thread}: {row['accesses']} of these accesses add {row['added_us']:.1f} us{build}")
    print(f"results: {out / (stem + '.json')}")
    labels = [f"{r['access']}\n({r['thread']})" for r in doc["rows"]]
    panel = (labels, [r["added_ns"] for r in doc["rows"]], "ns added per access by dbo_runtime (median of alternating blocks)")
    bar_panels(out / f"{stem}.png", f"dbo_runtime's hooked accesses against vanilla vLLM{' (cold)' if args.cold else ''}", [panel], horizontal=True)
    say_written("bench_hook_calls", out / f"{stem}.json", out / f"{stem}.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
