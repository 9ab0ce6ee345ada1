"""UbatchTopkState and the memory function, pure (no vLLM, no GPU)."""

from __future__ import annotations

import types

import pytest
import torch

from dbo_runtime.core.errors import ConfigError, DboRuntimeError
from dbo_runtime.core.topk_memory import index_leaders
from dbo_runtime.services.topk_state import TopkLayout, UbatchTopkState, parse_layout
from tests.harness.topk_memory import groups_with_followers, topk_memory_bytes


def test_glm53_pattern_and_memory() -> None:
    leaders = index_leaders(78, 4, 3)
    assert [i for i, x in enumerate(leaders) if x] == [0, 1, 2, *range(6, 78, 4)]
    assert sum(leaders) == 21 and groups_with_followers(leaders) == 19
    m = topk_memory_bytes(num_layers=78, index_topk_freq=4, index_skip_topk_offset=3, index_topk=2048,
                          max_num_batched_tokens=8192, max_num_seqs=1024)
    upstream = (8192 + 19 * (1024 + 1)) * 2048 * 4  # vllm#60734's formula: 216 MiB
    assert m["copies"] == upstream + 19 * 1025 * 4 and m["windows"] == 0
    assert round(upstream / 2**20) == 216


def test_freq1_costs_nothing() -> None:
    m = topk_memory_bytes(num_layers=78, index_topk_freq=1, index_skip_topk_offset=3, index_topk=2048,
                          max_num_batched_tokens=8192, max_num_seqs=1024)
    assert m == {"copies": 0, "windows": 0, "groups_with_followers": 0, "max_decode_rows": 1024}


def test_layout_parsing() -> None:
    assert parse_layout(None) is TopkLayout.WINDOWS and parse_layout(" Copies ") is TopkLayout.COPIES
    with pytest.raises(ConfigError, match="DBO_RUNTIME_TOPK_LAYOUT"):
        parse_layout("shared")


class FakeIndexGroup(types.SimpleNamespace):
    """The fields of vLLM's SparseMLAIndexGroup that UbatchTopkState reads.

    Its GPU twin: tests/gpu/test_topk_isolation_gpu.py.
    """


def _group(base: torch.Tensor) -> FakeIndexGroup:
    return FakeIndexGroup(
        logical_topk_indices=base, physical_topk_indices=torch.zeros(5, 2, dtype=torch.int32),
        valid_topk_counts=torch.zeros(5, dtype=torch.int32), side_stream=None, logical_topk_ready=None,
        physical_topk_ready=None, has_indexer=True, num_layers=2,
    )


@pytest.mark.parametrize("layout", list(TopkLayout))
def test_resolution_by_microbatch(layout: TopkLayout) -> None:
    where = {"v": (0, 0)}
    st = UbatchTopkState(lambda: where["v"], layout)
    base = torch.zeros(8, 2, dtype=torch.int32)
    g = _group(base)
    st.attach(g, 2, object)
    assert st.logical(base) is base and st.group_view(g) is None
    where["v"] = (1, 3)
    win = st.logical(base)
    view = st.group_view(g)
    assert view is not None and view.logical_topk_ready is not g.logical_topk_ready
    if layout is TopkLayout.WINDOWS:
        assert win.data_ptr() == base[3:].data_ptr() and win.shape[0] == 5
        assert view.physical_topk_indices.data_ptr() == g.physical_topk_indices[3:].data_ptr()
        assert st.extra_bytes() == 0
    else:
        assert win.data_ptr() != base.data_ptr() and win.shape == base.shape
        assert st.extra_bytes() == 8 * 2 * 4 + 5 * 2 * 4 + 5 * 4
    other = torch.zeros(8, 2, dtype=torch.int32)
    assert st.logical(other) is other  # never attached: itself


def test_windows_refuse_zero_offset_and_unknown_ubatch() -> None:
    where = {"v": (1, 0)}
    st = UbatchTopkState(lambda: where["v"], TopkLayout.WINDOWS)
    base = torch.zeros(8, 2, dtype=torch.int32)
    group = _group(base)  # the state lives as long as the group (vLLM: as long as the model)
    st.attach(group, 2, object)
    with pytest.raises(DboRuntimeError, match="token offset 0"):
        st.logical(base)
    where["v"] = (2, 4)
    with pytest.raises(DboRuntimeError, match="built for 2 microbatches"):
        st.logical(base)


