"""Fixtures for contract tests against the real vLLM 0.33.0 package on a CPU box.

The only fakes here stand in for what cannot exist without a GPU: the CUDA /
ROCm platform answer, the device's SM count and compute capability, the current accelerator index,
the expert-parallel group (``FakeEpGroup``) with its all2all manager
(``FakeAll2AllManager``) and DeepGEMM's SM setter (``FakeDeepGemmSetter``).
Each is installed on the exact vLLM global that ``create_sm_control_context``
reads (``docs/vllm-hook-points.md`` §2).

These vLLM-platform fakes cannot have a GPU twin that imports vLLM: the GPU
machine has no vLLM. Their semantic twin is tests/gpu/test_sm_control_gpu.py,
where SMControl turns the real DeepGEMM and DeepEP SM knobs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from dbo_runtime.integration import plugin
from dbo_runtime.services import sm_control


@dataclass
class FakeAll2AllManager:
    """Boundary fake for vLLM's all2all manager (needs a real EP group / NCCL).

    ``num_sms`` mirrors vLLM's ``DeepEPAll2AllManagerBase.num_sms = 20``, the SM
    count its buffers are sized for; dbo_runtime's sm_hooks reads it as the HT
    manager's clamp on the comm SMs that reach DeepEP.
    """

    max_sms: int | None
    calls: list[tuple[str, int]]
    num_sms: int = 20

    def max_sms_used(self) -> int | None:
        return self.max_sms

    def set_num_sms(self, n: int) -> None:
        self.calls.append(("comm", n))


@dataclass
class FakeDeviceCommunicator:
    """Boundary fake for the EP group's device communicator: only the all2all manager is read."""

    all2all_manager: FakeAll2AllManager | None


@dataclass
class FakeEpGroup:
    """Boundary fake for vLLM's expert-parallel group (``get_ep_group()``; needs NCCL and GPUs)."""

    device_communicator: FakeDeviceCommunicator


@dataclass
class FakeDeepGemmSetter:
    """Boundary fake for vLLM's ``deep_gemm_set_num_sms`` (needs DeepGEMM on a GPU); logs ("compute", n)."""

    calls: list[tuple[str, int]]

    def __call__(self, n: int) -> None:
        self.calls.append(("compute", n))


@dataclass
class FakeGpuPlatform:
    """Applies the platform fakes; ``calls`` is the shared knob-call log."""

    monkeypatch: pytest.MonkeyPatch
    calls: list[tuple[str, int]] = field(default_factory=list)

    def set(
        self,
        *,
        platform: str = "cuda",
        total_sms: int = 132,
        max_sms_used: int | None = None,
        has_manager: bool = True,
        deep_gemm: bool = True,
        env_comm_sms: int | None = None,
        sm_major: int | None = None,
    ) -> None:
        from vllm.platforms import current_platform
        from vllm.platforms.interface import DeviceCapability
        from vllm.utils import platform_utils
        from vllm.v1.worker import ubatch_utils

        mp = self.monkeypatch
        mp.setattr(current_platform, "is_cuda", lambda: platform == "cuda")
        mp.setattr(current_platform, "is_rocm", lambda: platform == "rocm")
        mp.setattr(current_platform, "num_compute_units", lambda device_id=0: total_sms, raising=False)
        if sm_major is not None:  # None: the CPU platform's answer (no capability)
            capability = DeviceCapability(major=sm_major, minor=0)
            mp.setattr(current_platform, "get_device_capability", lambda device_id=0: capability)
        platform_utils.num_compute_units.cache_clear()
        mp.setattr(torch.accelerator, "current_device_index", lambda: 0)
        manager = FakeAll2AllManager(max_sms_used, self.calls) if has_manager else None
        ep = FakeEpGroup(FakeDeviceCommunicator(manager))
        mp.setattr(ubatch_utils, "get_ep_group", lambda: ep)
        mp.setattr(ubatch_utils, "has_deep_gemm", lambda: deep_gemm)
        mp.setattr(ubatch_utils, "deep_gemm_set_num_sms", FakeDeepGemmSetter(self.calls))
        if env_comm_sms is None:
            mp.delenv("VLLM_DBO_COMM_SMS", raising=False)
            if hasattr(ubatch_utils.envs, "VLLM_DBO_COMM_SMS") and "VLLM_DBO_COMM_SMS" in vars(ubatch_utils.envs):
                mp.delattr(ubatch_utils.envs, "VLLM_DBO_COMM_SMS")
            # vLLM picks the ROCm default from torch.version.hip.
            mp.setattr(torch.version, "hip", "6.4" if platform == "rocm" else None)
        else:
            mp.setenv("VLLM_DBO_COMM_SMS", str(env_comm_sms))
        mp.setattr(sm_control, "_CONTROLS", {})


