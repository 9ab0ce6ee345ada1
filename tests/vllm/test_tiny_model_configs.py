"""The tiny models the one-GPU runs start parse with the installed vLLM's own config readers.

The GPU rows start these directories with ``--load-format dummy``; a config vLLM rejects would only show on the
GPU machine. Mistral Large 4 is a Mistral-format ``params.json`` (``--config-format mistral``, as its checkpoints
ship): parsed by vLLM's ``get_config`` and expanded into layer specs by the model's own ``get_layer_specs``, it
must give indexer leaders and ``index_sharing`` followers, and ``ml4-emu`` must take the matrix's ``--layers``.
vLLM 0.33.0 has no Mistral Large 4.
"""

from __future__ import annotations

import importlib
import json
from typing import Any

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


def _ml4_layer_specs() -> Any:
    """Mistral Large 4's ``get_layer_specs``, or None where vLLM has no such model (then it must not be registered)."""
    from vllm.model_executor.models.registry import ModelRegistry

    try:
        return importlib.import_module("vllm.models.mistral.common.layer_spec").get_layer_specs
    except ImportError:
        assert "MistralLarge4ForCausalLM" not in ModelRegistry.get_supported_archs(), "registered, yet no layer specs"
        return None


@pytest.mark.parametrize("layers", [8, 61, 78])
def test_ml4_emu_takes_the_matrix_depths_through_its_engine_args_and_keeps_its_followers(layers: int) -> None:
    """``ml4-emu`` and its control parse through vLLM's Mistral reader with the engine's own ``--hf-overrides``:
    ``layers`` layers, the follower pattern of ``index_sharing`` intact on the model, none on the control, block
    fp8 weights; the two differ in the sharing alone."""
    from vllm.transformers_utils.config import get_config

    get_layer_specs = _ml4_layer_specs()
    if get_layer_specs is None:
        return
    model, control = emulated.FOLLOWERS["ml4"], emulated.CONTROLS["ml4"]
    params = {m: json.loads((emulated.MODELS / m / "params.json").read_text()) for m in (model, control)}
    sharing = params[model]["dsa"].pop("sharing").split(",")
    assert params[control]["dsa"].pop("sharing") == "full" and params[model] == params[control]
    for name, want in ((model, [i for i in range(layers) if sharing[i % len(sharing)] != "full"]), (control, [])):
        args = emulated.Engine(name, True, 0, "eager", layers, "v2").args()
        overrides = json.loads(args[args.index("--hf-overrides") + 1])
        config = get_config(
            str(emulated.MODELS / name), trust_remote_code=False, config_format="mistral", hf_overrides_kw=overrides
        )
        specs = get_layer_specs(config)
        assert config.architectures == ["MistralLarge4ForCausalLM"] and config.num_hidden_layers == len(specs) == layers
        assert [s.layer_idx for s in specs if s.use_sparse and not s.has_indexer] == want, name
        assert (
            config.quantization_config["weight_block_size"] == [128, 128]
            and config.quantization_config["quant_method"] == "fp8"
        )
    assert any(sharing[i % len(sharing)] != "full" for i in range(8)), "followers within the smallest depth"


def test_a_layer_override_cannot_deepen_a_mistral_config_so_the_engine_refuses_it() -> None:
    """vLLM expands a ``params.json``'s per-layer lists at its own depth, before ``--hf-overrides``: deeper than that
    the model's layer specs fail, so ``ml4-emu`` is as deep as the matrix goes and ``Engine.args`` refuses more."""
    from vllm.transformers_utils.config import get_config

    get_layer_specs = _ml4_layer_specs()
    if get_layer_specs is None:
        return
    depth = json.loads((ML4 / "params.json").read_text())["n_layers"]
    config = get_config(
        str(ML4), trust_remote_code=False, config_format="mistral", hf_overrides_kw={"num_hidden_layers": depth + 2}
    )
    with pytest.raises(IndexError):
        get_layer_specs(config)
    with pytest.raises(ValueError, match="cannot deepen"):
        emulated.Engine(emulated.FOLLOWERS["ml4"], True, 0, "eager", 79, "v2").args()


@pytest.mark.parametrize("model", [emulated.MTP_MODEL, emulated.V4_MTP_MODEL])
def test_the_mtp_models_are_their_base_model_plus_one_mtp_layer(model: str) -> None:
    base = {emulated.MTP_MODEL: "glm53-emu", emulated.V4_MTP_MODEL: "deepseek-v4"}[model]
    mtp, plain = (json.loads((emulated.MODELS / m / "config.json").read_text()) for m in (model, base))
    assert mtp.pop("num_nextn_predict_layers") == 1 and plain.pop("num_nextn_predict_layers") == 0
    assert mtp == plain
