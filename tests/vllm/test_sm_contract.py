"""Contract: the patched MRV1 and MRV2 ``create_sm_control_context`` equal vLLM 0.33.0's own.

For every cell of the matrix below, vLLM's original function (still bound in
``vllm.v1.worker.ubatch_utils``, which dbo_runtime never patches) and the
function each patched runner sees must give the same total/comm/compute and the
same knob-call sequence on enter and on exit.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import vllm.v1.worker.gpu.ubatch_utils  # noqa: F401

from dbo_runtime.core.errors import ConfigError
from dbo_runtime.integration.sm_hooks import DboSMControlContext
from dbo_runtime.services.sm_control import existing_controls
from tests.vllm.conftest import FakeGpuPlatform, has_module, parallel_config

RUNNER_MODULES = {
    name: module
    for name, module in (("MRV1", "vllm.v1.worker.gpu_ubatch_wrapper"), ("MRV2", "vllm.v1.worker.gpu.ubatch_utils"))
    if has_module(module)
}
"""The runners the installed vLLM has (Model Runner V1 is gone in 0.34), each with its own binding."""


def _runner_module() -> Any:
    """The first runner's module: its ``create_sm_control_context`` binding is the one patched for it."""
    import importlib

    return importlib.import_module(next(iter(RUNNER_MODULES.values())))

MATRIX = list(
    itertools.product(
        ["cuda", "rocm"],
        [True, False],  # expert parallel
        ["deepep_high_throughput", "deepep_low_latency", "nixl_ep"],
        [None, 0, 16],  # all2all max_sms_used()
        [None, 0, 24, 40],  # VLLM_DBO_COMM_SMS (None = platform default)
        [True, False],  # DeepGEMM present
    )
)


def run_context(factory: Any, pc: Any, calls: list[tuple[str, int]]) -> tuple[tuple[int, int, int], list, list]:
    ctx = factory(pc)
    start = len(calls)
    with ctx:
        entered = calls[start:]
    exited = calls[start + len(entered) :]
    return (ctx.total_sms, ctx.comm_sms, ctx.compute_sms), entered, exited


@pytest.mark.parametrize("runner", sorted(RUNNER_MODULES))
@pytest.mark.parametrize(("platform", "ep", "backend", "max_used", "env", "dg"), MATRIX)
def test_patched_context_equals_vllm(
    gpu_platform: FakeGpuPlatform,
    clean_plugin: Any,
    runner: str,
    platform: str,
    ep: bool,
    backend: str,
    max_used: int | None,
    env: int | None,
    dg: bool,
) -> None:
    import importlib

    from vllm.v1.worker import ubatch_utils

    total = 132 if platform == "cuda" else 304
    pc = parallel_config(backend=backend, ep=ep)  # built before the platform fakes, as on a real worker
    gpu_platform.set(platform=platform, total_sms=total, max_sms_used=max_used, deep_gemm=dg, env_comm_sms=env)

    expected = run_context(ubatch_utils.create_sm_control_context, pc, gpu_platform.calls)
    clean_plugin()
    module = importlib.import_module(RUNNER_MODULES[runner])
    assert module.create_sm_control_context is not ubatch_utils.create_sm_control_context
    got = run_context(module.create_sm_control_context, pc, gpu_platform.calls)
    assert got == expected
    ctx = module.create_sm_control_context(pc)
    assert isinstance(ctx, DboSMControlContext)
    # The budget was announced on the device's SMControl before any step.
    assert ctx.budget in existing_controls()[0].announced


def test_matrix_covers_partitioned_and_unpartitioned_cells() -> None:
    # Guard against a matrix that silently degenerates to "comm == 0 everywhere".
    kinds = {(env or 20) > 0 and max_used != 0 for (_, _, _, max_used, env, _) in MATRIX}
    assert kinds == {True, False} and len(MATRIX) == 288


def test_ubatch_size_without_dbo_matches(gpu_platform: FakeGpuPlatform, clean_plugin: Any) -> None:
    from vllm.v1.worker import ubatch_utils

    gpu_ubatch_wrapper = _runner_module()

    pc = parallel_config(dbo=False)
    gpu_platform.set(platform="rocm", total_sms=304)
    expected = run_context(ubatch_utils.create_sm_control_context, pc, gpu_platform.calls)
    clean_plugin()
    assert run_context(gpu_ubatch_wrapper.create_sm_control_context, pc, gpu_platform.calls) == expected
    assert expected[0] == (304, 64, 240)


