"""GLM-5.3 shared top-k under DBO, against the real vLLM 0.33.0 classes (vllm#60734).

Index groups come from the real ``SparseMLAIndexGroupBuilder`` for the GLM-5.3
pattern (78 layers, index_topk_freq 4, offset 3 -> leaders 0,1,2,6,...,74);
writers go through the real ``DeepseekV32Attention`` attribute, readers through
the real ``SparseMLACommonImpl`` methods (``topk_indices_buffer``,
``record_logical_topk_ready``, ``_convert_logical_to_physical_topk`` ->
``SparseMLAIndexGroup._convert_once``). Two real microbatch threads run under
vLLM's own ``make_ubatch_contexts`` / ``UBatchContext`` and ``dbo_yield`` after
every layer, which is DBO's order: leader L of microbatch 0, leader L of 1,
followers of 0, followers of 1. Only the GPU boundary is faked
(tests/fakes/topk_boundary.py; twin: tests/gpu/test_topk_isolation_gpu.py).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
import torch.nn as nn

from dbo_runtime.core.topk_memory import index_leaders
from dbo_runtime.integration import topk_hooks, ubatch_ids
from dbo_runtime.integration.patching import Patch, PatchSet
from dbo_runtime.services.topk_state import TopkLayout, UbatchTopkState
from tests.fakes.topk_boundary import FakeEvent, FakeStream, fake_convert
from tests.harness.topk_memory import topk_memory_bytes
from tests.vllm.conftest import fake_group_events, row_width_keyword


@dataclass
class FakeConvertMetadata:
    """The three fields of vLLM's attention metadata that ``_convert_logical_to_physical_topk`` reads
    (a full metadata object needs a KV cache on a GPU; the conversion is twinned in
    tests/gpu/test_topk_isolation_gpu.py)."""

    req_id_per_token: torch.Tensor
    block_table: torch.Tensor
    block_size: int


@dataclass
class FakeForwardContext:
    """The one field ``UBatchContext`` and the impls read from a ForwardContext (a real one needs a
    model runner); microbatch contexts always carry CUDAGraphMode.NONE in vLLM 0.33.0."""

    cudagraph_runtime_mode: Any

NUM_LAYERS = 78
TOPK = 8
MAX_TOKENS = 48  # max_num_batched_tokens (logical rows)
DECODE_ROWS = 16  # max_decode_rows -> physical workspace of 17 rows
BLOCK_SIZE = 4
NUM_BLOCKS = 6


@dataclass
class Boundary:
    log: list[tuple[str, int, int | None]] = field(default_factory=list)
    compute: FakeStream | None = None


@pytest.fixture()
def boundary(monkeypatch: pytest.MonkeyPatch) -> Boundary:
    from vllm import forward_context
    from vllm.v1.attention.backends.mla import index_group
    from vllm.v1.worker import ubatching

    b = Boundary()
    def who() -> int:
        return ubatch_ids.current_ubatch()[0]

    b.compute = FakeStream("compute", who, b.log)
    fake_group_events(monkeypatch, lambda: FakeEvent(who), lambda device: FakeStream("side", who, b.log))
    monkeypatch.setattr(index_group, "current_stream", lambda: b.compute)
    monkeypatch.setattr(index_group, "triton_convert_req_index_to_global_index", fake_convert)
    monkeypatch.setattr(ubatching, "current_stream", lambda: b.compute)
    monkeypatch.setattr(forward_context, "_forward_context", None)
    return b


def dbo_config(enable_dbo: bool = True) -> Any:
    from vllm.config import DeviceConfig, ParallelConfig, VllmConfig

    pc = ParallelConfig(
        enable_dbo=enable_dbo,
        enable_expert_parallel=True,
        all2all_backend="deepep_high_throughput",
        data_parallel_size=2,
    )
    return VllmConfig(device_config=DeviceConfig(device="cpu"), parallel_config=pc)


def _module(cls: type) -> Any:
    obj = object.__new__(cls)
    nn.Module.__init__(obj)
    return obj


@dataclass
class Layer:
    leader: bool
    attn: Any
    impl: Any
    group: Any
    index: int


@dataclass
class Model:
    layers: list[Layer]
    buffer: torch.Tensor
    leader_of: list[int]


def _common_impl() -> Any:
    from vllm.model_executor.layers.attention.sparse_mla_attention import SparseMLACommonImpl

    impl = object.__new__(SparseMLACommonImpl)
    impl.dcp_world_size = 1
    return impl


def build_model(
    vllm_config: Any, freq: int = 4, offset: int = 3, num_layers: int = NUM_LAYERS, make_impl: Callable[[], Any] = _common_impl
) -> Model:
    """What DeepseekV32Model / DeepseekV32Attention / SparseMLACommonImpl.__init__ do with the top-k state;
    ``make_impl``: a layer's attention impl before ``init_topk_indices_buffer`` (another reader, DCP)."""
    from vllm.models.deepseek_v32.attention import DeepseekV32Attention, DeepseekV32Indexer
    from vllm.models.deepseek_v32.nvidia.model import DeepseekV32Model
    from vllm.v1.attention.backends.mla.index_group import SparseMLAIndexGroupBuilder

    model = _module(DeepseekV32Model)
    model.topk_indices_buffer = torch.full((MAX_TOKENS, TOPK), -7, dtype=torch.int32)
    builder = SparseMLAIndexGroupBuilder(model.topk_indices_buffer, DECODE_ROWS)
    leaders = index_leaders(num_layers, freq, offset)
    layers, leader_of, last = [], [], 0
    for i, is_leader in enumerate(leaders):
        buf = model.topk_indices_buffer
        indexer = None
        if is_leader:
            indexer = _module(DeepseekV32Indexer)
            indexer.topk_indices_buffer = buf
            last = i
        impl = make_impl()
        impl.init_topk_indices_buffer(indexer, buf)
        group, index = builder.register_layer(
            indexer is not None, vllm_config, **{row_width_keyword(): 576}, kv_cache_dtype="auto"
        )
        impl.index_group, impl.index_group_index = group, index
        attn = _module(DeepseekV32Attention)
        attn.indexer = indexer
        attn.topk_indices_buffer = buf
        layers.append(Layer(is_leader, attn, impl, group, index))
        leader_of.append(last)
    return Model(layers, model.topk_indices_buffer, leader_of)


