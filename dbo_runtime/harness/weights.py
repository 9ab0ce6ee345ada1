"""``--load-format dbo_runtime_random``: random weights at the scale of a trained model.

Why this exists: vLLM's ``dummy`` format fills every float tensor, norm weights
included, with U(-1e-3, 1e-3) (``weight_utils.initialize_single_dummy_weight``),
and every tensor from the same seed. A model built that way barely uses its
attention: the RMSNorms scale each sublayer's input down by 1000, so the next
token depends almost only on the last input token. On 2x H200 (2026-11-30) the
shared top-k corruption of vanilla DBO then moved logprobs by 3.4e-4 on average
and did not flip a single greedy token -- a model like that cannot show what an
operator of a real model loses (GSM8K 0.93 -> 0.61 upstream), and a canary that
passes on it proves little.

This format keeps everything the ``dummy`` loader does (no files, deterministic,
fp8/online-quant handling) and then re-initialises the tensors the way a trained
network is scaled: norm weights 1 and biases 0, linear weights with standard
deviation 1/sqrt(fan_in) so every sublayer's output is O(1), embeddings with
standard deviation 1, each tensor from its own seed. For block-fp8 layers the fp8
values are U(-1, 1) and the ``*_scale_inv`` blocks are sqrt(3)/sqrt(fan_in), which
gives the same effective standard deviation. The output is random text, but
attention now matters and a corrupted top-k changes tokens.

It is registered by its own ``vllm.general_plugins`` entry point
(``dbo_runtime_weights``), not by the dbo_runtime plugin: vanilla runs
(``DBO_RUNTIME_DISABLE=1``) must load the identical weights. Registering a load
format patches nothing in vLLM; it only adds a name to
``vllm.model_executor.model_loader._LOAD_FORMAT_TO_MODEL_LOADER``.

Limitation: layers that vLLM quantizes online (a quantization method requested
for an unquantized checkpoint) keep the ``dummy`` values, because they are
already processed when this runs; the project's test models are serialized fp8.
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


def initialize(model: nn.Module, seed: int = 0) -> dict[str, int]:
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
                        param.data.fill_(math.sqrt(3.0) / math.sqrt(weight.shape[-1]))
                    else:
                        param.data.fill_(1.0)
                    counts["scale"] += 1
                elif torch.finfo(param.dtype).bits < 16:
                    _fill_random(param, seed=_seed(full, seed), uniform=1.0)
                    counts["fp8"] += 1
                elif "Embedding" in kind and "LMHead" not in kind:
                    _fill_random(param, seed=_seed(full, seed), std=1.0)
                    counts["embedding"] += 1
                elif param.dim() >= 2:
                    _fill_random(param, seed=_seed(full, seed), std=1.0 / math.sqrt(param.shape[-1]))
                    counts["linear"] += 1
                else:
                    param.data.fill_(1.0)
                    counts["other"] += 1
    return counts


def loader_class() -> type[Any]:
    """vLLM's ``DummyModelLoader`` followed by :func:`initialize` (imports vLLM)."""
    from vllm.model_executor.model_loader.dummy_loader import DummyModelLoader

    class RealisticRandomLoader(DummyModelLoader):  # type: ignore[misc]
        """``dummy`` weights rescaled to a trained model's statistics (dbo_runtime test format)."""

        def load_weights(self, model: nn.Module, model_config: Any) -> None:
            super().load_weights(model, model_config)
            initialize(model, seed=int(getattr(model_config, "seed", 0) or 0))

    return RealisticRandomLoader


def register() -> None:
    """Entry point ``dbo_runtime_weights`` (``vllm.general_plugins``): add the load format once per process.

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


__all__ = ["LOAD_FORMAT", "initialize", "loader_class", "register"]
