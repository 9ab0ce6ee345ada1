"""What ``dbo-runtime doctor`` probes without installing anything (the plugin never imports this module)."""

from __future__ import annotations

import importlib
import sys

from dbo_runtime.integration.patching import Patch, PatchStatus, resolve_owner


def probe_target(patch: Patch) -> PatchStatus:
    """Whether a patch's target exists."""
    module = sys.modules.get(patch.module)
    if module is None:
        try:
            module = importlib.import_module(patch.module)
        except Exception as exc:  # a lazy module may need what this machine lacks
            state = "skipped" if patch.optional or patch.lazy else "missing"
            return PatchStatus(patch, state, f"{type(exc).__name__}: {exc}")
    try:
        owner, name = resolve_owner(module, patch.attr)
        if not patch.adds:
            getattr(owner, name)
    except Exception as exc:
        return PatchStatus(patch, "skipped" if patch.optional else "missing", f"{type(exc).__name__}: {exc}")
    return PatchStatus(patch, "found")


def deep_gemm_available() -> bool:
    try:
        from vllm.utils.import_utils import has_deep_gemm
    except ImportError:
        try:
            importlib.import_module("deep_gemm")
        except Exception:
            return False
        return True
    return bool(has_deep_gemm())
