"""The tiny models the one-GPU runs start parse with the installed vLLM's own config readers.

The GPU rows start these directories with ``--load-format dummy``; a config vLLM rejects would only show on the
GPU machine. Mistral Large 4 is a Mistral-format ``params.json`` (``--config-format mistral``, as its checkpoints
ship): parsed by vLLM's ``get_config`` and expanded into layer specs by the model's own ``get_layer_specs``, it
must give indexer leaders and ``index_sharing`` followers. vLLM 0.33.0 has no Mistral Large 4.
"""

from __future__ import annotations

import importlib
import json

import pytest

from tests.e2e import emulated

ML4 = emulated.MODELS / emulated.TRANSPARENCY["ml4"]


def test_mistral_large4_parses_with_leaders_and_index_sharing_followers() -> None:
    from vllm.model_executor.models.registry import ModelRegistry
    from vllm.transformers_utils.config import get_config

    try:
        get_layer_specs = importlib.import_module("vllm.models.mistral.common.layer_spec").get_layer_specs
    except ImportError:
        assert "MistralLarge4ForCausalLM" not in ModelRegistry.get_supported_archs(), "registered, yet no layer specs"
        return
    config = get_config(str(ML4), trust_remote_code=False, config_format="mistral")
    assert config.architectures == ["MistralLarge4ForCausalLM"] and config.model_type == "mistral_large_4"
    specs = get_layer_specs(config)
    leaders = [s.layer_idx for s in specs if s.has_indexer]
    followers = [s.layer_idx for s in specs if s.use_sparse and not s.has_indexer]
    assert leaders == [0, 3] and followers == [1, 2, 4, 5]
    assert config.q_lora_rank is None, "Mistral Large 4's attention refuses q-LoRA"
    assert config.rope_parameters["attention_factor"] == 1.0, "its RoPE asserts YaRN without magnitude scaling"
    args = emulated.Engine("mistral-large4", True, 0, "eager", 0, "v2", dbo=False).args()
    assert args[args.index("--config-format") + 1] == "mistral"


@pytest.mark.parametrize("model", [emulated.MTP_MODEL, emulated.V4_MTP_MODEL])
def test_the_mtp_models_are_their_base_model_plus_one_mtp_layer(model: str) -> None:
    base = {emulated.MTP_MODEL: "glm53-emu", emulated.V4_MTP_MODEL: "deepseek-v4"}[model]
    mtp, plain = (json.loads((emulated.MODELS / m / "config.json").read_text()) for m in (model, base))
    assert mtp.pop("num_nextn_predict_layers") == 1 and plain.pop("num_nextn_predict_layers") == 0
    assert mtp == plain
