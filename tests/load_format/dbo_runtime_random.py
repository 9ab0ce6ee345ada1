"""``--load-format dbo_runtime_random``: random weights at the scale of a trained model.

Why this exists: vLLM's ``dummy`` format fills every float tensor except norms (which
carry a ``dummy_weight_value`` of 1 or 0) with U(-1e-3, 1e-3), and block-fp8 weights
with U(-1, 1) times block scales that are themselves U(-1e-3, 1e-3) -- every tensor
from the same seed (``weight_utils.initialize_single_dummy_weight``). Each linear layer
then scales its input down about 50x; the tiny models' next-token distribution is
nearly flat (top logprob -8.03 against a uniform -8.32) and nearly every request
starts with the same token: the shared top-k corruption of vanilla DBO moved logprobs by 3.4e-4 on
average and flipped no greedy token on two H200s (docs/accuracy.md).

This format keeps everything the ``dummy`` loader does (no files, deterministic,
fp8/online-quant handling) and then re-initialises the tensors the way a trained
network is scaled: norm weights 1 and biases 0, linear weights with standard
deviation 1/sqrt(fan_in) so every sublayer's output is O(1), embeddings with
standard deviation 1, each tensor from its own seed. For block-fp8 layers the fp8
values are U(-1, 1) and the ``*_scale_inv`` blocks are sqrt(3)/sqrt(fan_in), which
gives the same effective standard deviation. The output is random text, but
attention now matters and a corrupted top-k changes tokens.

It is a test-only plugin with its own ``vllm.general_plugins`` entry point (the ``.dist-info`` next
to this file, found when ``tests/load_format`` is on ``PYTHONPATH``), not part of the dbo_runtime
wheel: vanilla runs (``DBO_RUNTIME_DISABLE=1``) must load the identical weights. Registering a load
format patches nothing in vLLM; it only adds a name to
``vllm.model_executor.model_loader._LOAD_FORMAT_TO_MODEL_LOADER``.

Two gains shape how the network responds, set with
``--model-loader-extra-config '{"qk_gain": G, "mlp_gain": M}'`` (both default 1):

* ``qk_gain`` multiplies the MLA query and key/value up-projections (``q_b_proj``/``q_proj`` and
  ``kv_b_proj``, not the indexer's): the non-rotary attention logits grow by gain squared, the
  rotary part by gain, and the values (hence the attention output) by gain -- sharper attention
  whose output carries what it read;
* ``mlp_gain`` multiplies the MLP and MoE output projections (``down_proj``, ``w2_weight``), making
  their residual updates small.

Why: with both at 1 the tiny model is chaotic. DBO on vs off -- vanilla with ``VLLM_DBO_COMM_SMS=0``
and dbo_runtime alike, on the model without followers -- agreed on 6-11 % of greedy tokens on two
H200s (docs/accuracy.md): a request's first divergence came within ~4 tokens, because DBO is not
bit-identical (different GEMM shapes) and a random MoE router turns every near-tie into a different
expert. A trained model is not like that. Small MLP updates keep routing flips small, and sharp
attention keeps the model sensitive to which positions it reads -- which is exactly what a
corrupted top-k changes.

Parallel layouts: a linear layer's fan-in is its global ``input_size`` (a row-parallel shard
holds a slice of it), and routed experts are seeded by their *global* id (vLLM's
``expert_map_manager.expert_map``), so under expert parallelism every rank holds different experts
and the model is the one a single GPU would load. Fused-MoE weights under tensor parallelism keep
the local fan-in (the project's runs are TP 1).

Limitation: models that vLLM quantizes online (a quantization method requested for an
unquantized checkpoint) are refused -- their layers are already processed when the rules would run.
"""

from __future__ import annotations

import math
import zlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from torch import nn

LOAD_FORMAT = "dbo_runtime_random"

_SCALE_SUFFIXES = ("_scale_inv", "_scale")
"""Block-fp8 scales next to their weight: ``weight_scale_inv`` (DeepSeek checkpoints) and
``w13_weight_scale_inv`` / ``w2_weight_scale_inv`` (fused MoE)."""


def _seed(name: str, seed: int) -> int:
    return (zlib.crc32(name.encode()) ^ (seed * 0x9E3779B1)) & 0x7FFFFFFF


