"""``--load-format dbo_runtime_random`` (tests/load_format): realistic random weights for the tiny models.

The GPU twin is every e2e run in ``tests/e2e`` (they load the tiny DSA models with this format).
"""

from __future__ import annotations

import math
import os
from importlib import metadata

import pytest
import torch
from torch import nn

from tests.load_format import DIRECTORY, put_on_pythonpath
from tests.load_format import dbo_runtime_random as weights


class RMSNorm(nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.full((n,), 1e-3))


class VocabParallelEmbedding(nn.Module):
    def __init__(self, v: int, n: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(v, n))


class ParallelLMHead(VocabParallelEmbedding):
    pass


class Fp8Linear(nn.Module):
    def __init__(self, out: int, inp: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(out, inp, dtype=torch.float8_e4m3fn), requires_grad=False)
        self.weight_scale_inv = nn.Parameter(torch.full((out // 128, inp // 128), -1e-3), requires_grad=False)


class Experts(nn.Module):
    def __init__(self, e: int, n: int, k: int) -> None:
        super().__init__()
        self.w13_weight = nn.Parameter(torch.zeros(e, 2 * n, k, dtype=torch.float8_e4m3fn), requires_grad=False)
        self.w13_weight_scale_inv = nn.Parameter(torch.zeros(e, 2 * n // 128, k // 128), requires_grad=False)
        self.w2_weight = nn.Parameter(torch.zeros(e, k, n, dtype=torch.float8_e4m3fn), requires_grad=False)
        self.w2_weight_scale_inv = nn.Parameter(torch.zeros(e, k // 128, n // 128), requires_grad=False)


class Gate(nn.Module):
    def __init__(self, e: int, k: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(e, k))
        self.e_score_correction_bias = nn.Parameter(torch.full((e,), 5e-4))


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(512)
        self.k_norm = nn.LayerNorm(128)
        self.q_proj = Fp8Linear(1024, 512)
        self.weights_proj = nn.Linear(512, 64, bias=False)
        self.gate = Gate(8, 512)
        self.experts = Experts(8, 256, 512)
        self.register_buffer("cos_sin_cache", torch.full((4, 4), 7.0), persistent=False)
        self.positions = nn.Parameter(torch.arange(4), requires_grad=False)


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(256, 512)
        self.layers = nn.ModuleList([Layer(), Layer()])
        self.norm = RMSNorm(512)
        self.lm_head = ParallelLMHead(256, 512)


def _effective(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    blocks = scale.repeat_interleave(128, -2).repeat_interleave(128, -1)
    return w.float() * blocks


def test_rules_give_a_trained_models_scale() -> None:
    model = Tiny()
    counts = weights.initialize(model, seed=0)
    layer = model.layers[0]
    assert torch.all(layer.input_layernorm.weight == 1) and torch.all(model.norm.weight == 1)
    assert torch.all(layer.k_norm.weight == 1) and torch.all(layer.k_norm.bias == 0)
    assert torch.all(layer.gate.e_score_correction_bias == 0)
    assert torch.allclose(layer.q_proj.weight_scale_inv, torch.tensor(math.sqrt(3 / 512)))
    assert torch.allclose(layer.experts.w2_weight_scale_inv, torch.tensor(math.sqrt(3 / 256)))
    # effective std 1/sqrt(fan_in) for fp8 blocks and plain linears alike; embeddings std 1
    for w, s, fan_in in (
        (layer.q_proj.weight, layer.q_proj.weight_scale_inv, 512),
        (layer.experts.w13_weight, layer.experts.w13_weight_scale_inv, 512),
        (layer.experts.w2_weight, layer.experts.w2_weight_scale_inv, 256),
    ):
        assert _effective(w, s).std().item() == pytest.approx(1 / math.sqrt(fan_in), rel=0.05)
    assert layer.weights_proj.weight.std().item() == pytest.approx(1 / math.sqrt(512), rel=0.05)
    assert model.lm_head.weight.std().item() == pytest.approx(1 / math.sqrt(512), rel=0.05)
    assert model.embed_tokens.weight.std().item() == pytest.approx(1.0, rel=0.05)
    # integer parameters and non-persistent buffers are vLLM's, untouched
    assert torch.equal(layer.positions, torch.arange(4)) and torch.all(layer.cos_sin_cache == 7)
    assert counts["norm"] == 2 * 3 + 1 and counts["fp8"] == 2 * 3 and counts["scale"] == 2 * 3
    assert counts["embedding"] == 1 and counts["other"] == 0


def test_each_tensor_has_its_own_seed_and_runs_repeat() -> None:
    a, b = Tiny(), Tiny()
    weights.initialize(a, seed=0)
    weights.initialize(b, seed=0)
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert torch.equal(pa.float(), pb.float()), name  # deterministic: plugin and vanilla load the same model
    # vLLM's dummy loader seeds every tensor with 1234, so same-shaped tensors were identical
    assert not torch.equal(a.layers[0].q_proj.weight.float(), a.layers[1].q_proj.weight.float())
    assert not torch.equal(a.layers[0].experts.w13_weight.float(), a.layers[1].experts.w13_weight.float())
    c = Tiny()
    weights.initialize(c, seed=1)
    assert not torch.equal(a.lm_head.weight, c.lm_head.weight)


def test_dummy_weight_value_is_respected() -> None:
    model = Tiny()
    model.layers[0].weights_proj.weight.dummy_weight_value = 0.5  # type: ignore[attr-defined]
    model.layers[0].weights_proj.weight.data.fill_(0.5)
    weights.initialize(model)
    assert torch.all(model.layers[0].weights_proj.weight == 0.5)


def test_entry_point_registers_the_format_with_vllm() -> None:
    from vllm.config.load import LoadConfig
    from vllm.model_executor import model_loader
    from vllm.model_executor.model_loader.dummy_loader import DummyModelLoader

    installed = {ep.name: ep.value for ep in metadata.entry_points(group="vllm.general_plugins")}
    assert "dbo_runtime_random" not in installed  # test-only: not in the wheel
    assert installed.get("dbo_runtime") == "dbo_runtime.integration.plugin:register"
    found = {ep.name: ep.value for ep in metadata.distributions(path=[str(DIRECTORY)]) for ep in ep.entry_points}
    assert found == {"dbo_runtime_random": "dbo_runtime_random:register"}  # what a process with the dir on its path sees
    before = dict(model_loader._LOAD_FORMAT_TO_MODEL_LOADER)
    try:
        model_loader._LOAD_FORMAT_TO_MODEL_LOADER.pop(weights.LOAD_FORMAT, None)
        weights.register()
        cls = model_loader._LOAD_FORMAT_TO_MODEL_LOADER[weights.LOAD_FORMAT]
        weights.register()  # idempotent: vLLM warns on re-registration, so the second call must not
        assert model_loader._LOAD_FORMAT_TO_MODEL_LOADER[weights.LOAD_FORMAT] is cls
        loader = model_loader.get_model_loader(LoadConfig(load_format=weights.LOAD_FORMAT))
        assert isinstance(loader, DummyModelLoader) and type(loader).__name__ == "RealisticRandomLoader"
    finally:
        model_loader._LOAD_FORMAT_TO_MODEL_LOADER.clear()
        model_loader._LOAD_FORMAT_TO_MODEL_LOADER.update(before)


def test_loader_applies_the_rules_after_vllms_dummy_fill() -> None:
    from vllm.config.load import LoadConfig

    loader = weights.loader_class()(LoadConfig(load_format=weights.LOAD_FORMAT))
    model = Tiny()

    class Cfg:
        seed = 0

    loader.load_weights(model, Cfg())
    assert torch.all(model.norm.weight == 1)
    assert model.embed_tokens.weight.std().item() == pytest.approx(1.0, rel=0.05)


class Attn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q_b_proj = nn.Linear(512, 512, bias=False)
        self.kv_b_proj = Fp8Linear(1024, 512)
        self.o_proj = nn.Linear(512, 512, bias=False)
        self.indexer = nn.Module()
        self.indexer.q_b_proj = nn.Linear(512, 512, bias=False)


class Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.down_proj = nn.Linear(512, 512, bias=False)
        self.experts = Experts(8, 256, 512)


class GainModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.self_attn = Attn()
        self.mlp = Mlp()


def test_gains_sharpen_attention_and_shrink_mlp_updates() -> None:
    model = GainModel()
    weights.initialize(model, seed=0, qk_gain=2.0, mlp_gain=0.1)
    std = 1 / math.sqrt(512)
    assert model.self_attn.q_b_proj.weight.std().item() == pytest.approx(2 * std, rel=0.05)
    assert torch.allclose(model.self_attn.kv_b_proj.weight_scale_inv, torch.tensor(2 * math.sqrt(3 / 512)))
    assert model.self_attn.o_proj.weight.std().item() == pytest.approx(std, rel=0.05)
    assert model.self_attn.indexer.q_b_proj.weight.std().item() == pytest.approx(std, rel=0.05)  # the indexer keeps its scale
    assert model.mlp.down_proj.weight.std().item() == pytest.approx(0.1 * std, rel=0.05)
    assert torch.allclose(model.mlp.experts.w2_weight_scale_inv, torch.tensor(0.1 * math.sqrt(3 / 256)))
    assert torch.allclose(model.mlp.experts.w13_weight_scale_inv, torch.tensor(math.sqrt(3 / 512)))


def test_extra_config_is_checked_and_consumed() -> None:
    from vllm.config.load import LoadConfig

    cls = weights.loader_class()
    config = LoadConfig(load_format=weights.LOAD_FORMAT, model_loader_extra_config={"qk_gain": 2, "mlp_gain": 0.5})
    loader = cls(config)
    assert loader.gains == {"qk_gain": 2.0, "mlp_gain": 0.5}
    assert config.model_loader_extra_config == {"qk_gain": 2, "mlp_gain": 0.5}  # the caller's config is not touched
    with pytest.raises(ValueError, match=r"unknown keys \['qk'\]; allowed: \['qk_gain', 'mlp_gain'\]"):
        cls(LoadConfig(load_format=weights.LOAD_FORMAT, model_loader_extra_config={"qk": 2}))
    for extra in ([1], 2, "qk_gain=2"):
        with pytest.raises(ValueError, match="allowed: a JSON object with keys"):
            weights.parse_gains(extra)  # type: ignore[arg-type]
    for bad in (0, -1, float("nan"), "2", True):
        with pytest.raises(ValueError, match=r"qk_gain=.*allowed: a finite number > 0"):
            weights.parse_gains({"qk_gain": bad})


class _Manager:
    """The two attributes of vLLM 0.33's ExpertMapManager the format reads."""

    def __init__(self, local: int, expert_map: torch.Tensor | None) -> None:
        self.local_num_experts = local
        self.expert_map = expert_map


class RoutedExperts(nn.Module):
    def __init__(self, local: int, expert_map: torch.Tensor | None) -> None:
        super().__init__()
        self.w13_weight = nn.Parameter(torch.zeros(local, 512, 512, dtype=torch.float8_e4m3fn), requires_grad=False)
        self.w2_weight = nn.Parameter(torch.zeros(local, 512, 256), requires_grad=False)
        self.expert_map_manager = _Manager(local, expert_map)


class Moe(nn.Module):
    def __init__(self, local: int, expert_map: torch.Tensor | None) -> None:
        super().__init__()
        self.experts = RoutedExperts(local, expert_map)


def test_expert_parallel_ranks_hold_the_single_gpu_models_experts() -> None:
    """Each EP rank holds the single-GPU model's experts at their global ids: a seed by parameter name alone
    would give rank 1 the same experts as rank 0."""
    single = Moe(4, None)
    weights.initialize(single)
    rank0 = Moe(2, torch.tensor([0, 1, -1, -1]))
    rank1 = Moe(2, torch.tensor([-1, -1, 0, 1]))
    for m in (rank0, rank1):
        weights.initialize(m)
    w = [single.experts.w13_weight.float(), rank0.experts.w13_weight.float(), rank1.experts.w13_weight.float()]
    assert torch.equal(w[1][0], w[0][0]) and torch.equal(w[1][1], w[0][1])
    assert torch.equal(w[2][0], w[0][2]) and torch.equal(w[2][1], w[0][3])
    assert not torch.equal(w[1][0], w[2][0])
    assert torch.equal(rank1.experts.w2_weight[1], single.experts.w2_weight[3])


def test_row_parallel_shards_use_the_global_fan_in() -> None:
    class RowParallelLinear(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.input_size = 2048  # global; this shard holds 512 of it
            self.weight = nn.Parameter(torch.zeros(512, 512))

    layer = RowParallelLinear()
    weights.initialize(layer)
    assert layer.weight.std().item() == pytest.approx(1 / math.sqrt(2048), rel=0.05)


def test_put_on_pythonpath_prepends_the_directory_once() -> None:
    env = {"PYTHONPATH": "/a"}
    put_on_pythonpath(env)
    put_on_pythonpath(env)
    assert env["PYTHONPATH"] == f"{DIRECTORY}{os.pathsep}/a"