@pytest.fixture
def gpu_platform(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeGpuPlatform]:
    from vllm.utils import platform_utils

    monkeypatch.setattr(sm_control, "_CONTROLS", {})
    fake = FakeGpuPlatform(monkeypatch)
    yield fake
    platform_utils.num_compute_units.cache_clear()


@pytest.fixture
def clean_plugin() -> Iterator[Callable[[], None]]:
    """Guarantees vLLM is unpatched before and after the test."""
    plugin.uninstall()
    yield plugin.register
    plugin.uninstall()


def parallel_config(*, backend: str = "deepep_high_throughput", ep: bool = True, dbo: bool = True) -> object:
    from vllm.config import ParallelConfig

    return ParallelConfig(
        enable_dbo=dbo,
        ubatch_size=0 if dbo else 2,
        enable_expert_parallel=ep,
        all2all_backend=backend,
        data_parallel_size=2,
    )


@pytest.fixture
def fresh_arming(monkeypatch: pytest.MonkeyPatch) -> Any:
    """A process that has not split a step yet (``microbatch_arming``): a fresh registry in every module that
    registers with or arms the process-wide one, so no earlier test's installation or arming leaks in."""
    from dbo_runtime.integration import indexer_hooks, patching, ubatch_guard
    from dbo_runtime.integration.microbatch_arming import MicrobatchArming

    fresh = MicrobatchArming()
    for module in (patching, ubatch_guard, indexer_hooks):
        monkeypatch.setattr(module, "ARMING", fresh)
    return fresh


def in_release(patches: list[Any]) -> list[Any]:
    """The patches of the installed vLLM release's set: those whose every anchor exists in its code (what a recorded
    fingerprint requires). The Model Runner V1 patches, for one, are not part of vLLM 0.34's set."""
    from dbo_runtime.integration.fingerprints import MISSING, fingerprint

    return [p for p in patches if not p.fingerprint_anchors or fingerprint(p.fingerprint_anchors) != MISSING]


def has_module(module: str) -> bool:
    """Whether the installed vLLM has ``module`` (found by path: some cannot be imported on a CPU box)."""
    from dbo_runtime.integration.fingerprints import module_file

    return module_file(module) is not None


def row_width_keyword() -> str:
    """The keyword ``SparseMLAIndexGroupBuilder.register_layer`` takes the KV row width by in the installed vLLM
    (``head_size`` in 0.33, ``row_width`` in 0.34)."""
    import inspect

    from vllm.v1.attention.backends.mla.index_group import SparseMLAIndexGroupBuilder

    params = inspect.signature(SparseMLAIndexGroupBuilder.register_layer).parameters
    return "row_width" if "row_width" in params else "head_size"


def fake_group_events(monkeypatch: pytest.MonkeyPatch, make_event: Callable[[], Any], make_stream: Callable[[Any], Any]) -> None:
    """Boundary fakes for the index group's events and side stream (CPU torch records no event), wherever the
    installed vLLM makes them: its ``_create_event`` / ``_create_side_stream`` (0.33) or ``torch.Event`` /
    ``torch.Stream`` called directly (0.34)."""
    from vllm.v1.attention.backends.mla import index_group

    if hasattr(index_group, "_create_event"):
        monkeypatch.setattr(index_group, "_create_event", make_event)
        monkeypatch.setattr(index_group, "_create_side_stream", make_stream)
    else:
        monkeypatch.setattr(index_group, "torch", _TorchWith(Event=make_event, Stream=lambda device=None: make_stream(device)))


class _TorchWith:
    """``torch`` as one vLLM module sees it, with some names standing in (the rest is torch's own)."""

    def __init__(self, **names: Any) -> None:
        self.__dict__.update(names)

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)
