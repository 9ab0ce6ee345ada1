"""Environment settings other than the switches, parsed one way everywhere (stdlib only: ``doctor``
runs without torch)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Literal

from dbo_runtime.core.errors import ConfigError, did_you_mean

LAYOUT_ENV = "DBO_RUNTIME_TOPK_LAYOUT"
WARM_MAX_BATCH_ENV = "DBO_RUNTIME_PLANNER_WARM_MAX_BATCH"
VLLM_WARMUP_ENV = "VLLM_DEEP_GEMM_WARMUP"
VLLM_WARMUP_MODES = ("skip", "full", "relax")


def vllm_warmup_mode(environ: Mapping[str, str] | None = None) -> str:
    """``VLLM_DEEP_GEMM_WARMUP`` as vLLM reads it (exact; unset: ``relax``)."""
    raw = (os.environ if environ is None else environ).get(VLLM_WARMUP_ENV)
    if raw is None:
        return "relax"
    if raw not in VLLM_WARMUP_MODES:
        raise ConfigError(
            VLLM_WARMUP_ENV,
            raw,
            "'skip', 'full' or 'relax' (exact, lower case), or not set (relax): vLLM refuses any other value at engine start",
        )
    return raw


class TopkLayout(StrEnum):
    WINDOWS = "windows"
    COPIES = "copies"


def parse_layout(value: str | None) -> TopkLayout:
    """Empty -> ``WINDOWS``; else a layout name."""
    if value is None or value.strip() == "":
        return TopkLayout.WINDOWS
    try:
        return TopkLayout(value.strip().lower())
    except ValueError:
        names = [m.value for m in TopkLayout]
        hint = did_you_mean(value.strip().lower(), names)
        raise ConfigError(LAYOUT_ENV, value, f"{', '.join(map(repr, names))} in any case, or unset (windows){hint}") from None


def warm_max_batch(environ: Mapping[str, str] | None = None) -> int | None:
    """The warm-up bucket cap, None when unset (``0``: no warm-up)."""
    raw = (os.environ if environ is None else environ).get(WARM_MAX_BATCH_ENV)
    if raw is None or raw.strip() == "":
        return None
    allowed = (
        "a non-negative integer, digits only (0 disables planner warm-up; N warms every 32-row bucket up to N, "
        "at most the engine's largest decode step)"
    )
    digits = raw.strip()
    if not (digits.isascii() and digits.isdigit()):  # int() would also take "1_000", "+8" and non-ASCII digits
        raise ConfigError(WARM_MAX_BATCH_ENV, raw, allowed)
    return int(digits)


def setting_problems(environ: Mapping[str, str] | None = None) -> list[ConfigError]:
    """The plugin's settings a DBO engine reads only at model load, checked before any engine starts."""
    env = os.environ if environ is None else environ
    problems = []
    for check in (lambda: parse_layout(env.get(LAYOUT_ENV)), lambda: warm_max_batch(env)):
        try:
            check()
        except ConfigError as exc:
            problems.append(exc)
    return problems


@dataclass(frozen=True)
class WarmPolicy:
    """Planner variants to JIT-compile at model load, following ``VLLM_DEEP_GEMM_WARMUP``."""

    mode: Literal["all", "minimal", "off"]
    cap: int | None = None
    source: str = ""


def warm_policy(environ: Mapping[str, str] | None = None) -> WarmPolicy:
    env = os.environ if environ is None else environ
    cap = warm_max_batch(env)
    if cap == 0:
        return WarmPolicy("off", None, f"{WARM_MAX_BATCH_ENV}=0")
    if cap is not None:
        return WarmPolicy("all", cap, f"{WARM_MAX_BATCH_ENV}={cap}")
    try:
        vllm_mode = vllm_warmup_mode(env)
    except ConfigError:
        vllm_mode = "relax"
    if vllm_mode == "skip":
        return WarmPolicy("minimal", None, f"{VLLM_WARMUP_ENV}=skip")
    return WarmPolicy("all", None, f"{VLLM_WARMUP_ENV}={vllm_mode}")
