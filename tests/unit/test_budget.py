"""The pure partition policy: vLLM 0.33.0's decisions, and one clear error per bad input."""

from __future__ import annotations

import pytest

from dbo_runtime.core.budget import SMBudget, compute_budget, deep_gemm_compute_multiple, full_budget, parse_comm_sms
from dbo_runtime.core.errors import ConfigError


def ht(**kw: object) -> SMBudget:
    args: dict[str, object] = dict(
        total_sms=132,
        platform="cuda",
        enable_dbo=True,
        expert_parallel=True,
        all2all_backend="deepep_high_throughput",
        max_sms_used=None,
    )
    args.update(kw)
    return compute_budget(**args)  # type: ignore[arg-type]


def test_h200_deepep_ht_default_is_112_compute() -> None:
    b = ht()
    assert (b.total, b.comm, b.compute) == (132, 20, 112)
    assert b.comm_knob and b.compute_knob and b.partitioned


def test_low_latency_and_nixl_turn_partitioning_off() -> None:
    for backend in ("deepep_low_latency", "nixl_ep"):
        b = ht(all2all_backend=backend, max_sms_used=0)
        assert (b.comm, b.compute) == (0, 132)
        assert not b.comm_knob and not b.compute_knob


def test_max_sms_used_caps_env_value() -> None:
    b = ht(env_comm_sms=32, max_sms_used=24)
    assert (b.comm, b.compute) == (24, 108)


def test_env_value_used_below_cap() -> None:
    assert ht(env_comm_sms="16", max_sms_used=24).comm == 16


def test_rocm_deepep_ht_dbo_override_forces_zero() -> None:
    b = ht(platform="rocm", total_sms=304)
    assert b.comm == 0 and b.reason.rocm_override and not b.compute_knob


def test_rocm_default_is_64_without_override() -> None:
    b = ht(platform="rocm", total_sms=304, all2all_backend="allgather_reducescatter")
    assert b.comm == 64 and not b.reason.rocm_override


def test_rocm_override_needs_enable_dbo() -> None:
    # ubatch_size > 1 without --enable-dbo is microbatching too, and vLLM keeps the env value then.
    assert ht(platform="rocm", total_sms=304, enable_dbo=False).comm == 64


def test_no_expert_parallel_still_lowers_deep_gemm() -> None:
    # vLLM installs the compute setter whenever DeepGEMM is present and comm > 0, EP or not.
    b = ht(expert_parallel=False, max_sms_used=0)
    assert (b.comm, b.compute) == (20, 112)
    assert not b.comm_knob and b.compute_knob


def test_no_all2all_manager_ignores_max_sms_used() -> None:
    b = ht(has_all2all_manager=False, max_sms_used=0)
    assert b.comm == 20 and not b.comm_knob and b.compute_knob


def test_without_deep_gemm_no_compute_knob() -> None:
    b = ht(has_deep_gemm=False)
    assert b.comm == 20 and b.comm_knob and not b.compute_knob


@pytest.mark.parametrize("env", [132, 200])
def test_comm_at_or_above_total_is_named_error(env: int) -> None:
    with pytest.raises(ConfigError) as e:
        ht(env_comm_sms=env, expert_parallel=False)
    assert e.value.parameter == "VLLM_DBO_COMM_SMS" and "[0, 131]" in str(e.value)


@pytest.mark.parametrize("raw", ["-4", -4, "abc", "1.5", 2.0, True])
def test_bad_env_values(raw: object) -> None:
    with pytest.raises(ConfigError) as e:
        ht(env_comm_sms=raw)
    assert e.value.parameter == "VLLM_DBO_COMM_SMS" and "allowed values: integers in [0, 131] on a 132-SM device" in str(e.value)


def test_odd_comm_for_deepep_ht_rejected() -> None:
    with pytest.raises(ConfigError, match="even"):
        ht(env_comm_sms=19)


def test_odd_comm_fine_where_deepep_never_sees_it() -> None:
    assert ht(env_comm_sms=19, expert_parallel=False).comm == 19
    # vLLM's HT manager clamps 21 to the 20 its buffers were sized for: DeepEP sees an even count.
    assert ht(env_comm_sms=21, comm_cap=20).comm == 21
    with pytest.raises(ConfigError, match="even"):
        ht(env_comm_sms=19, comm_cap=20)