@dataclass
class StepResult:
    logical: dict[tuple[int, int], torch.Tensor]
    physical: dict[tuple[int, int], torch.Tensor]
    valid: dict[tuple[int, int], torch.Tensor]
    written: dict[tuple[int, int], torch.Tensor]
    metas: list[Any]
    same_buffer: list[bool]


def run_step(model: Model, boundary: Boundary, total: int, seed: int) -> StepResult:
    """One DBO step of ``total`` padded tokens split in two like ``maybe_create_ubatch_slices``."""
    from vllm.config import CUDAGraphMode
    from vllm.v1.worker import ubatching

    gen = torch.Generator().manual_seed(seed)
    n0 = total // 2
    sizes = [n0, total - n0]
    metas = []
    for n in sizes:
        metas.append(
            FakeConvertMetadata(
                req_id_per_token=torch.arange(n, dtype=torch.int32) % 3,
                block_table=torch.randint(0, 1000, (3, NUM_BLOCKS), generator=gen, dtype=torch.int32),
                block_size=BLOCK_SIZE,
            )
        )
    written = {
        (u, i): torch.randint(-1, NUM_BLOCKS * BLOCK_SIZE, (sizes[u], TOPK), generator=gen, dtype=torch.int32)
        for u in range(2)
        for i, layer in enumerate(model.layers)
        if layer.leader
    }
    res = StepResult({}, {}, {}, written, metas, [])
    errors: list[BaseException] = []

    def body(ctx: Any, u: int) -> None:
        try:
            with ctx:
                n = sizes[u]
                for i, layer in enumerate(model.layers):
                    if layer.leader:
                        buf = layer.attn.topk_indices_buffer  # writer: fused_norm_rope clear + indexer
                        buf[:n] = -1
                        buf[:n] = written[(u, i)]
                        res.same_buffer.append(buf.data_ptr() == layer.impl.topk_indices_buffer.data_ptr())
                        layer.impl.record_logical_topk_ready()
                    topk = layer.impl.topk_indices_buffer[:n]  # reader: SparseMLACommonImpl.forward_mqa
                    phys, valid = layer.impl._convert_logical_to_physical_topk(
                        topk, metas[u], block_stride_rows=None, return_valid_counts=True
                    )
                    res.logical[(u, i)] = topk.clone()
                    res.physical[(u, i)] = phys.clone()
                    res.valid[(u, i)] = valid.clone()
                    ubatching.dbo_yield()
        except BaseException as exc:
            errors.append(exc)

    barrier = threading.Barrier(3)
    fcs = [FakeForwardContext(cudagraph_runtime_mode=CUDAGraphMode.NONE) for _ in range(2)]
    ctxs = ubatching.make_ubatch_contexts(
        num_micro_batches=2,
        compute_stream=boundary.compute,
        comm_stream=FakeStream("comm", (lambda: ubatch_ids.current_ubatch()[0]), boundary.log),
        forward_contexts=fcs,
        ready_barrier=barrier,
        token_offsets=[0, n0],
    )
    run_microbatches(ctxs, body, barrier, errors)
    return res


