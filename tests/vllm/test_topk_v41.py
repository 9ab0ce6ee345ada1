"""DeepSeek-V4.1's shared top-k and candidate blocks under DBO, on the real vLLM 0.33.0 classes.

The layers are the real ``DeepseekV4Model`` (``models/deepseek_v41/nvidia/model.py``), ``DeepseekV4Attention``
and ``DeepseekV4Indexer`` (``models/deepseek_v41/attention.py``), ``SparseAttnIndexer`` and
``SparseMQAIndexer``: their attributes are assigned as vLLM's ``__init__`` assigns them and read and written
as their forward methods do (``buf[:n]`` of the calling microbatch). Two real microbatch threads run under
vLLM's ``UBatchContext`` and ``dbo_yield`` after every layer (every V4.1 layer's MoE yields there), so an
index source of microbatch 1 runs between microbatch 0's source and its consumers.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn as nn

from dbo_runtime.core.coverage import v41_consumers
from dbo_runtime.integration import topk_hooks, topk_v41_hooks, ubatch_ids
from dbo_runtime.integration.patching import PatchSet
from dbo_runtime.services.topk_state import TopkLayout, UbatchTopkState
from tests.fakes.ubatch_threads import run_microbatches
from tests.vllm.test_topk_isolation import arming_net

LAYERS = 8
RATIOS = [0, 1, 2, 1, 1, 2, 1, 0]
SOURCES = [1, 4]
CANDIDATE_SOURCE = 1
TOPK, CANDIDATES, MAX_TOKENS = 6, 3, 32


def _module(cls: type) -> Any:
    obj = object.__new__(cls)
    nn.Module.__init__(obj)
    return obj


def _config(enable_dbo: bool) -> Any:
    from vllm.config import DeviceConfig, ParallelConfig, VllmConfig

    parallel = ParallelConfig(
        enable_dbo=enable_dbo, enable_expert_parallel=True, all2all_backend="deepep_low_latency", data_parallel_size=2
    )
    return VllmConfig(device_config=DeviceConfig(device="cpu"), parallel_config=parallel)


def _source_of(layer: int) -> int:
    return max(s for s in SOURCES if s <= layer)


class V41Stack:
    """The model-wide buffers and, per layer, the modules vLLM hands them to."""

    def __init__(self, enable_dbo: bool = True) -> None:
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.layers.sparse_attn_indexer import SparseAttnIndexer
        from vllm.model_executor.layers.sparse_mqa_indexer import SparseMQAIndexer
        from vllm.models.deepseek_v41.attention import DeepseekV4Indexer
        from vllm.models.deepseek_v41.nvidia.flashmla import DeepseekV4FlashMLAAttention
        from vllm.models.deepseek_v41.nvidia.model import DeepseekV4Model

        with set_current_vllm_config(_config(enable_dbo)):
            self.model = _module(DeepseekV4Model)
            self.model.topk_indices_buffer = torch.full((MAX_TOKENS, TOPK), -7, dtype=torch.int32)
            self.model.candidate_block_buffer = torch.full((MAX_TOKENS, CANDIDATES), -7, dtype=torch.int32)
            self.attn: list[Any] = []
            self.ops: dict[int, Any] = {}
            self.indexers: dict[int, Any] = {}
            for layer in range(LAYERS):
                attn = _module(DeepseekV4FlashMLAAttention)  # the H200's V4.1 attention (reads via the base class)
                attn.topk_indices_buffer = self.model.topk_indices_buffer
                attn.candidate_block_buffer = self.model.candidate_block_buffer
                self.attn.append(attn)
                if layer in SOURCES:
                    indexer = _module(DeepseekV4Indexer)
                    indexer.topk_indices_buffer = self.model.topk_indices_buffer
                    op = _module(SparseAttnIndexer if layer == SOURCES[0] else SparseMQAIndexer)
                    op.topk_indices_buffer = self.model.topk_indices_buffer
                    op.candidate_blocks = self.model.candidate_block_buffer
                    self.indexers[layer], self.ops[layer] = indexer, op

    def step(self, sizes: list[int], seed: int) -> dict[tuple[str, int, int], torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        topk = {(u, s): torch.randint(0, 1000, (sizes[u], TOPK), generator=gen, dtype=torch.int32) for u in range(2) for s in SOURCES}
        cands = {u: torch.randint(0, 1000, (sizes[u], CANDIDATES), generator=gen, dtype=torch.int32) for u in range(2)}
        seen: dict[tuple[str, int, int], torch.Tensor] = {}

        def body(u: int) -> None:
            from vllm.v1.worker import ubatching

            n = sizes[u]
            for layer in range(LAYERS):
                if layer in SOURCES:
                    op = self.ops[layer]
                    # the last source takes the short-context path, which writes through the indexer itself
                    buf = self.indexers[layer].topk_indices_buffer if layer == SOURCES[-1] else op.topk_indices_buffer
                    buf[:n] = -1
                    buf[:n] = topk[(u, layer)]
                    if layer == CANDIDATE_SOURCE:
                        op.candidate_blocks[:n] = cands[u]
                    else:  # a later index source masks its scores with the candidates
                        seen[("candidates", u, layer)] = op.candidate_blocks[:n].clone()
                if RATIOS[layer] > 0:
                    seen[("topk", u, layer)] = self.attn[layer].topk_indices_buffer[:n].clone()
                ubatching.dbo_yield()

        run_microbatches([body, body], [0, sizes[0]])
        expected = {("topk", u, layer): topk[(u, _source_of(layer))] for u in range(2) for layer in range(LAYERS) if RATIOS[layer] > 0}
        expected.update({("candidates", u, s): cands[u] for u in range(2) for s in SOURCES if s != CANDIDATE_SOURCE})
        return {key: value for key, value in seen.items() if not torch.equal(value, expected[key])}


@pytest.fixture()
def installed(request: pytest.FixtureRequest) -> Any:
    def install(state: UbatchTopkState) -> PatchSet:
        patches = topk_hooks.patches(state)
        patches = [p for p in patches if p.name == "topk.SparseAttnIndexer.topk_indices_buffer"] + topk_v41_hooks.patches(state)
        ps = PatchSet([*patches, arming_net()])
        ps.install()
        request.addfinalizer(ps.uninstall)
        return ps

    return install


def test_the_config_has_consumers_the_way_vllm_builds_them() -> None:
    """Compressed layers that are not index sources (and index sources after the candidate source) reuse state."""
    config = {"num_hidden_layers": LAYERS, "compress_ratios": RATIOS, "index_source_layer_ids": SOURCES,
              "candidate_source_layer_id": CANDIDATE_SOURCE, "candidate_topk_blocks": CANDIDATES}  # fmt: skip
    assert v41_consumers(config) == [2, 3, 4, 5, 6]


@pytest.mark.parametrize("layout", list(TopkLayout))
def test_every_consumer_reads_its_own_microbatchs_source(installed: Any, layout: TopkLayout) -> None:
    state = UbatchTopkState(ubatch_ids.current_ubatch, layout)
    installed(state)
    stack = V41Stack()
    assert state.num_logical() == 2  # the top-k buffer and the candidate blocks
    for seed, sizes in enumerate(([5, 7], [16, 16], [3, 29])):
        assert stack.step(sizes, seed) == {}
    expected = 0 if layout is TopkLayout.WINDOWS else MAX_TOKENS * (TOPK + CANDIDATES) * 4
    assert state.extra_bytes() == expected


def test_without_the_fix_microbatch_0_reads_microbatch_1s_top_k() -> None:
    """vLLM 0.33.0 as shipped: the bug (the test can fail)."""
    bad = V41Stack().step([5, 7], 0)
    assert any(key[0] == "topk" and key[1] == 0 for key in bad)
    assert any(key[0] == "candidates" and key[1] == 0 for key in bad)


def test_without_dbo_nothing_is_registered(installed: Any) -> None:
    state = UbatchTopkState(ubatch_ids.current_ubatch, TopkLayout.WINDOWS)
    installed(state)
    stack = V41Stack(enable_dbo=False)
    assert state.num_logical() == 0
    assert stack.attn[2].topk_indices_buffer is stack.model.topk_indices_buffer  # plain reads, the base itself


def test_uninstall_leaves_plain_attributes(installed: Any) -> None:
    state = UbatchTopkState(ubatch_ids.current_ubatch, TopkLayout.WINDOWS)
    ps = installed(state)
    stack = V41Stack()
    ps.uninstall()
    assert stack.attn[3].topk_indices_buffer is stack.model.topk_indices_buffer
    assert stack.ops[4].candidate_blocks is stack.model.candidate_block_buffer
