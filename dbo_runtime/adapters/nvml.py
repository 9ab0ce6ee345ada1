"""NVML (``pynvml``, imported lazily) as per-GPU snapshots, without touching CUDA: MIG slices, and for a full GPU
a cross-check of CUDA's SM count (cores / cores per SM). A field is None on its own ``NVMLError``; only a failure
to start NVML raises (``NvmlUnavailable``)."""

from __future__ import annotations

import contextlib
import functools
import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

CORES_PER_SM: dict[tuple[int, int], int] = {
    **dict.fromkeys([(3, 0), (3, 2), (3, 5), (3, 7)], 192),
    **dict.fromkeys([(5, 0), (5, 2), (5, 3), (6, 1), (6, 2), (8, 6), (8, 7), (8, 9), (9, 0)], 128),
    **dict.fromkeys([(6, 0), (7, 0), (7, 2), (7, 5), (8, 0)], 64),
    **dict.fromkeys([(10, 0), (10, 1), (10, 3), (11, 0), (12, 0), (12, 1)], 128),
}
"""CUDA cores per SM by compute capability (CUDA samples' ``_ConvertSMVer2Cores``), for the cross-check."""


def cores_per_sm(capability: tuple[int, int] | None) -> int | None:
    """Cores per SM for a compute capability, or None when not in the table."""
    return None if capability is None else CORES_PER_SM.get((int(capability[0]), int(capability[1])))


class NvmlUnavailable(RuntimeError):
    """NVML cannot be used here (no nvidia-ml-py, no driver, no libnvidia-ml)."""


@dataclass(frozen=True, slots=True)
class NvmlMigDevice:
    """One MIG instance: its handle's slot index; SMs from ``nvmlDeviceGetAttributes_v2``."""

    slot: int
    name: str | None
    uuid: str | None
    multiprocessor_count: int | None


@dataclass(frozen=True, slots=True)
class NvmlGpu:
    """One physical GPU as NVML sees it; every field may be None."""

    index: int
    name: str | None
    uuid: str | None
    compute_capability: tuple[int, int] | None
    num_gpu_cores: int | None
    mig_enabled: bool | None
    attributes_multiprocessor_count: int | None
    """``nvmlDeviceGetAttributes_v2`` on the GPU handle: None on a full (non-MIG) GPU."""
    mig_devices: tuple[NvmlMigDevice, ...] = field(default_factory=tuple)
    memory_total_bytes: int | None = None

    @property
    def sms_from_cores(self) -> int | None:
        """NVML cores / cores-per-SM: the cross-check for the CUDA SM count."""
        cps = cores_per_sm(self.compute_capability)
        if self.num_gpu_cores is None or not cps or self.num_gpu_cores % cps:
            return None
        return self.num_gpu_cores // cps


@dataclass(frozen=True, slots=True)
class NvmlSnapshot:
    driver_version: str | None
    gpus: tuple[NvmlGpu, ...]


def _text(value: Any) -> str | None:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else None if value is None else str(value)


def _call(nvml: Any, name: str, *args: Any) -> Any:
    """``nvml.name(*args)``, None on an ``NVMLError`` or a binding an older nvidia-ml-py lacks."""
    try:
        return getattr(nvml, name)(*args)
    except (nvml.NVMLError, AttributeError):
        return None


def _mig_devices(r: Callable[..., Any], handle: Any) -> tuple[NvmlMigDevice, ...]:
    count = r("nvmlDeviceGetMaxMigDeviceCount", handle)
    out: list[NvmlMigDevice] = []
    for slot in range(int(count or 0)):
        mig = r("nvmlDeviceGetMigDeviceHandleByIndex", handle, slot)
        if mig is None:  # NVMLError_NotFound: an empty slot
            continue
        attrs = r("nvmlDeviceGetAttributes_v2", mig)
        name, uuid = _text(r("nvmlDeviceGetName", mig)), _text(r("nvmlDeviceGetUUID", mig))
        out.append(NvmlMigDevice(slot, name, uuid, None if attrs is None else int(attrs.multiprocessorCount)))
    return tuple(out)


def _gpu(nvml: Any, index: int) -> NvmlGpu:
    r = functools.partial(_call, nvml)
    handle = nvml.nvmlDeviceGetHandleByIndex(index)
    cc = r("nvmlDeviceGetCudaComputeCapability", handle)
    mig = r("nvmlDeviceGetMigMode", handle)
    mig_enabled = None if mig is None else int(mig[0]) == getattr(nvml, "NVML_DEVICE_MIG_ENABLE", 1)
    attrs = r("nvmlDeviceGetAttributes_v2", handle)
    cores = r("nvmlDeviceGetNumGpuCores", handle)
    memory = r("nvmlDeviceGetMemoryInfo", handle)
    return NvmlGpu(
        index=index, name=_text(r("nvmlDeviceGetName", handle)), uuid=_text(r("nvmlDeviceGetUUID", handle)),
        compute_capability=None if cc is None else (int(cc[0]), int(cc[1])), mig_enabled=mig_enabled,
        num_gpu_cores=None if cores is None else int(cores), mig_devices=_mig_devices(r, handle) if mig_enabled else (),
        attributes_multiprocessor_count=None if attrs is None else int(attrs.multiprocessorCount),
        memory_total_bytes=None if memory is None else int(memory.total),
    )  # fmt: skip


def query(nvml: ModuleType | None = None) -> NvmlSnapshot:
    """Snapshot every GPU NVML sees; raises ``NvmlUnavailable`` when NVML cannot start."""
    try:
        module = nvml if nvml is not None else importlib.import_module("pynvml")
    except ImportError as exc:
        raise NvmlUnavailable(f"nvidia-ml-py is not installed ({exc})") from None
    error: type[BaseException] = module.NVMLError
    try:
        module.nvmlInit()
    except (error, OSError) as exc:  # OSError: a broken libnvidia-ml
        raise NvmlUnavailable(f"NVML cannot initialise: {exc}") from None
    try:
        try:
            count = int(module.nvmlDeviceGetCount())
        except error as exc:
            raise NvmlUnavailable(f"nvmlDeviceGetCount failed: {exc}") from None
        gpus = []
        for index in range(count):
            with contextlib.suppress(error):  # a GPU that cannot be opened: report the others
                gpus.append(_gpu(module, index))
        return NvmlSnapshot(_text(_call(module, "nvmlSystemGetDriverVersion")), tuple(gpus))
    finally:
        with contextlib.suppress(error):
            module.nvmlShutdown()


def availability(nvml: ModuleType | None = None) -> tuple[bool, str]:
    """(available, one-line detail) for ``dbo-runtime doctor``."""
    try:
        snap = query(nvml)
    except NvmlUnavailable as exc:
        return False, str(exc)
    return True, f"driver {snap.driver_version or '?'}, {len(snap.gpus)} GPU(s)"
