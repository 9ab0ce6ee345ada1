"""vLLM's SM partition policy as a pure function: subscribers must know the split before any kernel runs
under it, and the CLI must reproduce it without a GPU. Contract tests hold it equal to vLLM's."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from dbo_runtime.core.errors import ConfigError

Platform = Literal["cuda", "rocm"]
PLATFORMS: tuple[Platform, ...] = ("cuda", "rocm")

#: ``VLLM_DBO_COMM_SMS`` defaults.
DEFAULT_COMM_SMS: dict[Platform, int] = {"cuda": 20, "rocm": 64}

ALL2ALL_BACKENDS: tuple[str, ...] = (
    "naive", "pplx", "deepep_high_throughput", "deepep_low_latency", "deepep_v2", "mori_high_throughput",
    "mori_low_latency", "moonep", "mori", "nixl_ep", "allgather_reducescatter", "flashinfer_all2allv",
    "flashinfer_nvlink_two_sided", "flashinfer_nvlink_one_sided", "passthrough",
)
"""vLLM's ``All2AllBackend`` values over every supported release (a contract test checks the installed one's)."""

#: ``DeepEPAll2AllManagerBase.num_sms``: the HT manager clamps requests to it.
DEEPEP_HT_MANAGER_NUM_SMS = 20

#: Multiple DeepGEMM's SM count must have, by compute-capability major: on SM90 the MTP-3 logits kernel
#: launches 2-CTA clusters over all of DeepGEMM's SMs, so an odd count fails to launch.
DEEP_GEMM_COMPUTE_MULTIPLE: dict[int, int] = {9: 2}
EVEN_COMPUTE_WHY = "on SM90 the MTP-3 indexer kernel launches 2-CTA clusters"
"""Why DeepGEMM's share is rounded on SM90, as every refusal and warning says it."""


def deep_gemm_compute_multiple(sm_major: int) -> int:
    """The multiple DeepGEMM's SM count must have (by major alone: vLLM does not know ``next_n`` yet)."""
    return DEEP_GEMM_COMPUTE_MULTIPLE.get(int(sm_major), 1)


#: ``max_sms_used()`` of each backend's all2all manager (None: the whole GPU; 0: no reservation).
BACKEND_MAX_SMS_USED: dict[str, int | None] = {"deepep_high_throughput": None, "deepep_low_latency": 0, "nixl_ep": 0}


@dataclass(frozen=True, slots=True)
class BudgetReason:
    """Why a budget has the split it has: the inputs of the policy, kept for display."""

    platform: str = ""
    all2all_backend: str | None = None
    env_comm_sms: int = 0
    max_sms_used: int | None = None
    rocm_override: bool = False
    expert_parallel: bool = False
    comm_knob: bool = False
    compute_knob: bool = False
    note: str = ""
    compute_multiple: int = 1
    """DeepGEMM's count multiple when the compute knob turns."""


@dataclass(frozen=True, slots=True)
class SMBudget:
    """An immutable SM split, ``compute + comm + idle == total``, and which knobs vLLM turns for it;
    ``idle`` is what rounding DeepGEMM's share left over."""

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
    return SMBudget(total=total, comm=0, compute=total, device=device, reason=BudgetReason(note=note))


