"""Per-microbatch top-k state does not outlive the model.

An offline ``LLM`` re-created in one process, or a test suite, drops the model; nothing in
dbo_runtime may keep its top-k buffer (64 MiB at GLM-5.3 sizes), any group's physical workspace
(about 8 MiB each), the side streams or the ``copies`` layout's tensors alive afterwards. Same
real vLLM 0.33.0 classes and microbatch threads as tests/vllm/test_topk_isolation.py.
"""

from __future__ import annotations

import gc
import weakref
from typing import Any

import pytest

from dbo_runtime.integration import ubatch_ids
from dbo_runtime.services.topk_state import STATE_ATTR, TopkLayout, UbatchTopkState
from tests.vllm.test_topk_isolation import (
    STEPS,
    Boundary,
    boundary,  # noqa: F401 - fixture
    build_model,
    dbo_config,
    installed,  # noqa: F401 - fixture
    mismatches,
    run_step,
)


@pytest.fixture(autouse=True)
def _vllm_modules_imported() -> None:
    """Import what ``build_model`` imports before it runs. On this CPU box a first import inside it leaves an
    exception caught at import time whose traceback holds ``build_model``'s frame, and with it the model, for
    the rest of the process -- a test artefact, not the teardown under test."""
    import vllm.model_executor.layers.attention.sparse_mla_attention
    import vllm.models.deepseek_v32.attention
    import vllm.models.deepseek_v32.nvidia.model
    import vllm.v1.attention.backends.mla.index_group  # noqa: F401 - imported for its side effect


def _build_run_and_watch(state: UbatchTopkState, boundary: Boundary) -> list[tuple[str, weakref.ref[Any]]]:  # noqa: F811
    """Build a GLM-5.3 model, run DBO steps (fills every per-microbatch cache), return weakrefs only."""
    model = build_model(dbo_config())
    for seed, total in enumerate(STEPS):
        assert mismatches(model, run_step(model, boundary, total, seed)) == []
    assert state.num_groups() == 19
    watched: list[tuple[str, weakref.ref[Any]]] = [("model top-k buffer", weakref.ref(model.buffer))]
    for i, layer in enumerate(model.layers):
        group = layer.group
        if state.is_attached(group) and layer.index == 0:
            watched += [
                (f"group of layer {i}", weakref.ref(group)),
                (f"physical workspace of layer {i}", weakref.ref(group.physical_topk_indices)),
                (f"valid counts of layer {i}", weakref.ref(group.valid_topk_counts)),
                (f"side stream of layer {i}", weakref.ref(group.side_stream)),
            ]
    for i, layer in enumerate(model.layers):
        group_state = getattr(layer.group, STATE_ATTR, None)
        if group_state is None or layer.index != 0:
            continue
        # The per-microbatch events come from vLLM's ``_create_event`` (real ``torch.Event``s on CUDA): the
        # only objects the product makes differently on a GPU, so they are watched too.
        watched += [(f"event {i}/{n}", weakref.ref(e)) for n, pair in enumerate(group_state.events) for e in pair]
        watched += [(f"group state {i}", weakref.ref(group_state))]
        for n, (physical, valid) in enumerate(group_state.copies):
            watched += [(f"physical copy {i}/{n}", weakref.ref(physical)), (f"valid copy {i}/{n}", weakref.ref(valid))]
        watched += [(f"logical copy {n}", weakref.ref(t)) for n, t in enumerate(group_state.logical.copies)]
    assert any(name.startswith("event ") for name, _ in watched)
    if state.layout is TopkLayout.COPIES:
        assert any("copy" in name for name, _ in watched)
    return watched


@pytest.mark.parametrize("layout", list(TopkLayout))
def test_nothing_outlives_the_model(boundary: Boundary, installed: Any, layout: TopkLayout) -> None:  # noqa: F811
    state = UbatchTopkState(ubatch_ids.current_ubatch, layout)
    installed(state)
    watched = _build_run_and_watch(state, boundary)
    gc.collect()
    alive = [name for name, ref in watched if ref() is not None]
    assert alive == [], f"kept alive after the model was dropped: {alive[:6]} (+{max(0, len(alive) - 6)})"
    assert state.num_groups() == 0 and state.extra_bytes() == 0 and state.max_logical_rows() == 0
    assert not state._groups and not state._logical and not state._model_buffers


def test_a_second_model_in_the_same_process_works(boundary: Boundary, installed: Any) -> None:  # noqa: F811
    """Offline ``LLM`` re-created: the registry serves the new model exactly like the first."""
    state = UbatchTopkState(ubatch_ids.current_ubatch, TopkLayout.WINDOWS)
    installed(state)
    _build_run_and_watch(state, boundary)
    gc.collect()
    model = build_model(dbo_config())
    assert state.num_groups() == 19
    for seed, total in enumerate(STEPS):
        assert mismatches(model, run_step(model, boundary, total, seed)) == []
