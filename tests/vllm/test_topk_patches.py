"""Top-k patch set against the real vLLM 0.33.0 classes: identity on uninstall, MTP re-pointing, refusals."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch

from dbo_runtime.core.errors import UnsupportedConfiguration
from dbo_runtime.integration import topk_hooks
from dbo_runtime.integration.patching import Patch, PatchSet, resolve_owner
from dbo_runtime.services.topk_state import TopkLayout, UbatchTopkState
from tests.vllm.test_topk_isolation import boundary, build_model, dbo_config, installed  # noqa: F401 - fixtures


@dataclass
class FakeHfConfig:
    """The HF-config keys the HiSparse refusal reads (a real one needs a model download)."""

    index_topk_freq: int
    num_hidden_layers: int = 8
    index_topk: int = 2048
    """Every DSA config has it; vLLM 0.34's follower rule (``compute_skip_topk_layers``) reads no other key without."""


@dataclass
class FakeModelConfig:
    """vLLM's ModelConfig needs a model's HF config; the refusal only reads ``hf_config`` and the architecture."""

    hf_config: FakeHfConfig
    architecture: str = "GlmMoeDsaForCausalLM"

ATTR = "topk_indices_buffer"


def _classes() -> dict[str, type]:
    from vllm.model_executor.layers.attention.sparse_mla_attention import SharedTopkIndicesBuffer
    from vllm.model_executor.layers.sparse_attn_indexer import SparseAttnIndexer
    from vllm.models.deepseek_v32.attention import DeepseekV32Attention, DeepseekV32Indexer
    from vllm.models.deepseek_v32.nvidia.model import DeepseekV32Model

    return {
        "attn": DeepseekV32Attention,
        "indexer": DeepseekV32Indexer,
        "op": SparseAttnIndexer,
        "model": DeepseekV32Model,
        "shared": SharedTopkIndicesBuffer,
    }


def test_uninstall_restores_identical_objects(fresh_arming: Any) -> None:
    import importlib

    patches = []
    for p in topk_hooks.patches(UbatchTopkState(lambda: (0, 0))):
        try:
            importlib.import_module(p.module)
        except ImportError:
            # Only the optional FA4 target needs the CUDA flash-attention extensions; it is covered
            # by tests/vllm/test_topk_fa4_key.py against the 0.33.0 source.
            assert p.optional, p.name
            continue
        patches.append(p)
    before = {}
    for p in patches:
        owner, name = resolve_owner(importlib.import_module(p.module), p.attr)
        before[p.name] = owner.__dict__.get(name, "<absent>")
    def found(p: Patch) -> Any:
        owner, name = resolve_owner(importlib.import_module(p.module), p.attr)
        return owner.__dict__.get(name, "<absent>")

    armable = {p.name for p in patches if p.armed_at_first_microbatch}
    fa4 = {topk_hooks.FA4_SCALARS} & {p.name for p in patches}  # where FA4 sparse MLA imports in this process
    assert armable == {
        "topk.group_convert_once", "topk.group_set_logical_topk_ready", "topk.SharedTopkIndicesBuffer.topk_indices_buffer",
        "topk.DeepseekV32Attention.topk_indices_buffer", "topk.DeepseekV32Indexer.topk_indices_buffer",
        "topk.SparseAttnIndexer.topk_indices_buffer",
    } | fa4  # fmt: skip
    for arm in (False, True):
        ps = PatchSet(patches)
        ps.install()
        try:
            for p in patches:  # until the first microbatched run the per-access hooks are vLLM's own objects
                assert (found(p) is before[p.name]) == (p.name in armable), p.name
            if arm:
                fresh_arming.arm("test")
                for p in patches:
                    assert found(p) is not before[p.name], p.name
        finally:
            ps.uninstall()
        for p in patches:
            assert found(p) is before[p.name], p.name
        assert fresh_arming.names() == [] and not fresh_arming.armed  # the next installation starts unarmed
    for key in ("attn", "indexer", "op", "model"):
        assert ATTR not in _classes()[key].__dict__
    assert isinstance(getattr(*resolve_owner(importlib.import_module(patches[3].module), patches[3].attr)), property)


def test_live_modules_keep_their_buffer_across_uninstall() -> None:
    import torch.nn as nn

    cls = _classes()["attn"]
    ps = PatchSet(topk_hooks.patches(UbatchTopkState(lambda: (0, 0))))
    ps.install()
    obj = object.__new__(cls)
    nn.Module.__init__(obj)
    buf = torch.zeros(4, 2, dtype=torch.int32)
    obj.topk_indices_buffer = buf
    ps.uninstall()
    assert obj.topk_indices_buffer is buf


