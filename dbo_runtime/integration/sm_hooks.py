"""vLLM's ``create_sm_control_context`` backed by SMControl: vLLM turns process-global SM knobs telling no one, so
the indexer schedule cannot know its count. This feeds vLLM's inputs to ``core.budget`` and enters the device's
SMControl, which publishes the budget before any kernel runs and restores the previous one on exit or failure."""

from __future__ import annotations

import functools
import os
from typing import Any

from dbo_runtime.adapters.all2all import All2AllKnob
from dbo_runtime.adapters.deep_gemm import DeepGemmKnob
from dbo_runtime.core.budget import ALL2ALL_BACKENDS, SMBudget, compute_budget, deep_gemm_compute_multiple
from dbo_runtime.core.errors import ConfigError
from dbo_runtime.core.log import get_logger
from dbo_runtime.integration import activation
from dbo_runtime.integration.features import Feature
from dbo_runtime.integration.patching import Patch
from dbo_runtime.services.metrics import export_to_prometheus
from dbo_runtime.services.sm_control import SMControl, SMKnob, sm_control_for

logger = get_logger(__name__)

FEATURES = [Feature("sm_control", "SM budget control")]

UPSTREAM_PR = "none yet (SM-control publication); crash fixed by vllm#60732"


class DboSMControlContext:
    """Drop-in for vLLM's ``SMControlContextManager``, entering through SMControl. The token lives on the
    instance (MRV2 exits on another path); one still outstanding at the next enter is closed first."""

    def __init__(self, control: SMControl, budget: SMBudget, comm_knob: SMKnob | None, compute_knob: SMKnob | None) -> None:
        self.control = control
        self.budget = budget
        self.total_sms = budget.total
        self.comm_sms = budget.comm
        self.compute_sms = budget.compute
        self._comm_knob = comm_knob
        self._compute_knob = compute_knob
        self.set_comm_sms = comm_knob.set if comm_knob is not None else (lambda sms: None)
        self.set_compute_sms = compute_knob.set if compute_knob is not None else (lambda sms: None)
        self._tokens: list[int] = []

    def __enter__(self) -> None:
        if self._tokens:  # e.g. MRV2's begin_capturable_run raised after entering: never leave the GPU split
            logger.warning("dbo_runtime: closing %d leaked SM-control scope(s) of %r", len(self._tokens), self)
            while self._tokens:
                self.control.exit(self._tokens.pop())
        self._tokens.append(self.control.enter(self.budget, comm_knob=self._comm_knob, compute_knob=self._compute_knob))

    def __exit__(self, *exc: object) -> None:
        self.control.exit(self._tokens.pop())

    def __repr__(self) -> str:
        return f"DboSMControlContext({self.budget.describe()}, device={self.budget.device})"


def _platform_name(platform: Any) -> str:
    if platform.is_cuda():
        return "cuda"
    if platform.is_rocm():
        return "rocm"
    raise ConfigError(
        "current_platform", getattr(platform, "device_name", type(platform).__name__),
        "cuda, rocm (vLLM's SM/CU control exists only on CUDA and ROCm)",
    )


_unknown_logged: set[str] = set()


