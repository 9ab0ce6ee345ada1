"""Renders ``docs/models.md``: ``dbo_runtime.core.coverage``'s per-architecture rules (status, needs, refusal), with
the prose only the table shows (where each architecture lives, how it meets the two bugs, the proof, the releases).

Run ``python tools/models_table.py > docs/models.md``; a test compares the committed file with this output, and
another fails when vLLM's registry holds a DSA architecture that has no row.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dbo_runtime.core.coverage import BY_ARCHITECTURE

RELEASES = ("0.33.0", "0.34.0")
"""The vLLM releases this table describes, oldest first (each row says which of them register it)."""


@dataclass(frozen=True)
class Row:
    """One architecture as the table shows it; what dbo_runtime does about it is ``core.coverage``'s rule."""

    architecture: str
    module: str
    bug_a: str
    """How the architecture reaches DeepGEMM's paged-MQA schedule ("" when it does not)."""
    bug_b: str
    """Which state it shares between layers ("" when it shares none)."""
    evidence: tuple[str, ...] = ()
    notes: str = ""
    releases: tuple[str, ...] = RELEASES
    """The releases whose model registry holds the architecture."""
    per_release: tuple[tuple[str, str], ...] = ()
    """``(release, what holds there)`` where a release differs from the rule's status (vLLM itself refuses DBO, say)."""

    def status_in(self, release: str) -> str:
        """What holds under DBO in ``release``: the status, a release's own line, or "-" where it is not registered."""
        if release not in self.releases:
            return "-"
        return dict(self.per_release).get(release, BY_ARCHITECTURE[self.architecture].status)


def _v32_family(arch: str, module: str, *, notes: str = "", evidence: tuple[str, ...] = ()) -> Row:
    return Row(
        architecture=arch,
        module=module,
        bug_a="DeepseekV32Indexer -> sparse_attn_indexer.fp8_fp4_paged_mqa_logits (DeepseekV32IndexerMetadataBuilder)",
        bug_b="model-wide topk_indices_buffer and SparseMLAIndexGroup state when index_topk_freq > 1 or "
        "index_topk_pattern has 'S'",
        evidence=evidence,
        notes=notes,
    )


def _generic(
    arch: str, module: str, releases: tuple[str, ...] = RELEASES, per_release: tuple[tuple[str, str], ...] = ()
) -> Row:
    return Row(
        architecture=arch,
        module=module,
        bug_a="only when the HF config sets index_topk (deepseek_v2.Indexer -> SparseAttnIndexer)",
        bug_b="only with index_topk and index_topk_freq > 1 (shared builder on a compiled model)",
        evidence=("tests/vllm/test_topk_patches.py",),
        releases=releases,
        per_release=per_release,
    )


def _not_affected(
    arch: str, module: str, why: str, releases: tuple[str, ...] = RELEASES, per_release: tuple[tuple[str, str], ...] = ()
) -> Row:
    return Row(arch, module, "", "", notes=why, releases=releases, per_release=per_release)


NEW_IN_034 = ("0.34.0",)
VLLM_REFUSES_MULTIMODAL = (("0.34.0", "vLLM refuses DBO (multimodal)"),)
VLLM_REFUSES_HYBRID = (("0.34.0", "vLLM refuses DBO (hybrid)"),)
_DRAFTER_034 = (("0.34.0", "not affected (the drafter runs whole, after the microbatched target)"),)


_E2E = "tests/e2e/test_engine_1gpu.py"
_FAMILY_E2E = "tests/e2e/test_family_1gpu.py (docs/records/e2e.jsonl, 1gpu-<model>-*)"
_CALL_SITES = "tests/gpu/test_call_site_gpu.py"
"""The real engine on one GPU: plugin vs vanilla DBO off (eager, graphs) token-identical, DBO at DP 1 starts."""
_V41_EVIDENCE = ("tests/vllm/test_topk_v41.py", "tests/gpu/test_topk_isolation_gpu.py", _FAMILY_E2E, _CALL_SITES)