def _new(cls: type) -> Any:
    import torch.nn as nn

    obj = object.__new__(cls)
    nn.Module.__init__(obj)
    return obj


@pytest.mark.parametrize("runner", ["mrv1_del_then_assign", "mrv2_assign"])
def test_mtp_repointing_with_descriptors(installed: Any, runner: str) -> None:  # noqa: F811
    """LLMBaseProposer.load_model (MRV1) / load_eagle_model (MRV2) statements on patched classes."""
    from vllm.model_executor.layers.attention.sparse_mla_attention import SparseMLACommonImpl

    c = _classes()
    # A live DBO microbatch 1 at offset 4 must not leak into the (never microbatched) draft.
    located = {"value": (0, 0)}
    state = UbatchTopkState(lambda: located["value"], TopkLayout.WINDOWS)
    installed(state)

    target = _new(c["model"])
    target.topk_indices_buffer = torch.zeros(8, 2, dtype=torch.int32)
    target_buffer = target.topk_indices_buffer
    assert state.is_model_buffer(target_buffer)

    draft_inner = _new(c["model"])
    draft_inner.topk_indices_buffer = torch.ones(8, 2, dtype=torch.int32)
    attn, indexer, op = _new(c["attn"]), _new(c["indexer"]), _new(c["op"])
    own = draft_inner.topk_indices_buffer
    for m in (attn, indexer, op):
        m.topk_indices_buffer = own
    impl = object.__new__(SparseMLACommonImpl)
    impl.init_topk_indices_buffer(indexer, own)

    if runner == "mrv1_del_then_assign":
        assert hasattr(draft_inner, ATTR)
        del draft_inner.topk_indices_buffer
        assert not hasattr(draft_inner, ATTR)
        with pytest.raises(AttributeError):
            del draft_inner.topk_indices_buffer
        draft_inner.topk_indices_buffer = target_buffer
    for m in (draft_inner, attn, indexer, op):
        if hasattr(m, ATTR):
            m.topk_indices_buffer = target_buffer

    for m in (draft_inner, attn, indexer, op):
        assert m.topk_indices_buffer is target_buffer
    assert impl.topk_indices_buffer is target_buffer
    assert not hasattr(_new(c["attn"]), ATTR)  # hasattr stays False where vLLM never set it


def test_hisparse_with_dbo_and_followers_refuses(boundary: Any, installed: Any) -> None:  # noqa: F811
    installed(UbatchTopkState(lambda: (0, 0)))
    config = dbo_config()
    config.attention_config.hisparse_config = object()
    # Refused at the first follower ...
    with pytest.raises(UnsupportedConfiguration, match=r"refuses HiSparse .*--enable-dbo.*reuse an earlier layer.s top-k.*Ways out"):
        _register_follower(config)
    # ... and, when the HF config declares followers, before HiSparse builds the leader's caches.
    config.model_config = FakeModelConfig(hf_config=FakeHfConfig(index_topk_freq=4))
    with pytest.raises(UnsupportedConfiguration, match=r"refuses HiSparse .*--enable-dbo.*reuse an earlier layer.s top-k.*Ways out"):
        build_model(config)


def _register_follower(config: Any) -> None:
    from vllm.v1.attention.backends.mla.index_group import SparseMLAIndexGroupBuilder

    builder = SparseMLAIndexGroupBuilder(torch.zeros(8, 2, dtype=torch.int32), 4)
    builder.current_group = object()  # a leader registered earlier (HiSparse leader state needs a real model)
    builder.register_layer(False, config)


def test_generic_path_with_dbo_and_followers_refuses(boundary: Any, installed: Any) -> None:  # noqa: F811
    """A builder whose buffer is not DeepseekV32Model's (compiled DeepseekV2Model / Glm4MoeLite path)."""
    from vllm.v1.attention.backends.mla.index_group import SparseMLAIndexGroupBuilder

    state = UbatchTopkState(lambda: (0, 0))
    installed(state)
    builder = SparseMLAIndexGroupBuilder(torch.zeros(8, 2, dtype=torch.int32), 4)
    config = dbo_config()
    builder.register_layer(True, config)  # a leader alone is fine
    with pytest.raises(UnsupportedConfiguration, match=r"refuses .* with --enable-dbo: .*not the CUDA DSA model.*Ways out") as err:
        builder.register_layer(False, config)
    assert "install a vLLM release" not in str(err.value)  # the model is the cause: no release would lift it
    # Without DBO the same model builds and nothing is attached.
    builder2 = SparseMLAIndexGroupBuilder(torch.zeros(8, 2, dtype=torch.int32), 4)
    builder2.register_layer(True, dbo_config(enable_dbo=False))
    group, index = builder2.register_layer(False, dbo_config(enable_dbo=False))
    assert index == 1 and not state.is_attached(group)