def _fan_in(module: nn.Module, weight: torch.Tensor) -> int:
    """The global fan-in: vLLM's linear layers keep it as ``input_size`` (a row-parallel shard's last
    dimension is only its slice); other tensors use their last dimension."""
    size = getattr(module, "input_size", None)
    return int(size) if isinstance(size, int) and size > 0 else int(weight.shape[-1])


def _global_experts(module: nn.Module, param: torch.Tensor) -> list[int] | None:
    """Global expert id of each local expert of a fused-MoE parameter (dim 0), or None if not one."""
    manager = getattr(module, "expert_map_manager", None)
    local = getattr(manager, "local_num_experts", None)
    if manager is None or not isinstance(local, int) or param.dim() < 2 or param.shape[0] != local:
        return None
    expert_map = getattr(manager, "expert_map", None)
    if expert_map is None:
        return list(range(local))
    ids = [0] * local
    for global_id, local_id in enumerate(expert_map.tolist()):
        if 0 <= local_id < local:
            ids[local_id] = global_id
    return ids


def _is_norm(module: nn.Module, module_name: str) -> bool:
    return "norm" in type(module).__name__.lower() or "norm" in module_name.rsplit(".", 1)[-1].lower()


def _fill_random(param: torch.Tensor, *, seed: int, uniform: float | None = None, std: float | None = None) -> None:
    import torch

    gen = torch.Generator(device=param.device)
    gen.manual_seed(seed)
    low_precision = torch.finfo(param.dtype).bits < 16
    tmp = torch.empty(param.shape, dtype=torch.float32 if not low_precision else torch.float16, device=param.device)
    if uniform is not None:
        tmp.uniform_(-uniform, uniform, generator=gen)
    else:
        tmp.normal_(0.0, std if std is not None else 1.0, generator=gen)
    param.data.copy_(tmp)


GAINS = ("qk_gain", "mlp_gain")
_QK_MODULES = (".q_b_proj", ".q_proj", ".kv_b_proj")
_MLP_OUT_MODULES = (".down_proj",)


def _gain(module_name: str, pname: str, qk_gain: float, mlp_gain: float) -> float:
    if "indexer" in module_name:
        return 1.0
    if module_name.endswith(_QK_MODULES):
        return qk_gain
    if module_name.endswith(_MLP_OUT_MODULES) or pname.startswith("w2_"):
        return mlp_gain
    return 1.0


def _fill_experts_or_all(module: nn.Module, param: torch.Tensor, name: str, seed: int, **dist: float) -> None:
    experts = _global_experts(module, param)
    if experts is None:
        _fill_random(param, seed=_seed(name, seed), **dist)
        return
    for local_id, global_id in enumerate(experts):
        _fill_random(param.data[local_id], seed=_seed(f"{name}[{global_id}]", seed), **dist)


def initialize(model: nn.Module, seed: int = 0, *, qk_gain: float = 1.0, mlp_gain: float = 1.0) -> dict[str, int]:
    """Re-initialise ``model``'s floating-point parameters in place (rules in the module docstring).

    Returns how many tensors each rule touched, so a caller (and a test) can see the model was
    covered. Parameters on the meta device, integer parameters and those with vLLM's
    ``dummy_weight_value`` (a value the layer requires) are left alone.
    """
    import torch

    counts = {"norm": 0, "zero": 0, "scale": 0, "fp8": 0, "embedding": 0, "linear": 0, "other": 0}
    with torch.no_grad():
        for module_name, module in model.named_modules():
            params = dict(module.named_parameters(recurse=False))
            norm = _is_norm(module, module_name)
            kind = type(module).__name__
            for pname, param in params.items():
                full = f"{module_name}.{pname}" if module_name else pname
                if param.device.type == "meta" or not torch.is_floating_point(param):
                    continue
                if getattr(param, "dummy_weight_value", None) is not None:
                    continue
                if norm:
                    param.data.fill_(0.0 if pname.endswith("bias") else 1.0)
                    counts["norm"] += 1
                elif pname.endswith("bias"):
                    param.data.zero_()
                    counts["zero"] += 1
                elif pname.endswith(_SCALE_SUFFIXES):
                    base = next((pname[: -len(s)] for s in _SCALE_SUFFIXES if pname.endswith(s)), pname)
                    weight = params.get(base)
                    if weight is not None and weight.dim() >= 2:
                        gain = _gain(module_name, base, qk_gain, mlp_gain)
                        param.data.fill_(gain * math.sqrt(3.0) / math.sqrt(_fan_in(module, weight)))
                    else:
                        param.data.fill_(1.0)
                    counts["scale"] += 1
                elif torch.finfo(param.dtype).bits < 16:
                    _fill_experts_or_all(module, param, full, seed, uniform=1.0)
                    counts["fp8"] += 1
                elif "Embedding" in kind and "LMHead" not in kind:
                    _fill_random(param, seed=_seed(full, seed), std=1.0)
                    counts["embedding"] += 1
                elif param.dim() >= 2:
                    gain = _gain(module_name, pname, qk_gain, mlp_gain)
                    _fill_experts_or_all(module, param, full, seed, std=gain / math.sqrt(_fan_in(module, param)))
                    counts["linear"] += 1
                else:
                    param.data.fill_(1.0)
                    counts["other"] += 1
    return counts


