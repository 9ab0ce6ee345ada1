"""Mistral Large 4's shared top-k under DBO, against the real vLLM 0.34 classes (bug B).

``MistralLarge4Model.__init__`` keeps the top-k buffer in a constructor local, hands it to every leader's
``MistralIndexer`` (``index_sharing[i] == "full"``) and to the sparse MLA impls, and groups the layers with one
``SparseMLAIndexGroupBuilder``; layers without an indexer reuse the closest preceding leader's top-k. Built here
as that constructor does (the real ``MistralIndexer`` attribute, the real ``SparseMLACommonImpl`` and builder), then
run as two real microbatch threads with vLLM's own ``UBatchContext`` (tests/vllm/test_topk_isolation.py: the same
step, the same GPU-boundary fakes). The model class itself cannot be built on a CPU box (its package refuses
non-GPU platforms). vLLM 0.33 has no Mistral Large 4: there the test checks that the patch is not in its set.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from dbo_runtime.core import coverage
from dbo_runtime.core.errors import UnsupportedConfiguration
from dbo_runtime.integration import topk_hooks, ubatch_ids
from dbo_runtime.services.topk_state import TopkLayout, UbatchTopkState
from tests.vllm.conftest import has_module, in_release
from tests.vllm.test_topk_isolation import (
    DECODE_ROWS,
    MAX_TOKENS,
    STEPS,
    TOPK,
    Layer,
    Model,
    _module,
    boundary,  # noqa: F401 - fixture
    dbo_config,
    installed,  # noqa: F401 - fixture
    mismatches,
    run_step,
)
from tools import models_table

MISTRAL_INDEXER = "vllm.models.mistral.nvidia.indexer"
PATCH = "topk.MistralIndexer.topk_indices_buffer"
SHARING = ["full", "shared", "shared", "full", "shared", "full", "full", "shared", "shared", "shared"]


def build_mistral_large4(vllm_config: Any, sharing: list[str]) -> Model:
    """What MistralLarge4Model / MistralMLAAttention / MistralIndexer / SparseMLACommonImpl do with the top-k state."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.attention.sparse_mla_attention import SparseMLACommonImpl
    from vllm.models.mistral.nvidia.indexer import MistralIndexer
    from vllm.v1.attention.backends.mla.index_group import SparseMLAIndexGroupBuilder

    topk_indices_buffer = torch.full((MAX_TOKENS, TOPK), -7, dtype=torch.int32)  # a constructor local
    builder = SparseMLAIndexGroupBuilder(topk_indices_buffer, DECODE_ROWS)
    layers, leader_of, last = [], [], 0
    with set_current_vllm_config(vllm_config):
        for i, kind in enumerate(sharing):
            indexer = None
            if kind == "full":
                indexer = _module(MistralIndexer)
                indexer.topk_indices_buffer = topk_indices_buffer  # MistralIndexer.__init__'s assignment
                last = i
            impl = object.__new__(SparseMLACommonImpl)
            impl.dcp_world_size = 1
            impl.init_topk_indices_buffer(indexer, topk_indices_buffer)
            group, index = builder.register_layer(indexer is not None, vllm_config, row_width=576, kv_cache_dtype="auto")
            impl.index_group, impl.index_group_index = group, index
            # the leader's writer: MistralIndexer's fused Q launch clears its rows and SparseAttnIndexer fills them
            layers.append(Layer(indexer is not None, indexer, impl, group, index))
            leader_of.append(last)
    return Model(layers, topk_indices_buffer, leader_of)


def test_vllm_033_has_no_mistral_large4_and_its_set_no_such_patch() -> None:
    names = {p.name for p in in_release(topk_hooks.patches(UbatchTopkState(ubatch_ids.current_ubatch)))}
    if has_module(MISTRAL_INDEXER):
        assert PATCH in names
        assert models_table.BY_NAME["MistralLarge4ForCausalLM"].status_in("0.34.0") == "fixed"
    else:
        assert PATCH not in names and not has_module("vllm.models.mistral.mistral_large4")


@pytest.mark.parametrize("layout", list(TopkLayout))
def test_followers_read_their_own_leaders_top_k_in_each_microbatch(
    boundary: Any, fresh_arming: Any, installed: Any, layout: TopkLayout  # noqa: F811
) -> None:
    if not has_module(MISTRAL_INDEXER):
        pytest.skip("vLLM 0.33 has no Mistral Large 4 (checked by the test above)")
    state = UbatchTopkState(ubatch_ids.current_ubatch, layout)
    installed(state)
    model = build_mistral_large4(dbo_config(), SHARING)
    # groups with followers get state (leaders 0, 3 and 6); leader 5's group has none
    attached = [i for i, layer in enumerate(model.layers) if layer.index == 0 and state.is_attached(layer.group)]
    assert attached == [0, 3, 6]
    for seed, total in enumerate(STEPS * 2):
        res = run_step(model, boundary, total, seed)
        assert all(res.same_buffer)  # the leader's writer and its impl's reader resolve the same microbatch buffer
        assert mismatches(model, res) == []
    assert coverage.mistral_followers({"index_topk": TOPK, "index_sharing": SHARING}) == [
        i for i, layer in enumerate(model.layers) if not layer.leader
    ]


def test_without_the_per_microbatch_buffer_the_followers_read_the_other_microbatchs_top_k(
    boundary: Any, fresh_arming: Any, installed: Any  # noqa: F811
) -> None:
    """The control: vLLM's own state (nothing attached, DBO off at construction) hands microbatch 0's followers
    microbatch 1's leader output, which is the bug the patches exist for."""
    if not has_module(MISTRAL_INDEXER):
        pytest.skip("vLLM 0.33 has no Mistral Large 4 (checked by the first test)")
    installed(UbatchTopkState(ubatch_ids.current_ubatch, TopkLayout.WINDOWS))
    model = build_mistral_large4(dbo_config(enable_dbo=False), SHARING)
    res = run_step(model, boundary, STEPS[0], 0)
    assert mismatches(model, res)


def test_a_shared_group_whose_buffer_no_patch_resolves_is_refused_under_dbo(
    boundary: Any, fresh_arming: Any, installed: Any  # noqa: F811
) -> None:
    """Where the indexer's descriptor is not installed (another release, changed code), nothing marks the buffer:
    the first follower's registration refuses DBO in one line naming that cause and the verified releases, not
    the ROCm reason ``core.coverage`` keeps for this fixed architecture."""
    if not has_module(MISTRAL_INDEXER):
        pytest.skip("vLLM 0.33 has no Mistral Large 4 (checked by the first test)")
    installed(UbatchTopkState(ubatch_ids.current_ubatch, TopkLayout.WINDOWS), drop=(PATCH,))
    config = dbo_config()
    object.__setattr__(config, "model_config", type("M", (), {"architecture": "MistralLarge4ForCausalLM"})())
    with pytest.raises(UnsupportedConfiguration) as refused:
        build_mistral_large4(config, SHARING)
    line = str(refused.value)
    assert "refuses MistralLarge4ForCausalLM with --enable-dbo" in line and "patch that hands its indexer" in line
    assert "ROCm" not in line and "\n" not in line
    assert "install a vLLM release dbo_runtime verifies (0.33.0 or 0.34.0)" in line
