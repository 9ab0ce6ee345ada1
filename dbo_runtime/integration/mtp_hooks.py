"""The DeepSeek-V4 / V4.1 MTP hidden buffer under DBO: vLLM's NVIDIA models write ``_mtp_hidden_buffer[:n]`` from
row 0 in every microbatch, but the drafter reads it after the join in token order (acceptance drops). On a
microbatch thread the buffer reads as ``buffer[token_offset:]``, as ROCm's model writes it."""

from __future__ import annotations

from typing import Any

from dbo_runtime.core import coverage
from dbo_runtime.integration import ubatch_ids
from dbo_runtime.integration.features import Feature, Probe, Upstream
from dbo_runtime.integration.patching import Patch
from dbo_runtime.integration.ubatch_failures import MicrobatchAttr

ATTR = "_mtp_hidden_buffer"
V4_MODEL = "vllm.models.deepseek_v4.nvidia.model"
V41_MODEL = "vllm.models.deepseek_v41.nvidia.model"
UPSTREAM_PR = "none yet (the ROCm V4 model writes at dbo_current_ubatch_token_offset(); NVIDIA does not)"
REMOVAL = "the NVIDIA V4/V4.1 models write the MTP hidden buffer at the microbatch's token offset"

FEATURES = [
    Feature(
        coverage.MTP_HIDDEN,
        "per-microbatch MTP hidden rows for DeepSeek-V4/V4.1",
        requires=("ubatch_guard",),
        upstream=Upstream(
            "the NVIDIA models write the MTP hidden buffer at the microbatch's token offset",
            (
                Probe("call", V4_MODEL, "DeepseekV4Model.forward", "dbo_current_ubatch_token_offset"),
                Probe("call", V41_MODEL, "DeepseekV4Model.forward", "dbo_current_ubatch_token_offset"),
            ),
        ),
    )
]


class TokenWindowAttr(MicrobatchAttr):
    """A per-step buffer indexed by the step's token rows: a microbatch sees it from its token offset (the view
    is cached per buffer and offset)."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.window_key = f"_dbo_runtime_window_{name}"

    def resolve(self, obj: Any, value: Any) -> Any:
        if value is None:
            return None
        ubatch, offset = ubatch_ids.current_ubatch()
        if ubatch == 0:
            return value
        hit = obj.__dict__.get(self.window_key)
        if hit is not None and hit[0] is value and hit[1] == offset:
            return hit[2]
        view = value[offset:]
        obj.__dict__[self.window_key] = (value, offset, view)
        return view

    def __set__(self, obj: Any, value: Any) -> None:
        obj.__dict__[self.name] = value
        obj.__dict__.pop(self.window_key, None)

    def __delete__(self, obj: Any) -> None:
        obj.__dict__.pop(self.window_key, None)
        super().__delete__(obj)


def patches() -> list[Patch]:
    return [
        Patch(
            name=f"mtp_hidden.{label}",
            module=module,
            attr=f"DeepseekV4Model.{ATTR}",
            make=lambda original: TokenWindowAttr(ATTR),
            reason="each microbatch writes its MTP hidden states at its own token rows, so the drafter reads "
            "both microbatches' rows after the join",
            upstream_pr=UPSTREAM_PR,
            removal=REMOVAL,
            lazy=True,
            adds=True,
            architectures=archs,
            runs_on_ubatch_thread=True,
            armed_at_first_microbatch=True,
        )
        for label, module, archs in (
            ("deepseek_v4", V4_MODEL, ("DeepseekV4ForCausalLM", "DeepseekV4ForConditionalGeneration")),
            ("deepseek_v41", V41_MODEL, ("DeepseekV41ForCausalLM",)),
        )
    ]
