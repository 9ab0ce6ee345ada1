"""The inputs of the SM split, read and checked one way for ``sms`` and ``simulate``.

Why a module of its own: both commands compute vLLM's split (``core.budget.compute_budget``)
from the same inputs -- the device's SM count, the comm share (``--comm-sms``, else
``VLLM_DBO_COMM_SMS``, else vLLM's default) and, for ``sms``, the all2all manager's
``max_sms_used()`` -- and an operator must get the same answer, bounds and wording from
either for the same value.

Why errors are re-attributed: the policy reports a broken rule in terms of
``VLLM_DBO_COMM_SMS``, the only input a vLLM server takes from the operator. On the command
line another input can be the wrong one (a typed ``--max-sms-used`` that makes the comm share
odd; a typed ``--total-sms`` smaller than a default comm share nobody set), and an error that
names a setting nobody touched sends the operator to the wrong place. So ``budget_for`` asks
the policy itself which input to blame: it re-runs it with one input changed, and names the
input whose change makes the split valid, with the values that input may take.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from dbo_runtime.core.budget import (
    DEEPEP_HT_MANAGER_NUM_SMS,
    DEFAULT_COMM_SMS,
    EVEN_COMPUTE_WHY,
    SMBudget,
    compute_budget,
    deep_gemm_compute_multiple,
    min_compute_sms,
)
from dbo_runtime.core.errors import ConfigError, shown

COMM_ENV = "VLLM_DBO_COMM_SMS"

MAX_SMS = 1024
"""Largest SM count ``--total-sms`` takes: above any GPU (H200 132, B200 148), low enough to catch a typo."""


def parse_int(raw: object, parameter: str, lo: int, hi: int | None = None, *, also: str = "") -> int:
    """An integer in ``[lo, hi]`` from a flag or variable; every integer input of the CLI goes through here.

    One wording for every such error ("integers in [lo, hi]"), whether the value is not a number,
    empty, or out of range, so ``sms`` and ``simulate`` read alike; ``also`` names other allowed
    spellings (``'none'``, "not set").
    """
    allowed = f"integers in [{lo}, {hi}]" if hi is not None else f"integers >= {lo}"
    if also:
        allowed = f"{allowed}, or {also}"
    if isinstance(raw, bool):
        raise ConfigError(parameter, raw, allowed)
    try:
        value = raw if isinstance(raw, int) else int(str(raw).strip(), 10)
    except ValueError:
        raise ConfigError(parameter, raw, allowed) from None
    if value < lo or (hi is not None and value > hi):
        raise ConfigError(parameter, raw, allowed)
    return value


def parse_total(raw: object, split_at: Callable[[int], object]) -> int:
    """``--total-sms``: an integer in ``[1, MAX_SMS]`` that the split also accepts.

    A refused value gets the range that really applies: ``split_at(1)`` computes the split for a 1-SM device
    with the other inputs as given, and where that blames ``--total-sms`` its range (above the comm share) is
    the one named; so ``0`` and ``1`` get the same bound, not ``[1, 1024]`` for one and ``[21, 1024]`` for the other."""
    try:
        return parse_int(raw, "--total-sms", 1, MAX_SMS)
    except ConfigError as exc:
        try:
            split_at(1)
        except ConfigError as bound:
            if bound.parameter == "--total-sms":
                raise ConfigError("--total-sms", exc.value, bound.allowed) from None
        raise


def split_warnings(budget: SMBudget) -> list[str]:
    """What makes a valid split a poor one; shown by ``sms`` and ``simulate`` alike, never refused (vLLM runs it
    as asked): compute below the comm share, comm SMs vLLM's DeepEP HT manager leaves idle, and the SM DeepGEMM's
    even rounding leaves idle."""
    out = []
    if budget.partitioned and budget.compute < budget.comm:
        out.append(
            f"compute {budget.compute} of {budget.total} SMs is less than the comm share {budget.comm}: the "
            "compute kernels lose more than DBO's overlap can win back (lower VLLM_DBO_COMM_SMS / --comm-sms)"
        )
    used = deepep_sms(budget)
    if used is not None and budget.comm > used:
        out.append(
            f"{budget.comm - used} of the {budget.comm} comm SMs stay idle: vLLM's DeepEP high-throughput manager "
            f"clamps set_num_sms({budget.comm}) to {used}, the SM count its buffers were sized for"
        )
    if budget.idle:
        out.append(
            f"{budget.idle} SM idle: DeepGEMM's count rounded down to {budget.compute} of {budget.total - budget.comm}, "
            f"a multiple of {budget.reason.compute_multiple} ({EVEN_COMPUTE_WHY}, and the split is fixed before the model is known)"
        )
    return out


def deepep_sms(budget: SMBudget) -> int | None:
    """The SM count DeepEP really gets: vLLM's HT manager clamps ``set_num_sms`` to its buffers' 20.

    ``all2all_manager.set_num_sms(comm)`` is what vLLM calls, but ``DeepEPHTAll2AllManager``
    (``all2all.py:303-311``) lowers any request above ``num_sms`` (20) before
    ``deep_ep.Buffer.set_num_sms``; every other manager's ``set_num_sms`` does nothing. So with
    ``--comm-sms 32`` DeepGEMM loses 32 SMs and DeepEP uses 20. None when no DeepEP knob turns.
    """
    r = budget.reason
    if not budget.comm_knob or r.all2all_backend != "deepep_high_throughput":
        return None
    return min(budget.comm, DEEPEP_HT_MANAGER_NUM_SMS)


class _Unset:
    """The value shown for an input nobody set: its default, and that it was not set."""

    def __init__(self, default: int) -> None:
        self.default = default

    def __repr__(self) -> str:
        return f"<not set: default {self.default}>"


@dataclass(frozen=True)
class Input:
    """One input of the split and who chose it: a flag, a variable, ``default`` or ``hardware``."""

    value: int | None
    source: str
    origin: str = ""
    """For display: where a non-typed value came from ("CUDA", "--total-sms", "nvml-cores")."""

    @property
    def typed(self) -> bool:
        """Chosen by the operator (a flag or a variable), so an error may name it."""
        return self.source.startswith("--") or self.source == COMM_ENV

    @property
    def came_from(self) -> str:
        return self.source if self.typed else (self.origin or self.source)


def comm_input(flag: str | None, platform: str, environ: Mapping[str, str] | None = None) -> Input:
    """``--comm-sms``, else ``VLLM_DBO_COMM_SMS``, else vLLM's platform default.

    An empty ``VLLM_DBO_COMM_SMS`` is an error, not the default: vLLM parses it with a bare
    ``int()``, so a server with it set empty fails at model load (the plugin names it too).
    """
    if flag is not None:
        return Input(parse_int(flag, "--comm-sms", 0), "--comm-sms")
    raw = (os.environ if environ is None else environ).get(COMM_ENV)
    if raw is not None:
        also = f"not set (default {DEFAULT_COMM_SMS['cuda']} on CUDA, {DEFAULT_COMM_SMS['rocm']} on ROCm)"
        return Input(parse_int(raw, COMM_ENV, 0, also=also), COMM_ENV)
    default = DEFAULT_COMM_SMS["rocm" if platform == "rocm" else "cuda"]
    return Input(default, "default", f"vLLM's {COMM_ENV} default on {platform.upper()}")


def shadowed_comm_env(flag: str | None, environ: Mapping[str, str] | None = None) -> str | None:
    """A ``VLLM_DBO_COMM_SMS`` that ``--comm-sms`` hides and a server would not run with: the flag is a what-if, so
    the run goes on, but vLLM parses the variable with a bare ``int()`` at model load (a word fails there) and
    dbo_runtime refuses a negative count, which the answer computed for the flag must not let pass unsaid."""
    raw = (os.environ if environ is None else environ).get(COMM_ENV)
    if flag is None or raw is None:
        return None
    try:
        parse_int(raw, COMM_ENV, 0)
    except ConfigError:
        return (
            f"{COMM_ENV}={shown(raw)} in this environment is not an integer >= 0: --comm-sms {flag} stands in for it "
            "here, but a server started from this environment would not run with it (vLLM fails on a non-integer at "
            "model load; dbo_runtime refuses a negative count)"
        )
    return None


def _valid(kwargs: Mapping[str, Any], **change: Any) -> SMBudget | None:
    try:
        return compute_budget(**{**kwargs, **change})
    except ConfigError:
        return None


def budget_for(
    *,
    total: Input,
    comm: Input,
    max_sms_used: Input,
    platform: str,
    all2all_backend: str | None,
    expert_parallel: bool = True,
    deep_gemm: bool = True,
    device: int = 0,
    where: str = "",
    sm_major: int | None = None,
) -> SMBudget:
    """vLLM's split for these inputs; a ``ConfigError`` names the input that is wrong (module docstring).

    ``sm_major`` (the device's compute-capability major, when known) applies the worker's one
    deviation from vLLM: on SM90 DeepGEMM's share is rounded down to an even count
    (``core.budget.deep_gemm_compute_multiple``), so ``sms`` shows what the worker will set."""
    kwargs: dict[str, Any] = {
        "total_sms": total.value,
        "platform": platform,
        "enable_dbo": True,
        "expert_parallel": expert_parallel,
        "all2all_backend": all2all_backend,
        "env_comm_sms": comm.value,
        "has_all2all_manager": True,
        "max_sms_used": max_sms_used.value,
        "has_deep_gemm": deep_gemm,
        "device": device,
        "comm_cap": DEEPEP_HT_MANAGER_NUM_SMS if all2all_backend == "deepep_high_throughput" else None,
        "compute_multiple": deep_gemm_compute_multiple(sm_major) if sm_major is not None else 1,
    }
    try:
        budget = compute_budget(**kwargs)
    except ConfigError as exc:
        raise _blame(exc, kwargs, total, comm, max_sms_used, where, sm_major) from None
    unused = _unused_comm_beyond_device(budget, total, comm, where)
    if unused is not None:
        raise unused
    return budget


def _unused_comm_beyond_device(budget: SMBudget, total: Input, comm: Input, where: str) -> ConfigError | None:
    """A typed comm share the device cannot hold, where this configuration never applies it.

    vLLM 0.33.0 (``create_sm_control_context``) asserts ``comm_sms < total_sms`` only after it lowered the value:
    with DeepEP low-latency or NIXL under expert parallelism ``max_sms_used()`` is 0, and on ROCm DeepEP
    high-throughput forces 0, so ``VLLM_DBO_COMM_SMS=99999999999`` starts there and is silently unused. The CLI
    refuses it all the same, with every backend: a share larger than the device is a typo or meant for another
    device, and the same variable stops an engine whose backend or expert parallelism differs (vLLM asserts it
    before any request). Only a typed value: a default nobody set is vLLM's, not a mistake to name."""
    if not comm.typed or comm.value is None or total.value is None or comm.value < total.value:
        return None
    r = budget.reason
    if r.rocm_override:
        why = "ROCm with DeepEP high-throughput reserves no CUs"
    else:
        why = f"{r.all2all_backend} with expert parallelism reserves no comm SMs (max_sms_used() is 0)"
    on = f" on {where}" if where else ""
    return ConfigError(
        comm.source,
        comm.value,
        f"integers in [0, {total.value - 1}]{on}, which has {total.value} SMs ({total.came_from}): unused here ({why}), but "
        "vLLM asserts the comm share is below the SM count wherever it applies it",
    )


def compute_floor(multiple: int, deep_gemm: bool, sm_major: int | None, where: str = "") -> str:
    """Why a split must leave ``multiple`` compute SMs, for the allowed-values text of an input that leaves fewer.

    The floor differs by device, and an operator comparing ``sms --total-sms 10`` (21 or more) with ``simulate
    --total-sms 10`` (22 or more) must see why: vLLM only asserts that the comm share is below the total (one
    compute SM), while on SM90 DeepGEMM's share must be even (``core.budget.DEEP_GEMM_COMPUTE_MULTIPLE``), so
    the simulated device, always SM90, needs two; a ``--total-sms`` count other than the H200's 132 has no
    known architecture, so ``sms`` applies no multiple to it."""
    if multiple > 1:
        return f"{multiple} compute SMs: {where or 'the device'} is SM{sm_major}0, where DeepGEMM's share must be a multiple of {multiple}"
    if not deep_gemm:
        return "1 compute SM: vLLM asserts the comm share is below the total"
    if sm_major is None:
        return "1 compute SM: the device's architecture is unknown, so DeepGEMM's share needs no multiple (on SM90 it must be even)"
    return f"1 compute SM: DeepGEMM's share needs no multiple on SM{sm_major}0"


def _blame(
    exc: ConfigError, kwargs: Mapping[str, Any], total: Input, comm: Input, max_used: Input, where: str, sm_major: int | None
) -> ConfigError:
    if exc.parameter != COMM_ENV:
        return exc
    on = f" on {where}" if where else ""
    comm_value: object = comm.value if comm.typed else _Unset(int(comm.value or 0))
    if max_used.typed and max_used.value is not None and _valid(kwargs, max_sms_used=None) is not None:
        # Without the cap the split is fine: the capped comm share is odd where DeepEP HT gets it.
        reach = min(int(comm.value or 0), DEEPEP_HT_MANAGER_NUM_SMS)
        return ConfigError(
            max_used.source,
            max_used.value,
            f"'none', even integers, or integers >= {reach}: it caps the comm share {comm.value} ({comm.came_from}), and "
            "DeepEP's Buffer.set_num_sms asserts an even SM count",
        )
    roomy = _valid(kwargs, total_sms=max(1 << 40, int(comm.value or 0) + 64))  # a device with room for any typed share
    multiple = min_compute_sms(int(kwargs["compute_multiple"]), bool(kwargs["has_deep_gemm"]))
    floor = compute_floor(multiple, bool(kwargs["has_deep_gemm"]), sm_major, where)
    if roomy is not None:
        # Only the device is too small for the comm share (and, on SM90, DeepGEMM's even count).
        device = f"{on}, which has {total.value} SMs ({total.came_from})"
        if multiple > 1:
            device += f"; DeepGEMM's share must be a multiple of {multiple} on SM{sm_major}0"
        if comm.typed:
            return ConfigError(comm.source, comm.value, f"integers in [0, {int(total.value or 0) - multiple}]{device}")
        if total.typed:
            return ConfigError(
                total.source,
                total.value,
                f"integers in [{roomy.comm + multiple}, {MAX_SMS}], above the comm share {roomy.comm} ({comm.came_from}) by "
                f"at least {floor}; --comm-sms or {COMM_ENV} lowers it",
            )
        return ConfigError(
            COMM_ENV,
            comm_value,
            f"integers in [0, {int(total.value or 0) - multiple}]{device}: {comm.came_from} does not fit; set {COMM_ENV} or pass --comm-sms",
        )
    return ConfigError(comm.source if comm.typed else COMM_ENV, comm_value, f"{exc.allowed}" + (f" [{where}]" if where else ""))
