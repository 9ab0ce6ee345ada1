"""DeepGEMM's SM knob and planner, imported lazily.

DeepGEMM keeps one process-global SM count in its device runtime
(``csrc/jit/device_runtime.hpp``): ``set_num_sms`` changes it for every thread,
``get_num_sms`` lazily initialises it to the device's SM count. Importing
DeepGEMM initialises CUDA, so the core never imports it; this adapter does, on
first use, and prefers vLLM's wrapper module when vLLM is importable because
that is the binding vLLM's own kernels go through.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any


def _module() -> ModuleType:
    try:
        return importlib.import_module("vllm.utils.deep_gemm")
    except ImportError:
        return importlib.import_module("deep_gemm")


def available() -> bool:
    """True when a DeepGEMM build loads here (CPU boxes usually say False)."""
    try:
        from vllm.utils.import_utils import has_deep_gemm
    except ImportError:
        try:
            importlib.import_module("deep_gemm")
        except Exception:  # noqa: BLE001 - any load failure means "not available"
            return False
        return True
    return bool(has_deep_gemm())


def get_num_sms() -> int:
    return int(_module().get_num_sms())


def set_num_sms(num_sms: int) -> None:
    _module().set_num_sms(num_sms)


class DeepGemmKnob:
    """``SMKnob`` for DeepGEMM's compute SM count.

    ``setter`` lets the vLLM integration route through the exact alias vLLM's
    context calls (``vllm.v1.worker.ubatch_utils.deep_gemm_set_num_sms``), so a
    test that fakes that alias sees the same calls with or without dbo_runtime.
    """

    name = "deep_gemm.set_num_sms"

    def __init__(self, setter: Any | None = None) -> None:
        self._setter = setter

    def set(self, num_sms: int) -> None:
        (self._setter or set_num_sms)(num_sms)
