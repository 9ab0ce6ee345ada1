"""Indexer schedule hooks against the real vLLM 0.33.0 package (CPU).

What is real: vLLM's modules, the ``DeepseekV32IndexerMetadataBuilder`` class, its ``__init__``,
``build()`` (decode branch) and ``update_draft_decode_metadata()``, the ``DeepSeekV32IndexerDecodeMetadata``
objects they return, the call-site module attributes, the PatchSet transaction.

Boundary fakes (no GPU / no DeepGEMM here; GPU twin: tests/gpu/test_indexer_schedule_gpu.py):
``current_platform.is_cuda`` / ``is_device_capability_family`` (the builder only plans on CUDA),
the indexer module's ``num_compute_units`` (132) and ``has_deep_gemm``, DeepGEMM's planner and
logits kernel (tests/fakes/fake_deep_gemm.py; the logits fake performs DeepGEMM's host assertion),
and ``builder.device`` set to ``cuda:0`` after construction (buffers stay on the CPU; the hooks
only read the device index).
"""

from __future__ import annotations

import functools
import importlib
import inspect
from collections.abc import Iterator
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from dbo_runtime.core.budget import compute_budget
from dbo_runtime.integration import indexer_hooks
from dbo_runtime.integration.patching import PatchSet
from dbo_runtime.services import schedule_cache, sm_control
from dbo_runtime.services.schedule_cache import IndexerScheduleCache
from dbo_runtime.services.sm_control import sm_control_for
from tests.fakes.fake_deep_gemm import (
    FakeDeepGemm,
    FakeSchedulePlanner,
    vllm_signature_logits,
    vllm_signature_planner,
)
from tests.forked import Scenario, run_forked
from tests.vllm.conftest import has_module, in_release

LAYERS = 21
BLOCK = 64
IX = "vllm.v1.attention.backends.mla.indexer"
MRV1_RUNNER = "vllm.v1.worker.gpu_model_runner"
SAI = "vllm.model_executor.layers.sparse_attn_indexer"


@pytest.fixture(autouse=True)
def arming(fresh_arming: Any) -> Any:
    """Every test here starts in a process that has not split a step: the logits call site is vLLM's own function
    until a production path arms it (a microbatched build, a write to DeepGEMM's count through vLLM's wrapper, a
    runner's join point)."""
    return fresh_arming


def _raw(owner: Any, name: str) -> Any:
    return owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)


def test_patches_land_on_real_targets_and_uninstall_restores_identity(arming: Any) -> None:
    ix = importlib.import_module(IX)
    sai = importlib.import_module(SAI)
    from vllm.utils import deep_gemm as vdg
    from vllm.v1.worker.gpu.ubatch_utils import UBatchRunner

    builder = ix.DeepseekV32IndexerMetadataBuilder
    targets = {
        "indexer.builder_init": (builder, "__init__"),
        "indexer.builder_build": (builder, "build"),
        "indexer.builder_update_draft": (builder, "update_draft_decode_metadata"),
        "indexer.builder_planner": (ix, "get_paged_mqa_logits_metadata"),
        "indexer.logits.sparse_attn_indexer": (sai, "fp8_fp4_paged_mqa_logits"),
        "indexer.plan_ahead.mrv2": (UBatchRunner, "prepare"),
    }
    names = {p.name for p in in_release(indexer_hooks.patches())}
    if has_module(MRV1_RUNNER):  # vLLM 0.33: Model Runner V1 exists and runs DBO too
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner

        targets["indexer.plan_ahead.mrv1"] = (GPUModelRunner, "_build_attention_metadata")
    else:  # vLLM 0.34: no V1 runner, so its patch is not part of the release's set
        assert "indexer.plan_ahead.mrv1" not in names
    if hasattr(sai, "_varlen_decode_rows"):  # vLLM 0.34's SM100 chunked decode binds the planner itself
        targets["indexer.slice_planner"] = (sai, "get_paged_mqa_logits_metadata")
    else:
        assert "indexer.slice_planner" not in names
    before = {name: _raw(owner, attr) for name, (owner, attr) in targets.items()}
    # The call sites really hold vLLM's DeepGEMM wrappers (from-import bindings).
    assert before["indexer.logits.sparse_attn_indexer"] is vdg.fp8_fp4_paged_mqa_logits
    assert before["indexer.builder_planner"] is vdg.get_paged_mqa_logits_metadata

    patch_set = PatchSet(in_release(indexer_hooks.patches()))
    patch_set.install()
    try:
        # the call site is vLLM's own until the process first splits a step (microbatch_arming)
        assert _raw(sai, "fp8_fp4_paged_mqa_logits") is before["indexer.logits.sparse_attn_indexer"]
        arming.arm("test")
        for name, (owner, attr) in targets.items():
            now = _raw(owner, attr)
            assert now is not before[name], name
            assert now.__wrapped__ is before[name], name
        states = {s.patch.name: s.state for s in patch_set.status()}
        assert all(states[name] == "installed" for name in targets)
        # GLM-5-Next's module needs torchvision and cannot be imported here: armed, not applied.
        assert states["indexer.logits.glm5next"] == "pending"
    finally:
        patch_set.uninstall()
    for name, (owner, attr) in targets.items():
        assert _raw(owner, attr) is before[name], name


@dataclass
class FakeModelConfig:
    """Stands for vLLM's ModelConfig, which needs a real model's HF config (none on this box).

    The builder paths exercised here read only ``max_model_len`` from it; on the GPU twin
    (tests/gpu/test_indexer_schedule_gpu.py) no vLLM config is involved at all.
    """

    max_model_len: int
    hf_text_config: Any = None
    """vLLM 0.34's builder reads the indexer geometry from it (``None``: no fused MQA top-k planning)."""


@dataclass
class Env:
    dg: FakeDeepGemm
    cache: IndexerScheduleCache
    ix: Any
    sai: Any
    patch_set: PatchSet

    def builder(self, *, dbo: bool = True) -> Any:
        """A real builder of an engine started with ``--enable-dbo`` (``dbo=False``: one that never microbatches)."""
        from vllm.config import DeviceConfig, VllmConfig
        from vllm.v1.kv_cache_interface import FullAttentionSpec

        vc = VllmConfig(device_config=DeviceConfig(device="cpu"))
        object.__setattr__(vc, "model_config", FakeModelConfig(max_model_len=40960))
        object.__setattr__(vc.parallel_config, "enable_dbo", dbo)
        vc.attention_config.sparse_mla_prefill_workspace_factor = 5
        spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=132, dtype=torch.uint8)
        builder = self.ix.DeepseekV32IndexerMetadataBuilder(spec, ["indexer.0"], vc, torch.device("cpu"), block_table_width=64)
        builder.device = torch.device("cuda", 0)
        return builder

    def logits(self, decode: Any) -> torch.Tensor:
        # Exactly how sparse_attn_indexer's decode branch calls it (module-global lookup, keywords).
        return self.sai.fp8_fp4_paged_mqa_logits(
            (torch.empty(0), None),
            torch.empty((4, BLOCK, 1, 132), dtype=torch.uint8),
            torch.empty(0),
            decode.seq_lens,
            decode.block_table,
            decode.schedule_metadata,
            max_model_len=8,
            indices=decode.indices,
        )


def _common(seq_lens: list[int]) -> Any:
    from vllm.v1.attention.backends.utils import CommonAttentionMetadata

    n = len(seq_lens)
    qsl = torch.arange(n + 1, dtype=torch.int32)
    return CommonAttentionMetadata(
        query_start_loc=qsl,
        query_start_loc_cpu=qsl.clone(),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        num_reqs=n,
        num_actual_tokens=n,
        max_query_len=1,
        max_seq_len=max(seq_lens),
        block_table_tensor=torch.zeros((n, 64), dtype=torch.int32),
        slot_mapping=torch.arange(n, dtype=torch.int64),
    )