def mismatches(model: Model, res: StepResult) -> list[str]:
    """Every (microbatch, layer) whose top-k is not its own leader's, bit for bit."""
    bad = []
    for (u, i), logical in res.logical.items():
        lead = model.leader_of[i]
        if not torch.equal(logical, res.written[(u, lead)]):
            bad.append(f"logical u{u} L{i}")
        ref_phys, ref_valid = fake_convert(
            res.metas[u].req_id_per_token, res.metas[u].block_table, res.written[(u, lead)], BLOCK_SIZE,
            return_valid_counts=True,
        )
        if not torch.equal(res.physical[(u, i)], res.physical[(u, lead)]) or not torch.equal(
            res.physical[(u, i)], ref_phys
        ):
            bad.append(f"physical u{u} L{i}")
        if not torch.equal(res.valid[(u, i)], ref_valid):
            bad.append(f"valid u{u} L{i}")
    return bad


def foreign_waits(boundary: Boundary) -> list[tuple[str, int, int | None]]:
    return [entry for entry in boundary.log if entry[2] is not None and entry[1] != entry[2]]


@pytest.fixture()
def installed(request: pytest.FixtureRequest) -> Any:
    def install(state: UbatchTopkState, drop: tuple[str, ...] = ()) -> PatchSet:
        ps = PatchSet([*(p for p in topk_hooks.patches(state) if p.name not in drop), arming_net()])
        ps.install()
        request.addfinalizer(ps.uninstall)
        return ps

    return install


def arming_net() -> Patch:
    """``UBatchContext.__enter__``'s hook, which the plugin installs with every top-k feature (they require
    ``ubatch_guard``): the hand-rolled steps here start vLLM's own contexts without a runner's join point, so it is
    this net that arms the per-access hooks at the first step (``microbatch_arming``)."""
    from dbo_runtime.integration import ubatch_guard

    return next(p for p in ubatch_guard.patches() if p.name == ubatch_guard.CONTEXT_ENTER)


STEPS = (16, 48)  # a decode step whose microbatches fit the physical workspace (17 rows); a prefill step whose do not


@pytest.mark.parametrize("layout", list(TopkLayout))
def test_followers_read_own_leader_bit_for_bit(boundary: Boundary, fresh_arming: Any, installed: Any, layout: TopkLayout) -> None:
    state = UbatchTopkState(ubatch_ids.current_ubatch, layout)
    installed(state)
    model = build_model(dbo_config())

    # 19 groups with followers get state; leader-only groups (layers 0, 1) none.
    assert state.num_groups() == 19
    assert not state.is_attached(model.layers[0].group) and not state.is_attached(model.layers[1].group)
    assert all(state.is_attached(model.layers[i].group) for i in range(2, NUM_LAYERS))
    expected = topk_memory_bytes(
        num_layers=NUM_LAYERS, index_topk_freq=4, index_skip_topk_offset=3, index_topk=TOPK,
        max_num_batched_tokens=MAX_TOKENS, max_num_seqs=DECODE_ROWS,
    )
    assert state.extra_bytes() == expected[layout.value]

    assert not fresh_arming.armed  # before the first microbatched run: vLLM's own objects, no hook
    for seed, total in enumerate(STEPS * 2):
        res = run_step(model, boundary, total, seed)
        assert fresh_arming.armed_by == "UBatchContext.__enter__"  # no runner here: the net armed them, before the model ran
        assert len(res.logical) == 2 * NUM_LAYERS
        assert mismatches(model, res) == []
        assert res.same_buffer and all(res.same_buffer), "writer and reader resolved different buffers"
    assert boundary.log, "the fake streams saw no waits: conversion path not exercised"
    assert foreign_waits(boundary) == []


