"""A dbo_runtime failure on a DBO microbatch thread never hangs the step.

vLLM 0.33.0 does not wake the partner microbatch when one thread dies: the partner waits at its
next ``dbo_yield`` forever and the main thread's ``join()`` never returns. Here the real join
points run: MRV1 ``UBatchWrapper._run_ubatches`` and MRV2 ``UBatchRunner.begin_capturable_run`` +
``finish()``, each starting real threads under vLLM's own ``make_ubatch_contexts`` /
``UBatchContext``; the "model" is the GLM-5.3 layer stack of tests/vllm/test_topk_isolation.py
(real ``DeepseekV32Attention`` / ``SparseMLACommonImpl`` / ``SparseMLAIndexGroup`` objects, real
``dbo_yield`` after every layer), plus vLLM's indexer logits call site on leader layers. A fault
is injected into dbo_runtime code on microbatch 1 (``FailingLocator``: the top-k microbatch
resolver; ``FailingJitPlanner``: the call-site re-plan). The step must finish on every thread,
and the main thread must get ``MicrobatchFailure`` with the injected error as its cause.

Boundary fakes beyond test_topk_isolation's: ``torch.accelerator.set_device_index`` (no
accelerator here) and MRV2's ``current_stream``; the UBatchWrapper / UBatchRunner objects are
made with ``object.__new__`` and only the attributes their run methods read (constructing them
needs a CUDA device and a model runner). The GPU machine has no vLLM, so there is no GPU twin:
nothing here is GPU behaviour (thread hand-off only).
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from dbo_runtime.integration import indexer_hooks, topk_hooks, ubatch_ids
from dbo_runtime.integration.patching import PatchSet
from dbo_runtime.services import schedule_cache
from dbo_runtime.services.schedule_cache import IndexerScheduleCache
from dbo_runtime.services.topk_state import TopkLayout, UbatchTopkState
from tests.fakes.fake_deep_gemm import (
    FakeDeepGemm,
    FakeSchedulePlanner,
    vllm_signature_logits,
)
from tests.fakes.topk_boundary import FakeStream
from tests.vllm.conftest import has_module
from tests.vllm.test_topk_isolation import (
    BLOCK_SIZE,
    NUM_BLOCKS,
    TOPK,
    Boundary,
    FakeConvertMetadata,
    FakeForwardContext,
    Model,
    boundary,  # noqa: F401 - fixture
    build_model,
    dbo_config,
)

SAI = "vllm.model_executor.layers.sparse_attn_indexer"
TOTAL = 16  # padded tokens of the step (8 per microbatch: fits the physical workspace)
HANG_S = 20.0
LENS = torch.tensor([[5], [300], [7000]], dtype=torch.int32)  # three decode requests, next_n 1


class FailingLocator:
    """The top-k state's microbatch resolver (``ubatch_ids.current_ubatch``), failing on microbatch
    ``ubatch`` from its ``after``-th call on: a bug in dbo_runtime code on a microbatch thread."""

    def __init__(self, ubatch: int | None, after: int = 20) -> None:
        self.ubatch, self.after, self.calls = ubatch, after, 0

    def __call__(self) -> tuple[int, int]:
        u, offset = ubatch_ids.current_ubatch()
        if u == self.ubatch:
            self.calls += 1
            if self.calls > self.after:
                raise RuntimeError(f"injected top-k resolver fault on microbatch {u}")
        return u, offset


class FailingJitPlanner(FakeSchedulePlanner):
    """The DeepGEMM planner fake, failing (like a JIT compile error) when microbatch ``fail_on`` re-plans,
    and failing to read DeepGEMM's SM count on microbatch ``fail_live_on``."""

    fail_on: int | None = None
    fail_live_on: int | None = None
    oom_on: int | None = None

    def plan(self, context_lens: Any, block_kv: int, num_sms: int, indices: Any | None = None) -> Any:
        if self.oom_on is not None and ubatch_ids.ubatch_thread_id() == self.oom_on:
            raise torch.OutOfMemoryError("injected CUDA out of memory in the call-site re-plan")
        if self.fail_on is not None and ubatch_ids.ubatch_thread_id() == self.fail_on:
            raise RuntimeError("injected DeepGEMM JIT failure in the call-site re-plan")
        return super().plan(context_lens, block_kv, num_sms, indices)

    def get_num_sms(self) -> int:
        if self.fail_live_on is not None and ubatch_ids.ubatch_thread_id() == self.fail_live_on:
            raise RuntimeError("injected DeepGEMM get_num_sms failure")
        return super().get_num_sms()


