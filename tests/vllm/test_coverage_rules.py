"""``core.coverage``'s sharing rules against the installed vLLM's own layer construction and real HF configs.

vLLM decides which layers get an indexer inside ``DeepseekV32Attention.__init__``, a constructor that needs a GPU
model. vLLM 0.33 spells the rule out there: the test runs those statements, cut from the installed source; vLLM 0.34
calls ``compute_skip_topk_layers`` (which reads ``indexer_types`` first): the test calls it. Either way it runs on
real HF config objects and compares every layer with ``v32_followers`` under the rule the installed code has.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from typing import Any

import pytest

from dbo_runtime.core import coverage
from dbo_runtime.integration.topk_hooks import honours_indexer_types
from tools import models_table

RULE = honours_indexer_types()
"""Whether the installed vLLM reads ``indexer_types`` first (``compute_skip_topk_layers``)."""


def _vllm_rule() -> Any:
    """How ``DeepseekV32Attention.__init__`` decides ``skip_topk``, as a function of (config, layer)."""
    from vllm.models.deepseek_v32.attention import DeepseekV32Attention

    if RULE:
        from vllm.model_executor.models.utils import compute_skip_topk_layers

        assert "skip_topk = layer_id in compute_skip_topk_layers(config)" in inspect.getsource(DeepseekV32Attention)
        return lambda config, layer_id: layer_id in compute_skip_topk_layers(config)
    tree = ast.parse(textwrap.dedent(inspect.getsource(DeepseekV32Attention.__init__)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    start = next(i for i, node in enumerate(body) if "index_topk_freq" in ast.unparse(node))
    stop = next(i for i, node in enumerate(body) if isinstance(node, ast.If) and "skip_topk" in ast.unparse(node)) + 1
    source = "\n".join(ast.unparse(node) for node in body[start:stop])
    assert source.count("skip_topk =") == 3, source  # pattern None / in range / past the pattern

    def skip(config: Any, layer_id: int) -> bool:
        scope: dict[str, Any] = {"config": config, "layer_id": layer_id}
        exec(source, {}, scope)
        return bool(scope["skip_topk"])

    return skip


def _glm(**kw: Any) -> Any:
    import transformers

    return transformers.GlmMoeDsaConfig(**kw)


CONFIGS = {
    "glm-5.3 (freq 4, offset 3, 78 layers)": dict(num_hidden_layers=78, index_topk_freq=4, index_skip_topk_offset=3),
    "freq 2, default offset": dict(num_hidden_layers=12, index_topk_freq=2),
    "pattern string": dict(num_hidden_layers=10, index_topk_pattern="FFFSSSFSSS"),
    "pattern shorter than the model": dict(num_hidden_layers=10, index_topk_pattern="FSFS"),
    "every layer a leader": dict(num_hidden_layers=10, index_topk_freq=1),
    "indexer_types with freq 1": dict(
        num_hidden_layers=6, index_topk_freq=1, indexer_types=["full", "shared", "full", "shared", "shared", "full"]
    ),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_followers_are_the_layers_vllm_builds_without_an_indexer(name: str) -> None:
    skip = _vllm_rule()
    config = _glm(**CONFIGS[name])
    if RULE and len(config.indexer_types) != config.num_hidden_layers:
        # transformers derives a short indexer_types from a short pattern, and vLLM 0.34 refuses the config itself
        with pytest.raises(ValueError, match="indexer_types must contain one entry per hidden layer"):
            skip(config, 0)
        return
    vllm_followers = [layer for layer in range(config.num_hidden_layers) if skip(config, layer)]
    assert coverage.v32_followers(config, indexer_types=RULE) == vllm_followers
    assert set(vllm_followers) <= set(coverage.v32_followers(config))  # release unknown: never misses one


def test_glm53_has_21_leaders_and_19_groups_with_followers() -> None:
    config = _glm(**CONFIGS["glm-5.3 (freq 4, offset 3, 78 layers)"])
    followers = coverage.v32_followers(config)
    assert 78 - len(followers) == 21 and followers[:3] == [3, 4, 5]
    assert coverage.shared_topk("GlmMoeDsaForCausalLM", config).startswith("layers 3, 4, 5, 7, 8, 9, ... (57 layers)")


def test_the_spellings_of_one_pattern_agree_and_those_vllm_ignores_share_nothing() -> None:
    """``index_topk_pattern`` (a string) and ``index_topk_freq`` / offset make the same followers. A list pattern
    and ``indexer_types`` alone are ignored by vLLM 0.33's DSA model (every layer then builds an indexer), so
    under DBO they share nothing there; vLLM 0.34 builds followers from ``indexer_types``: the coverage rule of the
    installed release says exactly what vLLM builds."""
    skip = _vllm_rule()
    by_freq = _glm(num_hidden_layers=14, index_topk_freq=4, index_skip_topk_offset=3)
    pattern = "".join("S" if layer in coverage.v32_followers(by_freq) else "F" for layer in range(14))
    by_pattern = _glm(num_hidden_layers=14, index_topk_pattern=pattern)
    assert coverage.v32_followers(by_pattern) == coverage.v32_followers(by_freq) == [3, 4, 5, 7, 8, 9, 11, 12, 13]
    as_list = _glm(num_hidden_layers=14, index_topk_pattern=["full" if c == "F" else "shared" for c in pattern])
    types_only = _glm(num_hidden_layers=14, indexer_types=list(by_freq.indexer_types))
    for config in (as_list, types_only):
        built = [layer for layer in range(14) if skip(config, layer)]  # what vLLM builds
        assert coverage.v32_followers(config, indexer_types=RULE) == built
        assert bool(coverage.shared_topk("GlmMoeDsaForCausalLM", config, indexer_types=RULE)) == bool(built)
    assert [layer for layer in range(14) if skip(types_only, layer)] == ([3, 4, 5, 7, 8, 9, 11, 12, 13] if RULE else [])


def test_mistral_large4_followers_are_the_layers_vllm_builds_without_an_indexer() -> None:
    """Mistral Large 4 (vLLM 0.34): layers whose ``index_sharing`` entry is not ``'full'`` get no indexer and
    reuse the closest preceding indexer's top-k (vLLM's ``get_layer_specs``, run on its own config class)."""
    from tests.vllm.conftest import has_module

    if not has_module("vllm.models.mistral.common.layer_spec"):  # vLLM 0.33 has no Mistral Large 4
        from vllm.model_executor.models import registry

        assert "MistralLarge4ForCausalLM" not in registry._VLLM_MODELS
        assert models_table.BY_NAME["MistralLarge4ForCausalLM"].status_in("0.33.0") == "-"
        return
    from types import SimpleNamespace

    from vllm.models.mistral.common.layer_spec import get_layer_specs

    sharing = ["full", "shared", "shared", "full", "dense", "full"]
    config = SimpleNamespace(num_hidden_layers=6, index_topk=2048, index_sharing=sharing)
    built = [spec.layer_idx for spec in get_layer_specs(config) if spec.use_sparse and not spec.has_indexer]
    assert coverage.mistral_followers(config) == built == [1, 2, 4]
    assert coverage.shared_topk("MistralLarge4ForCausalLM", config).startswith("layers 1, 2, 4 ")
    dense = SimpleNamespace(num_hidden_layers=6, index_topk=None, index_sharing=sharing)
    assert not any(spec.use_sparse for spec in get_layer_specs(dense)) and coverage.mistral_followers(dense) == []
    assert "index_sharing" in coverage.shared_topk("SomeFutureModel", config)  # an unknown architecture: refused


def test_hy_v4_default_config_shares_topk() -> None:
    from vllm.transformers_utils.configs.hy_v4 import HYV4Config

    config = HYV4Config()
    assert coverage.hy_v4_shared_layers(config), "HY V4's default indexer_types has no shared layer any more"
    assert "indexer_types" in coverage.shared_topk("HYV4ForCausalLM", config)


def test_deepseek_v41_consumers_follow_index_source_layer_ids() -> None:
    from vllm.transformers_utils.configs.deepseek_v41 import DeepseekV41Config

    config = DeepseekV41Config(
        num_hidden_layers=6, compress_ratios=[0, 1, 2, 1, 2, 0], index_source_layer_ids=[1, 3], kv_source_layer_ids=[1, 3]
    )
    assert coverage.v41_consumers(config) == [2, 4]
    assert "index_source_layer_ids" in coverage.shared_topk("DeepseekV41ForCausalLM", config)
    every_compressed_layer_is_a_source = DeepseekV41Config(
        num_hidden_layers=4, compress_ratios=[0, 1, 1, 0], index_source_layer_ids=[1, 2], kv_source_layer_ids=[1, 2]
    )
    assert coverage.shared_topk("DeepseekV41ForCausalLM", every_compressed_layer_is_a_source) == ""


def test_the_generic_deepseek_path_shares_only_with_an_indexer() -> None:
    without_indexer = {"num_hidden_layers": 6, "index_topk_freq": 2}
    assert coverage.shared_topk("DeepseekV3ForCausalLM", without_indexer) == ""
    assert coverage.shared_topk("DeepseekV3ForCausalLM", dict(without_indexer, index_topk=2048))
    assert coverage.uses_indexer("DeepseekV3ForCausalLM", dict(without_indexer, index_topk=2048))
    assert not coverage.uses_indexer("DeepseekV3ForCausalLM", without_indexer)
