"""CUDA devices through torch: the SM count vLLM partitions; a GPU-less box gets no devices and the reason."""

from __future__ import annotations

import importlib
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class CudaDevice:
    index: int
    """CUDA ordinal (after ``CUDA_VISIBLE_DEVICES``), not the NVML index."""
    name: str
    multi_processor_count: int
    compute_capability: tuple[int, int]
    uuid: str | None
    """As torch prints it, or None on older torch."""


@dataclass(frozen=True, slots=True)
class CudaScan:
    devices: tuple[CudaDevice, ...]
    torch_version: str | None
    reason: str
    """Why ``devices`` is empty, or a summary when it is not."""


def normalize_uuid(uuid: str | None) -> str | None:
    """Compare torch's and NVML's spellings of a UUID."""
    if not uuid:
        return None
    text = str(uuid).strip().lower()
    for prefix in ("gpu-", "mig-"):
        if text.startswith(prefix):
            text = text[len(prefix) :]
    return text or None


def scan() -> CudaScan:
    """Every CUDA device torch can see."""
    try:
        torch = importlib.import_module("torch")
    except ImportError as exc:
        return CudaScan((), None, f"torch is not installed ({exc})")
    version = str(torch.__version__)
    if not torch.cuda.is_available():
        return CudaScan((), version, "torch.cuda.is_available() is False")
    devices = []
    for index in range(int(torch.cuda.device_count())):
        props = torch.cuda.get_device_properties(index)
        devices.append(
            CudaDevice(
                index=index,
                name=str(props.name),
                multi_processor_count=int(props.multi_processor_count),
                compute_capability=(int(props.major), int(props.minor)),
                uuid=None if getattr(props, "uuid", None) is None else str(props.uuid),
            )
        )
    return CudaScan(tuple(devices), version, f"{len(devices)} CUDA device(s)")
