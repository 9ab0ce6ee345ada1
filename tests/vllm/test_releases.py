"""A vLLM build is identified as a recorded release by its code, and each release installs its own set."""

from __future__ import annotations

import json
from importlib import metadata

import pytest

from dbo_runtime.integration import fingerprints, plugin, releases
from dbo_runtime.integration.catalog import all_reliances
from dbo_runtime.integration.features import Feature, Reliance, verify
from dbo_runtime.integration.fingerprints import RELEASES
from tests.fakes.vllm_build import edited_sources, replace_once
from tests.vllm.conftest import has_module
from tools import record_release

INDEX_GROUP = "vllm.v1.attention.backends.mla.index_group"


def _edit_builder_register_layer(text: str) -> str:
    """One parameter added to ``SparseMLAIndexGroupBuilder.register_layer`` (the group's own is left alone)."""
    head, sep, tail = text.partition("class SparseMLAIndexGroupBuilder")
    assert sep and "    def register_layer(\n        self," in tail
    return head + sep + tail.replace("    def register_layer(\n        self,", "    def register_layer(\n        self, _edited=0,", 1)


EDIT_REGISTER_LAYER = {INDEX_GROUP: _edit_builder_register_layer}


def test_both_supported_releases_are_recorded_and_the_installed_one_is_among_them() -> None:
    assert releases.SUPPORTED[:2] == ("0.33.0", "0.34.0")
    assert metadata.version("vllm") in releases.SUPPORTED


def test_an_edited_build_is_no_release_and_names_what_differs() -> None:
    installed = metadata.version("vllm")

    with edited_sources(EDIT_REGISTER_LAYER):
        match = releases.identify()
        states = plugin.feature_states()
    assert match.release is None and match.closest == installed
    assert "topk.builder_register_layer" in match.differing
    assert match.describe().startswith(f"vLLM {installed}: not a release dbo_runtime verifies (closest {installed}")
    assert states["topk"].verdict == "unverified" and f"vLLM {installed}" in states["topk"].detail
    assert releases.identify().release == installed


def test_a_patch_whose_target_a_release_lacks_is_not_part_of_its_set() -> None:
    """Recorded ``missing`` (the V1 runner's patches in 0.34.0) and absent here: left out, the feature still verifies.
    Recorded ``missing`` but present here: this build is not that release, the feature fails closed. Not recorded at
    all: unknown, fails closed too."""
    from dataclasses import replace

    [mrv2] = [p for p in plugin.all_patches() if p.name == "sm_control.mrv2"]
    ghost = replace(mrv2, name="sm_control.ghost", anchors=("vllm.v1.worker.no_such_module:Nothing",))
    feature = Feature("sm_control", "the SM budget")
    recorded = {mrv2.name: fingerprints.fingerprint(mrv2.fingerprint_anchors), ghost.name: fingerprints.MISSING}
    state = verify([feature], [mrv2, ghost], recorded, "vLLM 9.9.9")["sm_control"]
    assert state.verdict == "verified" and state.patches == [mrv2.name]
    assert not releases.part_of(ghost, recorded) and releases.part_of(mrv2, recorded)
    reappeared = {**recorded, mrv2.name: fingerprints.MISSING}
    state = verify([feature], [mrv2, ghost], reappeared, "vLLM 9.9.9")["sm_control"]
    assert state.verdict == "unverified" and mrv2.name in state.detail
    del recorded[mrv2.name]
    assert verify([feature], [mrv2, ghost], recorded, "vLLM 9.9.9")["sm_control"].verdict == "unverified"


UBATCH_BOUNDARY_EDITS = [
    ("vllm.v1.worker.ubatch_utils", "split_point = int(num_tokens_padded) // num_ubatches",
     "split_point = int(num_tokens_padded) // num_ubatches + 1", "topk.ubatch_slices"),
    ("vllm.v1.worker.gpu.ubatch_utils", "            s.token_slice,\n",
     "            slice(s.token_slice.start + 1, s.token_slice.stop),\n", "topk.ubatch_slices.mrv2"),
] + [
    ("vllm.v1.worker.gpu_ubatch_wrapper", "token_offsets=[s.token_slice.start for s in ubatch_slices]",
     "token_offsets=None", "topk.ubatch_slices.mrv1")
] * has_module("vllm.v1.worker.gpu_ubatch_wrapper")  # fmt: skip