SEQS = [1, 7, 300, 4096, 30000, 32768]


@pytest.fixture
def env(monkeypatch: pytest.MonkeyPatch) -> Iterator[Env]:
    from vllm.platforms import current_platform

    ix = importlib.import_module(IX)
    sai = importlib.import_module(SAI)
    dg = FakeDeepGemm(total_sms=132, sm_major=9)
    monkeypatch.setattr(current_platform, "is_cuda", lambda: True)
    monkeypatch.setattr(current_platform, "is_device_capability_family", lambda fam, device_id=0: fam == 90)
    monkeypatch.setattr(ix, "num_compute_units", lambda device_id=0: 132)
    monkeypatch.setattr(ix, "has_deep_gemm", lambda: True)
    monkeypatch.setattr(ix, "get_paged_mqa_logits_metadata", vllm_signature_planner(dg))
    monkeypatch.setattr(sai, "fp8_fp4_paged_mqa_logits", vllm_signature_logits(dg))
    if hasattr(sai, "get_paged_mqa_logits_metadata"):  # vLLM 0.34's chunked decode binds the planner too
        monkeypatch.setattr(sai, "get_paged_mqa_logits_metadata", vllm_signature_planner(dg))
    import vllm.utils.deep_gemm as vdg

    monkeypatch.setattr(vdg, "_lazy_init", lambda: None)  # vLLM's wrapper writes the fake's count (_sm_write)
    monkeypatch.setattr(vdg, "_import_deep_gemm", lambda: dg)
    cache = IndexerScheduleCache(FakeSchedulePlanner(dg))
    monkeypatch.setattr(schedule_cache, "_CACHE", cache)
    monkeypatch.setattr(sm_control, "_CONTROLS", {})
    patch_set = PatchSet(in_release(indexer_hooks.patches()))
    patch_set.install()
    try:
        yield Env(dg, cache, ix, sai, patch_set)
    finally:
        patch_set.uninstall()
        cache.detach_all()


def _sm_write(num_sms: int) -> None:
    """Set DeepGEMM's count the way vLLM 0.33's SM control does, through ``vllm.utils.deep_gemm.set_num_sms`` (the
    watched writer, which arms the call site before the count changes)."""
    import vllm.utils.deep_gemm as vdg

    vdg.set_num_sms(num_sms)


def _register(builder: Any) -> None:
    """``register_builder`` as on cuda:0, with the warm-up tensors on the CPU (no GPU here)."""
    device, builder.device = builder.device, torch.device("cpu")
    try:
        indexer_hooks.register_builder(builder, device_index=0)
    finally:
        builder.device = device


def _announce_dbo(device: int = 0) -> Any:
    budget = compute_budget(
        total_sms=132, platform="cuda", enable_dbo=True, expert_parallel=True, all2all_backend="deepep_high_throughput"
    )
    sm_control_for(device, 132).announce(budget)
    return budget


def test_build_records_planned_count_and_call_site_replans_once(env: Env) -> None:
    builder = env.builder()
    metadata = builder.build(0, _common(SEQS))
    decode = metadata.decode
    state = env.cache.state_of(decode.schedule_metadata)
    assert state is not None and (state.planned_sms, state.block_kv, state.next_n) == (132, BLOCK, 1)
    assert decode.dbo_schedule_state is state
    assert tuple(decode.schedule_metadata.shape) == (133, 2)

    env.logits(decode)  # 132 SMs: the build's schedule passes DeepGEMM's check untouched
    calls = len(env.dg.plan_calls)
    _sm_write(112)  # what SMControl does inside the microbatches
    for _ in range(LAYERS):
        env.logits(decode)
    assert len(env.dg.plan_calls) == calls + 1 and env.dg.plan_calls[-1][0] == 112
    assert env.cache.stats.replans == 1

    env.patch_set.uninstall()  # vLLM as shipped: the production assertion
    with pytest.raises(RuntimeError, match="_schedule_meta_size == num_sms"):
        env.logits(decode)


def test_plan_ahead_in_microbatched_build_needs_no_call_site_replan(env: Env) -> None:
    builder = env.builder()
    _register(builder)  # what the patched __init__ does on a GPU
    _announce_dbo()
    calls = len(env.dg.plan_calls)
    with env.cache.microbatched_build():
        metadata = builder.build(0, _common(SEQS))
    assert tuple(metadata.decode.schedule_metadata.shape) == (113, 2)
    assert env.cache.stats.planned_ahead == 1
    assert len(env.dg.plan_calls) == calls  # deferred: the build launches no planner
    _sm_write(112)
    for _ in range(LAYERS):
        env.logits(metadata.decode)
    # The first layer of the eager step plans it, for 112, into the same tensor; no re-plan after.
    assert len(env.dg.plan_calls) == calls + 1 and env.dg.plan_calls[-1][0] == 112
    assert env.cache.stats.replans == 0 and env.cache.stats.deferred_plans == 1

    _sm_write(132)  # a non-microbatched step on the same builder plans for the whole GPU
    plain = builder.build(0, _common(SEQS))
    assert tuple(plain.decode.schedule_metadata.shape) == (133, 2)
    env.logits(plain.decode)
    assert env.cache.stats.replans == 0


def test_update_draft_invalidates_and_keeps_planned_count(env: Env) -> None:
    builder = env.builder()
    metadata = builder.build(0, _common(SEQS))
    decode = metadata.decode
    _sm_write(112)
    env.logits(decode)
    assert env.cache.stats.replans == 1
    metadata.seq_lens = torch.tensor([s + 1 for s in SEQS], dtype=torch.int32)
    builder.update_draft_decode_metadata(metadata)
    assert env.cache.stats.invalidations == 1
    assert tuple(decode.seq_lens.view(-1).tolist()) == tuple(s + 1 for s in SEQS)
    env.logits(decode)
    assert env.cache.stats.replans == 2  # the first re-plan was for the previous seq_lens


def test_update_draft_after_plan_ahead_keeps_vllm_shape_assertion_happy(env: Env) -> None:
    builder = env.builder()
    _register(builder)
    _announce_dbo()
    with env.cache.microbatched_build():
        metadata = builder.build(0, _common(SEQS))
    # vLLM re-plans with self.num_sms (132 -> 133 rows) and asserts the 113-row shape: the hook plans 112.
    builder.update_draft_decode_metadata(metadata)
    assert env.dg.plan_calls[-1][0] == 112
    assert tuple(metadata.decode.schedule_metadata.shape) == (113, 2)


