"""``fake_cuda_scan``: the torch.cuda boundary, which cannot exist on this CPU box.

Returns real ``dbo_runtime.adapters.cuda_devices`` value objects as ``scan()``
would on a GPU machine; the GPU twin (``tests/gpu/test_cli_gpu.py``) checks the
real ``scan()`` against ``torch.cuda.get_device_properties``.
"""

from __future__ import annotations

from dbo_runtime.adapters.cuda_devices import CudaDevice, CudaScan


def fake_cuda_device(index: int, sms: int, uuid: str | None, name: str = "NVIDIA H200") -> CudaDevice:
    return CudaDevice(
        index=index,
        name=name,
        multi_processor_count=sms,
        compute_capability=(9, 0),
        uuid=uuid,
    )


def fake_cuda_scan(*devices: CudaDevice) -> CudaScan:
    return CudaScan(tuple(devices), "2.11.0+cu130 (fake)", f"{len(devices)} CUDA device(s)")