ROWS: tuple[Row, ...] = (
    _v32_family(
        "DeepseekV32ForCausalLM",
        "vllm.models.deepseek_v32",
        evidence=("tests/vllm/test_topk_isolation.py", "tests/vllm/test_topk_dcp.py (DCP, MTP)", "docs/records/e2e.jsonl (two-GPU A/B records)", _E2E),
    ),
    _v32_family(
        "GlmMoeDsaForCausalLM",
        "vllm.models.deepseek_v32",
        notes="on CUDA an alias of DeepseekV32ForCausalLM; followers from index_topk_freq / index_skip_topk_offset / "
        "index_topk_pattern (a string), and in 0.34.0 first from indexer_types (compute_skip_topk_layers)",
        evidence=("tests/vllm/test_coverage_rules.py", _E2E, _FAMILY_E2E, _CALL_SITES),
    ),
    Row(
        "DeepseekV32MTPModel",
        "vllm.models.deepseek_v32",
        bug_a="the MTP layer's indexer (same call site)",
        bug_b="",
        notes="MTP layers are always leaders and the drafter never runs microbatched",
    ),
    Row(
        "DeepseekV4ForCausalLM",
        "vllm.models.deepseek_v4",
        bug_a="C4 layers' DeepseekV4Indexer -> SparseAttnIndexer (DeepseekV4IndexerBackend, V3.2 builder)",
        bug_b="",
        notes="each C4 layer writes and reads its own top-k; the MTP hidden buffer (written from row 0 by every "
        "microbatch) is windowed per microbatch; refused with DP peers on CUDA for vLLM's own compressor crash (below)",
        evidence=("tests/vllm/test_mtp_hidden.py", _FAMILY_E2E, _CALL_SITES),
    ),
    Row(
        "DeepseekV4ForConditionalGeneration",
        "vllm.models.deepseek_v4",
        bug_a="as DeepseekV4ForCausalLM",
        bug_b="",
        notes="as DeepseekV4ForCausalLM (the vision entry point: vLLM's V2 runner refuses it DBO)",
        per_release=VLLM_REFUSES_MULTIMODAL,
    ),
    _not_affected("DeepSeekV4MTPModel", "vllm.models.deepseek_v4", "drafter; never microbatched"),
    _not_affected(
        "DSparkDraftModel", "vllm.models.deepseek_v4", "DSpark runs only on MRV2, which rejects DBO with a drafter",
        per_release=_DRAFTER_034,
    ),
    Row(
        "DeepseekV41ForCausalLM",
        "vllm.models.deepseek_v41",
        bug_a="the dense indexer through SparseAttnIndexer (DeepseekV41IndexerBackend, V3.2 builder)",
        bug_b="model-wide topk_indices_buffer written by index_source_layer_ids and read by later compressed "
        "layers; candidate_block_buffer (candidate_source_layer_id)",
        evidence=_V41_EVIDENCE,
        notes="vLLM 0.33 runs it with DBO only on MRV1 and refuses Engram with DBO; its specialized decode never "
        "runs microbatched",
        per_release=VLLM_REFUSES_MULTIMODAL,
    ),
    _not_affected(
        "DSparkV41DraftModel", "vllm.models.deepseek_v41", "DSpark runs only on MRV2, which rejects DBO with a drafter",
        per_release=_DRAFTER_034,
    ),
    Row(
        "Glm5NextForCausalLM",
        "vllm.models.glm5next",
        bug_a="SparseAttnIndexerKpool -> glm5next/nvidia/sparse_indexer.fp8_fp4_paged_mqa_logits",
        bug_b="",
        notes="GLM-5.3-Flash: every indexed-attention layer runs its own indexer",
        evidence=(_FAMILY_E2E, _CALL_SITES),
        per_release=VLLM_REFUSES_HYBRID,
    ),
    Row(
        "Glm5NextForConditionalGeneration",
        "vllm.models.glm5next",
        bug_a="as Glm5NextForCausalLM",
        bug_b="",
        per_release=VLLM_REFUSES_MULTIMODAL,
    ),
    _not_affected("Glm5NextMTPModel", "vllm.models.glm5next", "drafter; never microbatched"),
    Row(
        "HYV4ForCausalLM",
        "vllm.models.hy_v4",
        bug_a="hy_v4 Indexer -> SparseAttnIndexer (DeepseekV32IndexerCache)",
        bug_b="model-wide topk_indices_buffer read by 'shared' sparse layers (indexer_types)",
        evidence=("tests/vllm/test_coverage_rules.py",),
    ),
    _not_affected("HYV4MTPModel", "vllm.models.hy_v4", "drafter; never microbatched"),
    Row(
        "Dots3NoteForCausalLM",
        "vllm.models.dots3_note",
        bug_a="full-attention layers' deepseek_v2 Indexer -> SparseAttnIndexer",
        bug_b="only when the checkpoint or --hf-overrides sets index_topk_freq > 1 or an index_topk_pattern with 'S'",
        per_release=VLLM_REFUSES_MULTIMODAL,
    ),
    _not_affected("Dots3NoteMTPModel", "vllm.models.dots3_note", "drafter; never microbatched"),
    _generic("DeepseekV2ForCausalLM", "vllm.model_executor.models.deepseek_v2"),
    _generic("DeepseekV3ForCausalLM", "vllm.model_executor.models.deepseek_v2"),
    _generic("DeepseekForCausalLM", "vllm.model_executor.models.deepseek_v2"),
    _generic("DeepseekV3BidirectionalModel", "vllm.model_executor.models.deepseek_v2"),
    _generic("Glm4MoeLiteForCausalLM", "vllm.model_executor.models.glm4_moe_lite"),
    _generic("MistralLarge3ForCausalLM", "vllm.model_executor.models.mistral_large_3"),
    _generic("KimiK25ForConditionalGeneration", "vllm.model_executor.models.kimi_k25", per_release=VLLM_REFUSES_MULTIMODAL),
    _generic("KimiVLForConditionalGeneration", "vllm.model_executor.models.kimi_vl", per_release=VLLM_REFUSES_MULTIMODAL),
    _generic("LongcatFlashForCausalLM", "vllm.model_executor.models.longcat_flash"),
    _generic("UnlimitedOCRForCausalLM", "vllm.model_executor.models.unlimited_ocr", per_release=VLLM_REFUSES_MULTIMODAL),
    _generic("UnlimitedOCR2TextForCausalLM", "vllm.model_executor.models.unlimited_ocr", releases=NEW_IN_034),
    Row(
        "MistralLarge4ForCausalLM",
        "vllm.models.mistral.mistral_large4",
        bug_a="MistralIndexer -> SparseAttnIndexer -> sparse_attn_indexer.fp8_fp4_paged_mqa_logits "
        "(DeepseekV32IndexerBackend, V3.2 builder)",
        bug_b="the model constructor's topk_indices_buffer and SparseMLAIndexGroup state for layers whose "
        "index_sharing entry is not 'full'",
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
    _not_affected(
        "MiniMaxM3SparseForConditionalGeneration", "vllm.models.minimax_m3", "as MiniMaxM3SparseForCausalLM",
        per_release=VLLM_REFUSES_MULTIMODAL,
    ),
    _not_affected("MiniMaxM3MTP", "vllm.models.minimax_m3", "drafter; never microbatched"),
)
"""Every architecture of ``core.coverage``, in the table's order (a test keeps the two sets equal)."""
BY_NAME: dict[str, Row] = {row.architecture: row for row in ROWS}


def render() -> str:
    def cell(text: str) -> str:
        return (text or "-").replace("|", "\\|")

    lines = [
        "# DSA-family architectures under DBO",
        "",
        "Generated by `python tools/models_table.py > docs/models.md` from `dbo_runtime.core.coverage` (the rules the",
        "guard applies) and the prose in `tools/models_table.py` (a test keeps this file equal to that output, and",
        "another fails when vLLM's registry holds a DSA architecture without a row). Bug A: the indexer's paged-MQA",
        "schedule is planned for the whole GPU while DBO lowers DeepGEMM's SM count. Bug B: layers reuse an earlier layer's top-k through state without a",
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
        rule = BY_ARCHITECTURE[row.architecture]
        reason = rule.refusal if rule.status == "refused" else row.notes
        if rule.status == "fixed" and rule.refusal:
            reason = (row.notes + "; " if row.notes else "") + "refused " + rule.refusal
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
        "## vLLM's own crashes under DBO (not bugs A or B; dbo_runtime does not cause them)",
        "",
        "Seen in vanilla vLLM 0.34.0 on one H100 under the one-GPU DBO emulation (`docs/accuracy.md`):",
        "",
        "- `DeepseekV4ForCausalLM`, every DBO step whose second microbatch starts at a token offset that is not a multiple",
        "  of 8: the CuTe DSL compressor (`sparse_attn_compress_cutedsl.py`) is compiled for 64-byte-aligned `positions`",
        "  and slot mappings, and raises `Misaligned Tensor data` on microbatch 1's views. Seen with MTP 1 in eager mode;",
        "  the cause is read from vLLM's code, the same in 0.33.0. dbo_runtime refuses DeepSeek-V4 under DBO with DP",
        "  peers on CUDA while a build's compressor assumes that alignment (`integration/upstream_crashes.py`), so its",
        "  MTP hidden-buffer fix cannot run there until vLLM fixes that; it is proven by CPU tests and a kernel twin.",
        "- `MistralLarge4ForCausalLM` whose every layer has its own indexer, in FULL CUDA graphs: microbatch 1's sparse MLA",
        "  workspace never grows before vLLM locks it, and the first long microbatched prefill raises `Workspace is",
        "  locked`. A layer that reuses a leader's top-k grows it, so a model with followers is not affected;",
        "  `VLLM_MULTI_STREAM_GEMM_TOKEN_THRESHOLD=0` avoids it.",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    import argparse

    argparse.ArgumentParser(prog=Path(__file__).name, description=(__doc__ or "").split("\n\n")[0]).parse_args()
    print(render(), end="")
