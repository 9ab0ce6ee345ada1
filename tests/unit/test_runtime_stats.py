"""Per-worker counters (``Worker.dbo_runtime_stats``) and the /metrics series present from model load."""

from __future__ import annotations

from types import SimpleNamespace

from prometheus_client import CollectorRegistry, generate_latest

from dbo_runtime.core.budget import compute_budget
from dbo_runtime.integration import worker_stats
from dbo_runtime.services import runtime_stats
from dbo_runtime.services.metrics import MetricsExporter
from dbo_runtime.services.sm_control import SMControl


def test_microbatched_builds_are_counted_separately_from_capture() -> None:
    before = runtime_stats.collect()["steps"]
    runtime_stats.count_microbatched_build()
    runtime_stats.count_microbatched_build(for_capture=True)
    after = runtime_stats.collect()["steps"]
    assert after["microbatched_builds"] == before["microbatched_builds"] + 1
    assert after["microbatched_capture_builds"] == before["microbatched_capture_builds"] + 1


def test_worker_snapshot_has_identity_counters_and_summary() -> None:
    parallel = SimpleNamespace(data_parallel_rank=1, data_parallel_size=2, enable_dbo=True, all2all_backend="deepep_high_throughput")
    runner = type("GPUModelRunner", (), {"__module__": "vllm.v1.worker.gpu.model_runner"})()
    worker = SimpleNamespace(vllm_config=SimpleNamespace(parallel_config=parallel), rank=1, local_rank=1, device="cuda:1", model_runner=runner)
    snap = worker_stats.collect(worker)
    assert snap["worker"]["dp_rank"] == 1 and snap["worker"]["runner"] == "v2"
    for key in ("microbatched_builds", "partitions", "replans_call_site", "replans_in_graph", "planned_ahead", "warmups", "topk_groups_attached",
                "armed_patches", "armable_patches"):
        assert isinstance(snap["summary"][key], int), key
    import json

    json.dumps(snap)  # crosses vLLM's msgpack RPC: plain types only


def test_metrics_series_exist_before_the_first_dbo_step() -> None:
    registry = CollectorRegistry()
    exporter = MetricsExporter(registry=registry, cache=SimpleNamespace(stats=SimpleNamespace()))
    control = SMControl(device=0, total_sms=132)
    exporter.attach(control)
    control.announce(
        compute_budget(
            total_sms=132, platform="cuda", enable_dbo=True, expert_parallel=True, all2all_backend="deepep_high_throughput",
            env_comm_sms=None, has_all2all_manager=True, max_sms_used=20, has_deep_gemm=True, device=0,
        )
    )
    text = generate_latest(registry).decode()
    for name in ("dbo_runtime_sm_partitions_total", "dbo_runtime_sm_knob_switches_total", "dbo_runtime_indexer_replans_total", "dbo_runtime_dbo_compute_sms"):
        assert name in text, name
    assert 'dbo_runtime_dbo_compute_sms{device="0"} 112.0' in text
