"""Per DSA-family architecture: whether a config shares top-k the way vLLM builds the layers (bug B) or runs the
indexer (bug A), and which fixes must be in force under DBO or why it is refused. The guard reads these rules;
``tools/models_table.py`` renders them into ``docs/models.md``."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

Sharing = Literal["index_topk_freq", "index_sharing", "hy_v4", "deepseek_v41", "none"]
Status = Literal["fixed", "refused", "not affected"]
Indexer = Literal["always", "with index_topk", "never"]

ROCM_MTP_WRITES_AT_OFFSET = frozenset({"DeepseekV4ForCausalLM", "DeepseekV4ForConditionalGeneration"})
"""ROCm models that write the MTP hidden buffer at the microbatch's offset themselves (``mtp_hidden`` is NVIDIA-only)."""
UNALIGNED_COMPRESSOR = frozenset({"DeepseekV4ForCausalLM", "DeepseekV4ForConditionalGeneration"})
"""CUDA models that run vLLM's V4 CuTe compressor."""

TOPK_V32 = "topk"
"""Feature names (``Patch.name`` prefixes) a row may require."""
TOPK_V41 = "topk_v41"
INDEXER = "indexer"
MTP_HIDDEN = "mtp_hidden"


@dataclass(frozen=True)
class Coverage:
    """One architecture's rule."""

    architecture: str
    sharing: Sharing
    status: Status = "not affected"
    needs: tuple[str, ...] = ()
    """Features the fix needs in force (bug A: ``indexer``, whenever ``indexer`` is not ``never``)."""
    refusal: str = ""
    """Why a sharing config is refused (for ``fixed``: on ROCm)."""
    indexer: Indexer = "always"


_GENERIC_REFUSAL = (
    "the generic torch.compiled DeepseekV2 path passes the top-k buffer into compiled graphs, where a "
    "per-microbatch getter would be read once at trace time"
)
_ROCM = "on ROCm (models/{}/amd) "


def _v32(arch: str) -> Coverage:
    return Coverage(arch, "index_topk_freq", "fixed", (TOPK_V32,), _ROCM.format("deepseek_v32") + "the layers get no shared index-group builder")


_DRAFTERS_AND_OTHERS = (
    "DeepSeekV4MTPModel", "DSparkDraftModel", "DSparkV41DraftModel", "Glm5NextMTPModel", "HYV4MTPModel", "Dots3NoteMTPModel",
    "MistralLarge4DSparkModel", "KimiK3ForConditionalGeneration", "KimiK31ForConditionalGeneration", "KimiLinearForCausalLM",
    "KimiK3MTPModel", "DeepSeekMTPModel", "Glm4MoeLiteMTPModel", "LongCatFlashMTPModel", "EagleDeepSeekMTPModel",
    "Eagle3DeepseekV2ForCausalLM", "Eagle3DeepseekV3ForCausalLM", "EagleMistralLarge3ForCausalLM", "MiniMaxM3SparseForCausalLM",
    "MiniMaxM3SparseForConditionalGeneration", "MiniMaxM3MTP",
)  # fmt: skip
_GENERIC = (
    "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "DeepseekForCausalLM", "DeepseekV3BidirectionalModel",
    "Glm4MoeLiteForCausalLM", "MistralLarge3ForCausalLM", "KimiK25ForConditionalGeneration", "KimiVLForConditionalGeneration",
    "LongcatFlashForCausalLM", "UnlimitedOCRForCausalLM", "UnlimitedOCR2TextForCausalLM",
)  # fmt: skip

ROWS: tuple[Coverage, ...] = (
    _v32("DeepseekV32ForCausalLM"),
    _v32("GlmMoeDsaForCausalLM"),
    Coverage("DeepseekV32MTPModel", "none"),
    Coverage("DeepseekV4ForCausalLM", "none", needs=(MTP_HIDDEN,)),
    Coverage("DeepseekV4ForConditionalGeneration", "none", needs=(MTP_HIDDEN,)),
    Coverage(
        "DeepseekV41ForCausalLM", "deepseek_v41", "fixed", (TOPK_V41, MTP_HIDDEN),
        _ROCM.format("deepseek_v41") + "consumers also read a per-source packed top-k cache",
    ),
    Coverage("Glm5NextForCausalLM", "none"),
    Coverage("Glm5NextForConditionalGeneration", "none"),
    Coverage(
        "HYV4ForCausalLM", "hy_v4", "refused",
        refusal="HY V4 builds its sparse MLA layers without a shared index-group builder "
        "(models/hy_v4/nvidia/attention.py), so a 'shared' layer's read of the leader's top-k is tied to no "
        "group that per-microbatch state could be attached to",
    ),
    Coverage(
        "Dots3NoteForCausalLM", "index_topk_freq", "refused",
        refusal="Dots3 Note keeps its top-k buffer in a local of the model constructor and builds every layer "
        "without a shared index-group builder, so nothing ties a follower to its leader",
    ),
    Coverage(
        "MistralLarge4ForCausalLM", "index_sharing", "fixed", (TOPK_V32,),
        _ROCM.format("mistral") + "its indexer holds the top-k buffer where no per-microbatch view reaches it",
    ),
    *(Coverage(arch, "index_topk_freq", "refused", refusal=_GENERIC_REFUSAL, indexer="with index_topk") for arch in _GENERIC),
    *(Coverage(arch, "none", indexer="never") for arch in _DRAFTERS_AND_OTHERS),
)
"""Every architecture whose source builds a DSA indexer, shares top-k or reuses DeepSeek-V2/V3.2 layers that can."""

