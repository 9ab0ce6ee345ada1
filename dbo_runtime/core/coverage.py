"""Which DSA-family architectures dbo_runtime fixes under DBO, which it refuses, and why.

vLLM serves many architectures that run the DSA indexer (bug A: a paged-MQA schedule
planned for the whole GPU) or hand one layer's top-k to later layers through state without a
microbatch dimension (bug B). Each does it its own way, so the guard must know, per
architecture, whether a config shares top-k *the way vLLM builds the layers* and which of
dbo_runtime's fixes must be in force. This table is that knowledge, in one place: the guard
reads it, ``docs/models.md`` is rendered from it (``python -m dbo_runtime.core.coverage``), and
a test fails when vLLM's registry holds a DSA architecture that has no row.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

Sharing = Literal["index_topk_freq", "index_sharing", "hy_v4", "deepseek_v41", "none"]
Status = Literal["fixed", "refused", "not affected"]

RELEASES = ("0.33.0", "0.34.0")

ROCM_MTP_WRITES_AT_OFFSET = frozenset({"DeepseekV4ForCausalLM", "DeepseekV4ForConditionalGeneration"})
"""Architectures whose ROCm model writes the MTP hidden buffer at the microbatch's token offset itself. On ROCm vLLM
imports its AMD model, never the NVIDIA one the ``mtp_hidden`` patches target, so they stay pending: that is a gap
only for the architectures not listed (V4.1's AMD model writes from row 0). A test reads this from each release's
source."""
"""The vLLM releases this table describes, oldest first (each row says which of them register it)."""

TOPK_V32 = "topk"
"""Feature names (``Patch.name`` prefixes) a row may require."""
TOPK_V41 = "topk_v41"
INDEXER = "indexer"
MTP_HIDDEN = "mtp_hidden"


@dataclass(frozen=True)
class Coverage:
    """One architecture: the two bugs, what dbo_runtime does about them, and the proof."""

    architecture: str
    module: str
    bug_a: str
    """How the architecture reaches DeepGEMM's paged-MQA schedule ("" when it does not)."""
    bug_b: str
    """Which state it shares between layers ("" when it shares none)."""
    sharing: Sharing
    """The rule that decides, from the HF config, whether vLLM builds layers that reuse top-k."""
    status: Status
    """Under DBO with sharing: ``fixed`` (dbo_runtime keeps state per microbatch) or ``refused``."""
    needs: tuple[str, ...] = ()
    """Features that must be in force for the fix (bug A needs ``indexer`` whenever ``bug_a``)."""
    refusal: str = ""
    """The real reason, when ``status`` is ``refused`` for a config that shares top-k."""
    evidence: tuple[str, ...] = ()
    notes: str = ""
    releases: tuple[str, ...] = RELEASES
    """The releases whose model registry holds the architecture."""
    per_release: tuple[tuple[str, str], ...] = ()
    """``(release, what holds there)`` where a release differs from ``status`` (vLLM itself refuses DBO, say)."""

    @property
    def uses_indexer(self) -> bool:
        return bool(self.bug_a)

    def status_in(self, release: str) -> str:
        """What holds under DBO in ``release``: ``status``, a release's own line, or "-" where it is not registered."""
        if release not in self.releases:
            return "-"
        return dict(self.per_release).get(release, self.status)


def _v32_family(arch: str, module: str, *, notes: str = "", evidence: tuple[str, ...] = ()) -> Coverage:
    return Coverage(
        architecture=arch,
        module=module,
        bug_a="DeepseekV32Indexer -> sparse_attn_indexer.fp8_fp4_paged_mqa_logits (DeepseekV32IndexerMetadataBuilder)",
        bug_b="model-wide topk_indices_buffer and SparseMLAIndexGroup state when index_topk_freq > 1 or "
        "index_topk_pattern has 'S'",
        sharing="index_topk_freq",
        status="fixed",
        needs=(TOPK_V32,),
        refusal="on ROCm (models/deepseek_v32/amd) the layers get no shared index-group builder",
        evidence=evidence,
        notes=notes,
    )


_GENERIC_REFUSAL = (
    "the generic torch.compiled DeepseekV2 path passes the top-k buffer into compiled graphs, where a "
    "per-microbatch getter would be read once at trace time"
)


def _generic(arch: str, module: str, releases: tuple[str, ...] = RELEASES) -> Coverage:
    return Coverage(
        architecture=arch,
        module=module,
        bug_a="only when the HF config sets index_topk (deepseek_v2.Indexer -> SparseAttnIndexer)",
        bug_b="only with index_topk and index_topk_freq > 1 (shared builder on a compiled model)",
        sharing="index_topk_freq",
        status="refused",
        refusal=_GENERIC_REFUSAL,
        evidence=("tests/vllm/test_topk_patches.py",),
        releases=releases,
    )


def _not_affected(
    arch: str, module: str, why: str, releases: tuple[str, ...] = RELEASES, per_release: tuple[tuple[str, str], ...] = ()
) -> Coverage:
    return Coverage(
        architecture=arch, module=module, bug_a="", bug_b="", sharing="none", status="not affected", notes=why,
        releases=releases, per_release=per_release,
    )  # fmt: skip


NEW_IN_034 = ("0.34.0",)
VLLM_REFUSES_MULTIMODAL = (("0.34.0", "vLLM refuses DBO (multimodal)"),)
VLLM_REFUSES_HYBRID = (("0.34.0", "vLLM refuses DBO (hybrid)"),)
_DRAFTER_034 = (("0.34.0", "not affected (the drafter runs whole, after the microbatched target)"),)


_E2E = "tests/e2e/test_engine_1gpu.py"
_FAMILY_E2E = "tests/e2e/test_family_1gpu.py (docs/records/e2e.jsonl, 1gpu-<model>-*)"
_CALL_SITES = "tests/gpu/test_call_site_gpu.py"
"""The real engine on one GPU: plugin vs vanilla DBO off (eager, graphs) token-identical, DBO at DP 1 starts."""
_V41_EVIDENCE = ("tests/vllm/test_topk_v41.py", "tests/gpu/test_topk_isolation_gpu.py", _FAMILY_E2E, _CALL_SITES)

ROWS: tuple[Coverage, ...] = (
    _v32_family(
        "DeepseekV32ForCausalLM",
        "vllm.models.deepseek_v32",
        evidence=(
            "tests/vllm/test_topk_isolation.py",
            "tests/vllm/test_topk_dcp.py (DCP, MTP)",
            "docs/records/e2e.jsonl (two-GPU A/B records)",
            _E2E,
        ),
    ),
    _v32_family(
        "GlmMoeDsaForCausalLM",
        "vllm.models.deepseek_v32",
        notes="on CUDA an alias of DeepseekV32ForCausalLM; vLLM reads index_topk_freq / index_skip_topk_offset / "
        "index_topk_pattern (a string), never indexer_types",
        evidence=("tests/vllm/test_coverage_rules.py", _E2E, _FAMILY_E2E, _CALL_SITES),
    ),
    Coverage(
        "DeepseekV32MTPModel",
        "vllm.models.deepseek_v32",
        bug_a="the MTP layer's indexer (same call site)",
        bug_b="",
        sharing="none",
        status="not affected",
        notes="MTP layers are always leaders and the drafter never runs microbatched",
    ),
    Coverage(
        "DeepseekV4ForCausalLM",
        "vllm.models.deepseek_v4",
        bug_a="C4 layers' DeepseekV4Indexer -> SparseAttnIndexer (DeepseekV4IndexerBackend, V3.2 builder)",
        bug_b="",
        sharing="none",
        status="not affected",
        needs=(MTP_HIDDEN,),
        notes="each C4 layer writes and reads its own top-k; the MTP hidden buffer (written from row 0 by every "
        "microbatch) is windowed per microbatch",
        evidence=("tests/vllm/test_mtp_hidden.py", _FAMILY_E2E, _CALL_SITES),
    ),
    Coverage(
        "DeepseekV4ForConditionalGeneration",
        "vllm.models.deepseek_v4",
        bug_a="as DeepseekV4ForCausalLM",
        bug_b="",
        sharing="none",
        status="not affected",
        needs=(MTP_HIDDEN,),
        notes="as DeepseekV4ForCausalLM",
    ),
    _not_affected("DeepSeekV4MTPModel", "vllm.models.deepseek_v4", "drafter; never microbatched"),
    _not_affected(
        "DSparkDraftModel", "vllm.models.deepseek_v4", "DSpark runs only on MRV2, which rejects DBO with a drafter",
        per_release=_DRAFTER_034,
    ),
    Coverage(
        "DeepseekV41ForCausalLM",
        "vllm.models.deepseek_v41",
        bug_a="the dense indexer through SparseAttnIndexer (DeepseekV41IndexerBackend, V3.2 builder)",
        bug_b="model-wide topk_indices_buffer written by index_source_layer_ids and read by later compressed "
        "layers; candidate_block_buffer (candidate_source_layer_id)",
        sharing="deepseek_v41",
        status="fixed",
        needs=(TOPK_V41, MTP_HIDDEN),
        refusal="on ROCm (models/deepseek_v41/amd) consumers also read a per-source packed top-k cache",
        evidence=_V41_EVIDENCE,
        notes="vLLM 0.33 runs it with DBO only on MRV1 and refuses Engram with DBO; its specialized decode never "
        "runs microbatched",
        per_release=VLLM_REFUSES_MULTIMODAL,
    ),
    _not_affected(
        "DSparkV41DraftModel", "vllm.models.deepseek_v41", "DSpark runs only on MRV2, which rejects DBO with a drafter",
        per_release=_DRAFTER_034,
    ),
    Coverage(
        "Glm5NextForCausalLM",
        "vllm.models.glm5next",
        bug_a="SparseAttnIndexerKpool -> glm5next/nvidia/sparse_indexer.fp8_fp4_paged_mqa_logits",
        bug_b="",
        sharing="none",
        status="not affected",
        notes="GLM-5.3-Flash: every indexed-attention layer runs its own indexer",
        evidence=(_FAMILY_E2E, _CALL_SITES),
        per_release=VLLM_REFUSES_HYBRID,
    ),
    Coverage(
        "Glm5NextForConditionalGeneration",
        "vllm.models.glm5next",
        bug_a="as Glm5NextForCausalLM",
        bug_b="",
        sharing="none",
        status="not affected",
        per_release=VLLM_REFUSES_MULTIMODAL,
    ),
    _not_affected("Glm5NextMTPModel", "vllm.models.glm5next", "drafter; never microbatched"),
    Coverage(
        "HYV4ForCausalLM",
        "vllm.models.hy_v4",
        bug_a="hy_v4 Indexer -> SparseAttnIndexer (DeepseekV32IndexerCache)",
        bug_b="model-wide topk_indices_buffer read by 'shared' sparse layers (indexer_types)",
        sharing="hy_v4",
        status="refused",
        refusal="HY V4 builds its sparse MLA layers without a shared index-group builder "
        "(models/hy_v4/nvidia/attention.py), so a 'shared' layer's read of the leader's top-k is tied to no "
        "group that per-microbatch state could be attached to",
        evidence=("tests/vllm/test_coverage_rules.py",),
    ),
    _not_affected("HYV4MTPModel", "vllm.models.hy_v4", "drafter; never microbatched"),
    Coverage(
        "Dots3NoteForCausalLM",
        "vllm.models.dots3_note",
        bug_a="full-attention layers' deepseek_v2 Indexer -> SparseAttnIndexer",
        bug_b="only when the checkpoint or --hf-overrides sets index_topk_freq > 1 or an index_topk_pattern with 'S'",
        sharing="index_topk_freq",
        status="refused",
        refusal="Dots3 Note keeps its top-k buffer in a local of the model constructor and builds every layer "
        "without a shared index-group builder, so nothing ties a follower to its leader",
        per_release=VLLM_REFUSES_HYBRID,
    ),
    _not_affected("Dots3NoteMTPModel", "vllm.models.dots3_note", "drafter; never microbatched"),
    _generic("DeepseekV2ForCausalLM", "vllm.model_executor.models.deepseek_v2"),
    _generic("DeepseekV3ForCausalLM", "vllm.model_executor.models.deepseek_v2"),
    _generic("DeepseekForCausalLM", "vllm.model_executor.models.deepseek_v2"),
    _generic("DeepseekV3BidirectionalModel", "vllm.model_executor.models.deepseek_v2"),
    _generic("Glm4MoeLiteForCausalLM", "vllm.model_executor.models.glm4_moe_lite"),
    _generic("MistralLarge3ForCausalLM", "vllm.model_executor.models.mistral_large_3"),
    _generic("KimiK25ForConditionalGeneration", "vllm.model_executor.models.kimi_k25"),
    _generic("KimiVLForConditionalGeneration", "vllm.model_executor.models.kimi_vl"),
    _generic("LongcatFlashForCausalLM", "vllm.model_executor.models.longcat_flash"),
    _generic("UnlimitedOCRForCausalLM", "vllm.model_executor.models.unlimited_ocr"),
    _generic("UnlimitedOCR2TextForCausalLM", "vllm.model_executor.models.unlimited_ocr", releases=NEW_IN_034),
    Coverage(
        "MistralLarge4ForCausalLM",
        "vllm.models.mistral.mistral_large4",
        bug_a="MistralIndexer -> SparseAttnIndexer -> sparse_attn_indexer.fp8_fp4_paged_mqa_logits "
        "(DeepseekV32IndexerBackend, V3.2 builder)",
        bug_b="the model constructor's topk_indices_buffer and SparseMLAIndexGroup state for layers whose "
        "index_sharing entry is not 'full'",
        sharing="index_sharing",
        status="fixed",
        needs=(TOPK_V32,),
        refusal="on ROCm (models/mistral/amd) its indexer holds the top-k buffer where no per-microbatch view reaches it",
        evidence=("tests/vllm/test_topk_mistral_large4.py", "tests/vllm/test_coverage_rules.py"),
        notes="the per-layer aux-stream events are recorded and waited on within one layer call, never across a "
        "microbatch switch",
        releases=NEW_IN_034,
    ),
    _not_affected(
        "MistralLarge4DSparkModel", "vllm.models.mistral.mistral_large4",
        "drafter with no top-k buffer; runs whole, after the microbatched target", releases=NEW_IN_034,
    ),
    _not_affected(
        "KimiK3ForConditionalGeneration", "vllm.models.kimi_k3",
        "vLLM 0.34 gives it a DSA indexer and refuses DBO for it (multimodal)", per_release=VLLM_REFUSES_MULTIMODAL,
    ),
    _not_affected(
        "KimiK31ForConditionalGeneration", "vllm.models.kimi_k3",
        "as KimiK3ForConditionalGeneration", releases=NEW_IN_034, per_release=VLLM_REFUSES_MULTIMODAL,
    ),
    _not_affected(
        "KimiLinearForCausalLM", "vllm.models.kimi_k3",
        "shares its package with Kimi K3's DSA; vLLM refuses DBO for it (hybrid)", per_release=VLLM_REFUSES_HYBRID,
    ),
    _not_affected("KimiK3MTPModel", "vllm.models.kimi_k3", "drafter; never microbatched"),
    _not_affected("DeepSeekMTPModel", "vllm.model_executor.models.deepseek_mtp", "drafter; never microbatched"),
    _not_affected("Glm4MoeLiteMTPModel", "vllm.model_executor.models.glm4_moe_lite_mtp", "drafter; never microbatched"),
    _not_affected("LongCatFlashMTPModel", "vllm.model_executor.models.longcat_flash_mtp", "drafter; never microbatched"),
    _not_affected("EagleDeepSeekMTPModel", "vllm.model_executor.models.deepseek_eagle", "drafter; never microbatched"),
    _not_affected("Eagle3DeepseekV2ForCausalLM", "vllm.model_executor.models.deepseek_eagle3", "drafter; never microbatched"),
    _not_affected("Eagle3DeepseekV3ForCausalLM", "vllm.model_executor.models.deepseek_eagle3", "drafter; never microbatched"),
    _not_affected("EagleMistralLarge3ForCausalLM", "vllm.model_executor.models.mistral_large_3_eagle", "drafter; never microbatched"),
    _not_affected(
        "MiniMaxM3SparseForCausalLM",
        "vllm.models.minimax_m3",
        "its MSA indexer plans no DeepGEMM schedule; on CUDA it shares no top-k (use_index_cache is ROCm only)",
    ),
    _not_affected("MiniMaxM3SparseForConditionalGeneration", "vllm.models.minimax_m3", "as MiniMaxM3SparseForCausalLM"),
    _not_affected("MiniMaxM3MTP", "vllm.models.minimax_m3", "drafter; never microbatched"),
)
"""Every architecture of the releases in ``RELEASES`` whose source builds a DSA indexer, shares top-k between layers or
reuses the DeepSeek-V2/V3.2 layers that can (the registry test lists them)."""

BY_ARCHITECTURE: dict[str, Coverage] = {row.architecture: row for row in ROWS}


# -- the sharing rules, exactly as vLLM builds the layers -----------------------------------------
def _get(config: Any, name: str, default: Any = None) -> Any:
    return getattr(config, name, default) if not isinstance(config, dict) else config.get(name, default)


def v32_followers(config: Any, *, indexer_types: bool | None = None) -> list[int]:
    """Layers DeepSeek-V3.2 / GLM-5.x build without an indexer. ``index_topk_pattern`` (a string, ``'S'`` marks a
    follower) wins over ``index_topk_freq`` / ``index_skip_topk_offset``; a list pattern compares unequal to ``'S'``
    everywhere (the same rule in ``deepseek_v2.py`` and ``hy_v4``). ``indexer_types``: whether vLLM honours that key
    first, as 0.34's ``compute_skip_topk_layers`` does (then its ``'shared'`` entries are the followers and a config
    without ``index_topk`` has none); False: 0.33's rule; None (release unknown): both rules' followers, so a caller
    that does not know the release never misses one."""
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
    out = []
    for layer in range(layers):
        if pattern is None:
            skip = max(layer - offset + 1, 0) % freq != 0
        elif 0 <= layer < len(pattern):
            skip = pattern[layer] == "S"
        else:
            skip = False
        if skip:
            out.append(layer)
    return out


def mistral_followers(config: Any) -> list[int]:
    """Mistral Large 4's layers without an indexer: with ``index_topk``, those whose ``index_sharing`` entry is not
    ``'full'`` (vLLM's ``models/mistral/common/layer_spec.py``)."""
    sharing = _get(config, "index_sharing", None)
    if _get(config, "index_topk") is None or sharing is None:
        return []
    return [i for i, kind in enumerate(sharing) if kind != "full"]


def hy_v4_shared_layers(config: Any) -> list[int]:
    """Sparse layers whose ``indexer_types`` entry is ``shared`` (HY V4 reads the leader's top-k there)."""
    types = _get(config, "indexer_types", None) or ()
    return [i for i, kind in enumerate(types) if str(kind).lower() == "shared"]


def v41_consumers(config: Any) -> list[int]:
    """Backbone layers that read a top-k or candidate set an earlier layer wrote: compressed layers that are not index sources,
    and index sources after the candidate source when the candidate filter is on."""
    layers = int(_get(config, "num_hidden_layers", 0) or 0)
    ratios: Sequence[int] = _get(config, "compress_ratios", None) or ()
    sources = set(_get(config, "index_source_layer_ids", None) or ())
    out = {layer for layer in range(min(layers, len(ratios))) if int(ratios[layer]) > 0 and layer not in sources}
    candidate_source = int(_get(config, "candidate_source_layer_id", -1) if _get(config, "candidate_source_layer_id") is not None else -1)
    if candidate_source >= 0 and int(_get(config, "candidate_topk_blocks", 0) or 0) > 0:
        out |= {s for s in sources if candidate_source < s < layers}
    return sorted(out)


def _generic_markers(config: Any) -> str:
    """For an architecture without a row: any spelling of top-k sharing vLLM models use today."""
    if v32_followers(config):
        return "index_topk_freq / index_topk_pattern / indexer_types declare layers without an indexer"
    if mistral_followers(config):
        return "index_sharing declares layers without an indexer"
    if hy_v4_shared_layers(config):
        return "indexer_types declares 'shared' layers"
    if v41_consumers(config):
        return "index_source_layer_ids leaves compressed layers that reuse an earlier layer's top-k"
    return ""


def shared_topk(architecture: str, config: Any, *, indexer_types: bool | None = None) -> str:
    """Why this config makes vLLM build layers that reuse an earlier layer's top-k ("" when it does not).
    ``indexer_types``: as in ``v32_followers`` (None: the release is not known, every rule counts)."""
    row = BY_ARCHITECTURE.get(architecture)
    if row is None:
        return _generic_markers(config)
    if row.sharing == "index_topk_freq":
        if row.status == "refused" and row.refusal == _GENERIC_REFUSAL and _get(config, "index_topk") is None:
            return ""  # the generic DeepseekV2 path builds no indexer without index_topk
        followers = v32_followers(config, indexer_types=indexer_types)
        return (
            f"layers {_short(followers)} reuse an earlier layer's top-k (index_topk_freq / index_topk_pattern / "
            "indexer_types)" if followers else ""
        )  # fmt: skip
    if row.sharing == "index_sharing":
        followers = mistral_followers(config)
        return f"layers {_short(followers)} reuse an earlier layer's top-k (index_sharing)" if followers else ""
    if row.sharing == "hy_v4":
        shared = hy_v4_shared_layers(config)
        return f"layers {_short(shared)} are 'shared' indexer layers (indexer_types)" if shared else ""
    if row.sharing == "deepseek_v41":
        consumers = v41_consumers(config)
        return f"layers {_short(consumers)} reuse an index source's top-k (index_source_layer_ids)" if consumers else ""
    return ""


def _short(layers: Sequence[int]) -> str:
    shown = ", ".join(str(i) for i in layers[:6])
    return shown + (f", ... ({len(layers)} layers)" if len(layers) > 6 else "")


def uses_indexer(architecture: str, config: Any) -> bool:
    """Whether the model runs the DSA indexer's paged-MQA logits (bug A); unknown architectures with
    ``index_topk`` count, as every DSA config carries it."""
    row = BY_ARCHITECTURE.get(architecture)
    if row is None:
        return _get(config, "index_topk") is not None
    if row.bug_a.startswith("only when"):
        return _get(config, "index_topk") is not None
    return row.uses_indexer


# -- docs/models.md --------------------------------------------------------------------------------
def render() -> str:
    def cell(text: str) -> str:
        return (text or "-").replace("|", "\\|")

    lines = [
        "# DSA-family architectures under DBO",
        "",
        "Generated by `python -m dbo_runtime.core.coverage > docs/models.md` from `dbo_runtime.core.coverage.ROWS`",
        "(a test keeps this file equal to that output, and another fails when vLLM's registry holds a DSA",
        "architecture without a row). Bug A: the indexer's paged-MQA schedule is planned for the whole GPU while DBO",
        "lowers DeepGEMM's SM count. Bug B: layers reuse an earlier layer's top-k through state without a",
        "microbatch dimension. *Status* is what dbo_runtime does under `--enable-dbo` when the config shares top-k:",
        "`fixed` (per-microbatch state), `refused` (engine start stops with one error naming the reason and the ways",
        "out), `not affected`. Bug A is fixed for every architecture that has it (the indexer feature).",
        "The MTP hidden-buffer fix (DeepSeek-V4 / V4.1) is the one fix that is not refused for: without it the",
        "drafter reads the other microbatch's hidden states, which lowers draft acceptance but never changes a",
        "token (the target model verifies every draft), so a worker logs one warning instead.",
        "",
        "One *status* column per vLLM release: `-` where that release does not register the architecture; where",
        "vLLM itself refuses DBO for the architecture in a release, that column says so.",
        "",
        "| architecture | module | bug A | bug B | " + " | ".join(f"status {r}" for r in RELEASES)
        + " | reason / notes | evidence |",
        "|---|---|---|---|" + "---|" * len(RELEASES) + "---|---|",
    ]
    for row in ROWS:
        reason = row.refusal if row.status == "refused" else row.notes
        if row.status == "fixed" and row.refusal:
            reason = (row.notes + "; " if row.notes else "") + "refused " + row.refusal
        statuses = " | ".join(cell(row.status_in(r)) for r in RELEASES)
        lines.append(
            f"| `{row.architecture}` | `{row.module}` | {cell(row.bug_a)} | {cell(row.bug_b)} | {statuses} | "
            f"{cell(reason)} | {cell(', '.join(f'`{e}`' for e in row.evidence))} |"
        )
    lines += [
        "",
        "An architecture without a row whose config spells any known form of top-k sharing (`index_topk_freq`,",
        "`index_topk_pattern`, `indexer_types`, `index_sharing`, `index_source_layer_ids`) is refused under DBO as",
        "unknown.",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    print(render(), end="")
