"""ROCm DSA + GLM-5.x shared top-k + DBO: refused at model construction.

vLLM 0.33.0's ROCm DSA model (``vllm/models/deepseek_v32/amd/``) builds its attention
(``rocm.DeepseekV32MLAAttention``) without a shared ``SparseMLAIndexGroupBuilder``, so each
``ROCMAiterMLASparseImpl`` makes its own builder in ``SparseMLACommonImpl.__init__``. A follower
layer (no indexer) then registers with ``current_group is None``: it is never seen as a follower,
gets no per-microbatch state, and reads the leader's top-k from the model-wide buffer that the
other microbatch's leader overwrites. The real ROCm classes import on CPU; the impls below are
constructed through their real ``__init__`` exactly as ``MLAAttention.__init__`` calls them.

Boundary fakes (no ROCm GPU here, and no ROCm twin: the project's GPU machine is NVIDIA):
``get_tensor_model_parallel_world_size`` of the sparse-MLA module (needs an initialised TP
group), the ROCm backend's ``current_workspace_manager`` (allocates on an accelerator), and the
model config (``FakeModelConfig``: the impl reads only ``dtype``; a real ModelConfig needs the
model's HF config), and the platform (``guard.platform`` answers ``rocm``; on CPU it reads vLLM's current
platform as neither CUDA nor ROCm).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.nn as nn

from dbo_runtime.core.errors import UnsupportedConfiguration
from dbo_runtime.core.topk_memory import index_leaders
from dbo_runtime.services.topk_state import TopkLayout, UbatchTopkState
from tests.vllm.test_topk_isolation import dbo_config, installed  # noqa: F401 - fixture

TOPK = 8
MAX_TOKENS = 48


@dataclass
class FakeModelConfig:
    """The one field ``ROCMAiterMLASparseImpl.__init__`` reads from the model config."""

    dtype: torch.dtype = torch.bfloat16
    architectures: tuple[str, ...] = ("GlmMoeDsaForCausalLM",)


class FakeWorkspaceManager:
    """vLLM's WorkspaceManager empties the accelerator cache when it grows; here: plain CPU tensors."""

    def get_simultaneous(self, *shapes_and_dtypes: tuple[tuple[int, ...], torch.dtype]) -> list[torch.Tensor]:
        return [torch.empty(shape, dtype=dtype) for shape, dtype in shapes_and_dtypes]


@pytest.fixture
def rocm(monkeypatch: pytest.MonkeyPatch) -> Any:
    from vllm.model_executor.layers.attention import sparse_mla_attention
    from vllm.v1.attention.backends.mla import rocm_aiter_mla_sparse

    monkeypatch.setattr(sparse_mla_attention, "get_tensor_model_parallel_world_size", lambda: 1)
    monkeypatch.setattr(rocm_aiter_mla_sparse, "current_workspace_manager", FakeWorkspaceManager)
    return rocm_aiter_mla_sparse


def _config(enable_dbo: bool) -> Any:
    config = dbo_config(enable_dbo)
    config.model_config = FakeModelConfig()
    return config


def build_rocm_layers(vllm_config: Any, num_layers: int, freq: int = 4, offset: int = 3) -> list[Any]:
    """What the ROCm DSA model builds per layer: an indexer on leaders, and the backend's impl
    constructed like ``MLAAttention.__init__`` does (``index_group_builder`` is never passed)."""
    from vllm.config import set_current_vllm_config
    from vllm.models.deepseek_v32.amd.rocm import DeepseekV32MLAAttention
    from vllm.v1.attention.backends.mla.rocm_aiter_mla_sparse import ROCMAiterMLASparseBackend

    buffer = torch.zeros((MAX_TOKENS, TOPK), dtype=torch.int32)
    impl_cls = ROCMAiterMLASparseBackend.get_impl_cls()
    impls = []
    with set_current_vllm_config(vllm_config):
        for leader in index_leaders(num_layers, freq, offset):
            indexer = None
            if leader:
                indexer = object.__new__(DeepseekV32MLAAttention.indexer_cls)
                nn.Module.__init__(indexer)
                indexer.topk_indices_buffer = buffer
            impls.append(
                impl_cls(
                    num_heads=16,
                    head_size=576,
                    scale=0.1,
                    num_kv_heads=1,
                    alibi_slopes=None,
                    sliding_window=None,
                    kv_cache_dtype="auto",
                    logits_soft_cap=None,
                    attn_type="decoder",
                    kv_sharing_target_layer_name=None,
                    q_lora_rank=1536,
                    kv_lora_rank=512,
                    qk_nope_head_dim=128,
                    qk_rope_head_dim=64,
                    qk_head_dim=192,
                    v_head_dim=128,
                    kv_b_proj=None,
                    indexer=indexer,
                    topk_indices_buffer=buffer,
                )
            )
    return impls


