"""DBO with decode context parallelism (DCP) and with MTP, against the real vLLM sparse MLA readers (bug B).

Under DCP each follower converts its top-k per layer (``triton_filter_and_convert_dcp_index``), reading
``topk_indices_buffer[topk_start : topk_start + num_tokens]`` in ``SparseMLACommonImpl.forward_mqa`` and in
``FlashMLASparseImpl.forward_mqa`` (0.33 reads from row 0). The windows layout is right only if those rows are
the calling microbatch's: ``topk_start`` must count from the microbatch's own first token. Both readers run here
unmodified with ``dcp_world_size = 2`` inside vLLM's own ``UBatchContext`` threads (the step of
tests/vllm/test_topk_isolation.py); only the GPU kernels at the boundary are faked. The last tests cover MTP
(docs/topk-memory.md): microbatch 0's padded decode rows (``B x next_n``) reach into microbatch 1's first rows,
harmless while DBO yields between every two attention layers, and the copies layout where dense layers sit
between MoE layers.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from dbo_runtime.integration import ubatch_ids
from dbo_runtime.services.topk_state import TopkLayout, UbatchTopkState
from tests.fakes.topk_boundary import fake_convert
from tests.vllm.test_topk_isolation import (
    TOPK,
    Boundary,
    FakeForwardContext,
    Model,
    boundary,  # noqa: F401 - fixture
    build_model,
    dbo_config,
    installed,  # noqa: F401 - fixture
    run_microbatches,
)

NUM_LAYERS = 15  # GLM-5.3's pattern (freq 4, offset 3): leaders 0, 1, 2, 6, 10, 14; groups with followers 2, 6, 10
BLOCK_SIZE = 64  # FlashMLA's fp8 page: the cache needs no re-paging view
NUM_BLOCKS = 4
JUNK = 4242  # what the padded decode rows hold: top-k of padding queries
SHARED_BUFFER_PATCH = "topk.SharedTopkIndicesBuffer.topk_indices_buffer"


def readers() -> dict[str, type]:
    from vllm.model_executor.layers.attention.sparse_mla_attention import SparseMLACommonImpl
    from vllm.v1.attention.backends.mla.flashmla_sparse import FlashMLASparseImpl

    return {"common": SparseMLACommonImpl, "flashmla": FlashMLASparseImpl}


def has_topk_start() -> bool:
    from vllm.model_executor.layers.attention.sparse_mla_attention import SparseMLACommonMetadata

    return "topk_start" in SparseMLACommonMetadata.__dataclass_fields__


@dataclass
class Trace:
    """What the faked kernels saw, per ``(microbatch, layer)``."""

    layer: dict[int, int] = field(default_factory=dict)
    rows: dict[tuple[int, int], int] = field(default_factory=dict)
    """The first buffer row the converter's top-k view starts at (rows of the model's buffer)."""
    consumed: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    """What reached the attention kernel (physical top-k)."""
    metas: list[Any] = field(default_factory=list)


def _row_of(view: torch.Tensor, base: torch.Tensor) -> int:
    return (view.data_ptr() - base.data_ptr()) // (base.stride(0) * base.element_size())


def fake_kernels(monkeypatch: pytest.MonkeyPatch, model: Model, trace: Trace) -> None:
    """The Triton converters and attention kernels of both readers (GPU only), recording where they read."""
    from vllm.model_executor.layers.attention import sparse_mla_attention
    from vllm.v1.attention.backends.mla import flashmla_sparse

    def where(view: torch.Tensor) -> None:
        u = ubatch_ids.current_ubatch()[0]
        trace.rows[(u, trace.layer[u])] = _row_of(view, model.buffer)

    def dcp_convert(req_id: Any, block_table: Any, topk: torch.Tensor, *, return_valid_counts: bool = False, **_: Any) -> Any:
        where(topk)
        counts = (topk >= 0).sum(dim=1).to(torch.int32)
        return (topk.clone(), counts) if return_valid_counts else topk.clone()  # localizing is not under test

    def convert(req_id: Any, block_table: Any, topk: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        where(topk)
        return fake_convert(req_id, block_table, topk, *args, **kwargs)

    for module in (sparse_mla_attention, flashmla_sparse):
        monkeypatch.setattr(module, "triton_filter_and_convert_dcp_index", dcp_convert)
        monkeypatch.setattr(module, "triton_convert_req_index_to_global_index", convert)

    def consumed(topk: torch.Tensor) -> None:
        u = ubatch_ids.current_ubatch()[0]
        trace.consumed[(u, trace.layer[u])] = topk.clone()

    def mqa_kernel(q: torch.Tensor, kv: Any, physical: torch.Tensor, valid: Any, **_: Any) -> Any:
        consumed(physical)
        return torch.zeros(q.shape[0], q.shape[1], 4), None

    def fp8_kernel(q: torch.Tensor, kv_c_and_k_pe_cache: Any, topk_indices: torch.Tensor, **_: Any) -> Any:
        consumed(topk_indices[0])
        return torch.zeros(1, q.shape[1], q.shape[2], 4), None

    for layer in model.layers:
        layer.impl._forward_mqa_kernel = mqa_kernel
        layer.impl._fp8_flash_mla_kernel = fp8_kernel


def build(vllm_config: Any, reader: type, dcp_world_size: int) -> Model:
    """DeepseekV32Model's top-k wiring (``build_model``) with ``reader`` impls at ``dcp_world_size``."""

    def make_impl() -> Any:
        impl = object.__new__(reader)
        impl.dcp_world_size, impl.dcp_rank = dcp_world_size, dcp_world_size - 1
        impl.num_heads, impl.q_head_size, impl.kv_cache_dtype = 2, 16, "fp8_ds_mla"  # FlashMLA: mixed-batch fp8
        impl.fp8_supports_topk_length = impl.need_to_return_lse_for_decode = False
        return impl

    return build_model(vllm_config, num_layers=NUM_LAYERS, make_impl=make_impl)