def parse_comm_sms(raw: object, *, parameter: str = "VLLM_DBO_COMM_SMS") -> int:
    """A comm-SM value from the environment or a flag; a negative one is refused here, by name, instead
    of failing in DeepGEMM far from the cause."""
    value = raw if isinstance(raw, int) and not isinstance(raw, bool) else -1
    if isinstance(raw, str):
        try:
            value = int(raw.strip(), 10)
        except ValueError:
            pass
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
    *, platform: str, enable_dbo: bool, expert_parallel: bool, all2all_backend: str | None,
    env_comm_sms: object | None, has_all2all_manager: bool, max_sms_used: int | None, has_deep_gemm: bool,
    allow_unknown_backend: bool = False,
) -> CommDecision:
    """The comm share and knobs, in vLLM's order. ``allow_unknown_backend`` takes a backend vLLM added
    later as it comes; the CLI keeps refusing typos."""
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
    *, total_sms: int, platform: str, enable_dbo: bool, expert_parallel: bool, all2all_backend: str | None,
    env_comm_sms: object | None = None, has_all2all_manager: bool = True, max_sms_used: int | None = None,
    has_deep_gemm: bool = True, device: int = 0, comm_cap: int | None = None, compute_multiple: int = 1,
    allow_unknown_backend: bool = False,
) -> SMBudget:
    """vLLM's ``create_sm_control_context``, decision only, with one deliberate deviation: DeepGEMM's share is
    rounded *down* to its multiple and the leftover SM stays idle (refusing would break odd-SM devices)."""
    if platform not in PLATFORMS:
        raise ConfigError("platform", platform, PLATFORMS)
    if not isinstance(compute_multiple, int) or isinstance(compute_multiple, bool) or compute_multiple < 1:
        raise ConfigError("compute_multiple", compute_multiple, "a positive integer")
    if not isinstance(total_sms, int) or isinstance(total_sms, bool) or total_sms <= 0:
        raise ConfigError("total_sms", total_sms, "a positive integer")
    # the fewest compute SMs a split may leave: DeepGEMM's multiple
    in_range = f"integers in [0, {total_sms - (compute_multiple if has_deep_gemm else 1)}] on a {total_sms}-SM device"
    try:
        decision = decide_comm(
            platform=platform, enable_dbo=enable_dbo, expert_parallel=expert_parallel, all2all_backend=all2all_backend,
            env_comm_sms=env_comm_sms, has_all2all_manager=has_all2all_manager, max_sms_used=max_sms_used,
            has_deep_gemm=has_deep_gemm, allow_unknown_backend=allow_unknown_backend,
        )
    except ConfigError as exc:  # not an integer >= 0: the same range as a share too large
        raise ConfigError(exc.parameter, exc.value, in_range) if exc.parameter == "VLLM_DBO_COMM_SMS" else exc from None
    env_value, comm, compute_knob = decision.env_value, decision.comm, decision.compute_knob
    if comm >= total_sms:
        raise ConfigError("VLLM_DBO_COMM_SMS", env_value, f"{in_range}: the comm share must leave compute SMs")
    if comm_cap is None and all2all_backend == "deepep_high_throughput":
        comm_cap = DEEPEP_HT_MANAGER_NUM_SMS
    reaches_deepep = min(comm, comm_cap) if comm_cap is not None else comm
    even_note = f" (even up to DeepEP's {comm_cap}-SM ceiling)" if decision.comm_knob and all2all_backend == "deepep_high_throughput" else ""
    if even_note and reaches_deepep % 2:
        raise ConfigError(
            "VLLM_DBO_COMM_SMS", env_value,
            f"even integers up to the DeepEP manager's {comm_cap}-SM ceiling, or values above it (vLLM clamps "
            "those to the ceiling); DeepEP's Buffer.set_num_sms asserts an even SM count",
        )
    idle = (total_sms - comm) % compute_multiple if compute_knob else 0
    if idle and total_sms - comm - idle <= 0:
        raise ConfigError(
            "VLLM_DBO_COMM_SMS", env_value,
            f"integers in [0, {total_sms - compute_multiple}]{even_note} on a {total_sms}-SM device, so that DeepGEMM keeps a "
            f"multiple of {compute_multiple} SMs, at least {compute_multiple} ({EVEN_COMPUTE_WHY})",
        )
    return SMBudget(
        total=total_sms, comm=comm, compute=total_sms - comm - idle, device=device, idle=idle,
        reason=BudgetReason(
            platform=platform, all2all_backend=all2all_backend, env_comm_sms=env_value,
            max_sms_used=decision.max_sms_used, rocm_override=decision.rocm_override, expert_parallel=expert_parallel,
            comm_knob=decision.comm_knob, compute_knob=compute_knob, compute_multiple=compute_multiple,
        ),
    )