def test_without_patches_dbo_mixes_microbatches(boundary: Boundary) -> None:
    """vLLM 0.33.0 as shipped: the bug this fixes (followers of microbatch 0 read microbatch 1's top-k)."""
    model = build_model(dbo_config())
    res = run_step(model, boundary, 16, 0)
    bad = mismatches(model, res)
    assert any(b.startswith("logical u0") for b in bad)
    assert any(b.startswith("physical u0") for b in bad)


def test_mutation_resolution_always_ubatch0_fails(boundary: Boundary, installed: Any) -> None:
    state = UbatchTopkState(lambda: (0, 0), TopkLayout.WINDOWS)
    installed(state)
    model = build_model(dbo_config())
    bad = [b for total in STEPS for b in mismatches(model, run_step(model, boundary, total, total))]
    assert bad, "resolving every thread to microbatch 0 must break isolation"


@pytest.mark.parametrize("layout", list(TopkLayout))
def test_mutation_impl_not_wired_fails(boundary: Boundary, installed: Any, layout: TopkLayout) -> None:
    state = UbatchTopkState(ubatch_ids.current_ubatch, layout)
    installed(state, drop=("topk.SharedTopkIndicesBuffer.topk_indices_buffer",))
    model = build_model(dbo_config())
    bad = [b for total in STEPS for b in mismatches(model, run_step(model, boundary, total, total))]
    assert any(b.startswith("logical") for b in bad)
    assert any(b.startswith("physical") for b in bad)  # the step larger than the workspace converts per layer


def _snapshot(res: StepResult) -> list[tuple[Any, torch.Tensor]]:
    return sorted(
        [(("l", *k), v) for k, v in res.logical.items()]
        + [(("p", *k), v) for k, v in res.physical.items()]
        + [(("v", *k), v) for k, v in res.valid.items()],
        key=lambda kv: kv[0],
    )


def test_negative_control_freq1_zero_bytes_identical(boundary: Boundary, installed: Any) -> None:
    vanilla_model = build_model(dbo_config(), freq=1)
    vanilla = [_snapshot(run_step(vanilla_model, boundary, t, t)) for t in STEPS]

    state = UbatchTopkState(ubatch_ids.current_ubatch, TopkLayout.COPIES)
    installed(state)
    model = build_model(dbo_config(), freq=1)
    assert state.num_groups() == 0 and state.extra_bytes() == 0
    patched = [_snapshot(run_step(model, boundary, t, t)) for t in STEPS]
    for a, b in zip(vanilla, patched, strict=True):
        assert [k for k, _ in a] == [k for k, _ in b]
        assert all(torch.equal(x, y) for (_, x), (_, y) in zip(a, b, strict=True))
    assert mismatches(model, run_step(model, boundary, 16, 99)) == []


def test_dbo_off_attaches_nothing(boundary: Boundary, installed: Any) -> None:
    state = UbatchTopkState(ubatch_ids.current_ubatch, TopkLayout.COPIES)
    installed(state)
    build_model(dbo_config(enable_dbo=False))
    assert state.num_groups() == 0 and state.extra_bytes() == 0


def test_patch_list_is_well_formed() -> None:
    for p in topk_hooks.patches(UbatchTopkState(lambda: (0, 0))):
        assert isinstance(p, Patch) and p.reason and p.upstream_pr and p.removal


def run_microbatches(ctxs: list[Any], body: Any, barrier: threading.Barrier, errors: list[BaseException]) -> None:
    """vLLM's two microbatch threads over ``ctxs`` (``body(ctx, ubatch)``), released as vLLM's runner releases them;
    the first error a thread recorded is raised here, a hang fails the test."""
    threads = [threading.Thread(target=body, args=(ctxs[u], u), daemon=True) for u in range(2)]
    for t in threads:
        t.start()
    barrier.wait()
    ctxs[0].cpu_wait_event.set()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), f"microbatch threads hung; errors: {errors!r}"
    if errors:
        raise errors[0]