def test_comm_not_below_total_both_refuse(gpu_platform: FakeGpuPlatform, clean_plugin: Any) -> None:
    from vllm.v1.worker import ubatch_utils

    gpu_ubatch_wrapper = _runner_module()

    pc = parallel_config()
    gpu_platform.set(env_comm_sms=132, max_sms_used=None)
    with pytest.raises(AssertionError):
        ubatch_utils.create_sm_control_context(pc)
    clean_plugin()
    with pytest.raises(ConfigError, match=r"VLLM_DBO_COMM_SMS=132 .*\[0, 131\]"):
        gpu_ubatch_wrapper.create_sm_control_context(pc)


@pytest.mark.parametrize("raw", ["-2", "twenty"])
def test_bad_env_is_one_named_error(gpu_platform: FakeGpuPlatform, clean_plugin: Any, raw: str, monkeypatch: Any) -> None:
    gpu_ubatch_wrapper = _runner_module()

    pc = parallel_config()
    gpu_platform.set()
    monkeypatch.setenv("VLLM_DBO_COMM_SMS", raw)
    clean_plugin()
    with pytest.raises(ConfigError) as e:
        gpu_ubatch_wrapper.create_sm_control_context(pc)
    assert e.value.parameter == "VLLM_DBO_COMM_SMS" and str(e.value.value) == raw


def test_odd_comm_with_deepep_ht_is_refused(gpu_platform: FakeGpuPlatform, clean_plugin: Any) -> None:
    from vllm.v1.worker.gpu import ubatch_utils as mrv2

    pc = parallel_config()
    gpu_platform.set(env_comm_sms=19)
    clean_plugin()
    with pytest.raises(ConfigError, match="even"):
        mrv2.create_sm_control_context(pc)


def test_nested_contexts_restore_previous(gpu_platform: FakeGpuPlatform, clean_plugin: Any) -> None:
    """MRV1 enters SM control per warm-up and around the capture; nesting restores the outer split."""
    gpu_ubatch_wrapper = _runner_module()

    pc = parallel_config()
    gpu_platform.set(max_sms_used=None)
    clean_plugin()
    outer = gpu_ubatch_wrapper.create_sm_control_context(pc)
    calls = gpu_platform.calls
    with outer:
        with gpu_ubatch_wrapper.create_sm_control_context(pc):
            pass
        assert calls[-2:] == [("comm", 20), ("compute", 112)]
    assert calls[-2:] == [("comm", 132), ("compute", 132)]


def test_contract_holds_for_all2all_backends_list() -> None:
    import typing
    from importlib import metadata

    from packaging.version import Version
    from vllm.config.parallel import All2AllBackend

    from dbo_runtime.core.budget import ALL2ALL_BACKENDS

    added_after_oldest = {"mori": "0.34.0"}  # backends a newer supported release added, and that release
    installed = Version(metadata.version("vllm"))
    expected = {b for b in ALL2ALL_BACKENDS if installed >= Version(added_after_oldest.get(b, "0"))}
    assert set(typing.get_args(All2AllBackend)) == expected


def test_real_all2all_managers_max_sms_used_table() -> None:
    """The CLI's per-backend defaults equal what vLLM's managers return (class-level read)."""
    from vllm.distributed.device_communicators import all2all, base_device_communicator

    from dbo_runtime.core.budget import BACKEND_MAX_SMS_USED

    assert all2all.DeepEPLLAll2AllManager.max_sms_used(None) == BACKEND_MAX_SMS_USED["deepep_low_latency"]  # type: ignore[arg-type]
    assert all2all.NixlEPAll2AllManager.max_sms_used(None) == BACKEND_MAX_SMS_USED["nixl_ep"]  # type: ignore[arg-type]
    assert "max_sms_used" not in vars(all2all.DeepEPHTAll2AllManager)
    base = base_device_communicator.All2AllManagerBase
    assert base.max_sms_used(None) is BACKEND_MAX_SMS_USED["deepep_high_throughput"]  # type: ignore[arg-type]


def test_leaked_scope_is_closed_at_next_enter(gpu_platform: FakeGpuPlatform, clean_plugin: Any) -> None:
    """MRV2: begin_capturable_run can raise after entering SM control; the next step must not stay nested."""
    from vllm.v1.worker.gpu import ubatch_utils as mrv2

    pc = parallel_config()
    gpu_platform.set(max_sms_used=None)
    clean_plugin()
    ctx = mrv2.create_sm_control_context(pc)
    ctx.__enter__()  # leaked: never exited
    control = existing_controls()[0]
    assert control.active.compute == 112 and control.stats.partitions_entered == 1
    with ctx:
        assert control.active.compute == 112 and control.stats.partitions_entered == 2
    assert control.active.compute == 132  # a nested enter would restore the leaked 112 here
    assert gpu_platform.calls[-2:] == [("comm", 132), ("compute", 132)]