@dataclass
class Step:
    """One DBO step: each microbatch's tokens, the rows its indexer writes, and where its readers start."""

    sizes: list[int]
    written_rows: list[int]
    """``B x next_n`` on vLLM's padded decode path (more than the microbatch's tokens), else its tokens."""
    topk_start: list[int]
    read_rows: list[int]


def split(query_lens: list[int], next_n: int) -> Step:
    """Microbatches as vLLM's ``maybe_create_ubatch_slices`` cuts ``query_lens`` (decodes of ``next_n`` tokens)."""
    from vllm.v1.worker.ubatch_utils import maybe_create_ubatch_slices

    total = sum(query_lens)
    _, slices = maybe_create_ubatch_slices(True, np.array(query_lens), total, len(query_lens), 2)
    assert slices is not None
    sizes = [s.token_slice.stop - s.token_slice.start for s in slices]
    written = [max(n, (s.request_slice.stop - s.request_slice.start) * next_n) for n, s in zip(sizes, slices, strict=True)]
    return Step(sizes, written, [0, 0], sizes)


def run(
    model: Model,
    boundary: Boundary,  # noqa: F811
    trace: Trace,
    step: Step,
    seed: int,
    yield_after: Callable[[int], bool] = lambda i: True,
) -> dict[tuple[int, int], torch.Tensor]:
    """Each microbatch, on vLLM's own microbatch threads, writes its leaders' top-k (its padded decode rows first,
    holding ``JUNK``) and calls the real ``forward_mqa`` of every layer; a ``dbo_yield`` follows each layer whose
    ``yield_after`` holds (the MoE layer's all-to-all). Returns what each leader wrote on its microbatch's rows."""
    from vllm.config import CUDAGraphMode
    from vllm.v1.worker import ubatching

    gen = torch.Generator().manual_seed(seed)
    offsets = [0, step.sizes[0]]
    written = {
        (u, i): torch.randint(-1, NUM_BLOCKS * BLOCK_SIZE, (step.sizes[u], TOPK), generator=gen, dtype=torch.int32)
        for u in range(2)
        for i, layer in enumerate(model.layers)
        if layer.leader
    }
    metas = [
        SimpleNamespace(
            topk_start=step.topk_start[u],
            num_decode_tokens=step.read_rows[u] if step.topk_start[u] == 0 else 0,
            num_actual_tokens=step.read_rows[u],
            block_size=BLOCK_SIZE,
            req_id_per_token=torch.arange(step.read_rows[u], dtype=torch.int32) % 3,
            block_table=torch.randint(0, 1000, (3, NUM_BLOCKS), generator=gen, dtype=torch.int32),
            cp_kv_cache_interleave_size=1,
            fp8_use_mixed_batch=True,
            fp8_extra_metadata=_fp8_kernel_metadata(),
        )
        for u in range(2)
    ]
    kv = torch.zeros(NUM_BLOCKS, BLOCK_SIZE, 16)
    errors: list[BaseException] = []

    def body(ctx: Any, u: int) -> None:
        try:
            with ctx:
                for i, layer in enumerate(model.layers):
                    trace.layer[u] = i
                    if layer.leader:
                        buf = layer.attn.topk_indices_buffer  # fused_norm_rope clear + sparse_attn_indexer
                        buf[: step.sizes[u]] = -1
                        buf[: step.written_rows[u]] = JUNK  # the padded decode path: B x next_n rows
                        buf[: step.sizes[u]] = written[(u, i)]  # unpack_seq_triton: the real rows
                        layer.impl.record_logical_topk_ready()
                    q = torch.zeros(step.read_rows[u], 2, 16)
                    layer.impl.forward_mqa(q, kv, metas[u], None)
                    if yield_after(i):
                        ubatching.dbo_yield()
        except BaseException as exc:
            errors.append(exc)

    barrier = threading.Barrier(3)
    ctxs = ubatching.make_ubatch_contexts(
        num_micro_batches=2,
        compute_stream=boundary.compute,
        comm_stream=boundary.compute,
        forward_contexts=[FakeForwardContext(cudagraph_runtime_mode=CUDAGraphMode.NONE) for _ in range(2)],
        ready_barrier=barrier,
        token_offsets=offsets,
    )
    run_microbatches(ctxs, body, barrier, errors)
    trace.metas = metas
    return written