BY_ARCHITECTURE: dict[str, Coverage] = {row.architecture: row for row in ROWS}


# -- the sharing rules, exactly as vLLM builds the layers -----------------------------------------
def _get(config: Any, name: str, default: Any = None) -> Any:
    return getattr(config, name, default) if not isinstance(config, dict) else config.get(name, default)


def v32_followers(config: Any, *, indexer_types: bool | None = None) -> list[int]:
    """Layers DeepSeek-V3.2 / GLM-5.x build without an indexer: ``index_topk_pattern`` (``'S'``) wins over
    ``index_topk_freq`` / ``index_skip_topk_offset``. ``indexer_types``: whether vLLM honours that key first
    (``compute_skip_topk_layers``: its ``'shared'`` entries, none without ``index_topk``); None: both."""
    if indexer_types is None:
        return sorted(set(v32_followers(config, indexer_types=False)) | set(v32_followers(config, indexer_types=True)))
    if indexer_types:
        if _get(config, "index_topk") is None:
            return []
        if _get(config, "indexer_types") is not None:
            return hy_v4_shared_layers(config)
    layers = int(_get(config, "num_hidden_layers", 0) or 0)
    freq = int(_get(config, "index_topk_freq", 1) or 1)
    pattern = _get(config, "index_topk_pattern", None)
    offset = int(_get(config, "index_skip_topk_offset", 2))
    if pattern is None:
        return [layer for layer in range(layers) if max(layer - offset + 1, 0) % freq != 0]
    return [layer for layer in range(min(layers, len(pattern))) if pattern[layer] == "S"]


def mistral_followers(config: Any) -> list[int]:
    """Mistral Large 4's layers without an indexer: with ``index_topk``, those whose ``index_sharing`` is not ``'full'``."""
    sharing = _get(config, "index_sharing", None)
    if _get(config, "index_topk") is None or sharing is None:
        return []
    return [i for i, kind in enumerate(sharing) if kind != "full"]


def hy_v4_shared_layers(config: Any) -> list[int]:
    """HY V4's layers whose ``indexer_types`` entry is ``shared``."""
    types = _get(config, "indexer_types", None) or ()
    return [i for i, kind in enumerate(types) if str(kind).lower() == "shared"]


def v41_consumers(config: Any) -> list[int]:
    """Layers that read a top-k or candidate set an earlier layer wrote: compressed non-source layers, and sources
    after the candidate source when the candidate filter is on."""
    layers = int(_get(config, "num_hidden_layers", 0) or 0)
    ratios: Sequence[int] = _get(config, "compress_ratios", None) or ()
    sources = set(_get(config, "index_source_layer_ids", None) or ())
    out = {layer for layer in range(min(layers, len(ratios))) if int(ratios[layer]) > 0 and layer not in sources}
    candidate_source = int(_get(config, "candidate_source_layer_id", -1) if _get(config, "candidate_source_layer_id") is not None else -1)
    if candidate_source >= 0 and int(_get(config, "candidate_topk_blocks", 0) or 0) > 0:
        out |= {s for s in sources if candidate_source < s < layers}
    return sorted(out)


def _generic_markers(config: Any) -> str:
    """Without a row: any spelling of top-k sharing vLLM models use."""
    if v32_followers(config):
        return "index_topk_freq / index_topk_pattern / indexer_types declare layers without an indexer"
    if mistral_followers(config):
        return "index_sharing declares layers without an indexer"
    if hy_v4_shared_layers(config):
        return "indexer_types declares 'shared' layers"
    if v41_consumers(config):
        return "index_source_layer_ids leaves compressed layers that reuse an earlier layer's top-k"
    return ""


_SHARING: dict[str, tuple[Callable[[Any, bool | None], list[int]], str]] = {
    "index_topk_freq": (
        lambda config, types: v32_followers(config, indexer_types=types),
        "reuse an earlier layer's top-k (index_topk_freq / index_topk_pattern / indexer_types)",
    ),
    "index_sharing": (lambda config, _: mistral_followers(config), "reuse an earlier layer's top-k (index_sharing)"),
    "hy_v4": (lambda config, _: hy_v4_shared_layers(config), "are 'shared' indexer layers (indexer_types)"),
    "deepseek_v41": (lambda config, _: v41_consumers(config), "reuse an index source's top-k (index_source_layer_ids)"),
}


def shared_topk(architecture: str, config: Any, *, indexer_types: bool | None = None) -> str:
    """Why this config makes vLLM build layers that reuse an earlier layer's top-k ("" when it does not);
    ``indexer_types`` as in ``v32_followers``."""
    row = BY_ARCHITECTURE.get(architecture)
    if row is None:
        return _generic_markers(config)
    if row.sharing == "none" or (row.indexer == "with index_topk" and _get(config, "index_topk") is None):
        return ""  # the generic DeepseekV2 path builds no indexer without index_topk
    followers, what = _SHARING[row.sharing]
    layers = followers(config, indexer_types)
    return f"layers {_short(layers)} {what}" if layers else ""


def _short(layers: Sequence[int]) -> str:
    shown = ", ".join(str(i) for i in layers[:6])
    return shown + (f", ... ({len(layers)} layers)" if len(layers) > 6 else "")


def uses_indexer(architecture: str, config: Any) -> bool:
    """Whether the model runs the DSA indexer's paged-MQA logits (bug A); unknown ones do with ``index_topk``."""
    row = BY_ARCHITECTURE.get(architecture)
    if row is None or row.indexer == "with index_topk":
        return _get(config, "index_topk") is not None
    return row.indexer == "always"
