"""DeepGEMM's SM knob and paged-MQA planner, imported lazily (importing DeepGEMM initialises CUDA); through vLLM's
wrapper where importable: vLLM's kernels use its vendored copy, which has its own SM counter and slot rule."""

from __future__ import annotations

import functools
import importlib
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any


@functools.cache
def _vllm_wrapper() -> ModuleType | None:
    try:
        return importlib.import_module("vllm.utils.deep_gemm")
    except ImportError:
        return None


def _module() -> ModuleType:
    return _vllm_wrapper() or importlib.import_module("deep_gemm")


def next_n_of(context_lens: Any) -> int:
    """Tokens per request the planner and logits kernel see (``context_lens`` is ``[B, next_n]`` or ``[B]``)."""
    return int(context_lens.shape[1]) if context_lens.dim() == 2 else 1


def get_num_sms() -> int:
    return int(_module().get_num_sms())


def set_num_sms(num_sms: int) -> None:
    try:
        _module().set_num_sms(num_sms)
    finally:
        LIVE_NUM_SMS.stale()


class LiveNumSms:
    """DeepGEMM's live SM count for the indexer call site, read once per change, not per layer (a torch op releases
    the GIL): cached since the last ``stale`` while every writer in ``WRITERS`` is watched, else read every time."""

    WRITERS = frozenset({"vllm.utils.deep_gemm.set_num_sms", "vllm.v1.worker.ubatch_utils.deep_gemm_set_num_sms"})

    def __init__(self, reader: Callable[[], Callable[[], int]] | None = None) -> None:
        self._make_reader = reader
        self._reader: Callable[[], int] | None = None
        self._value: int | None = None
        self._watched: set[str] = set()
        self._bindings: dict[str, tuple[str, Any, str, Any]] = {}
        """Per watched writer: (module name, module, attribute, our hook)."""
        self._trusted = False
        self._generation = 0
        """Bumped by ``stale``: a read overlapping a write never stores."""

    def read(self) -> int:
        value = self._value
        if value is not None:
            return value
        reader = self._reader
        if reader is None:
            reader = self._reader = (self._make_reader or num_sms_reader)()
        generation = self._generation
        value = int(reader())
        if self._trusted:
            self._value = value
            if generation != self._generation:
                self._value = None
        return value

    def stale(self) -> None:
        self._generation += 1
        self._value = None

    def watch(self, writer: str, binding: tuple[str, Any, str, Any] | None = None) -> None:
        self._watched.add(writer)
        if binding is not None:
            self._bindings[writer] = binding
        else:
            self._bindings.pop(writer, None)
        self._trusted = self._watched >= self.WRITERS
        self.stale()

    def unwatch(self, writer: str) -> None:
        self._watched.discard(writer)
        self._bindings.pop(writer, None)
        self._trusted = False
        self.stale()

    def bindings_intact(self) -> bool:
        """Every watched writer's name still holds our hook."""
        if len(self._bindings) != len(self._watched):
            return False
        modules = sys.modules
        for module_name, module, attr, hook in tuple(self._bindings.values()):
            if modules.get(module_name) is not module or vars(module).get(attr) is not hook:
                return False
        return True

    def distrust(self) -> None:
        """A writer was rebound behind us: every read asks DeepGEMM."""
        self._watched.clear()
        self._bindings.clear()
        self._trusted = False
        self.stale()

    @property
    def trusted(self) -> bool:
        return self._trusted


LIVE_NUM_SMS = LiveNumSms()


@functools.cache
def num_sms_reader() -> Callable[[], int]:
    """DeepGEMM's own ``get_num_sms``, bound once (vLLM's wrapper is too slow for once per layer)."""
    wrapper = _vllm_wrapper()
    if wrapper is not None:
        wrapper._lazy_init()
        dg = wrapper._import_deep_gemm()
        if dg is None:
            raise RuntimeError("DeepGEMM is not available")
    else:
        dg = importlib.import_module("deep_gemm")
    return dg.get_num_sms  # type: ignore[no-any-return]


@functools.cache
def sm_major(device: int | None = None) -> int:
    """Compute-capability major (0 without CUDA)."""
    import torch

    if not torch.cuda.is_available():
        return 0
    index = torch.cuda.current_device() if device is None else device
    return int(torch.cuda.get_device_capability(index)[0])


def schedule_slots(num_sms: int, next_n: int, major: int | None = None) -> int:
    """Scheduler slots for ``num_sms`` (a schedule has ``slots + 1`` rows); ``major`` None: vLLM's rule if any."""
    if major is None:
        wrapper = _vllm_wrapper()
        rule = getattr(wrapper, "_paged_mqa_logits_schedule_slots", None) if wrapper is not None else None
        if rule is not None:
            return int(rule(num_sms, next_n))
        major = sm_major()
    return num_sms // (2 if next_n == 4 and major == 9 else 1)


class DeepGemmPlanner:
    """The real ``SchedulePlanner`` of ``services.schedule_cache``."""

    name = "deep_gemm"

    def get_num_sms(self) -> int:
        return int(num_sms_reader()())

    def slots(self, num_sms: int, next_n: int) -> int:
        return schedule_slots(num_sms, next_n)

    def plan(self, context_lens: Any, block_kv: int, num_sms: int, indices: Any | None = None) -> Any:
        """The bare wheel's planner takes scheduler slots, not SMs."""
        wrapper = _vllm_wrapper()
        if wrapper is not None:
            return wrapper.get_paged_mqa_logits_metadata(context_lens, block_kv, num_sms, indices=indices)
        dg = importlib.import_module("deep_gemm")
        slots = schedule_slots(num_sms, next_n_of(context_lens))
        if indices is None:
            return dg.get_paged_mqa_logits_metadata(context_lens, block_kv, slots)
        return dg.get_paged_mqa_logits_metadata(context_lens, block_kv, slots, indices=indices)

    def capturing(self) -> bool:
        import torch

        return bool(torch.cuda.is_current_stream_capturing())

    def capture_id(self) -> int | None:
        from dbo_runtime.adapters.cuda_graph import capture_id

        return capture_id()

    def hot_probes(self) -> tuple[Callable[[], int], Callable[[], bool]]:
        """Once per layer: the live SM count and torch's raw capture probe."""
        import torch

        capturing = getattr(torch.cuda.graphs, "_cuda_isCurrentStreamCapturing", torch.cuda.is_current_stream_capturing)
        return LIVE_NUM_SMS.read, capturing


class DeepGemmKnob:
    """``SMKnob`` for DeepGEMM's compute SM count; ``setter`` routes through the alias vLLM calls."""

    name = "deep_gemm.set_num_sms"

    def __init__(self, setter: Any | None = None) -> None:
        self._setter = setter

    def set(self, num_sms: int) -> None:
        (self._setter or set_num_sms)(num_sms)