def _fp8_kernel_metadata() -> Any:
    from vllm.v1.attention.backends.mla.flashmla_sparse import FlashMLASparseMetadata

    return object.__new__(FlashMLASparseMetadata.FP8KernelMetadata)


def wrong_reads(model: Model, trace: Trace, step: Step, written: dict[tuple[int, int], torch.Tensor], dcp: int) -> list[str]:
    """Every ``(microbatch, layer)`` whose attention got other rows than its own leader's top-k."""
    bad = []
    for u in range(2):
        start, rows = step.topk_start[u], step.read_rows[u]
        for i in range(NUM_LAYERS):
            own = written[(u, model.leader_of[i])][start : start + rows]
            if dcp == 1:
                meta = trace.metas[u]
                own = fake_convert(meta.req_id_per_token, meta.block_table, own, BLOCK_SIZE)
            if not torch.equal(trace.consumed[(u, i)], own):
                bad.append(f"u{u} L{i}")
    return bad


def outside_window(trace: Trace, step: Step) -> list[str]:
    """Every converter read that does not start at the microbatch's offset plus ``topk_start``."""
    offsets = [0, step.sizes[0]]
    return [f"u{u} L{i} at row {row}" for (u, i), row in trace.rows.items() if row != offsets[u] + step.topk_start[u]]


DCP_STEPS = {
    "decode": split([1] * 16, 1),
    "mtp": split([2] * 11, 2),  # 22 tokens cut at 11: microbatch 0 holds 5 requests and one token of the 6th
    "prefill": split([20, 28], 1),
}


@pytest.mark.parametrize("step_name", list(DCP_STEPS))
@pytest.mark.parametrize("reader", ["common", "flashmla"])
@pytest.mark.parametrize("layout", list(TopkLayout))
def test_dcp_reads_land_in_each_microbatchs_own_window(
    boundary: Boundary, fresh_arming: Any, installed: Any, monkeypatch: pytest.MonkeyPatch,  # noqa: F811
    reader: str, step_name: str, layout: TopkLayout,
) -> None:  # fmt: skip
    state = UbatchTopkState(ubatch_ids.current_ubatch, layout)
    installed(state)
    model = build(dbo_config(), readers()[reader], dcp_world_size=2)
    assert state.num_groups() == 3
    trace = Trace()
    fake_kernels(monkeypatch, model, trace)
    step = DCP_STEPS[step_name]
    for seed in range(2):
        written = run(model, boundary, trace, step, seed)
        assert len(trace.consumed) == 2 * NUM_LAYERS
        assert wrong_reads(model, trace, step, written, dcp=2) == []
        assert len(trace.rows) == 2 * NUM_LAYERS  # every layer converted per layer (DCP), none from the group
        if layout is TopkLayout.WINDOWS:
            assert outside_window(trace, step) == []