@dataclass
class Logits:
    """vLLM's indexer decode call site (``sparse_attn_indexer``'s ``fp8_fp4_paged_mqa_logits`` global)."""

    sai: Any
    dg: FakeDeepGemm
    schedules: list[torch.Tensor]
    """One per microbatch: vLLM builds each microbatch's indexer metadata (and schedule) separately."""

    def __call__(self) -> torch.Tensor:
        return self.sai.fp8_fp4_paged_mqa_logits(
            (torch.empty(0), None),
            torch.empty((4, 64, 1, 132), dtype=torch.uint8),
            torch.empty((3, 4), dtype=torch.float32),
            LENS,
            torch.zeros((3, 4), dtype=torch.int32),
            self.schedules[ubatch_ids.current_ubatch()[0]],
            max_model_len=8,
            indices=None,
        )


class DboModel:
    """What each microbatch thread runs: the layer stack, one ``dbo_yield`` per layer (DBO's order)."""

    def __init__(self, model: Model, logits: Logits | None) -> None:
        self.model, self.logits = model, logits
        self.done: dict[int, int] = {}
        self.logits_rows: dict[int, list[float]] = {}

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, **_: Any) -> torch.Tensor:
        from vllm.v1.worker import ubatching

        u = ubatch_ids.current_ubatch()[0]
        n = int(input_ids.shape[0])
        meta = FakeConvertMetadata(
            req_id_per_token=torch.arange(n, dtype=torch.int32) % 3,
            block_table=torch.zeros((3, NUM_BLOCKS), dtype=torch.int32),
            block_size=BLOCK_SIZE,
        )
        for i, layer in enumerate(self.model.layers):
            if layer.leader:
                buf = layer.attn.topk_indices_buffer
                buf[:n] = torch.full((n, TOPK), i, dtype=torch.int32)
                layer.impl.record_logical_topk_ready()
                if self.logits is not None:
                    self.logits_rows.setdefault(u, []).append(float(self.logits()[0, 0]))
            topk = layer.impl.topk_indices_buffer[:n]
            layer.impl._convert_logical_to_physical_topk(topk, meta, block_stride_rows=None, return_valid_counts=True)
            ubatching.dbo_yield()
            self.done[u] = i + 1
        return input_ids.float()[:, None]


@dataclass
class Env:
    boundary: Boundary
    state: UbatchTopkState
    locator: FailingLocator
    model: Model
    dbo_model: DboModel
    planner: FailingJitPlanner
    contexts: list[Any]
    """The UBatchContexts vLLM made for the last step (for the hang rescue)."""
    arming: Any
    """This test's arming registry (``fresh_arming``): nothing armed before the first microbatched run."""