@pytest.mark.parametrize(("module", "old", "new", "reliance"), UBATCH_BOUNDARY_EDITS, ids=[e[3] for e in UBATCH_BOUNDARY_EDITS])
def test_a_moved_microbatch_boundary_makes_the_topk_fix_unverified(module: str, old: str, new: str, reliance: str) -> None:
    """Top-k windows read a microbatch's rows from its token offset: vLLM's slicing code is patched nowhere, yet a
    change there fails the feature closed (the guard refuses DBO for its models) instead of misplacing windows."""
    from dbo_runtime.cli import doctor

    with edited_sources({module: replace_once(old, new)}):
        match = releases.identify()
        states = plugin.feature_states()
        doc = doctor.collect()
    assert match.release is None and match.differing == (reliance,)
    assert [r["name"] for r in doc["relied_on"] if r["fingerprint"] == "differs"] == [reliance]
    assert any(p.startswith("topk (") and "unverified" in p for p in doc["problems"]), doc["problems"]
    assert states["topk"].verdict == "unverified" and states["topk"].detail.endswith(f"at {reliance}")
    assert not states["topk_v41"].installs and states["indexer"].verdict == "verified"
    assert plugin.feature_states()["topk"].verdict == "verified"


TOPK_RELIANCE_EDITS = [
    ("vllm.v1.worker.gpu.ubatch_utils", "    tok_start = ubatch_slice.token_slice.start\n",
     "    tok_start = ubatch_slice.token_slice.start + 1\n", "topk.ubatch_metadata.mrv2"),
    ("vllm.v1.worker.ubatch_utils", "    first_tok = token_slice.start\n", "    first_tok = token_slice.start + 1\n",
     "topk.ubatch_metadata.mrv1"),
    ("vllm.model_executor.layers.attention.sparse_mla_attention", "        topk_start=num_decode_tokens,\n",
     "        topk_start=0,\n", "topk.shardq_start"),
    ("vllm.models.deepseek_v32.nvidia.model", "            and layer_idx % moe_layer_freq == 0\n",
     "            and layer_idx % moe_layer_freq == 1\n", "topk.moe_placement.v32"),
    ("vllm.models.mistral.common.layer_spec", "            and i % moe_layer_freq == 0,\n",
     "            and i % moe_layer_freq == 1,\n", "topk.moe_placement.mistral"),
    ("vllm.model_executor.layers.sparse_attn_indexer", "        num_padded_tokens = batch_size * next_n\n",
     "        num_padded_tokens = batch_size * (next_n + 1)\n", "topk.decode_padding"),
]  # fmt: skip
_IN_THIS_RELEASE = [e for e in TOPK_RELIANCE_EDITS if RELEASES[metadata.version("vllm")].get(e[3]) != fingerprints.MISSING]


@pytest.mark.parametrize(("module", "old", "new", "reliance"), _IN_THIS_RELEASE, ids=[e[3] for e in _IN_THIS_RELEASE])
def test_code_the_topk_windows_and_padding_rule_rely_on_makes_the_fix_unverified(
    module: str, old: str, new: str, reliance: str
) -> None:
    """Per-microbatch metadata, ShardQ's top-k offset, the MoE layer placement ``padding_reaches_live_rows`` reads
    and the padded decode write are patched by no required top-k patch: a change there alone fails topk closed."""
    with edited_sources({module: replace_once(old, new)}):
        match = releases.identify()
        states = plugin.feature_states()
    assert reliance in match.differing
    assert states["topk"].verdict == "unverified" and reliance in states["topk"].detail


def test_code_a_feature_relies_on_is_judged_like_its_required_patches() -> None:
    """Recorded and equal: verified. Differing, unrecorded, or recorded ``missing`` yet present: unverified. Recorded
    ``missing`` and absent: not part of that release (the V1 runner's slicing in 0.34)."""
    [slices] = [r for r in all_reliances() if r.name == "topk.ubatch_slices"]
    feature = Feature("topk", "top-k", relies_on=(slices,))
    printed = fingerprints.fingerprint(slices.anchors)
    assert verify([feature], [], {slices.name: printed}, "vLLM 9.9.9")["topk"].verdict == "verified"
    for recorded in ({slices.name: "0" * 16}, {}, {slices.name: fingerprints.MISSING}):
        state = verify([feature], [], recorded, "vLLM 9.9.9")["topk"]
        assert state.verdict == "unverified" and slices.name in state.detail, recorded
    ghost = Reliance("topk.ghost", ("vllm.v1.worker.no_such_module:split",), "absent from this build")
    assert verify([Feature("topk", "top-k", relies_on=(ghost,))], [], {ghost.name: fingerprints.MISSING}, "vLLM 9.9.9")["topk"].verdict == "verified"
    with pytest.raises(ValueError, match=r"indexer\.split"):
        Feature("topk", "top-k", relies_on=(Reliance("indexer.split", ghost.anchors, "another feature's name"),))