def budget_from_vllm(parallel_config: Any) -> tuple[SMBudget, SMKnob | None, SMKnob | None]:
    """The budget and knobs as vLLM computes them, from its globals."""
    import torch
    from vllm.v1.worker import ubatch_utils as uu

    platform = _platform_name(uu.current_platform)
    device = torch.accelerator.current_device_index()
    total = uu.num_compute_units(device)

    manager = None
    max_sms_used: int | None = None
    if parallel_config.enable_expert_parallel:
        communicator = uu.get_ep_group().device_communicator
        if communicator is not None:
            manager = communicator.all2all_manager
        if manager is not None:
            max_sms_used = manager.max_sms_used()

    deep_gemm_present = bool(uu.has_deep_gemm())
    try:
        env_comm_sms: object = uu.envs.VLLM_DBO_COMM_SMS
    except ValueError:  # vLLM parses with a bare int(); give the operator the variable's name instead
        env_comm_sms = os.environ.get("VLLM_DBO_COMM_SMS")
    # compute-capability major, 0 off CUDA (ROCm reports gfx9xx as 9.x)
    capability = uu.current_platform.get_device_capability(device_id=device) if platform == "cuda" else None
    cap = getattr(manager, "num_sms", None) if manager is not None else None
    backend = parallel_config.all2all_backend
    if backend is not None and backend not in ALL2ALL_BACKENDS and backend not in _unknown_logged:
        # vLLM adds backends; an unknown one is no reason to stop model load: its live manager's
        # max_sms_used() is exactly what vLLM's own policy reads.
        _unknown_logged.add(backend)
        logger.info(
            "dbo_runtime: all2all backend %r is new to dbo_runtime; its SM split follows vLLM's policy with the "
            "manager's max_sms_used()=%r", backend, max_sms_used,
        )
    budget = compute_budget(
        total_sms=total, platform=platform, enable_dbo=bool(parallel_config.enable_dbo),
        expert_parallel=bool(parallel_config.enable_expert_parallel), all2all_backend=parallel_config.all2all_backend,
        env_comm_sms=env_comm_sms, has_all2all_manager=manager is not None, max_sms_used=max_sms_used,
        has_deep_gemm=deep_gemm_present, device=device,
        comm_cap=cap if isinstance(cap, int) and not isinstance(cap, bool) else None,
        compute_multiple=deep_gemm_compute_multiple(int(capability.major) if capability is not None else 0),
        allow_unknown_backend=True,
    )
    comm_knob: SMKnob | None = All2AllKnob(manager) if budget.comm_knob else None
    # the compute knob resolves vLLM's alias at call time, like vLLM's lambda does
    compute_knob = DeepGemmKnob(lambda sms: uu.deep_gemm_set_num_sms(sms)) if budget.compute_knob else None
    return budget, comm_knob, compute_knob


def create_sm_control_context(parallel_config: Any) -> DboSMControlContext:
    """What vLLM's ``create_sm_control_context`` computes, published through SMControl."""
    from dbo_runtime.integration import guard

    guard.check_without_worker_hooks()
    budget, comm_knob, compute_knob = budget_from_vllm(parallel_config)
    control = sm_control_for(budget.device, budget.total)
    # at model load: exporting metrics is optional and must never stop the engine
    try:
        export_to_prometheus(control)
    except Exception as exc:
        logger.warning("dbo_runtime: Prometheus metrics not exported (%r); the engine runs without them", exc)
    # UBatchWrapper / UBatchRunner construction (model load): subscribers warm per-SM-count kernels outside any capture
    control.announce(budget)
    activation.flush()
    logger.info("dbo_runtime: DBO SM budget on device %d: %s", budget.device, budget.describe())
    return DboSMControlContext(control, budget, comm_knob, compute_knob)


def _replace(original: Any) -> Any:
    """A wrapper of its own per patch, so each carries its own patch mark and ``__wrapped__``."""

    def replacement(parallel_config: Any) -> DboSMControlContext:
        return create_sm_control_context(parallel_config)

    return replacement


def patches() -> list[Patch]:
    patch = functools.partial(
        Patch, make=_replace,
        reason=(
            "route DBO's compute/comm SM split through SMControl so subscribers (indexer schedule "
            "cache, planner warm-up) learn the budget before any kernel runs under it"
        ),
        upstream_pr=UPSTREAM_PR, removal="vLLM exposes an SM-budget callback from create_sm_control_context",
        # patched at the runner module's import (in the worker): the API server never imports CUDA-only runner code
        lazy=True,
    )
    policy = ("vllm.v1.worker.ubatch_utils:create_sm_control_context", "vllm.v1.worker.ubatch_utils:SMControlContextManager")
    return [
        patch(
            name="sm_control.mrv1", runner="mrv1", module="vllm.v1.worker.gpu_ubatch_wrapper",
            attr="create_sm_control_context",
            anchors=(*policy, "vllm.v1.worker.gpu_ubatch_wrapper:UBatchWrapper.__init__"),
        ),
        patch(
            name="sm_control.mrv2", runner="mrv2", module="vllm.v1.worker.gpu.ubatch_utils",
            attr="create_sm_control_context",
            anchors=(*policy, "vllm.v1.worker.gpu.ubatch_utils:UBatchRunner.__init__"),
        ),
    ]
