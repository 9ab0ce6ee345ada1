"""``core.coverage``'s sharing rules against vLLM 0.33.0's own layer construction and real HF configs.

vLLM decides which layers get an indexer inside ``DeepseekV32Attention.__init__`` (``models/deepseek_v32/
attention.py:166-177``), a constructor that needs a GPU model. So the test runs vLLM's own statements, cut
from the installed source, on real HF config objects, and compares every layer with ``v32_followers``.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from typing import Any

import pytest

from dbo_runtime.core import coverage


def _vllm_rule() -> Any:
    """The statements of ``DeepseekV32Attention.__init__`` that decide ``skip_topk``, as a function."""
    from vllm.models.deepseek_v32.attention import DeepseekV32Attention

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
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_followers_are_the_layers_vllm_builds_without_an_indexer(name: str) -> None:
    skip = _vllm_rule()
    config = _glm(**CONFIGS[name])
    vllm_followers = [layer for layer in range(config.num_hidden_layers) if skip(config, layer)]
    assert coverage.v32_followers(config) == vllm_followers


def test_glm53_has_21_leaders_and_19_groups_with_followers() -> None:
    config = _glm(**CONFIGS["glm-5.3 (freq 4, offset 3, 78 layers)"])
    followers = coverage.v32_followers(config)
    assert 78 - len(followers) == 21 and followers[:3] == [3, 4, 5]
    assert coverage.shared_topk("GlmMoeDsaForCausalLM", config).startswith("layers 3, 4, 5, 7, 8, 9, ... (57 layers)")


def test_the_spellings_of_one_pattern_agree_and_those_vllm_ignores_share_nothing() -> None:
    """``index_topk_pattern`` (a string) and ``index_topk_freq`` / offset make the same followers. A list pattern
    and ``indexer_types`` alone are ignored by vLLM 0.33.0's DSA model (every layer then builds an indexer), so
    under DBO they share nothing: the guard does not refuse them and nothing needs fixing."""
    skip = _vllm_rule()
    by_freq = _glm(num_hidden_layers=14, index_topk_freq=4, index_skip_topk_offset=3)
    pattern = "".join("S" if layer in coverage.v32_followers(by_freq) else "F" for layer in range(14))
    by_pattern = _glm(num_hidden_layers=14, index_topk_pattern=pattern)
    assert coverage.v32_followers(by_pattern) == coverage.v32_followers(by_freq) == [3, 4, 5, 7, 8, 9, 11, 12, 13]
    as_list = _glm(num_hidden_layers=14, index_topk_pattern=["full" if c == "F" else "shared" for c in pattern])
    types_only = _glm(num_hidden_layers=14, indexer_types=list(by_freq.indexer_types))
    for config in (as_list, types_only):
        assert [layer for layer in range(14) if skip(config, layer)] == []  # what vLLM builds
        assert coverage.shared_topk("GlmMoeDsaForCausalLM", config) == ""


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
