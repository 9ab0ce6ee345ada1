"""DeepGEMM's SM knob and paged-MQA planner, imported lazily.

DeepGEMM keeps one process-global SM count in its device runtime
(``csrc/jit/device_runtime.hpp``): ``set_num_sms`` changes it for every thread,
``get_num_sms`` lazily initialises it to the device's SM count. Importing
DeepGEMM initialises CUDA, so the core never imports it; this adapter does, on
first use, and prefers vLLM's wrapper module when vLLM is importable because
that is the binding vLLM's own kernels go through (vLLM may load its vendored
copy, whose device runtime is a different SM counter from a pip ``deep_gemm``).

The paged-MQA schedule rule lives here too: on SM90 with ``next_n == 4`` the
logits kernel runs one task per 2-CTA multicast cluster, so the planner is
asked for ``num_sms // 2`` slots (``vllm.utils.deep_gemm._paged_mqa_logits_schedule_slots``);
DeepGEMM then asserts ``rows == slots + 1``. When vLLM is importable its own
rule function is used, so a future vLLM change of the rule is followed.
"""

from __future__ import annotations

import functools
import importlib
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any


def _module() -> ModuleType:
    try:
        return importlib.import_module("vllm.utils.deep_gemm")
    except ImportError:
        return importlib.import_module("deep_gemm")


@functools.cache
def _vllm_wrapper() -> ModuleType | None:
    """vLLM's DeepGEMM wrapper module, or None (GPU box without vLLM); looked up once."""
    try:
        return importlib.import_module("vllm.utils.deep_gemm")
    except ImportError:
        return None


def next_n_of(context_lens: Any) -> int:
    """Tokens per request the planner and logits kernel see: ``context_lens`` is ``[B, next_n]`` (native
    decode) or one length per row (``[B]``: flattened or varlen decode, next_n 1)."""
    return int(context_lens.shape[1]) if context_lens.dim() == 2 else 1


def available() -> bool:
    """True when a DeepGEMM build loads here (CPU boxes usually say False)."""
    try:
        from vllm.utils.import_utils import has_deep_gemm
    except ImportError:
        try:
            importlib.import_module("deep_gemm")
        except Exception:  # any load failure means "not available"
            return False
        return True
    return bool(has_deep_gemm())


def get_num_sms() -> int:
    return int(_module().get_num_sms())


def set_num_sms(num_sms: int) -> None:
    try:
        _module().set_num_sms(num_sms)
    finally:
        LIVE_NUM_SMS.stale()


class LiveNumSms:
    """DeepGEMM's live SM count for the indexer call site, read once per change instead of once per call.

    Why: vLLM's vendored DeepGEMM 2.8 binds ``get_num_sms`` as a torch custom op (``torch.ops.deep_gemm``), and a
    torch op call dispatches (1-3 µs) and releases the GIL, so any other Python thread of the engine may run until
    its switch interval ends (5 ms) before the call returns; the call site asks once per indexer layer. In vLLM
    0.33 the count changes only through ``vllm.utils.deep_gemm.set_num_sms``, which vLLM's SM control calls by the
    alias ``ubatch_utils.deep_gemm_set_num_sms`` on the main thread with no microbatch thread alive (MRV1 enters it
    around ``_run_ubatches``, MRV2 before starting its threads). While both writers are watched (the indexer's
    optional ``indexer.sm_writes.*`` patches) a read returns the value cached since the last write; every write
    through them, every write through this adapter and every tracked indexer metadata build (``stale``: once per
    step; an engine that never microbatches tracks none, ``IndexerScheduleCache.steps_aside``) re-reads. Not
    watched -- a patch skipped, or the plugin uninstalled -- every read asks DeepGEMM."""

    WRITERS = frozenset({"vllm.utils.deep_gemm.set_num_sms", "vllm.v1.worker.ubatch_utils.deep_gemm_set_num_sms"})

    def __init__(self, reader: Callable[[], Callable[[], int]] | None = None) -> None:
        self._make_reader = reader
        self._reader: Callable[[], int] | None = None
        self._value: int | None = None
        self._watched: set[str] = set()
        self._bindings: dict[str, tuple[str, Any, str, Any]] = {}
        """Per watched writer: (module name, module, attribute, the hook installed there); ``bindings_intact``."""
        self._trusted = False
        self._generation = 0
        """Bumped by every ``stale``: a read that overlapped a write never stores the count it read before it."""

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
            if generation != self._generation:  # a write landed during the read or before the store
                self._value = None
        return value

    def stale(self) -> None:
        self._generation += 1
        self._value = None

    def watch(self, writer: str, binding: tuple[str, Any, str, Any] | None = None) -> None:
        """``writer`` is hooked; ``binding`` is where its name lives and the hook it holds, for ``bindings_intact``
        (a writer watched without one never passes that check)."""
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
        """Every watched writer's module is still the one in ``sys.modules`` and its name still holds the hook
        installed there (a rebinding or a re-import behind the plugin would write the count unseen)."""
        if len(self._bindings) != len(self._watched):
            return False
        modules = sys.modules
        for module_name, module, attr, hook in tuple(self._bindings.values()):  # a lazy import may watch meanwhile
            if modules.get(module_name) is not module or vars(module).get(attr) is not hook:
                return False
        return True

    def distrust(self) -> None:
        """A watched writer was rebound behind the plugin: every read asks DeepGEMM until the writers are watched
        again."""
        self._watched.clear()
        self._bindings.clear()
        self._trusted = False
        self.stale()

    @property
    def trusted(self) -> bool:
        return self._trusted


