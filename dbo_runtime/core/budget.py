"""The SM budget and vLLM 0.33.0's partition policy, as a pure function.

vLLM decides the compute/comm split in ``create_sm_control_context`` (``v1/worker/ubatch_utils.py:83-126``)
and turns process-global knobs in the same breath. Subscribers (the schedule cache, the warm-up, the CLI) must
know the decision before any kernel runs under it, and the CLI must reproduce it without a GPU, so the decision
lives here, pure, checked against vLLM's function by the contract tests.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from dbo_runtime.core.errors import ConfigError

Platform = Literal["cuda", "rocm"]
PLATFORMS: tuple[Platform, ...] = ("cuda", "rocm")

#: SMs of an NVIDIA H200 (SM90): the CLI's embedded device profile when no GPU is visible.
H200_SMS = 132

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

#: SM-count multiple that DeepGEMM's compute share must have, by compute-capability major (default 1).
#: SM90: ``fp8_fp4_paged_mqa_logits`` at ``next_n == 4`` (MTP with 3 speculative tokens) runs one 2-CTA
#: multicast cluster per scheduler task and launches over *all* of DeepGEMM's SMs, so an odd count
#: fails to launch with ``CUDA_ERROR_INVALID_CLUSTER_SIZE`` (measured on the H200 at 113 and 131).
DEEP_GEMM_COMPUTE_MULTIPLE: dict[int, int] = {9: 2}
EVEN_COMPUTE_WHY = "kept even on SM90 whatever the next_n: an MTP-3 indexer, next_n 4, launches 2-CTA clusters"
"""Why DeepGEMM's share is rounded on SM90, in the words every refusal and warning of the split uses."""


def deep_gemm_compute_multiple(sm_major: int) -> int:
    """The multiple DeepGEMM's SM count must have on a device of this major. Keyed by the major alone: vLLM
    builds the SM-control context from the parallel config only (MRV2 before any indexer builder exists), so
    the budget cannot know whether an MTP-3 indexer will run; the default split (132 - 20) is even anyway."""
    return DEEP_GEMM_COMPUTE_MULTIPLE.get(int(sm_major), 1)


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
    compute_multiple: int = 1
    """DeepGEMM's count must be a multiple of this when the compute knob is turned (2 on SM90)."""


@dataclass(frozen=True, slots=True)
class SMBudget:
    """An immutable SM split, ``compute + comm + idle == total``, and which knobs vLLM turns for it (comm SMs
    reserved on paper leave DeepGEMM untouched where it is absent, as in vLLM). ``idle``: SMs rounded off a
    compute share DeepGEMM's cluster kernels cannot launch on (``compute_budget``)."""

    total: int
    comm: int
    compute: int
    device: int
    reason: BudgetReason
    idle: int = 0

    def __post_init__(self) -> None:
        if self.total <= 0:
            raise ConfigError("total_sms", self.total, "a positive integer")
        if not 0 <= self.comm < self.total:
            raise ConfigError("comm_sms", self.comm, f"integers in [0, {self.total - 1}] (total SMs {self.total})")
        if not 0 <= self.idle < self.total - self.comm:
            raise ConfigError("idle_sms", self.idle, f"integers in [0, {self.total - self.comm - 1}] (total - comm - 1)")
        if self.compute != self.total - self.comm - self.idle:
            raise ConfigError("compute_sms", self.compute, f"total - comm - idle = {self.total - self.comm - self.idle}")
        multiple = self.reason.compute_multiple
        if self.compute_knob and self.compute % multiple:  # such a budget cannot even be constructed
            raise ConfigError("compute_sms", self.compute, f"multiples of {multiple} (DeepGEMM cluster kernels on this device)")

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
        if self.idle:
            parts.append(
                f"{self.idle} SM idle: DeepGEMM's count rounded down to a multiple of {r.compute_multiple} ({EVEN_COMPUTE_WHY})"
            )
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


def min_compute_sms(compute_multiple: int, has_deep_gemm: bool) -> int:
    """The fewest compute SMs a split may leave (DeepGEMM's count multiple, else 1); every refusal names
    ``total - min_compute_sms``, so the bound it names is itself accepted."""
    return compute_multiple if has_deep_gemm else 1


def parse_comm_sms(raw: object, *, parameter: str = "VLLM_DBO_COMM_SMS") -> int:
    """A comm-SM value from the environment or a flag: vLLM's bare ``int()`` lets a negative value through to
    DeepGEMM, which fails far from the cause; refused here with the parameter's name."""
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


@dataclass(frozen=True, slots=True)
class CommDecision:
    """Steps 1-4 of vLLM's policy: the comm share and which knobs turn (no SM total needed)."""

    env_value: int
    comm: int
    rocm_override: bool
    max_sms_used: int | None
    comm_knob: bool
    compute_knob: bool