def test_without_the_fix_dcp_followers_read_the_other_microbatchs_top_k(
    boundary: Boundary, fresh_arming: Any, installed: Any, monkeypatch: pytest.MonkeyPatch  # noqa: F811
) -> None:
    """The control: the impls' buffer read unpatched (the fix disabled) hands microbatch 1 microbatch 0's rows."""
    installed(UbatchTopkState(ubatch_ids.current_ubatch, TopkLayout.WINDOWS), drop=(SHARED_BUFFER_PATCH,))
    model = build(dbo_config(), readers()["common"], dcp_world_size=2)
    trace = Trace()
    fake_kernels(monkeypatch, model, trace)
    step = DCP_STEPS["decode"]
    written = run(model, boundary, trace, step, 0)
    assert wrong_reads(model, trace, step, written, dcp=2)
    assert any(name.startswith("u1") for name in outside_window(trace, step))


def test_a_window_at_the_wrong_offset_is_caught(
    boundary: Boundary, fresh_arming: Any, installed: Any, monkeypatch: pytest.MonkeyPatch  # noqa: F811
) -> None:
    """The mutation: microbatch 1's window one row early overlaps microbatch 0's last row."""

    def one_row_early() -> tuple[int, int]:
        u, offset = ubatch_ids.current_ubatch()
        return u, offset - 1 if u else offset

    installed(UbatchTopkState(one_row_early, TopkLayout.WINDOWS))
    model = build(dbo_config(), readers()["flashmla"], dcp_world_size=2)
    trace = Trace()
    fake_kernels(monkeypatch, model, trace)
    step = DCP_STEPS["decode"]
    written = run(model, boundary, trace, step, 0)
    assert outside_window(trace, step) and wrong_reads(model, trace, step, written, dcp=2)


@pytest.mark.parametrize("reader", ["common", "flashmla"])
def test_shardq_topk_start_counts_from_the_microbatchs_first_token(
    boundary: Boundary, fresh_arming: Any, installed: Any, monkeypatch: pytest.MonkeyPatch, reader: str  # noqa: F811
) -> None:
    """vLLM 0.34's one non-zero ``topk_start`` (ShardQ: TP > 1 and DCP 1): the microbatch's own decode count, so a
    window serves it; vLLM turns ShardQ off under DCP. vLLM 0.33 has no ``topk_start`` (reads from row 0)."""
    if not has_topk_start():
        pytest.skip("vLLM 0.33 sparse MLA reads its top-k from row 0 (no topk_start)")
    installed(UbatchTopkState(ubatch_ids.current_ubatch, TopkLayout.WINDOWS))
    model = build(dbo_config(), readers()[reader], dcp_world_size=1)
    trace = Trace()
    fake_kernels(monkeypatch, model, trace)
    # microbatch 0: 6 decodes then this rank's 9 prefill tokens; microbatch 1: 4 decodes then 12
    step = Step(sizes=[24, 24], written_rows=[24, 24], topk_start=[6, 4], read_rows=[9, 12])
    written = run(model, boundary, trace, step, 0)
    assert wrong_reads(model, trace, step, written, dcp=1) == []
    assert outside_window(trace, step) == []


FIRST_K_DENSE = 3  # GLM-5.x / DeepSeek-V3.2: dense layers 0-2, then an MoE layer every moe_layer_freq


def moe_yields(moe_layer_freq: int) -> Callable[[int], bool]:
    """DBO's yields: one in each MoE layer (its all-to-all), none in a dense layer, as vLLM places them."""
    return lambda i: i >= FIRST_K_DENSE and i % moe_layer_freq == 0