def test_deepep_ht_comm_above_manager_ceiling(gpu_platform: FakeGpuPlatform, clean_plugin: Any) -> None:
    """VLLM_DBO_COMM_SMS=21 on DeepEP HT: the manager clamps to its num_sms (20, even), so both accept it.

    =19 stays below the ceiling and reaches DeepEP odd: dbo_runtime refuses it up front
    (DeepEP's Buffer.set_num_sms asserts an even count), while vLLM's own accepts it.
    """
    import importlib

    from vllm.v1.worker import ubatch_utils

    from tests.vllm.conftest import FakeAll2AllManager

    assert FakeAll2AllManager(None, []).num_sms == 20
    pc = parallel_config()  # built before the platform fakes, as on a real worker
    gpu_platform.set(env_comm_sms=21, max_sms_used=None)
    expected = run_context(ubatch_utils.create_sm_control_context, pc, gpu_platform.calls)
    assert expected[0] == (132, 21, 111)
    clean_plugin()
    for runner in sorted(RUNNER_MODULES):
        module = importlib.import_module(RUNNER_MODULES[runner])
        assert module.create_sm_control_context is not ubatch_utils.create_sm_control_context
        assert run_context(module.create_sm_control_context, pc, gpu_platform.calls) == expected, runner

    gpu_platform.set(env_comm_sms=19, max_sms_used=None)
    original = run_context(ubatch_utils.create_sm_control_context, pc, gpu_platform.calls)
    assert original[0] == (132, 19, 113)
    for runner in sorted(RUNNER_MODULES):
        module = importlib.import_module(RUNNER_MODULES[runner])
        with pytest.raises(ConfigError, match="even"):
            module.create_sm_control_context(pc)


# -- DeepGEMM's SM90 2-CTA-cluster kernels need an even compute count -------------------------------


@pytest.mark.parametrize("runner", sorted(RUNNER_MODULES))
@pytest.mark.parametrize(
    ("total", "env", "ep", "vllm_compute"),
    [
        (132, 21, True, 111),  # odd comm share above DeepEP HT's 20-SM ceiling (DeepEP still gets an even 20)
        (131, 20, True, 111),  # odd-SM device or MIG slice, default comm share
        (132, 19, False, 113),  # no expert parallel: vLLM still turns DeepGEMM's knob to total - comm
    ],
)
def test_sm90_odd_compute_rounds_down_and_restores_exactly(
    gpu_platform: FakeGpuPlatform,
    clean_plugin: Any,
    runner: str,
    total: int,
    env: int,
    ep: bool,
    vllm_compute: int,
) -> None:
    """vLLM 0.33.0 hands DeepGEMM an odd count here (the measured CUDA_ERROR_INVALID_CLUSTER_SIZE at
    next_n 4); dbo_runtime turns it to the even count below, leaves one SM idle, keeps the comm share,
    and on exit restores exactly what vLLM restores (the whole device)."""
    import importlib

    from vllm.v1.worker import ubatch_utils

    pc = parallel_config(ep=ep)
    gpu_platform.set(total_sms=total, env_comm_sms=env, max_sms_used=None, sm_major=9)
    expected = run_context(ubatch_utils.create_sm_control_context, pc, gpu_platform.calls)
    assert expected[0] == (total, env, vllm_compute) and expected[1][-1] == ("compute", vllm_compute)
    clean_plugin()
    module = importlib.import_module(RUNNER_MODULES[runner])
    (t, comm, compute), entered, exited = run_context(module.create_sm_control_context, pc, gpu_platform.calls)
    assert (t, comm, compute) == (total, env, vllm_compute - 1)
    assert entered == [c if c[0] == "comm" else ("compute", vllm_compute - 1) for c in expected[1]]
    assert exited == expected[2] and exited[-1] == ("compute", total)
    budget = module.create_sm_control_context(pc).budget
    assert budget.idle == 1 and "1 SM idle" in budget.describe()