@pytest.mark.parametrize("layout", list(TopkLayout))
def test_a_remembered_view_is_made_again_for_a_new_offset_and_checked_again(layout: TopkLayout) -> None:
    """The hot path returns the view remembered for (microbatch, offset) without checking it again; a new
    step's split point must still make a new window, and an offset that is no longer valid must still refuse."""
    where = {"v": (1, 3)}
    st = UbatchTopkState(lambda: where["v"], layout)
    base = torch.zeros(8, 2, dtype=torch.int32)
    group = _group(base)
    st.attach(group, 2, object)
    first, first_view = st.logical(base), st.group_view(group)
    assert st.logical(base) is first and st.group_view(group) is first_view  # remembered
    where["v"] = (1, 5)
    second, second_view = st.logical(base), st.group_view(group)
    assert second_view is not first_view
    if layout is TopkLayout.WINDOWS:
        assert second.data_ptr() == base[5:].data_ptr() and second.shape[0] == 3
        assert second_view.physical_topk_indices.data_ptr() == group.physical_topk_indices[5:].data_ptr()
        where["v"] = (1, 0)
        with pytest.raises(DboRuntimeError, match="token offset 0"):
            st.logical(base)
        with pytest.raises(DboRuntimeError, match="token offset 0"):
            st.group_view(group)
    else:
        assert second is first  # one copy per microbatch, whatever the offset


def test_clear_lets_the_next_model_read_the_layout_in_force_then(monkeypatch: pytest.MonkeyPatch) -> None:
    """The registry lives for the process (plugin uninstall clears it): a second LLM built after the user changed
    DBO_RUNTIME_TOPK_LAYOUT must get the layout it asked for, not the first model's."""
    from dbo_runtime.core.settings import LAYOUT_ENV

    st = UbatchTopkState(lambda: (0, 0))
    monkeypatch.setenv(LAYOUT_ENV, "copies")
    first = _group(torch.zeros(8, 2, dtype=torch.int32))
    st.attach(first, 2, object)
    assert st.layout is TopkLayout.COPIES
    st.clear()
    monkeypatch.setenv(LAYOUT_ENV, "windows")
    second = _group(torch.zeros(8, 2, dtype=torch.int32))
    st.attach(second, 2, object)
    assert st.layout is TopkLayout.WINDOWS and st.extra_bytes() == 0
    pinned = UbatchTopkState(lambda: (0, 0), TopkLayout.COPIES)
    pinned.clear()
    assert pinned.layout is TopkLayout.COPIES  # a layout given at construction stays


def _layout_setting(setting: str | None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """``DBO_RUNTIME_TOPK_LAYOUT`` as a server would find it (None: unset), warnings captured."""
    import logging

    from dbo_runtime.core.settings import LAYOUT_ENV

    caplog.set_level(logging.WARNING)
    if setting is None:
        monkeypatch.delenv(LAYOUT_ENV, raising=False)
    else:
        monkeypatch.setenv(LAYOUT_ENV, setting)


@pytest.mark.parametrize("setting", [None, "", "windows", "copies"])
def test_windows_that_are_not_safe_in_this_process_become_copies_unless_asked_for(
    setting: str | None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Where FA4's never-evicted scalar cache could not be keyed on the whole buffer, a window per split point
    would grow it: the default becomes COPIES (said once); an explicit windows setting is kept with a warning."""
    _layout_setting(setting, monkeypatch, caplog)
    st = UbatchTopkState(lambda: (0, 0))
    st.windows_unsafe = "topk.fa4_varlen_scalars is not installed (code differs)"
    group = _group(torch.zeros(8, 2, dtype=torch.int32))
    st.attach(group, 2, object)
    expected = TopkLayout.WINDOWS if setting == "windows" else TopkLayout.COPIES
    warned = [r.getMessage() for r in caplog.records if "fa4_varlen_scalars" in r.getMessage()]
    assert st.layout is expected and len(warned) == (0 if setting == "copies" else 1)
    st.clear()
    assert st.windows_unsafe is None and st.layout is None  # a later model is judged again


@pytest.mark.parametrize("setting", [None, "windows", "copies"])
def test_a_window_that_can_be_too_short_is_never_used(
    setting: str | None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Where vLLM's padded decode rows can pass a window's end, the layout is COPIES whatever is asked (a write past
    a buffer is no choice), said once; the flag is re-read for a layout already chosen as windows."""
    _layout_setting(setting, monkeypatch, caplog)
    st = UbatchTopkState(lambda: (0, 0))
    st.attach(_group(torch.zeros(8, 2, dtype=torch.int32)), 2, object)
    assert st.layout is (TopkLayout.COPIES if setting == "copies" else TopkLayout.WINDOWS)
    st.windows_too_short = "a decode microbatch can write 512 rows, more than the 510 a window holds"
    group = _group(torch.zeros(8, 2, dtype=torch.int32))
    st.attach(group, 2, object)
    assert st.layout is TopkLayout.COPIES and st.extra_bytes() > 0
    warned = [r.getMessage() for r in caplog.records if "510 a window holds" in r.getMessage()]
    assert len(warned) == (0 if setting == "copies" else 1)
    assert [w for w in warned if "not DBO_RUNTIME_TOPK_LAYOUT=windows" in w] == (warned if setting == "windows" else [])
