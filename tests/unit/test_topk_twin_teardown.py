"""The GPU teardown twin's own harness, run on a CPU with inert CUDA stand-ins.

A harness can keep the model alive by itself: a ``UbatchTopkState`` built with a locator lambda that
closes over the harness, held strongly by the registry the test keeps to inspect, keeps the whole
"model" (top-k buffer, groups, workspaces, ``copies`` tensors) alive. Then
``tests/gpu/test_topk_isolation_gpu.py::test_dropping_the_model_frees_all_per_microbatch_state``
fails with "the logical top-k buffer outlived the model" while the CPU twin
(``tests/vllm/test_topk_teardown.py``) passes, and the product is not at fault: on the H200 the
leaked bytes were exactly the harness's tensors (windows: 65536 + 5 x 17408 = 152576; copies:
+ 65536 + 3 x 17408).

Nothing in that harness needs a GPU to show the leak: streams, events and ``_sleep`` only order work.
This test replaces them with inert objects and runs the twin's exact build/step/drop code, so a
harness (or product) change that keeps the model alive fails here, on every CPU run, before GPU time
is spent.
"""

from __future__ import annotations

import contextlib
import gc
from typing import Any

import pytest
import torch

import tests.gpu.test_topk_isolation_gpu as twin
from dbo_runtime.services.topk_state import TopkLayout, UbatchTopkState


class _Stream:
    def wait_stream(self, other: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass


class _Event:
    def record(self, stream: Any = None) -> None:
        pass


@pytest.fixture
def inert_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    current = _Stream()
    monkeypatch.setattr(torch.cuda, "Stream", _Stream)
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a, **k: current)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "_sleep", lambda cycles: None)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *a, **k: 0)


@pytest.mark.parametrize("layout", list(TopkLayout))
def test_twin_harness_drops_its_model(inert_cuda: None, layout: TopkLayout) -> None:
    events_before = twin.live_events()
    state, watched, _, events_alive = twin._build_and_run_dropped(layout, torch.device("cpu"))
    gc.collect()
    names = [name for name, _ in watched]
    assert "logical top-k buffer" in names and any(n.startswith("group state") for n in names)
    if layout is TopkLayout.COPIES:
        assert any(n.startswith("logical copy") for n in names)
    kept = [name for name, ref in watched if ref() is not None]
    assert kept == [], f"outlived the model while the test holds only the registry: {kept[:6]}"
    assert events_alive > events_before and twin.live_events() == events_before
    assert state.num_groups() == 0 and state.extra_bytes() == 0 and state.max_logical_rows() == 0


def test_a_locator_closing_over_the_model_keeps_it_alive() -> None:
    """Why the harness changed: the registry owns its locator, so the locator must not own the model."""

    import weakref

    class Model:
        def __init__(self) -> None:
            self.buffer = torch.zeros(4, 2)

    def build(close_over_model: bool) -> tuple[UbatchTopkState, weakref.ref[torch.Tensor]]:
        model = Model()
        locator = {"fn": lambda: (0, 0)}
        if close_over_model:
            state = UbatchTopkState(lambda: model.__dict__.get("fn", locator["fn"])(), TopkLayout.WINDOWS)
        else:
            state = UbatchTopkState(lambda: locator["fn"](), TopkLayout.WINDOWS)
        state.mark_model_buffer(model.buffer)
        return state, weakref.ref(model.buffer)

    held_state, held = build(close_over_model=True)
    freed_state, freed = build(close_over_model=False)
    gc.collect()
    assert held() is not None and held_state.locate() == (0, 0)  # the registry -> locator -> model
    assert freed() is None and freed_state.locate() == (0, 0)


def test_twin_harness_takes_no_weak_reference_to_a_cuda_stream_or_event(inert_cuda: None) -> None:
    """On the H200 (torch 2.11.0+cu130) a weak reference to a used ``torch.cuda.Stream`` made the teardown twin
    segfault at a later garbage collection (4 of 4 runs with it, 0 of 4 without), and with only the events' weak
    references it segfaulted again on a later lease, as the test's frame released them. Streams are proven freed
    through their groups and events by the collector's count; the harness must not watch either directly."""
    import weakref

    made: list[Any] = []
    real_ref = weakref.ref

    def spy(obj: Any, *args: Any) -> Any:
        made.append(obj)
        return real_ref(obj, *args)

    try:
        weakref.ref = spy  # type: ignore[misc]
        _, watched, _, _ = twin._build_and_run_dropped(TopkLayout.WINDOWS, torch.device("cpu"))
    finally:
        weakref.ref = real_ref  # type: ignore[misc]
    assert made and not any(isinstance(obj, (_Stream, _Event)) for obj in made)
    assert not any(name.startswith(("side stream", "event ")) for name, _ in watched)
