"""The feature modules, in install order (dependencies first): the one list every consumer reads."""

from __future__ import annotations

import importlib

from dbo_runtime.integration.features import Feature, Reliance
from dbo_runtime.integration.patching import Patch

FEATURE_MODULES: tuple[str, ...] = (
    "dbo_runtime.integration.ubatch_guard",
    "dbo_runtime.integration.capture_hooks",
    "dbo_runtime.integration.sm_hooks",
    "dbo_runtime.integration.indexer_hooks",
    "dbo_runtime.integration.topk_hooks",
    "dbo_runtime.integration.topk_v41_hooks",
    "dbo_runtime.integration.mtp_hooks",
    "dbo_runtime.integration.worker_stats",
)


def all_patches() -> list[Patch]:
    out: list[Patch] = []
    for name in FEATURE_MODULES:
        out.extend(importlib.import_module(name).patches())
    return out


def all_features() -> list[Feature]:
    out: list[Feature] = []
    for name in FEATURE_MODULES:
        out.extend(importlib.import_module(name).FEATURES)
    return out


def all_reliances() -> list[Reliance]:
    return [reliance for feature in all_features() for reliance in feature.relies_on]
