"""Only the CLI uses these; H200_SMS: its device with no GPU visible."""

from __future__ import annotations

from collections.abc import Mapping

from dbo_runtime.core.errors import ConfigError
from dbo_runtime.core.settings import vllm_warmup_mode

H200_SMS = 132
DBO_BACKENDS: tuple[str, ...] = ("deepep_high_throughput", "deepep_low_latency", "nixl_ep")
"""The all2all backends vLLM runs DBO with on CUDA."""


class StateError(ConfigError):
    """A parameter refused for its state ("--model is missing")."""

    def __init__(self, parameter: str, state: str, allowed: str) -> None:
        super().__init__(parameter, state, allowed)
        self.state = state
        self.args = (f"{parameter} is {state}; allowed values: {allowed}",)


def vllm_setting_problems(environ: Mapping[str, str] | None = None) -> list[ConfigError]:
    try:
        vllm_warmup_mode(environ)
    except ConfigError as exc:
        return [exc]
    return []