def mtp_config(moe_layer_freq: int) -> Any:
    """A DBO engine with one MTP token and a model whose MoE layers come every ``moe_layer_freq`` layers."""
    config = dbo_config()
    object.__setattr__(config, "speculative_config", SimpleNamespace(num_speculative_tokens=1))
    hf = SimpleNamespace(n_routed_experts=256, moe_layer_freq=moe_layer_freq)
    object.__setattr__(config, "model_config", SimpleNamespace(hf_text_config=hf, architecture="GlmMoeDsaForCausalLM"))
    return config


def _mtp_step() -> Step:
    step = split([2] * 11, 2)
    assert step.written_rows[0] > step.sizes[0], "microbatch 0 must take the padded decode path"
    return step


@pytest.mark.parametrize("dcp", [1, 2])
def test_microbatch_0s_padded_rows_reach_microbatch_1_only_while_its_rows_are_dead(
    boundary: Boundary, fresh_arming: Any, installed: Any, monkeypatch: pytest.MonkeyPatch, dcp: int  # noqa: F811
) -> None:
    """With MTP and a cut request, microbatch 0 writes ``B x next_n`` rows, past its last token into microbatch 1's
    first rows. Microbatch 1's rows are live from its leader's write to its last follower's read; microbatch 0
    writes only at leaders, and with every layer after the dense ones an MoE layer DBO yields between any two
    attention layers, so each such write lands after microbatch 1 finished the previous group and before its next
    leader rewrites the rows. Windows stay."""
    state = UbatchTopkState(ubatch_ids.current_ubatch, TopkLayout.WINDOWS)
    installed(state)
    model = build(mtp_config(moe_layer_freq=1), readers()["common"], dcp_world_size=dcp)
    assert state.layout is TopkLayout.WINDOWS and state.windows_too_short is None
    trace = Trace()
    fake_kernels(monkeypatch, model, trace)
    step = _mtp_step()
    written = run(model, boundary, trace, step, 0, yield_after=moe_yields(1))
    assert wrong_reads(model, trace, step, written, dcp=dcp) == []


def test_with_dense_layers_between_moe_layers_windows_would_let_the_padding_land_first(
    boundary: Boundary, fresh_arming: Any, installed: Any, monkeypatch: pytest.MonkeyPatch  # noqa: F811
) -> None:
    """What the layout rule prevents (windows forced on): with moe_layer_freq 2, layer 5 (the last follower of
    leader 2) is dense, so microbatch 0 runs it and leader 6 in one DBO segment, and its padding reaches microbatch
    1's first rows before microbatch 1's layer 5 reads them."""
    state = UbatchTopkState(ubatch_ids.current_ubatch, TopkLayout.WINDOWS)
    installed(state)
    model = build(dbo_config(), readers()["common"], dcp_world_size=2)
    assert state.layout is TopkLayout.WINDOWS
    trace = Trace()
    fake_kernels(monkeypatch, model, trace)
    step = _mtp_step()
    written = run(model, boundary, trace, step, 0, yield_after=moe_yields(2))
    bad = wrong_reads(model, trace, step, written, dcp=2)
    assert "u1 L5" in bad and all(name.startswith("u1") for name in bad)


@pytest.mark.parametrize("dcp", [1, 2])
def test_with_dense_layers_between_moe_layers_mtp_takes_the_copies_layout(
    boundary: Boundary, fresh_arming: Any, installed: Any, monkeypatch: pytest.MonkeyPatch, dcp: int  # noqa: F811
) -> None:
    """The fix: the engine's config (MTP, moe_layer_freq 2) makes model construction pick copies, where microbatch
    0's padding lands on rows no one reads; the step of the test above then reads right."""
    state = UbatchTopkState(ubatch_ids.current_ubatch, TopkLayout.WINDOWS)
    installed(state)
    model = build(mtp_config(moe_layer_freq=2), readers()["common"], dcp_world_size=dcp)
    assert state.layout is TopkLayout.COPIES
    assert state.windows_too_short is not None and "moe_layer_freq 2" in state.windows_too_short
    trace = Trace()
    fake_kernels(monkeypatch, model, trace)
    step = _mtp_step()
    written = run(model, boundary, trace, step, 0, yield_after=moe_yields(2))
    assert wrong_reads(model, trace, step, written, dcp=dcp) == []