def test_a_patch_left_out_on_purpose_makes_its_architectures_refused() -> None:
    """Recorded ``excluded``: never compared, never installed, and the guard refuses the architectures it serves."""
    patches = [p for p in plugin.all_patches() if p.feature in ("topk_v41", "mtp_hidden")]
    recorded = {p.name: fingerprints.fingerprint(p.fingerprint_anchors) for p in patches}
    v41 = [p for p in patches if p.feature == "topk_v41" or p.name == "mtp_hidden.deepseek_v41"]
    recorded.update({p.name: fingerprints.EXCLUDED for p in v41})
    features = [Feature("topk_v41", "V4.1 top-k"), Feature("mtp_hidden", "MTP hidden rows")]
    states = verify(features, patches, recorded, "vLLM 9.9.9")
    assert states["topk_v41"].verdict == "not in release" and not states["topk_v41"].in_force
    assert not states["topk_v41"].applies and set(states["topk_v41"].left_out) == {p.name for p in v41 if p.feature == "topk_v41"}
    assert states["mtp_hidden"].verdict == "verified" and states["mtp_hidden"].applies
    assert states["mtp_hidden"].left_out == {"mtp_hidden.deepseek_v41": ("DeepseekV41ForCausalLM",)}


def test_record_release_reviews_the_installed_release_as_unchanged(capsys: pytest.CaptureFixture[str]) -> None:
    installed = metadata.version("vllm")
    root = fingerprints.module_file("vllm.config")
    assert root is not None
    assert record_release.main([installed, "--source", str(root.parents[1]), "--against", installed]) == 0
    out, _, call_sites = capsys.readouterr().out.partition("modules calling DeepGEMM's fp8_fp4_paged_mqa_logits")
    assert f"vLLM {installed} against the record of {installed}:" in out
    sites = [ln.split()[:2] for ln in call_sites.splitlines()[1:]]
    assert ["hooked", "vllm.model_executor.layers.sparse_attn_indexer"] in sites, sites
    # reviewed: the only unhooked callers are specialized decode paths that refuse DBO themselves
    assert all(".specialized_decode." in module for status, module in sites if status == "REVIEW"), sites
    lines = [ln.split() for ln in out.splitlines() if ln.startswith("  ") and not ln.startswith("   ")]
    statuses = {parts[0] for parts in lines[:-1]}
    recorded = RELEASES[installed]
    assert statuses <= {"unchanged", "missing", "excluded"}, statuses
    assert {parts[1] for parts in lines[:-1] if parts[0] == "excluded"} == {n for n, v in recorded.items() if v == fingerprints.EXCLUDED}
    assert {parts[1] for parts in lines[:-1] if parts[0] == "missing"} == {n for n, v in recorded.items() if v == fingerprints.MISSING}


def test_record_release_marks_a_changed_anchor_changed(capsys: pytest.CaptureFixture[str]) -> None:
    installed = metadata.version("vllm")
    root = fingerprints.module_file("vllm.config")
    assert root is not None
    with edited_sources(EDIT_REGISTER_LAYER):
        record_release.main([installed, "--source", str(root.parents[1]), "--against", installed])
    out = capsys.readouterr().out
    assert any(ln.split()[:2] == ["changed", "topk.builder_register_layer"] for ln in out.splitlines() if ln.strip())


def test_the_rendered_record_reads_back_as_the_same_releases() -> None:
    assert json.loads(record_release.render(RELEASES)) == RELEASES


def test_record_release_refuses_a_source_of_another_release(capsys: pytest.CaptureFixture[str]) -> None:
    """A ``--source`` holding another release would record its fingerprints under the wrong name: exit 2, one line."""
    installed = metadata.version("vllm")
    root = fingerprints.module_file("vllm.config")
    assert root is not None and record_release.source_version(root.parents[1]) == installed
    other = next(r for r in RELEASES if r != installed)
    before = record_release.RECORD.read_text()
    with pytest.raises(SystemExit) as stop:
        record_release.main([other, "--source", str(root.parents[1]), "--write"])
    assert stop.value.code == 2 and record_release.RECORD.read_text() == before
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"holds vLLM {installed}, not {other}" in err
    with pytest.raises(SystemExit) as stop:
        record_release.main(["abc"])
    assert stop.value.code == 2
    # a local build tag (vLLM's own index: +cu130) is the same release's code
    assert record_release.main([f"{installed}+cu130", "--source", str(root.parents[1]), "--against", installed]) == 0
