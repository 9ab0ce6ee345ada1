"""The SM budget and vLLM 0.33.0's partition policy, as a pure function.

vLLM decides the compute/comm split in ``create_sm_control_context``
(``vllm/v1/worker/ubatch_utils.py:83-126``) from the environment, the
platform, the parallel config and the all2all manager, and then flips
process-global library knobs. dbo_runtime needs the *decision* separately from
the *knob turning*: subscribers (the indexer schedule cache, the planner
warm-up, the CLI) must know the budget before any kernel runs under it, and the
CLI must reproduce the split on a machine without a GPU. So the decision lives
here, with no vLLM or DeepGEMM import, and is checked against vLLM's own
function by the contract tests in ``tests/vllm``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from dbo_runtime.core.errors import ConfigError

Platform = Literal["cuda", "rocm"]
PLATFORMS: tuple[Platform, ...] = ("cuda", "rocm")

#: ``envs.VLLM_DBO_COMM_SMS`` defaults (``vllm/envs.py:2069-2077``).
DEFAULT_COMM_SMS: dict[Platform, int] = {"cuda": 20, "rocm": 64}

#: All2all backends vLLM 0.33.0 knows (``ParallelConfig.all2all_backend``).
#: Only the first three may be combined with DBO on CUDA (``config/vllm.py:2180-2203``).
DBO_BACKENDS: tuple[str, ...] = ("deepep_high_throughput", "deepep_low_latency", "nixl_ep")
ALL2ALL_BACKENDS: tuple[str, ...] = (
    "naive",
    "pplx",
    "deepep_high_throughput",
    "deepep_low_latency",
    "deepep_v2",
    "mori_high_throughput",
    "mori_low_latency",
    "moonep",
    "nixl_ep",
    "allgather_reducescatter",
    "flashinfer_all2allv",
    "flashinfer_nvlink_two_sided",
    "flashinfer_nvlink_one_sided",
    "passthrough",
)
"""``typing.get_args(vllm.config.parallel.All2AllBackend)`` in 0.33.0 (a contract test keeps them equal)."""

#: ``DeepEPAll2AllManagerBase.num_sms`` in vLLM 0.33.0 (``all2all.py:216``): the HT manager clamps requests to it.
DEEPEP_HT_MANAGER_NUM_SMS = 20

#: What ``max_sms_used()`` of each backend's all2all manager returns in vLLM 0.33.0
#: (``None`` = "could use the whole GPU", base class; ``0`` = no SM reservation).
BACKEND_MAX_SMS_USED: dict[str, int | None] = {
    "deepep_high_throughput": None,
    "deepep_low_latency": 0,
    "nixl_ep": 0,
}


@dataclass(frozen=True, slots=True)
class BudgetReason:
    """Why a budget has the split it has: the inputs of the policy, kept for display."""

    platform: str
    all2all_backend: str | None
    env_comm_sms: int
    max_sms_used: int | None
    rocm_override: bool
    expert_parallel: bool
    comm_knob: bool
    compute_knob: bool
    note: str = ""


@dataclass(frozen=True, slots=True)
class SMBudget:
    """An immutable SM split: ``compute + comm == total`` on one device.

    ``comm_knob`` / ``compute_knob`` say whether vLLM would turn the all2all
    (DeepEP) and DeepGEMM knobs for this budget; a budget can reserve comm SMs
    on paper (``comm > 0``) and still leave DeepGEMM untouched when DeepGEMM is
    absent, exactly as vLLM does.
    """

    total: int
    comm: int
    compute: int
    device: int
    reason: BudgetReason

    def __post_init__(self) -> None:
        if self.total <= 0:
            raise ConfigError("total_sms", self.total, "a positive integer")
        if not 0 <= self.comm < self.total:
            raise ConfigError("comm_sms", self.comm, f"integers in [0, {self.total}) (total SMs {self.total})")
        if self.compute != self.total - self.comm:
            raise ConfigError("compute_sms", self.compute, f"total - comm = {self.total - self.comm}")

    @property
    def partitioned(self) -> bool:
        """True when the budget takes SMs away from the compute kernels."""
        return self.comm > 0

    @property
    def comm_knob(self) -> bool:
        return self.reason.comm_knob

    @property
    def compute_knob(self) -> bool:
        return self.reason.compute_knob

    def describe(self) -> str:
        r = self.reason
        parts = [f"compute {self.compute}/{self.total} SMs, comm {self.comm}"]
        if r.rocm_override:
            parts.append("ROCm + DeepEP HT + DBO forces comm 0")
        if r.max_sms_used is not None:
            parts.append(f"all2all max_sms_used={r.max_sms_used}")
        parts.append(f"VLLM_DBO_COMM_SMS={r.env_comm_sms}")
        if r.note:
            parts.append(r.note)
        return "; ".join(parts)


def full_budget(total: int, device: int = 0, *, note: str = "no partition") -> SMBudget:
    """The budget outside any partition: every SM for compute."""
    return SMBudget(
        total=total,
        comm=0,
        compute=total,
        device=device,
        reason=BudgetReason(
            platform="",
            all2all_backend=None,
            env_comm_sms=0,
            max_sms_used=None,
            rocm_override=False,
            expert_parallel=False,
            comm_knob=False,
            compute_knob=False,
            note=note,
        ),
    )


def parse_comm_sms(raw: object, *, parameter: str = "VLLM_DBO_COMM_SMS") -> int:
    """Validate a comm-SM value from the environment or a flag.

    vLLM parses the variable with a bare ``int()`` and lets a negative value
    through to DeepGEMM, which then fails far from the cause; we reject both
    here with the parameter's name.
    """
    if isinstance(raw, bool):
        raise ConfigError(parameter, raw, "a non-negative integer")
    if isinstance(raw, int):
        value = raw
    elif isinstance(raw, str):
        try:
            value = int(raw.strip(), 10)
        except ValueError:
            raise ConfigError(parameter, raw, "a non-negative integer") from None
    else:
        raise ConfigError(parameter, raw, "a non-negative integer")
    if value < 0:
        raise ConfigError(parameter, raw, "a non-negative integer")
    return value


def compute_budget(
    *,
    total_sms: int,
    platform: str,
    enable_dbo: bool,
    expert_parallel: bool,
    all2all_backend: str | None,
    env_comm_sms: object | None = None,
    has_all2all_manager: bool = True,
    max_sms_used: int | None = None,
    has_deep_gemm: bool = True,
    device: int = 0,
    comm_cap: int | None = None,
) -> SMBudget:
    """vLLM 0.33.0 ``create_sm_control_context``, decision only.

    Steps, in vLLM's order:

    1. ``comm = VLLM_DBO_COMM_SMS`` (default 20 on CUDA, 64 on ROCm).
    2. ROCm + ``enable_dbo`` + ``deepep_high_throughput`` forces ``comm = 0``
       (reserving CUs there corrupts DP+EP accuracy, per vLLM's comment).
    3. Under expert parallel with an all2all manager, ``max_sms_used()`` caps
       ``comm`` (``None`` = no cap, ``0`` = partitioning off); the comm knob is
       turned only when ``comm > 0``.
    4. The compute (DeepGEMM) knob is turned when DeepGEMM is importable and
       ``comm > 0`` -- also without expert parallel, as in vLLM.
    5. ``comm < total`` or vLLM asserts; we raise a named error instead.

    ``max_sms_used`` is only read when ``expert_parallel and has_all2all_manager``.
    ``comm_cap`` is the all2all manager's own ceiling (vLLM's DeepEP HT manager
    clamps every request to the ``num_sms`` its buffers were sized for, 20): the
    even-count check of DeepEP applies to the clamped value, which is what
    ``deep_ep.Buffer.set_num_sms`` receives.
    """
    if platform not in PLATFORMS:
        raise ConfigError("platform", platform, PLATFORMS)
    if not isinstance(total_sms, int) or isinstance(total_sms, bool) or total_sms <= 0:
        raise ConfigError("total_sms", total_sms, "a positive integer")
    if all2all_backend is not None and all2all_backend not in ALL2ALL_BACKENDS:
        raise ConfigError("all2all_backend", all2all_backend, ALL2ALL_BACKENDS)

    env_value = DEFAULT_COMM_SMS[platform] if env_comm_sms is None else parse_comm_sms(env_comm_sms)  # type: ignore[index]
    comm = env_value
    rocm_override = platform == "rocm" and enable_dbo and all2all_backend == "deepep_high_throughput"
    if rocm_override:
        comm = 0

    comm_knob = False
    effective_max: int | None = None
    if expert_parallel and has_all2all_manager:
        effective_max = max_sms_used
        if max_sms_used is not None:
            if max_sms_used < 0:
                raise ConfigError("all2all_manager.max_sms_used()", max_sms_used, "None or a non-negative integer")
            comm = min(comm, max_sms_used)
        comm_knob = comm > 0

    compute_knob = has_deep_gemm and comm > 0

    if comm >= total_sms:
        raise ConfigError(
            "VLLM_DBO_COMM_SMS",
            env_value,
            f"integers in [0, {total_sms}) on this device ({total_sms} SMs): the comm share must leave compute SMs",
        )
    if comm_cap is None and all2all_backend == "deepep_high_throughput":
        comm_cap = DEEPEP_HT_MANAGER_NUM_SMS
    reaches_deepep = min(comm, comm_cap) if comm_cap is not None else comm
    if comm_knob and all2all_backend == "deepep_high_throughput" and reaches_deepep % 2:
        raise ConfigError(
            "VLLM_DBO_COMM_SMS",
            env_value,
            f"even integers up to the DeepEP manager's {comm_cap}-SM ceiling, or values above it (vLLM clamps "
            "those to the ceiling); DeepEP's Buffer.set_num_sms asserts an even SM count",
        )

    return SMBudget(
        total=total_sms,
        comm=comm,
        compute=total_sms - comm,
        device=device,
        reason=BudgetReason(
            platform=platform,
            all2all_backend=all2all_backend,
            env_comm_sms=env_value,
            max_sms_used=effective_max,
            rocm_override=rocm_override,
            expert_parallel=expert_parallel,
            comm_knob=comm_knob,
            compute_knob=compute_knob,
        ),
    )