def parse_gains(extra: dict[str, Any]) -> dict[str, float]:
    """``--model-loader-extra-config`` of this format: only ``qk_gain`` and ``mlp_gain``, finite and > 0."""
    if not isinstance(extra, dict):
        raise ValueError(
            f"--model-loader-extra-config {extra!r} for load format {LOAD_FORMAT}: allowed: a JSON object with keys {list(GAINS)}"
        )
    unknown = sorted(set(extra) - set(GAINS))
    if unknown:
        raise ValueError(f"--model-loader-extra-config for load format {LOAD_FORMAT}: unknown keys {unknown}; allowed: {list(GAINS)}")
    out: dict[str, float] = {}
    for key in GAINS:
        value = extra.get(key, 1.0)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise ValueError(f"--model-loader-extra-config {key}={value!r} for load format {LOAD_FORMAT}: allowed: a finite number > 0")
        out[key] = float(value)
    return out


def loader_class() -> type[Any]:
    """vLLM's ``DummyModelLoader`` followed by :func:`initialize` (imports vLLM)."""
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader
    from vllm.model_executor.model_loader.dummy_loader import DummyModelLoader

    class RealisticRandomLoader(DummyModelLoader):  # type: ignore[misc]
        """``dummy`` weights rescaled to a trained model's statistics (dbo_runtime test format)."""

        def __init__(self, load_config: Any) -> None:
            self.gains = parse_gains(load_config.model_loader_extra_config or {})
            # DummyModelLoader.__init__ only refuses an extra config, which is ours.
            BaseModelLoader.__init__(self, load_config)

        def load_weights(self, model: nn.Module, model_config: Any) -> None:
            from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

            if any(get_layerwise_info(layer).can_load() for layer in model.modules()):
                raise ValueError(
                    f"load format {LOAD_FORMAT}: this model is quantized online (an unquantized checkpoint with a "
                    "quantization method); allowed: checkpoints that are unquantized or serialized quantized"
                )
            super().load_weights(model, model_config)
            initialize(model, seed=int(getattr(model_config, "seed", 0) or 0), **self.gains)

    return RealisticRandomLoader


def register() -> None:
    """Entry point ``dbo_runtime_random`` (``vllm.general_plugins``): add the load format once per process.

    Never raises: vLLM's plugin loader does not catch, and an exception here would stop every vLLM
    process from starting for the sake of a test-only load format.
    """
    try:
        from vllm.model_executor import model_loader

        registry = getattr(model_loader, "_LOAD_FORMAT_TO_MODEL_LOADER", {})
        if LOAD_FORMAT in registry:
            return
        model_loader.register_model_loader(LOAD_FORMAT)(loader_class())
    except Exception as exc:  # pragma: no cover - depends on a broken vLLM install
        import logging

        logging.getLogger("vllm.dbo_runtime").warning("dbo_runtime: load format %s not registered: %r", LOAD_FORMAT, exc)


__all__ = ["GAINS", "LOAD_FORMAT", "initialize", "loader_class", "parse_gains", "register"]
