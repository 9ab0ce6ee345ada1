"""Per-worker counters through vLLM's own RPC, ``llm.collective_rpc("dbo_runtime_stats")``, which calls a method
named by a string on each worker without insecure serialization: the plugin adds it to vLLM's ``Worker``. Under
``vllm serve`` the same counters go to ``/metrics``. Retired by a plugin RPC registry in vLLM."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from dbo_runtime.integration import activation, guard
from dbo_runtime.integration.features import REGISTRY, Feature
from dbo_runtime.integration.microbatch_arming import ARMING
from dbo_runtime.integration.patching import Patch

FEATURES = [Feature("stats", "per-worker counters")]

METHOD = "dbo_runtime_stats"
WORKER_MODULE = "vllm.v1.worker.gpu_worker"
EXTENSIONS: list[Callable[[dict[str, Any]], None]] = []
"""Called with each snapshot before it is returned: where a measurement harness adds its own section."""


def _runner_kind(worker: Any) -> str | None:
    runner = getattr(worker, "model_runner", None)
    if runner is None:
        return None
    module = type(runner).__module__
    if module.startswith("vllm.v1.worker.gpu."):
        return "v2"
    if module.startswith("vllm.v1.worker.gpu_model_runner"):
        return "v1"
    return module


def _identity(worker: Any) -> dict[str, Any]:
    if worker is None:
        return {}
    parallel = getattr(getattr(worker, "vllm_config", None), "parallel_config", None)
    device = getattr(worker, "device", None)
    return {
        "dp_rank": getattr(parallel, "data_parallel_rank", None),
        "dp_size": getattr(parallel, "data_parallel_size", None),
        "rank": getattr(worker, "rank", None), "local_rank": getattr(worker, "local_rank", None),
        "device": str(device) if device is not None else None, "enable_dbo": getattr(parallel, "enable_dbo", None),
        "all2all_backend": getattr(parallel, "all2all_backend", None), "runner": _runner_kind(worker),
    }


def collect(worker: Any = None) -> dict[str, Any]:
    """Everything dbo_runtime counts in this process, plus which worker it is."""
    from dbo_runtime.integration.topk_hooks import current_state
    from dbo_runtime.services import schedule_cache
    from dbo_runtime.services.runtime_stats import collect as services

    snap = services()
    state = current_state()
    snap["topk"] = {
        "groups_attached": state.num_groups() if state is not None else 0,
        "shared_buffers": state.num_logical() if state is not None else 0,
        "layout": str(state.layout) if state is not None and state.layout is not None else None,
        "extra_bytes": state.extra_bytes() if state is not None else 0,
    }
    patch_set = guard.bound_patch_set()
    statuses = patch_set.status() if patch_set is not None else []
    snap["patches"] = {s.patch.name: s.state for s in statuses}
    snap["activation_line_emitted"] = activation.emitted_in_this_process()
    snap["arming"] = ARMING.counters()
    snap["worker"] = _identity(worker)
    pending = guard.pending_required(guard.runner_of(worker) if worker is not None else None)
    cache = snap["schedule_cache"]
    snap["summary"] = {
        "microbatched_builds": snap["steps"]["microbatched_builds"],
        "partitions": sum(c["partitions_entered"] for c in snap["sm_control"].values()),
        "partition_s": sum(c["partition_seconds"] for c in snap["sm_control"].values()),
        "replans_call_site": cache.get("replans", 0), "replans_in_graph": cache.get("captured_replans", 0),
        "replans_untracked": cache.get("untracked_replans", 0), "planned_ahead": cache.get("planned_ahead", 0),
        "warmups": cache.get("warmups", 0), "warm_failures": cache.get("warm_failures", 0),
        "warm_s": cache.get("warm_ns", 0) / 1e9,
        "topk_groups_attached": snap["topk"]["groups_attached"], "topk_shared_buffers": snap["topk"]["shared_buffers"],
        "topk_extra_bytes": snap["topk"]["extra_bytes"],
        "jit_in_step": cache.get("jit_in_step", 0), "jit_at_start": cache.get("jit_at_start", 0),
        "builders_stepped_aside": cache.get("builders_stepped_aside", 0),
        "indexer_steps_aside": bool(schedule_cache._CACHE is not None and schedule_cache._CACHE.steps_aside),
        "armed_patches": snap["arming"]["armed_patches"], "armable_patches": snap["arming"]["armable_patches"],
        "patches_pending": len(pending), "patches_broken": sum(1 for s in statuses if s.state == "broken"),
    }
    snap["pending_required"] = pending
    snap["features"] = {name: state.describe() for name, state in REGISTRY.all().items()}
    snap["pid"] = os.getpid()
    for extend in EXTENSIONS:
        extend(snap)
    return snap


def _make_method(existing: Any) -> Any:
    def dbo_runtime_stats(self: Any) -> dict[str, Any]:
        return collect(self)

    return dbo_runtime_stats


def patches() -> list[Patch]:
    return [
        Patch(
            name="stats.worker_rpc", module=WORKER_MODULE, attr=f"Worker.{METHOD}", make=_make_method,
            reason="expose dbo_runtime's per-worker counters to LLM.collective_rpc (offline runs, tests, "
            "dbo-runtime verify) without insecure serialization",
            upstream_pr="none (vLLM has no plugin RPC registry)",
            removal="vLLM lets a plugin register worker extension methods",
            lazy=True, adds=True,
            anchors=(),  # a method added by name; collective_rpc resolves it, no vLLM code relied on
        )
    ]