@pytest.fixture
def env(boundary: Boundary, fresh_arming: Any, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> Any:  # noqa: F811
    """The GLM-5.3 stack with the top-k and call-site patches; ``ubatch_guard``'s join points unless the
    test is parametrized indirectly with ``False`` (then only its ``UBatchContext.__enter__`` net, which arms the
    hooks: the plugin never installs the top-k or indexer features without ``ubatch_guard``)."""
    import importlib

    from vllm.v1.worker.gpu import ubatch_utils as mrv2

    from dbo_runtime.integration import ubatch_guard

    sai = importlib.import_module(SAI)
    monkeypatch.setattr(torch.accelerator, "set_device_index", lambda device: None)
    monkeypatch.setattr(mrv2, "current_stream", lambda: boundary.compute)
    contexts: list[Any] = []

    def make_ubatch_contexts(*args: Any, **kwargs: Any) -> Any:
        made = original_make(*args, **kwargs)
        contexts[:] = made
        return made

    original_make = mrv2.make_ubatch_contexts
    monkeypatch.setattr(mrv2, "make_ubatch_contexts", make_ubatch_contexts)
    dg = FakeDeepGemm(total_sms=132)
    monkeypatch.setattr(sai, "fp8_fp4_paged_mqa_logits", vllm_signature_logits(dg))
    planner = FailingJitPlanner(dg)
    cache = IndexerScheduleCache(planner)
    monkeypatch.setattr(schedule_cache, "_CACHE", cache)

    locator = FailingLocator(None)
    state = UbatchTopkState(locator, TopkLayout.WINDOWS)
    wanted = {"indexer.logits.sparse_attn_indexer"}
    patch_set = PatchSet(
        topk_hooks.patches(state)
        + [p for p in indexer_hooks.patches() if p.name in wanted]
        + [p for p in ubatch_guard.patches() if getattr(request, "param", True) or p.name == ubatch_guard.CONTEXT_ENTER]
    )
    patch_set.install()
    try:
        model = build_model(dbo_config())
        schedules = [planner.plan(LENS, 64, 132) for _ in range(2)]
        for schedule in schedules:
            cache.track(schedule, planned_sms=132, block_kv=64, next_n=1)
        dg.set_num_sms(112)  # what SMControl does for the step: every call site re-plans
        yield Env(boundary, state, locator, model, DboModel(model, Logits(sai, dg, schedules)), planner, contexts, fresh_arming)
    finally:
        patch_set.uninstall()
        ubatch_guard.FAILURES.take()


def _watch(run: Any, contexts: list[Any]) -> tuple[Any, BaseException | None]:
    """Run a join point on a "main" thread; if it does not return, it hung: unblock and fail the test."""
    out: dict[str, Any] = {}

    def main() -> None:
        try:
            out["result"] = run()
        except BaseException as exc:
            out["error"] = exc

    t = threading.Thread(target=main, daemon=True)
    t.start()
    t.join(HANG_S)
    hung = t.is_alive()
    while t.is_alive():  # rescue the parked microbatch so the (non-daemon) vLLM threads can exit
        for ctx in contexts:
            ctx.cpu_wait_event.set()
        time.sleep(0.001)
    assert not hung, "the microbatch join hung: a dead microbatch thread left its partner parked"
    return out.get("result"), out.get("error")


def _mrv1(env: Env) -> tuple[Any, BaseException | None]:
    from vllm.v1.worker.gpu_ubatch_wrapper import UbatchMetadata, UBatchWrapper
    from vllm.v1.worker.ubatching import make_ubatch_contexts

    wrapper = object.__new__(UBatchWrapper)
    wrapper.__dict__.update(device=0, ready_barrier=threading.Barrier(3), cudagraphs={})
    sizes, offsets = [TOTAL // 2, TOTAL - TOTAL // 2], [0, TOTAL // 2]
    from vllm.config import CUDAGraphMode

    contexts = make_ubatch_contexts(
        num_micro_batches=2,
        compute_stream=env.boundary.compute,
        comm_stream=FakeStream("comm", (lambda: ubatch_ids.current_ubatch()[0]), env.boundary.log),
        forward_contexts=[FakeForwardContext(cudagraph_runtime_mode=CUDAGraphMode.NONE) for _ in range(2)],
        ready_barrier=wrapper.ready_barrier,
        token_offsets=offsets,
    )
    metadata = [
        UbatchMetadata(
            context=contexts[u],
            input_ids=torch.arange(offsets[u], offsets[u] + sizes[u]),
            positions=torch.arange(offsets[u], offsets[u] + sizes[u]),
            inputs_embeds=None,
            intermediate_tensors=None,
            num_tokens=sizes[u],
        )
        for u in range(2)
    ]
    return _watch(lambda: wrapper._run_ubatches(metadata, env.dbo_model), contexts)


def _mrv2(env: Env) -> tuple[Any, BaseException | None]:
    from vllm.config import CUDAGraphMode
    from vllm.v1.worker.gpu.ubatch_utils import UBatchRunner, UBatchState
    from vllm.v1.worker.ubatch_utils import UBatchSlice

    runner = object.__new__(UBatchRunner)
    runner.__dict__.update(
        num_ubatches=2,
        device=torch.device("cpu"),
        comm_stream=FakeStream("comm", (lambda: ubatch_ids.current_ubatch()[0]), env.boundary.log),
        capture_stream=env.boundary.compute,
        ready_barrier=threading.Barrier(3),
        _pending_finish=None,
        sm_control=contextlib.nullcontext(),
        # vLLM 0.34 reads the model dtype there (a GEMM that creates ROCm's per-thread handle before capture)
        vllm_config=SimpleNamespace(model_config=SimpleNamespace(dtype=torch.float32)),
    )
    half = TOTAL // 2
    ubatch_state = UBatchState(
        slices=[UBatchSlice(slice(0, 2), slice(0, half)), UBatchSlice(slice(2, 3), slice(half, TOTAL))],
        forward_contexts=[FakeForwardContext(cudagraph_runtime_mode=CUDAGraphMode.NONE) for _ in range(2)],
    )
    inputs = {"input_ids": torch.arange(TOTAL), "positions": torch.arange(TOTAL)}
    return _watch(lambda: runner.run(env.dbo_model, inputs, ubatch_state), env.contexts)


RUNNERS = {"mrv1": _mrv1, "mrv2": _mrv2} if has_module("vllm.v1.worker.gpu_ubatch_wrapper") else {"mrv2": _mrv2}
"""The runners the installed vLLM has: Model Runner V1 is gone in 0.34."""


@pytest.mark.parametrize("runner", list(RUNNERS))
def test_a_healthy_step_is_untouched(env: Env, runner: str) -> None:
    arming = env.arming

    def armed_names() -> list[str]:
        return [e.name for e in arming._entries if e.armed]

    assert armed_names() == []  # before the first microbatched run the per-access hooks are vLLM's own
    result, error = RUNNERS[runner](env)
    assert error is None
    # armed on the main thread by the join point, before the threads started, and kept
    assert arming.armed and arming.armed_by == {"mrv1": "UBatchWrapper._run_ubatches", "mrv2": "UBatchRunner.begin_capturable_run"}[runner]
    assert "topk.DeepseekV32Attention.topk_indices_buffer" in armed_names()
    assert torch.equal(result, torch.arange(TOTAL).float()[:, None])
    assert env.dbo_model.done == {0: len(env.model.layers), 1: len(env.model.layers)}
    assert all(v == 113.0 for rows in env.dbo_model.logits_rows.values() for v in rows)  # re-planned for 112 SMs


@pytest.mark.parametrize("runner", list(RUNNERS))
@pytest.mark.parametrize("fault", ["topk_resolver", "logits_replan", "live_count"])
def test_a_plugin_fault_on_a_microbatch_finishes_the_step_and_raises_on_the_main_thread(
    env: Env, runner: str, fault: str
) -> None:
    if fault == "topk_resolver":
        env.locator.ubatch = 1
        expected = "injected top-k resolver fault"
        hooks = {
            "topk.DeepseekV32Attention.topk_indices_buffer",
            "topk.DeepseekV32Indexer.topk_indices_buffer",
            "topk.SharedTopkIndicesBuffer.topk_indices_buffer",
            "topk.group_convert_once",
            "topk.group_set_logical_topk_ready",
        }
    elif fault == "logits_replan":
        env.planner.fail_on = 1
        expected = "injected DeepGEMM JIT failure"
        hooks = {"indexer.logits.sparse_attn_indexer"}
    else:
        env.planner.fail_live_on = 1
        expected = "injected DeepGEMM get_num_sms failure"
        hooks = {"indexer.logits.sparse_attn_indexer"}
    result, error = RUNNERS[runner](env)

    from dbo_runtime.core.errors import MicrobatchFailure

    assert result is None and isinstance(error, MicrobatchFailure), repr(error)
    assert expected in str(error.__cause__) and "microbatch 1" in str(error)
    assert {ubatch for _, ubatch, _ in error.failures} == {1}
    assert {where for where, _, _ in error.failures} == hooks
    # Both threads ran the whole layer stack in lock-step: no partner was left parked.
    assert env.dbo_model.done == {0: len(env.model.layers), 1: len(env.model.layers)}
    if fault == "logits_replan":
        assert env.dbo_model.logits_rows[1] == [0.0] * len(env.dbo_model.logits_rows[1])  # placeholder, no kernel
        assert set(env.dbo_model.logits_rows[0]) == {113.0}
    # The next step is clean again: nothing recorded is left over.
    env.locator.ubatch = env.planner.fail_on = env.planner.fail_live_on = None
    _, error = RUNNERS[runner](env)
    assert error is None


@pytest.mark.parametrize("env", [False], indirect=True)
def test_mutation_without_the_join_points_the_fault_would_be_silent(env: Env) -> None:
    """The placeholders alone would return a wrong step: the join-point check is what surfaces it."""
    from dbo_runtime.integration import ubatch_guard

    env.planner.fail_on = 1
    result, error = next(iter(RUNNERS.values()))(env)
    assert error is None and result is not None  # the step "succeeded" ...
    assert env.dbo_model.logits_rows[1] == [0.0] * len(env.dbo_model.logits_rows[1])  # ... on placeholder logits
    assert ubatch_guard.FAILURES.pending, "the failure was recorded but nobody raised it"


def test_off_microbatch_threads_a_plugin_fault_still_raises(env: Env) -> None:
    """On the main thread while microbatch threads are registered (MRV2 between its begin and finish, MRV1 while it
    joins) the hooks resolve and re-raise a fault as before; with no microbatch thread
    in the process they do not resolve at all (``ubatch_ids.THREAD_TABLE``), and before the first microbatched run
    they are not even there (``microbatch_arming``), so nothing can fail there."""
    import threading

    from vllm.v1.worker import ubatching

    from dbo_runtime.integration import ubatch_guard, ubatch_ids
    ubatch_ids._ubatching()
    env.locator.ubatch = 0
    env.locator.after = 0
    assert not ubatching._THREAD_ID_TO_CONTEXT
    buffer = env.model.layers[3].impl.topk_indices_buffer  # no microbatch thread: the plain value, no resolver
    assert buffer is not None
    env.arming.arm("test")  # what the patched runner does before its first threads start
    other = threading.get_ident() + 1  # a microbatch thread registered elsewhere in the process
    ubatching._THREAD_ID_TO_CONTEXT[other] = 1
    try:
        with pytest.raises(RuntimeError, match="injected top-k resolver fault"):
            _ = env.model.layers[3].impl.topk_indices_buffer
    finally:
        del ubatching._THREAD_ID_TO_CONTEXT[other]
    env.planner.fail_on = None
    assert ubatch_guard.FAILURES.pending == []


def test_placeholder_logits_have_the_kernels_shape_and_dtype() -> None:
    from dbo_runtime.integration.ubatch_guard import placeholder_logits

    lens = torch.ones((3, 4), dtype=torch.int32)
    out = placeholder_logits(lens, torch.empty((12, 64), dtype=torch.bfloat16), 40)
    assert out.shape == (12, 40) and out.dtype == torch.bfloat16 and not out.any()
    assert placeholder_logits(torch.ones(5, dtype=torch.int32), torch.empty((5, 64)), 8).dtype == torch.float32


def test_failures_are_counted_logged_once_per_hook_and_raised_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import logging

    from vllm.v1.worker import ubatching

    from dbo_runtime.core.errors import MicrobatchFailure
    from dbo_runtime.integration.ubatch_failures import UbatchFailures

    failures = UbatchFailures()
    assert failures.record("hook", RuntimeError("main thread")) is False  # not a microbatch thread: re-raise
    monkeypatch.setitem(ubatching._THREAD_ID_TO_CONTEXT, threading.get_ident(), 1)  # this thread is microbatch 1
    caplog.set_level(logging.DEBUG, logger="vllm.dbo_runtime")
    first, second = RuntimeError("first"), RuntimeError("second")
    assert failures.record("hook", first) and failures.record("hook", second) and failures.record("other", second)
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR and "failed on DBO microbatch 1" in r.getMessage()]
    assert [r.getMessage().split(" failed")[0] for r in errors] == ["dbo_runtime: hook", "dbo_runtime: other"]
    assert failures.recorded_total == 3 and failures.by_where == {"hook": 2, "other": 1}
    with pytest.raises(MicrobatchFailure, match=r"hook failed on DBO microbatch 1: RuntimeError\('first'\) \(\+2 more") as err:
        failures.raise_pending()
    assert err.value.__cause__ is first and len(err.value.failures) == 3
    failures.raise_pending()  # taken: nothing left to raise


def test_a_microbatch_failure_names_the_error_vllm_raised_at_the_join() -> None:
    """When vLLM's own join raises after a plugin fault on a microbatch thread, the report names vLLM's
    error too, and the plugin's fault stays the cause."""
    from dbo_runtime.core.errors import MicrobatchFailure

    failure = MicrobatchFailure([("indexer logits call site", 1, ValueError("plugin"))], also=RuntimeError("vLLM join failed"))
    assert "vLLM then raised: RuntimeError('vLLM join failed')" in str(failure)
    assert isinstance(failure.__cause__, ValueError)


@pytest.mark.parametrize("runner", list(RUNNERS))
@pytest.mark.parametrize("reserved", [True, False], ids=["reserved-row", "nothing-reserved"])
def test_out_of_memory_on_a_microbatch_never_hangs_and_the_handler_allocates_nothing(
    env: Env, runner: str, reserved: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The kernel path runs out of device memory on microbatch 1, and so does every allocation the
    handler could try: the step still finishes on both threads and raises on the main thread."""
    import sys

    from dbo_runtime.core.errors import MicrobatchFailure
    from dbo_runtime.integration import ubatch_guard

    monkeypatch.setattr(ubatch_guard, "_RESERVED", {})
    if reserved:
        ubatch_guard.reserve_placeholders(torch.device("cpu"), 8, max_rows=64)
    handler_allocations: list[str] = []
    real_zeros = torch.zeros

    def zeros(*args: Any, **kwargs: Any) -> Any:
        if sys._getframe(1).f_code.co_name == "placeholder_logits":
            handler_allocations.append("zeros")
            raise torch.OutOfMemoryError("injected: the handler's allocation is out of memory too")
        return real_zeros(*args, **kwargs)

    monkeypatch.setattr(torch, "zeros", zeros)
    env.planner.oom_on = 1
    result, error = RUNNERS[runner](env)
    assert result is None and isinstance(error, MicrobatchFailure), repr(error)
    assert isinstance(error.__cause__, torch.OutOfMemoryError)
    assert {where for where, _, _ in error.failures} == {"indexer.logits.sparse_attn_indexer"}
    assert env.dbo_model.done == {0: len(env.model.layers), 1: len(env.model.layers)}
    assert handler_allocations == ([] if reserved else ["zeros"] * len(env.dbo_model.logits_rows[1]))
    env.planner.oom_on = None
    _, error = RUNNERS[runner](env)
    assert error is None


def test_the_placeholder_has_a_row_stride_kernels_can_divide_by_and_stays_in_bounds(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's persistent top-k divides by ``stride(0)`` on the host: a stride-0 view died of SIGFPE on the H200."""
    from dbo_runtime.integration import ubatch_guard

    monkeypatch.setattr(ubatch_guard, "_RESERVED", {})
    ubatch_guard.reserve_placeholders(torch.device("cpu"), 4096, max_rows=256)
    buf = ubatch_guard._RESERVED[("cpu", torch.float32)]
    assert buf.numel() == 4096 + ubatch_guard.ROW_STRIDE * 256  # not 256 x 4096
    out = ubatch_guard.placeholder_logits(torch.ones((128, 2), dtype=torch.int32), torch.zeros((256, 8)), 4096)
    assert tuple(out.shape) == (256, 4096) and out.stride() == (ubatch_guard.ROW_STRIDE, 1) and out.stride(0) % 4 == 0
    assert out.data_ptr() == buf.data_ptr() and float(out.abs().sum()) == 0.0  # every row reads reserved zeros
    too_many = ubatch_guard.placeholder_logits(torch.ones((300, 1), dtype=torch.int32), torch.zeros((300, 8)), 4096)
    assert too_many.stride() == (4096, 1)  # beyond the reserve: allocated, as vLLM would
    # DeepSelect (SM100) requires a row pitch that is a multiple of 1024 bytes, bf16 logits included
    assert ubatch_guard.ROW_STRIDE * torch.finfo(torch.bfloat16).bits // 8 % 1024 == 0


def test_without_a_reserve_or_memory_the_placeholder_is_never_a_stride_0_view(monkeypatch: pytest.MonkeyPatch) -> None:
    from dbo_runtime.integration import ubatch_guard

    monkeypatch.setattr(ubatch_guard, "_RESERVED", {})

    def no_memory(*args: Any, **kwargs: Any) -> Any:
        raise torch.OutOfMemoryError("injected")

    monkeypatch.setattr(torch, "zeros", no_memory)
    weights = torch.ones((6, 8))
    out = ubatch_guard.placeholder_logits(torch.ones((6, 1), dtype=torch.int32), weights, 4096)
    assert out is weights and 0 not in out.stride()