def test_full_graph_dbo_step_launches_no_planner_at_build(env: Env) -> None:
    """With vLLM's real builder: a FULL-graph DBO step (build, then replay) launches no planner at the
    build, since the graph re-plans inside itself and never reads the build's plan.
    The replay-safety guarantee is untouched: the capture records its own planner, the buffer is never
    read by it, and an eager step plans the schedule before its first logits kernel."""
    builder = env.builder()
    _register(builder)
    _announce_dbo()
    builder.scheduler_metadata_buffer.fill_(-7)  # stale: whatever a non-DBO build left there
    _sm_write(112)  # both runners enter SM control before the capture

    def microbatched_build() -> Any:
        with env.cache.microbatched_build():
            return builder.build(0, _common(SEQS))

    # Capture: the call site records the graph's own planner (from the persistent seq_lens).
    capture_md = microbatched_build()
    env.cache.planner.capturing_now, env.cache.planner.current_capture = True, 1  # type: ignore[attr-defined]
    calls = len(env.dg.plan_calls)
    for _ in range(LAYERS):
        env.logits(capture_md.decode)
    env.cache.planner.capturing_now = False  # type: ignore[attr-defined]
    assert len(env.dg.plan_calls) == calls + 1 and env.cache.stats.captured_replans == 1

    # Replay steps: vLLM builds the microbatch metadata, then replays the graph (no call site runs).
    calls = len(env.dg.plan_calls)
    for _ in range(5):
        microbatched_build()
    per_step = (len(env.dg.plan_calls) - calls) / 5
    assert per_step == 0, f"planner kernels per FULL-graph DBO step (this microbatch's build): {per_step}"
    assert (capture_md.decode.schedule_metadata == -7).all()  # nothing wrote the buffer the graph never reads
    assert (builder.scheduler_metadata_buffer == -7).all()

    # An eager DBO step on the same builder: planned before its first logits kernel, bit for bit.
    eager_md = microbatched_build()
    out = env.logits(eager_md.decode)
    assert float(out[0, 0]) == 113.0  # the fake's logits carry the rows it was handed (host check passed)
    reference = vllm_signature_planner(FakeDeepGemm(total_sms=132, sm_major=9))
    assert torch.equal(eager_md.decode.schedule_metadata, reference(eager_md.decode.seq_lens, BLOCK, 112))
    assert env.cache.stats.deferred_plans == 1 and env.cache.stats.replans == 0


@pytest.mark.parametrize("defer", [True, False], ids=["deferred", "plan_at_build"])
def test_planners_and_schedule_copies_per_dbo_step_never_scale_with_layers(env: Env, defer: bool) -> None:
    """bench_replay_planning on the H200 printed 331 device-to-device copies per deferred FULL-graph step
    against 9 at build. Per step, with vLLM's real builder (one per microbatch) and the DeepGEMM fake:
    planner launches (the fake's calls) and copies into the schedule buffers, classified the way torch's
    ``copy_`` decides whether to launch anything (``CopyCounter``). A FULL-graph DBO step is the build
    followed by a replay, which runs no Python (no call site); an eager step runs every indexer layer's
    call site. Neither count may depend on the number of layers."""
    from tests.copy_counter import CopyCounter

    env.cache.defer_plan_ahead = defer
    builders = [env.builder(), env.builder()]  # one builder (and schedule buffer) per microbatch
    for builder in builders:
        _register(builder)
    _announce_dbo()
    _sm_write(112)  # the microbatches run under SM control

    def step(layers: int) -> tuple[int, int, int]:
        """(planner launches, real copies into the schedule buffers, same-memory no-op copies onto them)."""
        calls = len(env.dg.plan_calls)
        with CopyCounter([b.scheduler_metadata_buffer for b in builders]) as copies:
            with env.cache.microbatched_build():
                built = [b.build(0, _common(SEQS)) for b in builders]
            for _ in range(layers):
                for metadata in built:
                    out = env.logits(metadata.decode)
                    assert float(out[0, 0]) == 113.0  # DeepGEMM's host check passed on a 112-SM plan
        return len(env.dg.plan_calls) - calls, copies.into_targets, copies.noop

    full_graph = [step(0) for _ in range(3)]
    eager = [step(LAYERS) for _ in range(3)] + [step(3 * LAYERS)]
    if defer:
        # The build launches nothing and vLLM's `schedule_metadata[:] = metadata` is a same-memory no-op.
        assert full_graph == [(0, 0, 2)] * 3
        # Eager: one planner and one copy per schedule per step, at the first indexer layer.
        assert eager == [(2, 2, 2)] * 4
        assert env.cache.stats.deferred_plans == 2 * 4
    else:
        assert full_graph == [(2, 2, 0)] * 3  # planned and copied at build, never read by the replay
        assert eager == [(2, 2, 0)] * 4
    assert env.cache.stats.replans == 0


def test_update_draft_on_a_deferred_schedule_plans_it_in_place(env: Env) -> None:
    builder = env.builder()
    _register(builder)
    _announce_dbo()
    with env.cache.microbatched_build():
        metadata = builder.build(0, _common(SEQS))
    metadata.seq_lens = torch.tensor([s + 1 for s in SEQS], dtype=torch.int32)
    calls = len(env.dg.plan_calls)
    builder.update_draft_decode_metadata(metadata)  # vLLM re-plans in place and asserts the 113-row shape
    assert len(env.dg.plan_calls) == calls + 1 and env.dg.plan_calls[-1][0] == 112
    _sm_write(112)
    env.logits(metadata.decode)
    assert len(env.dg.plan_calls) == calls + 1  # settled: nothing deferred left to run
    assert env.cache.stats.deferred_plans == 0


def test_plan_at_build_when_deferral_is_off(env: Env) -> None:
    env.cache.defer_plan_ahead = False
    builder = env.builder()
    _register(builder)
    _announce_dbo()
    calls = len(env.dg.plan_calls)
    with env.cache.microbatched_build():
        metadata = builder.build(0, _common(SEQS))
    assert len(env.dg.plan_calls) == calls + 1 and env.dg.plan_calls[-1][0] == 112
    assert env.cache.stats.deferred == 0 and tuple(metadata.decode.schedule_metadata.shape) == (113, 2)