def test_bad_layout_env_is_one_clear_error(boundary: Any, installed: Any, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    from dbo_runtime.core.errors import ConfigError

    monkeypatch.setenv("DBO_RUNTIME_TOPK_LAYOUT", "shared")
    installed(UbatchTopkState(lambda: (0, 0)))
    with pytest.raises(ConfigError, match=r"DBO_RUNTIME_TOPK_LAYOUT='shared'.*'windows', 'copies'"):
        build_model(dbo_config())


def test_main_thread_resolution_never_raises_while_ubatch_threads_registered(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's dbo_current_ubatch_id() raises KeyError here; ubatch_ids does not."""
    import threading

    from vllm.v1.worker import ubatching

    from dbo_runtime.integration import ubatch_ids

    monkeypatch.setitem(ubatching._THREAD_ID_TO_CONTEXT, threading.get_ident() + 1, 1)
    with pytest.raises(KeyError):
        ubatching.dbo_current_ubatch_id()
    assert ubatch_ids.current_ubatch()[0] == 0
    assert ubatch_ids.current_ubatch() == (0, 0)


def test_hot_hooks_are_one_frame_in_vllms_signature_and_followers_never_call_through(fresh_arming: Any) -> None:
    """The three per-layer method hooks and the call site run as one Python frame each (they shield themselves, so
    ``PatchSet`` adds no wrapper), take vLLM's own parameters, and ``set_logical_topk_ready`` answers a follower
    layer without calling vLLM, whose first statement returns for it (``_ready_patch``)."""
    import inspect

    import vllm.model_executor.layers.sparse_attn_indexer as call_site
    import vllm.utils.deep_gemm as dg
    from vllm.model_executor.layers.attention.sparse_mla_attention import SharedTopkIndicesBuffer
    from vllm.v1.attention.backends.mla.index_group import SparseMLAIndexGroup

    from dbo_runtime.integration import indexer_hooks
    from dbo_runtime.integration.ubatch_failures import SHIELDS_ITSELF

    originals = {
        "_convert_once": SparseMLAIndexGroup.__dict__["_convert_once"],
        "set_logical_topk_ready": SparseMLAIndexGroup.__dict__["set_logical_topk_ready"],
    }
    calls: list[int] = []

    def spy(self: Any, layer_index: int) -> None:
        calls.append(layer_index)

    SparseMLAIndexGroup.set_logical_topk_ready = spy  # type: ignore[method-assign]
    state = UbatchTopkState(lambda: (0, 0))
    hot = {"topk.group_convert_once", "topk.group_set_logical_topk_ready", "topk.SharedTopkIndicesBuffer.topk_indices_buffer"}
    chosen = [p for p in topk_hooks.patches(state) if p.name in hot]
    chosen += [p for p in indexer_hooks.patches() if p.name == "indexer.logits.sparse_attn_indexer"]
    patch_set = PatchSet(chosen)
    patch_set.install()
    fresh_arming.arm("test")  # the per-layer top-k hooks are in force from the first microbatched run on
    try:
        convert = SparseMLAIndexGroup.__dict__["_convert_once"]
        ready = SparseMLAIndexGroup.__dict__["set_logical_topk_ready"]
        prop = SharedTopkIndicesBuffer.__dict__[ATTR]
        logits = call_site.fp8_fp4_paged_mqa_logits
        for fn in (convert, ready, prop.fget, logits):
            assert getattr(fn, SHIELDS_ITSELF, False), fn
        def shape(fn: Any) -> list[tuple[str, Any, Any]]:  # the hook's own parameters, not its __wrapped__'s
            return [(p.name, p.kind, p.default) for p in inspect.signature(fn, follow_wrapped=False).parameters.values()]

        assert shape(convert) == shape(originals["_convert_once"])
        assert shape(logits) == shape(dg.fp8_fp4_paged_mqa_logits)
        group = object.__new__(SparseMLAIndexGroup)
        for layer in (3, 1, 0):
            group.set_logical_topk_ready(layer)
        assert calls == [0]  # only a group's first layer reaches vLLM
    finally:
        patch_set.uninstall()
        SparseMLAIndexGroup.set_logical_topk_ready = originals["set_logical_topk_ready"]  # type: ignore[method-assign]
    assert SparseMLAIndexGroup.__dict__["_convert_once"] is originals["_convert_once"]
