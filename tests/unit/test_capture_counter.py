"""The process-wide capture counter that lets the indexer call site skip a ~440 ns probe.

GPU twin: tests/gpu/test_indexer_schedule_gpu.py::test_capture_counter_with_real_graph.
"""

from __future__ import annotations

import pytest
import torch

from dbo_runtime.adapters import cuda_graph
from dbo_runtime.adapters.cuda_graph import CAPTURES, counting_capture_begin, counting_capture_end
from dbo_runtime.integration import capture_hooks
from dbo_runtime.integration.patching import PatchSet
from dbo_runtime.services.schedule_cache import IndexerScheduleCache
from tests.fakes.fake_deep_gemm import FakeDeepGemm, FakeSchedulePlanner


def test_patch_set_installs_counts_and_restores_torch() -> None:
    cls = torch.cuda.graphs.CUDAGraph
    originals = (cls.__dict__["capture_begin"], cls.__dict__["capture_end"])
    ps = PatchSet(capture_hooks.patches())
    ps.install()
    try:
        assert CAPTURES.installed and CAPTURES.active == 0
        assert cls.__dict__["capture_begin"] is not originals[0]
    finally:
        ps.uninstall()
    assert (cls.__dict__["capture_begin"], cls.__dict__["capture_end"]) == originals
    assert cls.__dict__["capture_begin"] is originals[0] and not CAPTURES.installed


def test_counter_follows_begin_end_and_failed_begin() -> None:
    calls: list[str] = []
    begin = counting_capture_begin(lambda self, *a, **k: calls.append("begin"))
    end = counting_capture_end(lambda self: calls.append("end"))
    start = CAPTURES.active
    begin(object())
    assert CAPTURES.active == start + 1
    end(object())
    assert CAPTURES.active == start

    def refuses(self: object, *a: object, **k: object) -> None:
        raise RuntimeError("capture_begin failed")

    with pytest.raises(RuntimeError):
        counting_capture_begin(refuses)(object())
    assert CAPTURES.active == start and calls == ["begin", "end"]


def test_a_failed_capture_info_lookup_never_raises_and_reads_as_no_shared_capture(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # prepare_capture_id runs at model load; a map that cannot be read or a library that misbehaves must not stop
    # it, and capture_id then answers None (every capture records its own re-plan), as without an entry point.
    def broken() -> None:
        raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")

    monkeypatch.setattr(cuda_graph, "_get_capture_info", broken)
    cuda_graph.prepare_capture_id()
    assert "capture-info lookup failed" in caplog.text
    assert cuda_graph.capture_id(stream_handle=0) is None


def test_an_unreadable_process_map_leaves_the_fixed_library_names(monkeypatch: pytest.MonkeyPatch) -> None:
    import builtins

    real_open = builtins.open

    def fake_open(path: object, *a: object, **k: object) -> object:
        if path == "/proc/self/maps":
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")
        return real_open(path, *a, **k)  # type: ignore[call-overload]

    monkeypatch.setattr(builtins, "open", fake_open)
    assert cuda_graph._loaded_cudart_paths() == []


class FakeCountingPlanner(FakeSchedulePlanner):
    """Fake for the DeepGEMM planner + CUDA capture probe; counts probes.

    GPU twin: tests/gpu/test_indexer_schedule_gpu.py::test_capture_counter_with_real_graph.
    """

    def __init__(self, dg: FakeDeepGemm) -> None:
        super().__init__(dg)
        self.probes = 0

    def capturing(self) -> bool:
        self.probes += 1
        return super().capturing()


def test_fast_path_skips_the_capture_probe_only_when_the_counter_is_trusted(monkeypatch: pytest.MonkeyPatch) -> None:
    dg = FakeDeepGemm(total_sms=132)
    planner = FakeCountingPlanner(dg)
    cache = IndexerScheduleCache(planner)
    lens = torch.tensor([[100], [3000]], dtype=torch.int32)
    schedule = planner.plan(lens, 64, 132)
    cache.track(schedule, planned_sms=132, block_kv=64, next_n=1, ahead=True)
    counter = cuda_graph.CaptureCounter()
    monkeypatch.setattr(cache, "_captures", counter)

    assert cache.resolve(schedule, lens, None, 64) is schedule and planner.probes == 1  # not installed: probe
    counter.installed = True
    for _ in range(21):
        assert cache.resolve(schedule, lens, None, 64) is schedule
    assert planner.probes == 1  # trusted counter, no capture: no probe at all
    counter.active = 1  # a capture somewhere in the process: probe again
    planner.capturing_now, planner.current_capture = True, 5
    assert cache.resolve(schedule, lens, None, 64) is not schedule
    assert planner.probes >= 2 and cache.stats.captured_replans == 1


def test_call_site_wrapper_takes_the_cache_fast_path(monkeypatch: pytest.MonkeyPatch) -> None:
    from dbo_runtime.integration.indexer_hooks import _make_logits
    from dbo_runtime.services import schedule_cache as sc

    dg = FakeDeepGemm(total_sms=132)
    planner = FakeCountingPlanner(dg)
    cache = IndexerScheduleCache(planner)
    monkeypatch.setattr(sc, "_CACHE", cache)
    counter = cuda_graph.CaptureCounter()
    counter.installed = True
    monkeypatch.setattr(cache, "_captures", counter)
    lens = torch.tensor([[100], [3000]], dtype=torch.int32)
    schedule = planner.plan(lens, 64, 132)
    cache.track(schedule, planned_sms=132, block_kv=64, next_n=1)
    seen: list[object] = []
    def original(q, kv_cache, weights, context_lens, block_tables, schedule_metadata, max_model_len, indices=None):  # type: ignore[no-untyped-def]
        seen.append(schedule_metadata)

    wrapper = _make_logits(original)
    slow: list[int] = []
    real_resolve = cache.resolve
    monkeypatch.setattr(cache, "resolve", lambda *a: (slow.append(1), real_resolve(*a))[1])
    for _ in range(5):
        wrapper(None, 64, None, lens, None, schedule, 8)
    assert len(slow) == 1 and all(s is schedule for s in seen)  # only the first call binds the reader
    dg.set_num_sms(112)
    wrapper(None, 64, None, lens, None, schedule, 8)
    assert len(slow) == 2 and seen[-1] is not schedule and seen[-1].shape[0] == 113
    counter.active = 1  # a capture somewhere: always the precise path
    dg.set_num_sms(132)
    wrapper(None, 64, None, lens, None, schedule, 8)
    assert len(slow) == 3