def test_unknown_backend_and_platform() -> None:
    with pytest.raises(ConfigError, match=r"all2all_backend=.deepep_turbo.*deepep_high_throughput"):
        ht(all2all_backend="deepep_turbo")
    with pytest.raises(ConfigError, match="platform='xpu'"):
        ht(platform="xpu")


def test_budget_is_immutable_and_checked() -> None:
    b = ht()
    with pytest.raises(AttributeError):
        b.comm = 0  # type: ignore[misc]
    with pytest.raises(ConfigError):
        SMBudget(total=132, comm=20, compute=100, device=0, reason=b.reason)
    assert full_budget(132).compute == 132 and not full_budget(132).partitioned


def test_parse_comm_sms_accepts_whitespace_ints() -> None:
    assert parse_comm_sms(" 24 ") == 24


# -- even DeepGEMM counts on SM90 -----------------------------------------------------


def test_deep_gemm_compute_multiple_is_two_on_sm90_only() -> None:
    assert [deep_gemm_compute_multiple(m) for m in (0, 8, 9, 10, 12)] == [1, 1, 2, 1, 1]


@pytest.mark.parametrize(
    ("kw", "expected"),
    [
        ({"total_sms": 131}, (131, 20, 110, 1)),  # odd-SM device / MIG slice with the default comm share
        ({"env_comm_sms": 21}, (132, 21, 110, 1)),  # odd share above DeepEP HT's ceiling (DeepEP gets 20)
        ({"env_comm_sms": 19, "expert_parallel": False}, (132, 19, 112, 1)),  # no EP: DeepGEMM's knob only
        ({}, (132, 20, 112, 0)),  # the H200 default is even: nothing changes
        ({"total_sms": 131, "has_deep_gemm": False}, (131, 20, 111, 0)),  # no DeepGEMM knob: no constraint
        ({"total_sms": 131, "max_sms_used": 0}, (131, 0, 131, 0)),  # no partition: DeepGEMM keeps its own count
    ],
)
def test_sm90_compute_share_is_rounded_down_to_even(kw: dict[str, object], expected: tuple[int, ...]) -> None:
    b = ht(compute_multiple=2, **kw)
    assert (b.total, b.comm, b.compute, b.idle) == expected
    assert b.compute + b.comm + b.idle == b.total
    assert not (b.compute_knob and b.compute % 2)


def test_without_the_multiple_the_policy_is_vllms() -> None:
    assert ht(total_sms=131).compute == 111 and ht(total_sms=131).idle == 0


def test_no_even_compute_left_is_refused_naming_the_variable_and_total() -> None:
    with pytest.raises(ConfigError) as e:
        ht(compute_multiple=2, env_comm_sms=131, expert_parallel=False)
    assert e.value.parameter == "VLLM_DBO_COMM_SMS" and e.value.value == 131
    assert "[0, 130]" in str(e.value) and "132-SM device" in str(e.value)
    assert ht(compute_multiple=2, env_comm_sms=130, expert_parallel=False).compute == 2


def test_an_odd_budget_that_turns_deep_gemm_cannot_be_built() -> None:
    b = ht(compute_multiple=2, total_sms=131)
    with pytest.raises(ConfigError, match="multiples of 2"):
        SMBudget(total=131, comm=20, compute=111, device=0, reason=b.reason)
    with pytest.raises(ConfigError, match="total - comm - idle"):
        SMBudget(total=131, comm=20, compute=111, device=0, reason=b.reason, idle=1)


@pytest.mark.parametrize("bad", [0, -2, True, 1.5])
def test_compute_multiple_must_be_positive_int(bad: object) -> None:
    with pytest.raises(ConfigError, match="compute_multiple"):
        ht(compute_multiple=bad)


def test_the_refusal_bound_is_the_largest_value_accepted() -> None:
    """With DeepGEMM's even count (SM90) a message naming [0, 131] while 131 is refused with [0, 130]
    misleads. The bound a refusal names must itself be accepted, and one more refused."""
    for multiple, has_dg, bound in ((2, True, 130), (1, True, 131), (2, False, 131)):
        kw = {"expert_parallel": True, "compute_multiple": multiple, "has_deep_gemm": has_dg}
        with pytest.raises(ConfigError) as e:
            ht(env_comm_sms=132, **kw)
        assert f"[0, {bound}]" in str(e.value), (kw, str(e.value))
        ht(env_comm_sms=bound, **kw)
        with pytest.raises(ConfigError):
            ht(env_comm_sms=bound + 1, **kw)
