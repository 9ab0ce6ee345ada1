"""``FakePynvml``: a stand-in for ``import pynvml`` at the NVML driver boundary.

This CPU box has no NVIDIA driver, so real NVML cannot report a GPU here. The
fake reproduces the behaviour measured on the H200 (the ``dbo-runtime sms`` result, ``cli_sms``, in
``docs/records/twins.jsonl``) that the adapter depends on: ``nvmlDeviceGetNumGpuCores`` = 16896 and compute
capability 9.0 on a full H200, ``nvmlDeviceGetAttributes_v2`` raising
NotSupported on a non-MIG handle, MIG mode as ``[current, pending]``, empty MIG
slots raising NotFound. Fields can be made to raise NotSupported one by one.
The GPU twin ``tests/gpu/test_cli_gpu.py`` runs the same CLI against real NVML.
"""

from __future__ import annotations

import types
from dataclasses import dataclass, field

NVML_DEVICE_MIG_DISABLE = 0
NVML_DEVICE_MIG_ENABLE = 1


class NVMLError(Exception):
    """Base of the fake error hierarchy (pynvml's maps codes to ``NVMLError_*`` subclasses)."""

    value = 999

    def __str__(self) -> str:
        return self.text

    text = "Unknown Error"


class NVMLError_NotSupported(NVMLError):  # pynvml spells its error classes this way
    value = 3
    text = "Not Supported"


class NVMLError_NotFound(NVMLError):
    value = 6
    text = "Not Found"


class NVMLError_DriverNotLoaded(NVMLError):
    value = 9
    text = "Driver Not Loaded"


class NVMLError_InvalidArgument(NVMLError):
    value = 2
    text = "Invalid Argument"


@dataclass
class FakeMig:
    name: str
    uuid: str
    multiprocessor_count: int
    gpu_instance_id: int = 1
    compute_instance_id: int = 0
    gpu_instance_slice_count: int = 3
    memory_size_mb: int = 71_000


@dataclass
class FakeGpu:
    name: str = "NVIDIA H200"
    uuid: str = "GPU-6b1f0c2e-0000-4000-8000-000000000001"
    capability: tuple[int, int] = (9, 0)
    cores: int = 16896
    mig_enabled: bool = False
    memory_total: int = 143_771 * 2**20
    """``nvmlDeviceGetMemoryInfo(...).total`` of an H200 (``nvidia-smi``: 143,771 MiB)."""
    mig_slots: list[FakeMig | None] = field(default_factory=list)
    """``None`` = an empty slot (NotFound), as on a GPU with fewer instances than slots."""
    unsupported: set[str] = field(default_factory=set)
    """pynvml function names that raise NotSupported for this GPU."""


class _Attrs:
    def __init__(self, mig: FakeMig) -> None:
        self.multiprocessorCount = mig.multiprocessor_count
        self.gpuInstanceSliceCount = mig.gpu_instance_slice_count
        self.memorySizeMB = mig.memory_size_mb


@dataclass(frozen=True)
class _Handle:
    gpu: FakeGpu
    mig: FakeMig | None = None