@pytest.mark.parametrize(("platform", "sm_major"), [("cuda", 10), ("cuda", 8), ("rocm", 9)])
def test_odd_compute_elsewhere_is_vllms_own(
    gpu_platform: FakeGpuPlatform, clean_plugin: Any, platform: str, sm_major: int
) -> None:
    """Only CUDA SM90 runs the multicast kernel (ROCm gfx9xx also reports major 9): elsewhere, vLLM's split."""
    from vllm.v1.worker import ubatch_utils

    gpu_ubatch_wrapper = _runner_module()

    pc = parallel_config(backend="allgather_reducescatter", ep=False)
    gpu_platform.set(platform=platform, total_sms=131, env_comm_sms=20, sm_major=sm_major)
    expected = run_context(ubatch_utils.create_sm_control_context, pc, gpu_platform.calls)
    clean_plugin()
    got = run_context(gpu_ubatch_wrapper.create_sm_control_context, pc, gpu_platform.calls)
    assert got == expected and got[0] == (131, 20, 111)


def test_sm90_no_even_compute_left_is_refused(gpu_platform: FakeGpuPlatform, clean_plugin: Any) -> None:
    from vllm.v1.worker import ubatch_utils

    gpu_ubatch_wrapper = _runner_module()

    pc = parallel_config(ep=False)
    gpu_platform.set(total_sms=132, env_comm_sms=131, sm_major=9)
    assert run_context(ubatch_utils.create_sm_control_context, pc, gpu_platform.calls)[0] == (132, 131, 1)
    clean_plugin()
    with pytest.raises(ConfigError, match=r"VLLM_DBO_COMM_SMS=131 .*on a 132-SM device.*multiple of 2") as e:
        gpu_ubatch_wrapper.create_sm_control_context(pc)
    assert e.value.parameter == "VLLM_DBO_COMM_SMS"


# -- the warm-up's microbatch split is vLLM's ---------------------------------------------------------


@pytest.mark.parametrize(
    ("tokens_per_request", "padded"),
    [([1] * 64, 64), ([1] * 511, 512), ([4] * 9, 36), ([4] * 128, 512), ([1] * 60, 64), ([3, 1, 4, 1, 5], 14)],
)
def test_ubatch_split_matches_vllm(tokens_per_request: list[int], padded: int) -> None:
    import numpy as np
    from vllm.v1.worker.ubatch_utils import maybe_create_ubatch_slices

    from dbo_runtime.core.planner_shapes import ubatch_split

    reqs_padded = len(tokens_per_request)
    _, slices = maybe_create_ubatch_slices(True, np.array(tokens_per_request, dtype=np.int32), padded, reqs_padded, 2)
    assert slices is not None
    expected = [(s.request_slice.stop - s.request_slice.start, s.token_slice.stop - s.token_slice.start) for s in slices]
    assert ubatch_split(tokens_per_request, padded, 2) == expected


def test_an_all2all_backend_new_to_dbo_runtime_follows_vllms_policy(
    gpu_platform: FakeGpuPlatform, clean_plugin: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """vLLM adds all2all backends; one missing from ``core.budget.ALL2ALL_BACKENDS`` must not stop model load.
    Its split is vLLM's own policy with the live manager's ``max_sms_used()``, and one line says so."""
    import logging

    from vllm.v1.worker import ubatch_utils

    from dbo_runtime.core.budget import ALL2ALL_BACKENDS
    from dbo_runtime.integration import sm_hooks

    caplog.set_level(logging.INFO, logger="vllm.dbo_runtime")
    sm_hooks._unknown_logged.discard("mori_ep_v3")
    pc = parallel_config(backend="deepep_low_latency")
    object.__setattr__(pc, "all2all_backend", "mori_ep_v3")  # a name 0.33.0 does not know
    assert pc.all2all_backend not in ALL2ALL_BACKENDS
    for max_used, comm in ((None, 20), (8, 8)):
        gpu_platform.set(platform="cuda", total_sms=132, max_sms_used=max_used, deep_gemm=True)
        expected = run_context(ubatch_utils.create_sm_control_context, pc, gpu_platform.calls)
        clean_plugin()
        module = _runner_module()
        got = run_context(module.create_sm_control_context, pc, gpu_platform.calls)
        assert got == expected and got[0] == (132, comm, 132 - comm)
        from dbo_runtime.integration import plugin

        plugin.uninstall()
    lines = [r.getMessage() for r in caplog.records if "mori_ep_v3" in r.getMessage()]
    assert len(lines) == 1 and "new to dbo_runtime" in lines[0]