def decide_comm(
    *,
    platform: str,
    enable_dbo: bool,
    expert_parallel: bool,
    all2all_backend: str | None,
    env_comm_sms: object | None,
    has_all2all_manager: bool,
    max_sms_used: int | None,
    has_deep_gemm: bool,
    allow_unknown_backend: bool = False,
) -> CommDecision:
    """The comm share and knobs, in vLLM's order: (1) ``comm = VLLM_DBO_COMM_SMS`` (20 CUDA / 64 ROCm); (2) ROCm +
    DBO + DeepEP HT forces 0; (3) under EP with a manager, ``max_sms_used()`` caps it (None: no cap) and the
    comm knob turns when ``comm > 0``; (4) DeepGEMM's knob turns when DeepGEMM loads and ``comm > 0``, also
    without EP. ``allow_unknown_backend``: a backend missing from ``ALL2ALL_BACKENDS`` (vLLM adds them) is taken
    as it comes, with its manager's ``max_sms_used()``; the CLI keeps refusing typos."""
    if platform not in PLATFORMS:
        raise ConfigError("platform", platform, PLATFORMS)
    if all2all_backend is not None and all2all_backend not in ALL2ALL_BACKENDS and not allow_unknown_backend:
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
    return CommDecision(env_value, comm, rocm_override, effective_max, comm_knob, has_deep_gemm and comm > 0)


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
    compute_multiple: int = 1,
    allow_unknown_backend: bool = False,
) -> SMBudget:
    """vLLM 0.33.0 ``create_sm_control_context``, decision only: ``decide_comm`` (steps 1-4), then
    ``comm < total`` (vLLM asserts; a named error here), DeepEP HT's even-count rule on the share that reaches
    it (``comm_cap``: vLLM's HT manager clamps requests to the 20 SMs its buffers were sized for), and the one
    deliberate deviation: where DeepGEMM's knob turns, its share is rounded *down* to ``compute_multiple`` (2 on
    SM90, ``deep_gemm_compute_multiple``) and the leftover SM stays idle. DeepGEMM's count is only how many SMs
    its persistent kernels spread over, so one fewer changes no result, while refusing would make the default
    ``VLLM_DBO_COMM_SMS`` unusable on every odd-SM device; only a split that leaves no compute SM is refused.
    """
    if platform not in PLATFORMS:
        raise ConfigError("platform", platform, PLATFORMS)
    if not isinstance(compute_multiple, int) or isinstance(compute_multiple, bool) or compute_multiple < 1:
        raise ConfigError("compute_multiple", compute_multiple, "a positive integer")
    if not isinstance(total_sms, int) or isinstance(total_sms, bool) or total_sms <= 0:
        raise ConfigError("total_sms", total_sms, "a positive integer")
    decision = decide_comm(
        platform=platform,
        enable_dbo=enable_dbo,
        expert_parallel=expert_parallel,
        all2all_backend=all2all_backend,
        env_comm_sms=env_comm_sms,
        has_all2all_manager=has_all2all_manager,
        max_sms_used=max_sms_used,
        has_deep_gemm=has_deep_gemm,
        allow_unknown_backend=allow_unknown_backend,
    )
    env_value, comm, comm_knob, compute_knob = decision.env_value, decision.comm, decision.comm_knob, decision.compute_knob
    rocm_override, effective_max = decision.rocm_override, decision.max_sms_used

    if comm >= total_sms:
        raise ConfigError(
            "VLLM_DBO_COMM_SMS",
            env_value,
            f"integers in [0, {total_sms - min_compute_sms(compute_multiple, has_deep_gemm)}] on this device ({total_sms} SMs): "
            "the comm share must leave compute SMs",
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

    idle = (total_sms - comm) % compute_multiple if compute_knob else 0
    if idle and total_sms - comm - idle <= 0:
        raise ConfigError(
            "VLLM_DBO_COMM_SMS",
            env_value,
            f"integers in [0, {total_sms - compute_multiple}] on this device ({total_sms} SMs): DeepGEMM's count "
            f"must be a multiple of {compute_multiple} here ({EVEN_COMPUTE_WHY}), and {total_sms} - {comm} leaves fewer "
            "compute SMs than that",
        )

    return SMBudget(
        total=total_sms,
        comm=comm,
        compute=total_sms - comm - idle,
        device=device,
        idle=idle,
        reason=BudgetReason(
            platform=platform,
            all2all_backend=all2all_backend,
            env_comm_sms=env_value,
            max_sms_used=effective_max,
            rocm_override=rocm_override,
            expert_parallel=expert_parallel,
            comm_knob=comm_knob,
            compute_knob=compute_knob,
            compute_multiple=compute_multiple,
        ),
    )
