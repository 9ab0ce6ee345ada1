"""Per-microbatch top-k and candidate blocks for DeepSeek-V4.1 under DBO (vllm#56476), shared through model buffers
across MoE yields: the setters register them with ``topk_state``, the getters resolve the calling microbatch's view.
Steps aside where vLLM has ``ubatching.dbo_select_buffer`` (the upstream fix)."""

from __future__ import annotations

from dbo_runtime.core import coverage
from dbo_runtime.integration.features import Feature, Probe, Upstream
from dbo_runtime.integration.patching import Patch
from dbo_runtime.integration.topk_hooks import TopkIndicesBufferAttr, default_state
from dbo_runtime.services.topk_state import UbatchTopkState

UPSTREAM_PR = "vllm#56476 (DeepSeek-V4.1 per-microbatch sparse index state), open"
REMOVAL = "remove when the supported vLLM isolates V4.1's index state per microbatch (vllm#56476 merged)"
V41_MODEL = "vllm.models.deepseek_v41.nvidia.model"
V41_ATTENTION = "vllm.models.deepseek_v41.attention"
SPARSE_INDEXER = "vllm.model_executor.layers.sparse_attn_indexer"
SPARSE_MQA = "vllm.model_executor.layers.sparse_mqa_indexer"
ARCHITECTURES = ("DeepseekV41ForCausalLM",)

FEATURES = [
    Feature(
        coverage.TOPK_V41,
        "per-microbatch DeepSeek-V4.1 top-k and candidate blocks (vllm#56476)",
        requires=("ubatch_guard", coverage.TOPK_V32),
        upstream=Upstream(
            "vllm#56476: ubatching.dbo_select_buffer picks each microbatch's index state",
            (
                Probe("member", "vllm.v1.worker.ubatching", "", "dbo_select_buffer"),
                Probe("call", "vllm.model_executor.layers.sparse_attn_indexer", "", "dbo_select_buffer"),
            ),
        ),
    )
]


def _patch(state: UbatchTopkState, module: str, cls: str, attr: str, *, registers: bool = False) -> Patch:
    return Patch(
        name=f"topk_v41.{cls}.{attr}",
        module=module,
        attr=f"{cls}.{attr}",
        make=lambda original: TopkIndicesBufferAttr(state, attr, registers=registers),
        reason=(
            "the model-wide buffer: under DBO, register per-microbatch views at assignment (model construction)"
            if registers
            else "writers and readers of V4.1's shared index state resolve the calling microbatch's view"
        ),
        upstream_pr=UPSTREAM_PR,
        removal=REMOVAL,
        lazy=True,
        adds=True,
        architectures=ARCHITECTURES,
        runs_on_ubatch_thread=True,
        # setters act at model construction: always in force
        armed_at_first_microbatch=not registers,
    )


def patches(state: UbatchTopkState | None = None) -> list[Patch]:
    st = state if state is not None else default_state()
    return [
        _patch(st, V41_MODEL, "DeepseekV4Model", "topk_indices_buffer", registers=True),
        _patch(st, V41_MODEL, "DeepseekV4Model", "candidate_block_buffer", registers=True),
        _patch(st, V41_ATTENTION, "DeepseekV4Attention", "topk_indices_buffer"),
        _patch(st, V41_ATTENTION, "DeepseekV4Attention", "candidate_block_buffer"),
        _patch(st, V41_ATTENTION, "DeepseekV4Indexer", "topk_indices_buffer"),
        _patch(st, SPARSE_INDEXER, "SparseAttnIndexer", "candidate_blocks"),
        _patch(st, SPARSE_MQA, "SparseMQAIndexer", "topk_indices_buffer"),
        _patch(st, SPARSE_MQA, "SparseMQAIndexer", "candidate_blocks"),
    ]