LIVE_NUM_SMS = LiveNumSms()
"""The process's tracker (DeepGEMM's SM count is process-global)."""


@functools.cache
def num_sms_reader() -> Callable[[], int]:
    """The cheapest callable returning DeepGEMM's *live* SM count (~0.1 us).

    vLLM's ``get_num_sms`` wrapper runs ``_lazy_init`` and an import lookup on
    every call; the indexer call site runs once per layer, so we bind the
    underlying module's function once. It is the module vLLM itself resolved
    (``_import_deep_gemm``: pip ``deep_gemm`` first, vendored copy second).
    """
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
    """Compute-capability major of ``device`` (current device when None); 0 without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return 0
    index = torch.cuda.current_device() if device is None else device
    return int(torch.cuda.get_device_capability(index)[0])


def kv_multicast(next_n: int, major: int) -> int:
    """CTAs per scheduler task: 2 for SM90 ``next_n == 4`` (multicast cluster), else 1."""
    return 2 if next_n == 4 and major == 9 else 1


def schedule_slots(num_sms: int, next_n: int, major: int | None = None) -> int:
    """Scheduler slots the logits kernel launches for ``num_sms``; the schedule has ``slots + 1`` rows.

    With ``major`` None the rule of the installed vLLM is used when vLLM is
    importable (it reads the current platform), else this mirror of it.
    """
    if major is None:
        wrapper = _vllm_wrapper()
        rule = getattr(wrapper, "_paged_mqa_logits_schedule_slots", None) if wrapper is not None else None
        if rule is not None:
            return int(rule(num_sms, next_n))
        major = sm_major()
    return num_sms // kv_multicast(next_n, major)


def plan_paged_mqa_schedule(context_lens: Any, block_kv: int, num_sms: int, indices: Any | None = None) -> Any:
    """DeepGEMM ``get_paged_mqa_logits_metadata`` for ``num_sms`` SMs (slot rule applied once).

    Through vLLM's wrapper when vLLM is importable (it converts SMs to slots),
    else straight to ``deep_gemm`` with ``schedule_slots``.
    """
    wrapper = _vllm_wrapper()
    if wrapper is not None:
        return wrapper.get_paged_mqa_logits_metadata(context_lens, block_kv, num_sms, indices=indices)
    dg = importlib.import_module("deep_gemm")
    slots = schedule_slots(num_sms, next_n_of(context_lens))
    if indices is None:
        return dg.get_paged_mqa_logits_metadata(context_lens, block_kv, slots)
    return dg.get_paged_mqa_logits_metadata(context_lens, block_kv, slots, indices=indices)


class DeepGemmPlanner:
    """The real ``SchedulePlanner`` for ``dbo_runtime.services.schedule_cache`` (see there)."""

    name = "deep_gemm"

    def __init__(self) -> None:
        self._reader: Callable[[], int] | None = None

    def get_num_sms(self) -> int:
        reader = self._reader
        if reader is None:
            reader = self._reader = num_sms_reader()
        return int(reader())

    def slots(self, num_sms: int, next_n: int) -> int:
        return schedule_slots(num_sms, next_n)

    def plan(self, context_lens: Any, block_kv: int, num_sms: int, indices: Any | None = None) -> Any:
        return plan_paged_mqa_schedule(context_lens, block_kv, num_sms, indices)

    def capturing(self) -> bool:
        import torch

        return bool(torch.cuda.is_current_stream_capturing())

    def capture_id(self) -> int | None:
        from dbo_runtime.adapters.cuda_graph import capture_id

        return capture_id()

    def hot_probes(self) -> tuple[Callable[[], int], Callable[[], bool]]:
        """What the call site calls once per layer: the live SM count through ``LIVE_NUM_SMS`` (one cached read while
        DeepGEMM's writers are watched, DeepGEMM's own binding otherwise) and torch's raw capture probe."""
        import torch

        capturing = getattr(torch.cuda.graphs, "_cuda_isCurrentStreamCapturing", torch.cuda.is_current_stream_capturing)
        return LIVE_NUM_SMS.read, capturing


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


@functools.lru_cache(maxsize=8)
def logits_options(kernel: Callable[..., Any]) -> dict[str, Any]:
    """Keyword options for calling ``kernel`` (DeepGEMM's paged-MQA logits) the same way on every build: fp32 logits,
    and no in-kernel cleaning where the build has that switch (the copy vLLM 0.34.0 vendors has none)."""
    import inspect

    import torch

    try:
        params = inspect.signature(kernel).parameters
    except (TypeError, ValueError):  # a compiled binding without a signature: the oldest form
        params = {}
    return {"logits_dtype": torch.float32, **({"clean_logits": False} if "clean_logits" in params else {})}