class FakePynvml(types.ModuleType):
    """A module object with pynvml's names over a list of ``FakeGpu``; counts init/shutdown."""

    NVML_DEVICE_MIG_DISABLE = NVML_DEVICE_MIG_DISABLE
    NVML_DEVICE_MIG_ENABLE = NVML_DEVICE_MIG_ENABLE
    NVMLError = NVMLError
    NVMLError_NotSupported = NVMLError_NotSupported
    NVMLError_NotFound = NVMLError_NotFound
    NVMLError_DriverNotLoaded = NVMLError_DriverNotLoaded

    def __init__(self, gpus: list[FakeGpu], init_error: NVMLError | None = None, driver: str = "580.95.05") -> None:
        super().__init__("pynvml")
        self.gpus = gpus
        self.init_error = init_error
        self.driver = driver
        self.inits = 0
        self.shutdowns = 0

    # -- lifecycle ------------------------------------------------------------------
    def _live(self) -> None:
        if self.inits <= self.shutdowns:
            raise NVMLError()  # pynvml raises Uninitialized

    def nvmlInit(self) -> None:
        if self.init_error is not None:
            raise self.init_error
        self.inits += 1

    def nvmlShutdown(self) -> None:
        self._live()
        self.shutdowns += 1

    def nvmlSystemGetDriverVersion(self) -> str:
        self._live()
        return self.driver

    def nvmlSystemGetNVMLVersion(self) -> str:
        self._live()
        return "13." + self.driver

    # -- devices --------------------------------------------------------------------
    def nvmlDeviceGetCount(self) -> int:
        self._live()
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> _Handle:
        self._live()
        if not 0 <= index < len(self.gpus):
            raise NVMLError_InvalidArgument()
        return _Handle(self.gpus[index])

    def _check(self, handle: _Handle, fn: str) -> None:
        self._live()
        if fn in handle.gpu.unsupported:
            raise NVMLError_NotSupported()

    def nvmlDeviceGetName(self, handle: _Handle) -> str:
        self._check(handle, "nvmlDeviceGetName")
        return handle.mig.name if handle.mig else handle.gpu.name

    def nvmlDeviceGetUUID(self, handle: _Handle) -> str:
        self._check(handle, "nvmlDeviceGetUUID")
        return handle.mig.uuid if handle.mig else handle.gpu.uuid

    def nvmlDeviceGetCudaComputeCapability(self, handle: _Handle) -> tuple[int, int]:
        self._check(handle, "nvmlDeviceGetCudaComputeCapability")
        return handle.gpu.capability

    def nvmlDeviceGetNumGpuCores(self, handle: _Handle) -> int:
        self._check(handle, "nvmlDeviceGetNumGpuCores")
        if handle.mig:
            raise NVMLError_NotSupported()
        return handle.gpu.cores

    def nvmlDeviceGetMemoryInfo(self, handle: _Handle) -> types.SimpleNamespace:
        self._check(handle, "nvmlDeviceGetMemoryInfo")
        return types.SimpleNamespace(total=handle.gpu.memory_total, free=handle.gpu.memory_total, used=0)

    def nvmlDeviceGetMigMode(self, handle: _Handle) -> list[int]:
        self._check(handle, "nvmlDeviceGetMigMode")
        mode = NVML_DEVICE_MIG_ENABLE if handle.gpu.mig_enabled else NVML_DEVICE_MIG_DISABLE
        return [mode, mode]

    def nvmlDeviceGetAttributes_v2(self, handle: _Handle) -> _Attrs:
        self._check(handle, "nvmlDeviceGetAttributes_v2")
        if handle.mig is None:  # measured: NotSupported on a full H200
            raise NVMLError_NotSupported()
        return _Attrs(handle.mig)

    def nvmlDeviceGetMaxMigDeviceCount(self, handle: _Handle) -> int:
        self._check(handle, "nvmlDeviceGetMaxMigDeviceCount")
        return len(handle.gpu.mig_slots)

    def nvmlDeviceGetMigDeviceHandleByIndex(self, handle: _Handle, index: int) -> _Handle:
        self._check(handle, "nvmlDeviceGetMigDeviceHandleByIndex")
        if not handle.gpu.mig_enabled:
            raise NVMLError_InvalidArgument()
        mig = handle.gpu.mig_slots[index]
        if mig is None:
            raise NVMLError_NotFound()
        return _Handle(handle.gpu, mig)

    def nvmlDeviceGetGpuInstanceId(self, handle: _Handle) -> int:
        self._check(handle, "nvmlDeviceGetGpuInstanceId")
        if handle.mig is None:
            raise NVMLError_InvalidArgument()
        return handle.mig.gpu_instance_id

    def nvmlDeviceGetComputeInstanceId(self, handle: _Handle) -> int:
        self._check(handle, "nvmlDeviceGetComputeInstanceId")
        if handle.mig is None:
            raise NVMLError_InvalidArgument()
        return handle.mig.compute_instance_id


def h200() -> FakeGpu:
    """A full H200 as measured: 16896 cores, CC 9.0, MIG off."""
    return FakeGpu()


def h200_mig(*slots: FakeMig | None) -> FakeGpu:
    """An H200 in MIG mode with the given instances in its slots."""
    return FakeGpu(uuid="GPU-6b1f0c2e-0000-4000-8000-0000000000aa", mig_enabled=True, mig_slots=list(slots))