def test_rocm_model_builds_layers_without_a_shared_index_group_builder() -> None:
    """The upstream fact the refusal rests on (vLLM 0.33.0)."""
    from vllm.models.deepseek_v32.amd import model as amd_model
    from vllm.models.deepseek_v32.amd.rocm import DeepseekV32MLAAttention

    assert "index_group_builder" not in inspect.signature(DeepseekV32MLAAttention.__init__).parameters
    assert "SparseMLAIndexGroupBuilder" not in inspect.getsource(amd_model)


def test_on_cuda_a_follower_without_a_group_is_refused_without_the_rocm_reason(rocm: Any, installed: Any) -> None:  # noqa: F811
    """The same construction off ROCm (a follower before any leader would reach it): the real cause, no ROCm text."""
    installed(UbatchTopkState(lambda: (0, 0), TopkLayout.WINDOWS))
    with pytest.raises(UnsupportedConfiguration) as err:
        build_rocm_layers(_config(enable_dbo=True), num_layers=8)
    message = str(err.value)
    assert "without a shared index-group builder" in message and "ROCm" not in message and "\n" not in message


def test_rocm_glm5_shared_topk_with_dbo_is_refused_at_construction(
    rocm: Any, installed: Any, monkeypatch: pytest.MonkeyPatch  # noqa: F811
) -> None:
    from dbo_runtime.integration import guard

    monkeypatch.setattr(guard, "platform", lambda: "rocm")  # boundary: no ROCm device here
    installed(UbatchTopkState(lambda: (0, 0), TopkLayout.WINDOWS))
    # GLM-5.3's pattern: layers 0, 1, 2 lead, layer 3 is the first follower.
    with pytest.raises(UnsupportedConfiguration) as err:
        build_rocm_layers(_config(enable_dbo=True), num_layers=8)
    message = str(err.value)
    assert "--enable-dbo" in message and "GlmMoeDsaForCausalLM" in message
    assert "models/deepseek_v32/amd" in message and "without --enable-dbo" in message and "DBO_RUNTIME_DISABLE=1" in message


def test_rocm_leader_only_model_with_dbo_builds(rocm: Any, installed: Any) -> None:  # noqa: F811
    """DeepSeek-V3.2 / GLM-5.1 (every layer runs its indexer) are not affected on ROCm."""
    state = UbatchTopkState(lambda: (0, 0), TopkLayout.WINDOWS)
    installed(state)
    impls = build_rocm_layers(_config(enable_dbo=True), num_layers=8, freq=1)
    assert len(impls) == 8 and all(impl.index_group.has_indexer for impl in impls)
    assert state.num_groups() == 0


def test_rocm_glm5_without_dbo_builds(rocm: Any, installed: Any) -> None:  # noqa: F811
    state = UbatchTopkState(lambda: (0, 0), TopkLayout.WINDOWS)
    installed(state)
    impls = build_rocm_layers(_config(enable_dbo=False), num_layers=8)
    assert len(impls) == 8 and not impls[3].index_group.has_indexer
    assert state.num_groups() == 0


def test_without_the_refusal_rocm_followers_get_no_per_microbatch_state(rocm: Any) -> None:
    """vLLM 0.33.0 as shipped (no patches): the follower builds under DBO with a group of its own and no
    indexer, i.e. nothing links it to a leader and nothing gives it per-microbatch state."""
    impls = build_rocm_layers(_config(enable_dbo=True), num_layers=8)
    follower = impls[3]
    assert follower.index_group is not impls[2].index_group
    assert not follower.index_group.has_indexer and follower.index_group.num_layers == 1
    assert follower.topk_indices_buffer is impls[2].topk_indices_buffer  # the one model-wide buffer