def test_builder_init_registers_profile(env: Env, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[Any] = []
    monkeypatch.setattr(indexer_hooks, "register_builder", lambda builder, device_index=None: seen.append(builder))
    builder = env.builder()
    assert seen == [builder]


def test_a_failing_profile_registration_never_stops_vllms_builder(monkeypatch: pytest.MonkeyPatch, caplog: Any) -> None:
    """Registering the planner profile is optional work inside vLLM's builder ``__init__``: when it raises,
    the builder is still built, and the failure is logged once, not once per builder."""

    def broken(builder: Any, device_index: int | None = None) -> None:
        raise RuntimeError("warm-up exploded")

    monkeypatch.setattr(indexer_hooks, "register_builder", broken)
    monkeypatch.setattr(indexer_hooks, "_logged", set())
    built: list[Any] = []

    class Builder:
        def __init__(self, value: int) -> None:
            built.append(value)

    Builder.__init__ = indexer_hooks._make_builder_init(Builder.__init__)  # type: ignore[method-assign]
    Builder(1)
    Builder(2)
    assert built == [1, 2]
    assert caplog.text.count("planner profile not registered") == 1


def test_register_builder_warms_announced_dbo_count(env: Env, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under ``VLLM_DEEP_GEMM_WARMUP=skip`` (vLLM compiles nothing ahead): the minimal set, DBO count only."""
    monkeypatch.setenv("VLLM_DEEP_GEMM_WARMUP", "skip")
    builder = env.builder()
    builder.device = torch.device("cpu")  # the warm-up tensors are allocated on the builder's device
    _announce_dbo()
    profile = indexer_hooks.register_builder(builder, device_index=0)
    # No FULL cudagraphs in this config (enforce-eager-like): only the full batch, 128 requests -> 64 each.
    assert builder.vllm_config.scheduler_config.max_num_seqs == 128
    assert profile is not None and profile.block_kv == BLOCK and profile.shapes == ((64, 1),)
    assert [(c[0], c[2]) for c in env.dg.plan_calls] == [(112, (64, 1))]
    assert env.cache.stats.warmups == 1


@pytest.mark.parametrize(("spec", "expected"), [(0, [(112, 32), (112, 64), (112, 512)]), (3, [(56, 32), (56, 512)])])
def test_minimal_warm_up_is_exactly_what_vllm_runs_microbatched(
    env: Env, spec: int, expected: list[tuple[int, int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The minimal set (``VLLM_DEEP_GEMM_WARMUP=skip``), from the vLLM config the real builder holds: FULL capture
    sizes DBO microbatches (>= dbo_decode_token_threshold), and the full batch of max_num_seqs decodes, per
    microbatch, at the DBO count only."""
    from vllm.config import CUDAGraphMode

    monkeypatch.setenv("VLLM_DEEP_GEMM_WARMUP", "skip")
    builder = env.builder()
    builder.device = torch.device("cpu")
    vc = builder.vllm_config
    vc.scheduler_config.max_num_seqs = 1024
    vc.scheduler_config.max_num_batched_tokens = 8192
    vc.compilation_config.cudagraph_mode = CUDAGraphMode.FULL_AND_PIECEWISE
    vc.compilation_config.cudagraph_capture_sizes = [1, 2, 4, 8, 16, 24, 32, 64, 96, 128]
    vc.parallel_config.enable_dbo = True
    builder.num_speculative_tokens = spec  # what __init__ read from the speculative config
    _announce_dbo()
    profile = indexer_hooks.register_builder(builder, device_index=0)
    assert profile is not None
    got = sorted({(c[0], c[2][0]) for c in env.dg.plan_calls})
    # spec 0: graphs 32/64/96/128 tokens -> 16/32/48/64 requests per microbatch -> buckets 32, 64; full batch 512.
    # spec 3 (next_n 4, SM90: 56 slots): graphs 32/64/96/128 tokens -> 4/8/12/16 requests -> bucket 32; full 512.
    assert got == expected and env.cache.stats.warmups == len(expected)
    assert {c[2][1] for c in env.dg.plan_calls} == {1 + spec}


def test_sm90_next_n4_slot_rule_is_vllms(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.platforms import current_platform

    from dbo_runtime.adapters.deep_gemm import DeepGemmPlanner, schedule_slots

    planner = DeepGemmPlanner()
    monkeypatch.setattr(current_platform, "is_device_capability_family", lambda fam, device_id=0: fam == 90)
    assert [planner.slots(132, n) for n in (1, 2, 4)] == [132, 132, 66]
    assert planner.slots(112, 4) == 56
    monkeypatch.setattr(current_platform, "is_device_capability_family", lambda fam, device_id=0: fam == 100)
    assert planner.slots(132, 4) == 132
    assert schedule_slots(132, 4, major=9) == 66 and schedule_slots(132, 4, major=10) == 132


def test_runner_hooks_mark_microbatched_builds(env: Env) -> None:
    """The plan-ahead scopes find ``ubatch_slices`` / ``for_capture`` by name in vLLM's own signatures, however the
    runner passes them, and pass a keyword vLLM adds later straight through."""
    from vllm.v1.worker.gpu.ubatch_utils import UBatchRunner

    seen: list[bool] = []

    def recording(real: Any) -> Any:
        @functools.wraps(real)
        def original(self: Any, *args: Any, **kwargs: Any) -> str:
            seen.append(env.cache.in_microbatched_build())
            return "metadata"

        return original

    expected = []
    if has_module(MRV1_RUNNER):
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner

        mrv1 = indexer_hooks._make_mrv1_build_attention_metadata(recording(GPUModelRunner._build_attention_metadata))
        assert mrv1(object(), 8, 4, 1) == "metadata"
        mrv1(object(), 8, 4, 1, ubatch_slices=[slice(0, 4), slice(4, 8)])
        mrv1(object(), 8, 4, 1, None, None, ["positional ubatch slices"])
        mrv1(object(), 8, 4, 1, a_keyword_vllm_adds_later=True)
        expected = [False, True, True, False]
    mrv2 = indexer_hooks._make_mrv2_prepare(recording(UBatchRunner.prepare))
    mrv2(object(), "input_batch", (), None)
    mrv2(object(), "input_batch", (), None, None, None, True)  # every positional parameter, for_capture last
    mrv2(object(), "input_batch", (), None, for_capture=True, a_keyword_vllm_adds_later=True)
    assert seen == [*expected, True, True, True]
    assert not env.cache.in_microbatched_build()


def test_warm_up_under_vllms_default_keeps_every_decode_batch_out_of_jit(env: Env, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under vLLM's default ``VLLM_DEEP_GEMM_WARMUP`` (relax) with no capture sizes (DeepEP HT forces eager): every
    32-row bucket up to max_num_seqs at the full and the DBO count is compiled at load, so no decode batch from 1 to
    max_num_seqs -- microbatched or not -- meets a planner variant for the first time in a step."""
    monkeypatch.delenv("VLLM_DEEP_GEMM_WARMUP", raising=False)
    monkeypatch.delenv("DBO_RUNTIME_PLANNER_WARM_MAX_BATCH", raising=False)
    builder = env.builder()
    builder.device = torch.device("cpu")
    builder.vllm_config.parallel_config.enable_dbo = True
    _announce_dbo()
    indexer_hooks.register_builder(builder, device_index=0)
    max_seqs = builder.vllm_config.scheduler_config.max_num_seqs
    assert env.cache.stats.warmups == 2 * -(-max_seqs // 32)  # one per bucket, at 132 and at 112 SMs
    env.cache.warmup.start_serving()
    for batch in range(1, max_seqs + 1):
        lens = torch.ones((batch, 1), dtype=torch.int32)
        env.cache.warmup.note_plan(lens, BLOCK, 132, None)  # a step that does not microbatch
        env.cache.warmup.note_plan(lens[: batch // 2 + 1], BLOCK, 112, None)  # one microbatch of a DBO step
    assert env.cache.stats.jit_in_step == 0
    env.cache.warmup.note_plan(torch.ones((max_seqs + 32, 1), dtype=torch.int32), BLOCK, 132, None)
    assert env.cache.stats.jit_in_step == 1  # the counter counts: a batch beyond max_num_seqs was never warmed


def test_minimal_warm_up_leaves_eager_decode_batches_to_jit_in_step(env: Env, monkeypatch: pytest.MonkeyPatch) -> None:
    """The control: under ``skip`` the same sweep meets cold variants (the counter reports them)."""
    monkeypatch.setenv("VLLM_DEEP_GEMM_WARMUP", "skip")
    builder = env.builder()
    builder.device = torch.device("cpu")
    builder.vllm_config.parallel_config.enable_dbo = True
    _announce_dbo()
    indexer_hooks.register_builder(builder, device_index=0)
    env.cache.warmup.start_serving()
    for batch in range(1, builder.vllm_config.scheduler_config.max_num_seqs + 1):
        env.cache.warmup.note_plan(torch.ones((batch, 1), dtype=torch.int32), BLOCK, 132, None)
    cold = env.cache.stats.jit_in_step
    assert cold > 0
    # every later step of a shape already met is one set lookup: no variant key, no recount
    variants = []
    monkeypatch.setattr(env.cache.warmup, "variant", lambda *a: variants.append(a))
    for batch in (1, 33, 64):
        env.cache.warmup.note_plan(torch.ones((batch, 1), dtype=torch.int32), BLOCK, 132, None)
    assert variants == [] and env.cache.stats.jit_in_step == cold


def test_a_rocm_builder_warms_and_reserves_nothing(env: Env, monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's ROCm paged-MXFP4 indexer builder subclasses the CUDA one, but vLLM plans with DeepGEMM on CUDA only:
    on ROCm a warm-up would fail for every variant and log a compile-on-first-use that never comes."""
    from dbo_runtime.integration import guard

    monkeypatch.delenv("VLLM_DEEP_GEMM_WARMUP", raising=False)
    reserved: list[Any] = []
    monkeypatch.setattr(indexer_hooks, "reserve_placeholders", lambda *a, **k: reserved.append(a))
    monkeypatch.setattr(guard, "platform", lambda: "rocm")
    builder = env.builder()  # vLLM's __init__, hooked: on ROCm neither a profile nor placeholders
    builder.device = torch.device("cpu")
    assert indexer_hooks.register_builder(builder, device_index=0) is None
    indexer_hooks.reserve_builder_placeholders(builder)
    stats = env.cache.stats
    assert (stats.warmups, stats.warm_failures, env.dg.plan_calls, reserved) == (0, 0, [], [])
    monkeypatch.setattr(guard, "platform", lambda: "cuda")
    assert indexer_hooks.register_builder(builder, device_index=0) is not None
    indexer_hooks.reserve_builder_placeholders(builder)
    assert env.cache.stats.warmups > 0 and reserved


def test_a_dbo_builder_reserves_the_placeholders_even_when_its_profile_fails(env: Env, monkeypatch: pytest.MonkeyPatch) -> None:
    """The planner profile is an optimisation (its failure is logged and the engine starts); the placeholder logits
    are what keeps an out-of-memory error at the call site on a microbatch thread from hanging the step, so vLLM's
    builder ``__init__`` reserves them whatever the profile did, and sizes it cannot read mark the guard broken."""
    from dbo_runtime.integration import guard

    monkeypatch.setattr(guard, "platform", lambda: "cuda")
    reserved: list[Any] = []
    monkeypatch.setattr(indexer_hooks, "reserve_placeholders", lambda *a, **k: reserved.append(a))

    def failing(*_: Any, **__: Any) -> None:
        raise RuntimeError("profile shapes could not be read")

    monkeypatch.setattr(indexer_hooks, "register_builder", failing)
    builder = env.builder()  # vLLM's __init__, hooked: the profile fails, the reservation still happens
    sched = builder.vllm_config.scheduler_config
    q = 1 + int(getattr(builder, "num_speculative_tokens", 0))
    assert reserved and reserved[-1][1:] == (builder.vllm_config.model_config.max_model_len, min(sched.max_num_seqs * q, sched.max_num_batched_tokens))
    reserved.clear()
    indexer_hooks.reserve_builder_placeholders(env.builder(dbo=False))
    assert reserved == []  # an engine that never microbatches needs no placeholder
    marks: list[tuple[Any, ...]] = []
    monkeypatch.setattr(indexer_hooks.REGISTRY, "mark", lambda *a: marks.append(a))
    monkeypatch.setattr(builder, "vllm_config", SimpleNamespace(parallel_config=builder.vllm_config.parallel_config))
    indexer_hooks.reserve_builder_placeholders(builder)
    assert reserved == [] and [m[:2] for m in marks] == [("ubatch_guard", "broken")] and "placeholder" in marks[0][2]


def test_an_engine_that_never_microbatches_warms_nothing(env: Env, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without ``--enable-dbo`` / ``--ubatch-size`` vLLM plans as it always does: no warm-up, no load-time cost."""
    monkeypatch.delenv("VLLM_DEEP_GEMM_WARMUP", raising=False)
    builder = env.builder(dbo=False)
    builder.device = torch.device("cpu")
    assert not builder.vllm_config.parallel_config.use_ubatching
    indexer_hooks.register_builder(builder, device_index=0)
    assert env.cache.stats.warmups == 0 and env.dg.plan_calls == []
    assert env.cache.steps_aside
    builder.vllm_config.parallel_config.ubatch_size = 2  # the other way vLLM microbatches
    indexer_hooks.register_builder(builder, device_index=0)
    assert env.cache.stats.warmups > 0
    assert not env.cache.steps_aside  # a builder that may microbatch: every build is tracked again


def test_a_later_engine_that_never_microbatches_warms_no_earlier_engines_dbo_count(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two engines in one process: an HT DBO engine announced 112, then one without ``--enable-dbo`` registers its
    builder. Its steps never run at 112, so nothing is compiled for it (1-2 s per variant on a cold cache)."""
    monkeypatch.setenv("VLLM_DEEP_GEMM_WARMUP", "skip")
    _announce_dbo()
    builder = env.builder(dbo=False)
    builder.device = torch.device("cpu")
    indexer_hooks.register_builder(builder, device_index=0)
    assert env.dg.plan_calls == [] and env.cache.stats.warmups == 0


def test_only_a_dbo_engines_builder_looks_up_the_capture_id_entry_point(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Captures of a DBO engine may re-plan and read the capture id: its entry point is found at model load, not
    inside the first capture. An engine that never microbatches never re-plans: no lookup."""
    seen: list[int] = []
    monkeypatch.setattr(indexer_hooks, "prepare_capture_id", lambda: seen.append(1))
    builder = env.builder(dbo=False)
    builder.device = torch.device("cpu")
    indexer_hooks.register_builder(builder, device_index=0)
    assert seen == []
    builder = env.builder()
    builder.device = torch.device("cpu")
    indexer_hooks.register_builder(builder, device_index=0)
    assert seen == [1]


def test_an_engine_that_never_microbatches_gets_vllms_build_and_call_site(
    arming: Any, env: Env, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No ``--enable-dbo``: only vLLM's microbatch SM control turns DeepGEMM's count, so the builder, planner and
    call-site hooks step aside (vanilla's schedules, nothing tracked, no re-plan), said once at INFO. A write to
    DeepGEMM's count through vLLM ends that for the process: later builds are tracked, and a schedule built
    meanwhile is checked at the call site against the live count."""
    import logging

    caplog.set_level(logging.INFO, logger="vllm.dbo_runtime")
    builder = env.builder(dbo=False)
    _register(builder)
    assert env.cache.steps_aside and env.cache.stats.builders_stepped_aside >= 1  # vLLM's __init__ hook and this call
    assert sum("never microbatches" in r.getMessage() for r in caplog.records) == 1
    _register(env.builder(dbo=False))  # the drafter's builder, or a second layer group: said once
    assert sum("never microbatches" in r.getMessage() for r in caplog.records) == 1
    metadata = builder.build(0, _common(SEQS))
    decode = metadata.decode
    assert env.cache.state_of(decode.schedule_metadata) is None and not hasattr(decode, "dbo_schedule_state")
    builder.update_draft_decode_metadata(metadata)  # MTP's in-place re-plan: vLLM's own, nothing tracked either
    assert env.cache.state_of(decode.schedule_metadata) is None and env.cache.stats.invalidations == 0
    calls = len(env.dg.plan_calls)
    with monkeypatch.context() as m:  # the call site hands vLLM's call through without asking the cache
        m.setattr(env.cache, "fits", lambda *a: pytest.fail("the call site consulted the cache"))
        m.setattr(env.cache, "resolve", lambda *a: pytest.fail("the call site consulted the cache"))
        env.logits(decode)
    assert len(env.dg.plan_calls) == calls and env.cache.stats.untracked_replans == 0

    alias = importlib.import_module("vllm.v1.worker.ubatch_utils")  # how vLLM's SM control writes the count
    alias.deep_gemm_set_num_sms(112)  # the hook sees the write: it ends stepping aside and arms the call site
    assert not env.cache.steps_aside and arming.armed_by == "vllm.v1.worker.ubatch_utils.deep_gemm_set_num_sms"
    _register(env.builder(dbo=False))  # pinned: another engine without DBO does not step aside again
    assert not env.cache.steps_aside
    _sm_write(112)
    env.logits(decode)  # the untracked schedule is re-planned for the live count, not read as planned
    assert env.cache.stats.untracked_replans == 1
    assert env.cache.state_of(builder.build(0, _common(SEQS)).decode.schedule_metadata) is not None


def test_start_up_runs_and_failed_warm_ups_are_counted_where_they_happen(env: Env, monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's own start-up runs (profile, warm-up, capture) count as ``jit_at_start``; after
    ``compile_or_warm_up_model`` a first launch is ``jit_in_step``, including a variant whose warm-up failed."""
    monkeypatch.setenv("VLLM_DEEP_GEMM_WARMUP", "skip")
    builder = env.builder()
    builder.device = torch.device("cpu")
    builder.vllm_config.parallel_config.enable_dbo = True
    real_plan = env.cache.planner.plan
    monkeypatch.setattr(env.cache.planner, "plan", lambda *a, **k: (_ for _ in ()).throw(torch.OutOfMemoryError("load")))
    _announce_dbo()
    indexer_hooks.register_builder(builder, device_index=0)
    assert env.cache.stats.warm_failures > 0 and env.cache.stats.warmups == 0
    monkeypatch.setattr(env.cache.planner, "plan", real_plan)
    [(rows, width)] = env.cache.warmup._profiles[0][0].shapes[:1]
    lens = torch.ones((rows, width), dtype=torch.int32)
    env.cache.warmup.note_plan(torch.ones((7, 1), dtype=torch.int32), BLOCK, 132, None)
    assert (env.cache.stats.jit_at_start, env.cache.stats.jit_in_step) == (1, 0)
    env.cache.warmup.start_serving()
    env.cache.warmup.note_plan(lens, BLOCK, 112, None)  # its warm-up failed: the step compiles it
    assert env.cache.stats.jit_in_step == 1


def test_a_budget_entered_unannounced_warms_nothing_inside_the_step(env: Env, monkeypatch: pytest.MonkeyPatch) -> None:
    """Entered inside a live step (nobody announced it) while the DP peers wait in all-to-all: no warm-up there;
    the call site compiles the one variant it needs and ``jit_in_step`` counts it."""
    monkeypatch.delenv("VLLM_DEEP_GEMM_WARMUP", raising=False)
    builder = env.builder()
    builder.device = torch.device("cpu")
    builder.vllm_config.parallel_config.enable_dbo = True
    indexer_hooks.register_builder(builder, device_index=0)
    before = env.cache.stats.warmups
    budget = compute_budget(
        total_sms=132, platform="cuda", enable_dbo=True, expert_parallel=True, all2all_backend="deepep_high_throughput"
    )
    control = sm_control_for(0, 132)
    control.exit(control.enter(budget))
    assert env.cache.stats.warmups == before


def test_the_end_of_start_up_says_the_warm_up_cost_once_and_starts_counting_in_step(
    env: Env, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import logging

    monkeypatch.setenv("VLLM_DEEP_GEMM_WARMUP", "skip")
    builder = env.builder()
    builder.device = torch.device("cpu")
    builder.vllm_config.parallel_config.enable_dbo = True
    _announce_dbo()
    indexer_hooks.register_builder(builder, device_index=0)
    with caplog.at_level(logging.INFO, logger="vllm.dbo_runtime"):
        indexer_hooks._start_serving()
        indexer_hooks._start_serving()  # a second compile_or_warm_up_model in the process: said once
    lines = [r.getMessage() for r in caplog.records if "start-up cost" in r.getMessage()]
    assert len(lines) == 1 and f"{env.cache.stats.warmups} paged-MQA planner variants compiled" in lines[0]
    assert env.cache.warmup.serving


def test_deep_gemm_writers_keep_the_call_sites_cached_count_exact(monkeypatch: pytest.MonkeyPatch) -> None:
    """The call site reads DeepGEMM's count once per write (``adapters.deep_gemm.LiveNumSms``): installed, both of
    vLLM 0.33's writers -- the wrapper and the alias its SM control calls -- mark it stale after each write;
    uninstalled, every read asks DeepGEMM again."""
    import vllm.utils.deep_gemm as wrapper
    import vllm.v1.worker.ubatch_utils as uu

    from dbo_runtime.adapters import deep_gemm as adapter

    runtime = {"num_sms": 132, "asked": 0}

    def get() -> int:
        runtime["asked"] += 1
        return runtime["num_sms"]

    def set_num_sms(num_sms: int) -> None:  # DeepGEMM's device runtime, behind vLLM's two bindings
        runtime["num_sms"] = num_sms

    live = adapter.LiveNumSms(lambda: get)
    monkeypatch.setattr(adapter, "LIVE_NUM_SMS", live)
    monkeypatch.setattr(indexer_hooks, "LIVE_NUM_SMS", live)
    monkeypatch.setattr(wrapper, "set_num_sms", set_num_sms)
    monkeypatch.setattr(uu, "deep_gemm_set_num_sms", set_num_sms)
    chosen = [p for p in indexer_hooks.patches() if p.name.startswith("indexer.sm_writes.")]
    assert len(chosen) == 2 and all(p.optional for p in chosen)
    patch_set = PatchSet(chosen)
    patch_set.install()
    try:
        assert live.trusted
        assert [live.read() for _ in range(21)] == [132] * 21 and runtime["asked"] == 1
        uu.deep_gemm_set_num_sms(112)  # SMControl entering a microbatched step (vLLM's or dbo_runtime's)
        assert [live.read() for _ in range(21)] == [112] * 21 and runtime["asked"] == 2
        wrapper.set_num_sms(132)
        assert live.read() == 132 and runtime["asked"] == 3
        monkeypatch.setattr(adapter, "_module", lambda: SimpleNamespace(set_num_sms=set_num_sms))
        adapter.set_num_sms(120)  # dbo_runtime's own knob
        assert live.read() == 120 and runtime["asked"] == 4
        build = indexer_hooks._make_build(lambda self, *a, **k: SimpleNamespace(decode=None))
        build(SimpleNamespace(device=None))  # an indexer metadata build: once per step, the count is read afresh
        assert live.read() == 120 and runtime["asked"] == 5
    finally:
        patch_set.uninstall()
    assert not live.trusted and uu.deep_gemm_set_num_sms is set_num_sms and wrapper.set_num_sms is set_num_sms
    live.read(), live.read()
    assert runtime["asked"] == 7


def test_the_real_planners_hot_probe_is_the_tracker() -> None:
    from dbo_runtime.adapters.deep_gemm import LIVE_NUM_SMS, DeepGemmPlanner

    num_sms, _ = DeepGemmPlanner().hot_probes()
    assert num_sms == LIVE_NUM_SMS.read


def test_vllm_writes_deep_gemms_sm_count_only_through_the_two_watched_bindings() -> None:
    """``LiveNumSms`` trusts its cache while the two writers are watched: a contract with vLLM 0.33.0's source. Every
    file that names ``set_num_sms`` is one of the known ones (DeepEP's count is another knob, DeepGEMM's own binding
    is the vendored package), and only ``ubatch_utils`` binds DeepGEMM's under another name."""
    import pathlib

    import vllm

    root = pathlib.Path(vllm.__file__).parent
    named = {
        str(path.relative_to(root)) for path in root.rglob("*.py") if "set_num_sms" in path.read_text(encoding="utf-8")
    }
    vendored = {name for name in named if name.startswith("third_party/deep_gemm/")}
    assert named - vendored == {
        "utils/deep_gemm.py",  # the wrapper: watched (indexer.sm_writes.deep_gemm)
        "v1/worker/ubatch_utils.py",  # the alias SM control calls: watched (indexer.sm_writes.ubatch_alias)
        "distributed/device_communicators/all2all.py",  # DeepEP's comm count
        "distributed/device_communicators/base_device_communicator.py",  # DeepEP's comm count
    }
    source = (root / "v1/worker/ubatch_utils.py").read_text(encoding="utf-8")
    assert "from vllm.utils.deep_gemm import set_num_sms as deep_gemm_set_num_sms" in source


def test_a_writer_rebound_behind_the_plugin_ends_the_trust(monkeypatch: pytest.MonkeyPatch) -> None:
    import vllm.utils.deep_gemm as wrapper
    import vllm.v1.worker.ubatch_utils as uu

    from dbo_runtime.adapters import deep_gemm as adapter

    asked = []
    live = adapter.LiveNumSms(lambda: lambda: asked.append(1) or 132)
    monkeypatch.setattr(indexer_hooks, "LIVE_NUM_SMS", live)
    monkeypatch.setattr(wrapper, "set_num_sms", lambda n: None)
    monkeypatch.setattr(uu, "deep_gemm_set_num_sms", lambda n: None)
    patch_set = PatchSet([p for p in indexer_hooks.patches() if p.name.startswith("indexer.sm_writes.")])
    patch_set.install()
    try:
        indexer_hooks._refresh_live_count()
        assert live.trusted
        monkeypatch.setattr(uu, "deep_gemm_set_num_sms", lambda n: None)  # someone rebinds the alias
        # the next build sees it, before SM control writes; any build: one without plan-ahead cannot tell a
        # microbatched step from another
        indexer_hooks._refresh_live_count()
        assert not live.trusted
        live.read(), live.read()
        assert len(asked) == 2
    finally:
        patch_set.uninstall()


ALIAS_SCENARIOS = {
    "plugin": ("plugin.register()", "indexer.sm_writes.", "plugin.uninstall()"),
    "wrapper alone": (
        "[wrapper] = [p for p in indexer_hooks.patches() if p.name == 'indexer.sm_writes.deep_gemm']\n"
        "patch_set = PatchSet([wrapper]); patch_set.install()",
        "indexer.sm_writes.deep_gemm",
        "patch_set.uninstall()",
    ),
}
"""Per scenario: install, the mark the alias's hook carries, uninstall (the ``alias_after_uninstall`` fixture)."""


@pytest.fixture(scope="module")
def alias_after_uninstall() -> dict[str, Scenario]:
    """Each scenario in a fresh interpreter (``ubatch_utils`` not imported yet, as in a worker): ``install``, then
    import ``ubatch_utils`` so its ``from`` import binds the alias to the hook marked ``mark...``, then
    ``uninstall``: the alias must be vLLM's own function again. torch and ``vllm.config`` are imported first (neither
    binds the alias), once for both (``tests/forked.py``)."""
    prelude = (
        "import sys\n"
        "import torch, vllm.config\n"
        "from dbo_runtime.integration import indexer_hooks, plugin\n"
        "from dbo_runtime.integration.patching import PATCH_MARK, PatchSet\n"
        "assert 'vllm.v1.worker.ubatch_utils' not in sys.modules and 'vllm.utils.deep_gemm' not in sys.modules\n"
    )
    scenarios = {
        name: (
            f"{install}\n"
            "import vllm.v1.worker.ubatch_utils as uu, vllm.utils.deep_gemm as dg\n"
            f"assert getattr(uu.deep_gemm_set_num_sms, PATCH_MARK, '').startswith({mark!r}), uu.deep_gemm_set_num_sms\n"
            f"{uninstall}\n"
            "assert not hasattr(dg.set_num_sms, PATCH_MARK) and uu.deep_gemm_set_num_sms is dg.set_num_sms\n"
        )
        for name, (install, mark, uninstall) in ALIAS_SCENARIOS.items()
    }
    return run_forked(prelude, scenarios)


def test_uninstall_gives_the_alias_vllms_own_function_in_the_real_import_order(alias_after_uninstall: dict[str, Scenario]) -> None:
    """The alias is bound by ``from`` import when ``ubatch_utils`` executes, after the wrapper was patched: the set
    recorded the plugin's wrapper as the alias's original, and uninstall must still hand back vLLM's function."""
    run = alias_after_uninstall["plugin"]
    assert run.code == 0, run.stderr[-3000:]


def test_uninstalling_the_wrapper_alone_gives_the_alias_vllms_own_function(alias_after_uninstall: dict[str, Scenario]) -> None:
    """The alias patch is optional: where it was skipped, ``ubatch_utils`` imported after the wrapper was patched
    binds the plugin's hook by ``from`` import, and the wrapper's uninstall must hand the alias vLLM's function."""
    run = alias_after_uninstall["wrapper alone"]
    assert run.code == 0, run.stderr[-3000:]


def test_a_call_site_whose_parameters_moved_is_refused_at_install(monkeypatch: pytest.MonkeyPatch) -> None:
    """The call site takes vLLM's parameters one for one: a rebinding with other parameters is a PatchError when
    the set installs (the feature is then not in force and the guard refuses DBO), not a TypeError per call."""
    from dbo_runtime.core.errors import PatchError

    sai = importlib.import_module(SAI)
    monkeypatch.setattr(sai, "fp8_fp4_paged_mqa_logits", lambda q, kv_cache, weights, context_lens, schedule_metadata: None)
    [patch] = [p for p in indexer_hooks.patches() if p.name == "indexer.logits.sparse_attn_indexer"]
    patch_set = PatchSet([patch])
    with pytest.raises(PatchError, match="the target takes"):
        patch_set.install()
    assert not patch_set.installed


def test_no_step_aside_where_a_write_to_deepgemms_count_could_go_unseen(env: Env, monkeypatch: pytest.MonkeyPatch) -> None:
    """Stepping aside is safe only while every vLLM writer of DeepGEMM's count is watched (a write ends it): with
    a writer hook skipped or rebound (``LiveNumSms`` not trusted), an engine without DBO keeps every hook."""
    from dbo_runtime.adapters.deep_gemm import LIVE_NUM_SMS

    monkeypatch.setattr(type(LIVE_NUM_SMS), "trusted", property(lambda self: False))
    builder = env.builder(dbo=False)
    _register(builder)
    assert not env.cache.steps_aside and env.cache.stats.builders_stepped_aside == 0
    assert env.cache.state_of(builder.build(0, _common(SEQS)).decode.schedule_metadata) is not None


def test_a_dbo_builder_whose_registration_fails_still_ends_stepping_aside(env: Env, monkeypatch: pytest.MonkeyPatch) -> None:
    """The builder is noted before anything in ``register_builder`` can fail (vLLM's builder ``__init__`` hook
    swallows the failure): a DBO engine after one without DBO in the same process never has its builds handed
    through untracked."""
    _register(env.builder(dbo=False))
    assert env.cache.steps_aside
    monkeypatch.setattr(indexer_hooks, "dbo_planner_shapes", lambda **k: (_ for _ in ()).throw(RuntimeError("shapes")))
    with pytest.raises(RuntimeError, match="shapes"):
        _register(env.builder())
    assert not env.cache.steps_aside


@pytest.fixture
def unarmed(arming: Any) -> Any:
    return arming


def test_the_call_site_is_vllms_own_until_a_write_to_deepgemms_count(unarmed: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before vLLM first lowers DeepGEMM's count, every schedule was planned for the count in force: the call site is
    vLLM's own function (no frame per indexer layer). A watched write arms it before the count changes."""
    import vllm.utils.deep_gemm as wrapper

    sai = importlib.import_module(SAI)
    vllms = sai.fp8_fp4_paged_mqa_logits
    order: list[str] = []
    monkeypatch.setattr(wrapper, "set_num_sms", lambda n: order.append(f"write {n}, armed={unarmed.armed}"))
    chosen = [p for p in indexer_hooks.patches() if p.name == "indexer.logits.sparse_attn_indexer" or p.name.startswith("indexer.sm_writes.")]
    patch_set = PatchSet(chosen)
    patch_set.install()
    try:
        assert sai.fp8_fp4_paged_mqa_logits is vllms and not unarmed.armed
        wrapper.set_num_sms(112)  # SMControl entering a microbatched step
        assert order == ["write 112, armed=True"] and unarmed.armed_by == "vllm.utils.deep_gemm.set_num_sms"
        assert sai.fp8_fp4_paged_mqa_logits is not vllms
    finally:
        patch_set.uninstall()
    assert sai.fp8_fp4_paged_mqa_logits is vllms


def test_the_call_site_is_armed_by_a_microbatched_build(unarmed: Any) -> None:
    """Plan-ahead leaves a microbatched step's schedule to the call site: a microbatched build arms it first (MRV1
    with ``ubatch_slices``, MRV2's ``prepare``); a build without slices does not."""
    from vllm.v1.worker.gpu.ubatch_utils import UBatchRunner

    def standing_in_for(real: Any) -> Any:  # vLLM's signature, none of its body (it needs a GPU runner)
        @functools.wraps(real)
        def original(self: Any, *args: Any, **kwargs: Any) -> str:
            return "metadata"

        return original

    chosen = [p for p in indexer_hooks.patches() if p.name == "indexer.logits.sparse_attn_indexer"]
    runners: list[tuple[Any, Any, Any, str]] = [
        (indexer_hooks._make_mrv2_prepare, UBatchRunner.prepare,
         lambda hook: hook(object(), "input_batch", (), None), "UBatchRunner.prepare"),
    ]  # fmt: skip
    if has_module(MRV1_RUNNER):
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner

        runners.append(
            (indexer_hooks._make_mrv1_build_attention_metadata, GPUModelRunner._build_attention_metadata,
             lambda hook: hook(object(), 8, 4, 1, ubatch_slices=[slice(0, 4), slice(4, 8)]), "GPUModelRunner._build_attention_metadata"),
        )  # fmt: skip
    for make, real, call, where in runners:
        patch_set = PatchSet(chosen)
        patch_set.install()
        try:
            hook = make(standing_in_for(real))
            if where.startswith("GPUModelRunner"):
                assert hook(object(), 8, 4, 1) == "metadata" and not unarmed.armed  # no slices: not microbatched
            assert call(hook) == "metadata" and unarmed.armed_by == where
        finally:
            patch_set.uninstall()
        assert not unarmed.armed


def test_the_call_site_is_armed_at_once_where_a_write_could_go_unseen(
    env: Env, unarmed: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a writer of DeepGEMM's count not watched (its hook skipped or rebound), nothing would arm the call site
    before a lowered count meets a schedule planned for the full GPU: a builder arms it at registration."""
    from dbo_runtime.adapters.deep_gemm import LIVE_NUM_SMS

    monkeypatch.setattr(type(LIVE_NUM_SMS), "trusted", property(lambda self: False))
    _register(env.builder())
    assert unarmed.armed_by == "an indexer builder while DeepGEMM's SM-count writers are not watched"


def test_the_call_site_keeps_vllms_logits_dtype_and_its_placeholder_follows_it(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where vLLM passes ``logits_dtype`` (0.34: bf16 logits on SM100), the hook hands it to DeepGEMM unchanged and a
    kernel failure on a microbatch thread is answered with placeholder logits in that dtype; without the parameter
    (0.33) the logits are DeepGEMM's fp32 and a ``logits_dtype`` keyword is vLLM's own TypeError."""
    import inspect

    from vllm.utils import deep_gemm as vdg

    from dbo_runtime.integration import ubatch_guard
    from tests.fakes.ubatch_threads import run_microbatches

    takes_dtype = "logits_dtype" in inspect.signature(vdg.fp8_fp4_paged_mqa_logits).parameters
    env.patch_set.status()
    indexer_hooks.ARMING.arm("test")
    decode = env.builder().build(0, _common(SEQS)).decode
    call = functools.partial(
        env.sai.fp8_fp4_paged_mqa_logits,
        (torch.empty(0), None), torch.empty((4, BLOCK, 1, 132), dtype=torch.uint8), torch.empty((6, 8)),
        decode.seq_lens, decode.block_table, decode.schedule_metadata, max_model_len=8, indices=decode.indices,
    )  # fmt: skip
    if not takes_dtype:
        assert call().dtype == torch.float32
        with pytest.raises(TypeError):
            call(logits_dtype=torch.bfloat16)
        return
    assert call(logits_dtype=torch.bfloat16).dtype == torch.bfloat16
    ubatch_guard.reserve_placeholders(torch.device("cpu"), 8, 8)

    def out_of_memory(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("CUDA out of memory")

    monkeypatch.setattr(env.dg, "fp8_fp4_paged_mqa_logits", out_of_memory)
    outs: list[torch.Tensor] = []
    try:
        run_microbatches([lambda u: outs.append(call(logits_dtype=torch.bfloat16))] * 2, [0, 3])
        assert [o.dtype for o in outs] == [torch.bfloat16] * 2
        assert all(tuple(o.shape) == (decode.seq_lens.numel(), 8) for o in outs)
        assert ubatch_guard.FAILURES.take()
    finally:
        ubatch_guard.FAILURES.take()
        ubatch_guard._RESERVED.clear()


def test_a_row_slice_of_the_chunked_decode_is_planned_for_the_live_count(env: Env) -> None:
    """vLLM 0.34's SM100 chunked decode (``_varlen_decode_rows``) re-plans each row slice with its own planner
    binding for ``schedule.shape[0] - 1`` SMs, the count the batch was planned for, then runs the logits kernel on
    it. Under DBO that is the whole GPU while DeepGEMM runs on the compute SMs: the slice is planned for the live
    count, and the call site takes it as it is (no second planner). vLLM 0.33 has no such path or binding."""
    names = {p.name for p in in_release(indexer_hooks.patches())}
    if not hasattr(env.sai, "_varlen_decode_rows"):
        assert not hasattr(env.sai, "get_paged_mqa_logits_metadata") and "indexer.slice_planner" not in names
        return
    assert "indexer.slice_planner" in names
    indexer_hooks.ARMING.arm("test")
    decode = env.builder().build(0, _common(SEQS)).decode  # planned for the whole GPU (not a microbatched build)
    assert tuple(decode.schedule_metadata.shape) == (133, 2)
    _sm_write(112)
    env.dg.num_sms = 112
    start, end = 2, 5
    seq_lens, indices = decode.seq_lens[start:end], decode.indices[start:end] if decode.indices is not None else None
    schedule = env.sai.get_paged_mqa_logits_metadata(
        seq_lens, BLOCK, decode.schedule_metadata.shape[0] - 1, indices=indices
    )  # exactly vLLM's call
    assert tuple(schedule.shape) == (113, 2)
    plans = len(env.dg.plan_calls)
    logits = env.sai.fp8_fp4_paged_mqa_logits(
        (torch.empty(0), None), torch.empty((4, BLOCK, 1, 132), dtype=torch.uint8), torch.empty(0), seq_lens,
        decode.block_table[start:end], schedule, max_model_len=8, indices=indices,
    )  # fmt: skip
    assert float(logits[0, 0]) == 113.0 and len(env.dg.plan_calls) == plans
    assert env.cache.stats.untracked_replans == 0 and env.cache.stats.replans == 0


def test_the_dtype_wrapper_keeps_the_wrapped_functions_own_default_dtype(monkeypatch: pytest.MonkeyPatch) -> None:
    def logits(q, kv_cache, weights, context_lens, block_tables, schedule_metadata, max_model_len,
               logits_dtype=torch.bfloat16, indices=None):  # fmt: skip
        return logits_dtype

    wrapper = indexer_hooks._make_logits(logits)
    assert inspect.signature(wrapper).parameters["logits_dtype"].default is torch.bfloat16
    monkeypatch.setattr(schedule_cache, "_CACHE", SimpleNamespace(steps_aside=True))  # nothing microbatches
    assert wrapper(*[None] * 7) is torch.bfloat16
