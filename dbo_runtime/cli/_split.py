"""The DBO SM split as ``sms`` and ``simulate`` compute it: ``core.budget``'s policy, this module's inputs
(``--comm-sms``, else ``VLLM_DBO_COMM_SMS``, else vLLM's default) and what makes a valid split a poor one."""

from __future__ import annotations

import os
from collections.abc import Mapping

from dbo_runtime.core.budget import (
    ALL2ALL_BACKENDS,
    BACKEND_MAX_SMS_USED,
    DEEPEP_HT_MANAGER_NUM_SMS,
    DEFAULT_COMM_SMS,
    EVEN_COMPUTE_WHY,
    SMBudget,
    compute_budget,
    deep_gemm_compute_multiple,
    parse_comm_sms,
)
from dbo_runtime.core.cli_support import H200_SMS
from dbo_runtime.core.errors import ConfigError

COMM_ENV = "VLLM_DBO_COMM_SMS"


def comm_sms(flag: int | None, platform: str, environ: Mapping[str, str] | None = None) -> tuple[int, str]:
    """(comm share, its source): ``--comm-sms``, else ``VLLM_DBO_COMM_SMS`` (refused where vLLM fails on it), else vLLM's default."""
    if flag is not None:
        return flag, "--comm-sms"
    raw = (os.environ if environ is None else environ).get(COMM_ENV)
    if raw is not None:  # a refused value goes on: budget_for names the range
        try:
            return parse_comm_sms(raw), COMM_ENV
        except ConfigError:
            return raw, COMM_ENV  # type: ignore[return-value]
    return DEFAULT_COMM_SMS["rocm" if platform == "rocm" else "cuda"], "default"


def budget_for(
    *, total: int, comm: tuple[int, str], platform: str, all2all_backend: str | None, max_sms_used: int | None = None,
    device: int = 0, sm_major: int | None = None,
) -> SMBudget:
    """vLLM's split (SM90: DeepGEMM's share even); a typed comm share >= the SM count is refused: vLLM asserts it."""
    value, source = comm
    try:
        budget = compute_budget(
            total_sms=total, platform=platform, enable_dbo=True, expert_parallel=True, all2all_backend=all2all_backend,
            env_comm_sms=value, max_sms_used=max_sms_used, device=device,
            comm_cap=DEEPEP_HT_MANAGER_NUM_SMS if all2all_backend == "deepep_high_throughput" else None,
            compute_multiple=deep_gemm_compute_multiple(sm_major) if sm_major is not None else 1,
        )  # fmt: skip
    except ConfigError as exc:
        if exc.parameter == COMM_ENV and source != COMM_ENV:  # name what the user can change, not an unset variable
            raise ConfigError("--comm-sms", value, exc.allowed + ("" if source == "--comm-sms" else f" ({value} is vLLM's default; pass --comm-sms N)")) from None
        raise
    if source != "default" and value >= total:
        raise ConfigError(source, value, f"integers in [0, {total - 1}] (the device has {total} SMs; vLLM asserts comm < total)")
    return budget


def comm_sms_problem(environ: Mapping[str, str] | None = None, backend: str | None = None) -> ConfigError | None:
    """``VLLM_DBO_COMM_SMS`` as a DBO engine would refuse it (H200 profile, DeepEP HT unless ``backend``)."""
    backend = backend or "deepep_high_throughput"
    try:
        budget_for(
            total=H200_SMS, comm=comm_sms(None, "cuda", environ), platform="cuda", sm_major=9,
            all2all_backend=backend if backend in ALL2ALL_BACKENDS else None, max_sms_used=BACKEND_MAX_SMS_USED.get(backend),
        )  # fmt: skip
    except ConfigError as exc:
        return exc
    return None


def deepep_sms(budget: SMBudget) -> int | None:
    """The SMs DeepEP really gets (vLLM's HT manager clamps to what its buffers were sized for); None: no knob turns."""
    if not budget.comm_knob or budget.reason.all2all_backend != "deepep_high_throughput":
        return None
    return min(budget.comm, DEEPEP_HT_MANAGER_NUM_SMS)


def split_warnings(budget: SMBudget) -> list[str]:
    """What makes a valid split a poor one; warned, never refused (vLLM runs it as asked)."""
    out = []
    if budget.partitioned and budget.compute < budget.comm:
        out.append(f"only {budget.compute} of {budget.total} SMs are left for compute, fewer than the {budget.comm} for comm: the "
                   "compute kernels lose more than DBO's overlap can win back (lower VLLM_DBO_COMM_SMS / --comm-sms)")
    used = deepep_sms(budget)
    if used is not None and budget.comm > used:
        out.append(f"{budget.comm - used} of the {budget.comm} comm SMs {'stays' if budget.comm - used == 1 else 'stay'} idle: vLLM's DeepEP high-throughput "
                   f"manager clamps set_num_sms({budget.comm}) to {used}, the SM count its buffers were sized for")
    if budget.idle:
        out.append(f"{budget.idle} SM idle: DeepGEMM's count rounded down to {budget.compute} of "
                   f"{budget.total - budget.comm}, a multiple of {budget.reason.compute_multiple} ({EVEN_COMPUTE_WHY})")
    return out
