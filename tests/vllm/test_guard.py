"""The fail-closed guard against the real vLLM 0.33.0: a DBO model whose fix is not in force does not start.

The configurations are vLLM's own ``ParallelConfig`` / ``VllmConfig`` with the real HF configs of the e2e
models (read by vLLM's ``get_config``). Only ``model_config`` is a stand-in (``ModelAttrs``): vLLM's
``ModelConfig`` resolves the architecture through its model registry, which imports CUDA-only kernels on this
box; the guard reads exactly ``architecture`` and ``hf_text_config`` from it. Another vLLM build is emulated by
editing the source dbo_runtime fingerprints (``tests/fakes/vllm_build.py``), a failed install by a patch that
cannot be prepared, a moved target by a lazy patch whose module never imports.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from dbo_runtime.core.errors import DboRefusal
from dbo_runtime.integration import guard, plugin
from dbo_runtime.integration.patching import Patch, PatchSet
from dbo_runtime.integration.releases import SUPPORTED
from tests.fakes.vllm_build import TOPK_60734_PARTS, UPSTREAM_60734, edited_sources, in_turn, replace_once

MODELS = Path(__file__).resolve().parents[1] / "e2e" / "models"
TOPK_MOVED = {
    "vllm.v1.attention.backends.mla.index_group": replace_once(
        "workspace_rows = self.max_decode_rows", "workspace_rows = self.max_decode_rows + 0"
    )
}
INDEXER_MOVED = {"vllm.v1.attention.backends.mla.indexer": replace_once("self.num_sms = sm_count", "self.num_sms = int(sm_count)")}
WAYS_OUT = ("without --enable-dbo", f"install a vLLM release dbo_runtime verifies ({' or '.join(SUPPORTED)})", "DBO_RUNTIME_DISABLE=1")


@dataclass
class ModelAttrs:
    """The two fields of vLLM's ModelConfig the guard reads (see the module docstring)."""

    architecture: str
    hf_text_config: Any


def hf(name: str, **overrides: Any) -> Any:
    from vllm.transformers_utils.config import get_config

    config = get_config(str(MODELS / name), trust_remote_code=False)
    for key, value in overrides.items():
        setattr(config, key, value)
    return config


def engine_config(
    arch: str, hf_config: Any, *, enable_dbo: bool = True, backend: str = "deepep_high_throughput", dp: int = 2
) -> Any:
    from vllm.config import DeviceConfig, ParallelConfig, VllmConfig

    parallel = ParallelConfig(enable_dbo=enable_dbo, enable_expert_parallel=True, all2all_backend=backend, data_parallel_size=dp)
    config = VllmConfig(device_config=DeviceConfig(device="cpu"), parallel_config=parallel)
    config.model_config = ModelAttrs(arch, hf_config)  # type: ignore[assignment]
    return config


@pytest.fixture()
def cuda_platform(monkeypatch: pytest.MonkeyPatch) -> None:
    """The guard's platform answer (the CPU box has no CUDA; bug A exists only on CUDA with DeepGEMM)."""
    monkeypatch.setattr(guard, "platform", lambda: "cuda")


@pytest.fixture()
def fresh() -> Iterator[None]:
    plugin.uninstall()
    yield
    plugin.uninstall()


def shared() -> Any:
    return engine_config("GlmMoeDsaForCausalLM", hf("shared-topk"))


def leaders_only(**kw: Any) -> Any:
    return engine_config("DeepseekV32ForCausalLM", hf("deepseek-v32"), **kw)


@contextmanager
def lazy_patch_in(patch: Patch, cls: str, listener: Any) -> Iterator[tuple[PatchSet, Any]]:
    """``patch`` installed alone, with ``listener`` told of its lazy failures, and the call that applies it to a
    stand-in module holding an empty class ``cls`` (where it fails); everything is undone on exit."""
    import sys
    import types

    plugin.register()
    ps = PatchSet([patch])
    ps.failure_listeners.append(listener)
    ps.install()
    module = types.ModuleType(patch.module)
    setattr(module, cls, type(cls, (), {}))
    try:
        yield ps, lambda: ps._apply_lazy(module)
    finally:
        ps.uninstall()
        sys.modules.pop(patch.module, None)


def refusal(config: Any, stage: guard.Stage = "config") -> str:
    with pytest.raises(DboRefusal) as err:
        guard.check(config, stage)
    message = str(err.value)
    assert "\n" not in message
    return message


V4_RUNS_DBO = {"vllm.models.deepseek_v4.nvidia.ops.sparse_attn_compress_cutedsl": lambda t: t.replace("divisibility=8)", "divisibility=1)")}
"""A build whose DeepSeek-V4 compressor takes unaligned microbatch views (vLLM's own crash fixed), so V4 runs DBO."""


V32_MODULES = (
    "vllm.v1.attention.backends.mla.index_group",
    "vllm.model_executor.layers.attention.sparse_mla_attention",
    "vllm.models.deepseek_v32.attention",
    "vllm.model_executor.layers.sparse_attn_indexer",
    "vllm.models.deepseek_v32.nvidia.model",
    "vllm.v1.attention.backends.mla.indexer",
    "vllm.v1.worker.gpu_ubatch_wrapper",
    "vllm.v1.worker.gpu.ubatch_utils",
)
"""What a worker has imported once a DeepSeek-V3.2 / GLM-5.x model is built and its KV cache initialised."""


def test_the_verified_build_starts_every_dbo_configuration(fresh: None, cuda_platform: None) -> None:
    import importlib
    import importlib.util

    plugin.register()
    for config in (shared(), leaders_only(), leaders_only(backend="deepep_low_latency")):
        guard.check(config, "config")
    for name in V32_MODULES:
        if importlib.util.find_spec(name) is not None:  # the V1 runner's module exists only where V1 does
            importlib.import_module(name)
    for config in (shared(), leaders_only(), leaders_only(backend="deepep_low_latency")):
        guard.check(config, "worker")  # every patch the model needs applied when its module was imported


@pytest.mark.parametrize("dp", [1, 2])
def test_an_unverified_build_refuses_a_shared_topk_model_at_any_dp(fresh: None, cuda_platform: None, dp: int) -> None:
    with edited_sources(TOPK_MOVED):
        plugin.register()
    config = engine_config("GlmMoeDsaForCausalLM", hf("shared-topk"), dp=dp)
    message = refusal(config)
    assert message.startswith("dbo_runtime refuses GlmMoeDsaForCausalLM with --enable-dbo: layers 2, 4 reuse")
    assert "per-microbatch top-k for shared index groups (vllm#60734) is unverified (code differs from vLLM " in message
    assert "silently wrong tokens" in message and all(way in message for way in WAYS_OUT)
    guard.check(leaders_only(), "config")  # every layer runs its own indexer: bug B cannot happen
    guard.check(engine_config("GlmMoeDsaForCausalLM", hf("shared-topk"), enable_dbo=False), "config")


def test_a_failed_install_refuses_what_needs_any_fix(fresh: None, cuda_platform: None, monkeypatch: pytest.MonkeyPatch) -> None:
    real = plugin.all_patches
    broken = Patch(
        name="sm_control.broken", module="vllm.v1.worker.ubatch_utils", attr="SMControlContextManager.no_such_method",
        make=lambda o: o, reason="t", upstream_pr="-", removal="-", anchors=(),
    )  # fmt: skip
    monkeypatch.setattr(plugin, "all_patches", lambda: [*real(), broken])
    plugin.register()
    assert plugin.installed_patch_set() is None
    assert "not installed (install failed" in refusal(shared())
    indexer = refusal(leaders_only())  # DeepEP HT partitions DeepGEMM's SMs: the schedule fix is needed
    assert "DeepGEMM would assert '_schedule_meta_size == num_sms + 1' in the middle of serving" in indexer
    assert "VLLM_DBO_COMM_SMS=0" in indexer
    guard.check(leaders_only(backend="deepep_low_latency"), "config")  # LL reserves no comm SM: nothing to fix


def test_an_unverified_indexer_is_refused_only_where_deepgemm_is_partitioned(
    fresh: None, cuda_platform: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    with edited_sources(INDEXER_MOVED):
        plugin.register()
    assert "indexer schedule fix (vllm#60732) is unverified" in refusal(leaders_only())
    guard.check(leaders_only(backend="deepep_low_latency"), "config")
    monkeypatch.setenv("VLLM_DBO_COMM_SMS", "0")
    guard.check(leaders_only(), "config")


def test_a_moved_target_that_never_applies_is_refused_in_the_worker(fresh: None, cuda_platform: None) -> None:
    """A needed lazy patch still pending after the model loaded (vLLM reads the state elsewhere now)."""
    plugin.register()
    stuck = Patch(
        name="topk.moved_reader", module="dbo_module_vllm_no_longer_imports", attr="reader",
        make=lambda o: o, reason="t", upstream_pr="-", removal="-", lazy=True, anchors=(),
    )  # fmt: skip
    ps = PatchSet([stuck])
    ps.install()
    try:
        guard.bind_patch_set(ps)
        guard.check(shared(), "config")  # in the front-end a pending lazy patch is normal
        message = refusal(shared(), "worker")
        assert "incomplete: topk.moved_reader pending" in message
        assert guard.pending_required() == ["topk.moved_reader"]
    finally:
        ps.uninstall()
        guard.bind_patch_set(plugin.installed_patch_set())


def test_a_lazy_failure_marks_the_feature_broken(fresh: None, cuda_platform: None) -> None:
    plugin.register()
    patch_set = plugin.installed_patch_set()
    assert patch_set is not None
    [listener] = patch_set.failure_listeners
    listener([p for p in patch_set.patches if p.name == "topk.group_convert_once"], "dbo_runtime: patches for ... cannot be applied")
    assert "is broken (dbo_runtime: patches for" in refusal(shared(), "worker")


def test_an_upstream_fix_is_left_to_vllm_and_not_refused(fresh: None, cuda_platform: None) -> None:
    with edited_sources(UPSTREAM_60734):
        plugin.register()
    patch_set = plugin.installed_patch_set()
    assert patch_set is not None and not [p for p in patch_set.patches if p.feature in ("topk", "topk_v41")]
    assert plugin.REGISTRY.get("topk").verdict == "provided by vLLM"  # type: ignore[union-attr]
    guard.check(shared(), "config")
    guard.check(shared(), "worker")


@pytest.mark.parametrize(
    "edit",
    [
        pytest.param(replace_once("    def _convert_once(", "    # num_ubatches, _topk_state: see vllm#60734\n    def _convert_once("), id="comment"),
        pytest.param(TOPK_60734_PARTS[1], id="helper-without-consumer"),
        pytest.param(in_turn(TOPK_60734_PARTS[0], TOPK_60734_PARTS[2]), id="consumer-without-helper"),
    ],
)
def test_half_an_upstream_fix_or_a_mention_is_not_taken_for_the_fix(fresh: None, cuda_platform: None, edit: Any) -> None:
    """A comment, a helper nobody calls or a call to nothing never switches dbo_runtime's fix off: the feature
    is then unverified (the edit touched fingerprinted code) or verified, and never "provided by vLLM"."""
    with edited_sources({"vllm.v1.attention.backends.mla.index_group": edit}):
        plugin.register()
        verdict = plugin.REGISTRY.get("topk").verdict  # type: ignore[union-attr]
    assert verdict != "provided by vLLM"
    if verdict != "verified":
        assert "refuses" in refusal(shared())


def test_disable_removes_the_guard_too(fresh: None, cuda_platform: None, monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.engine.arg_utils import EngineArgs

    original = EngineArgs.create_engine_config
    monkeypatch.setenv("DBO_RUNTIME_DISABLE", "1")
    plugin.register()
    assert EngineArgs.create_engine_config is original
    monkeypatch.setenv("DBO_RUNTIME_DISABLE", "ture")  # a typo keeps the protection
    plugin.register()
    assert EngineArgs.create_engine_config is not original


def test_the_front_end_refuses_through_create_engine_config(fresh: None, cuda_platform: None) -> None:
    """The guard's patch on vLLM's config factory runs the check on the config vLLM just built."""
    with edited_sources(TOPK_MOVED):
        plugin.register()
    from vllm.engine.arg_utils import EngineArgs

    made = shared()
    factory = guard._after(lambda self: made, "config", lambda self, result: result)
    with pytest.raises(DboRefusal, match="refuses GlmMoeDsaForCausalLM with --enable-dbo"):
        factory(object())
    assert getattr(EngineArgs.create_engine_config, "__dbo_runtime_patch__", None) == "guard.engine_config"


@pytest.mark.parametrize(
    ("arch", "config", "reason"),
    [
        ("HYV4ForCausalLM", {"indexer_types": ["full", "shared", "full", "shared"], "num_hidden_layers": 4},
         "HY V4 builds its sparse MLA layers without a shared index-group builder"),
        ("Dots3NoteForCausalLM", {"index_topk_freq": 2, "num_hidden_layers": 6},
         "Dots3 Note keeps its top-k buffer in a local of the model constructor"),
        ("DeepseekV3ForCausalLM", {"index_topk": 2048, "index_topk_freq": 2, "num_hidden_layers": 6},
         "the generic torch.compiled DeepseekV2 path"),
        ("SomeFutureDsaForCausalLM", {"index_topk": 2048, "index_topk_freq": 2, "num_hidden_layers": 6},
         "dbo_runtime does not know how this architecture hands top-k between layers"),
    ],
)  # fmt: skip
def test_architectures_that_are_not_wired_are_refused_with_the_real_reason(
    fresh: None, cuda_platform: None, arch: str, config: dict[str, Any], reason: str
) -> None:
    plugin.register()
    message = refusal(engine_config(arch, dict(config)))
    assert message.startswith(f"dbo_runtime refuses {arch} with --enable-dbo: ") and reason in message
    assert "without --enable-dbo" in message and "DBO_RUNTIME_DISABLE=1" in message
    assert "install a vLLM build" not in message  # another build would not help
    flat = dict(config, index_topk_freq=1, indexer_types=["full"] * 4)
    guard.check(engine_config(arch, flat), "config")  # the same architecture without sharing starts


def test_deepseek_v41_on_rocm_is_refused(fresh: None, monkeypatch: pytest.MonkeyPatch) -> None:
    plugin.register()
    monkeypatch.setattr(guard, "platform", lambda: "rocm")
    v41 = {"num_hidden_layers": 4, "compress_ratios": [0, 1, 1, 0], "index_source_layer_ids": [1]}
    message = refusal(engine_config("DeepseekV41ForCausalLM", v41))
    assert "on ROCm" in message and "per-source packed top-k cache" in message
    monkeypatch.setattr(guard, "platform", lambda: "cuda")
    from importlib import metadata

    from dbo_runtime.integration.fingerprints import EXCLUDED, RELEASES

    record = RELEASES[metadata.version("vllm")]
    if any(v == EXCLUDED for n, v in record.items() if n.startswith("topk_v41.")):
        # a release that leaves V4.1's fix out (vLLM itself refuses DBO for it there): refused whatever vLLM allows
        message = refusal(engine_config("DeepseekV41ForCausalLM", v41))
        assert "is not in release" in message and "topk_v41" not in message.split("Ways out")[1], message
    else:
        guard.check(engine_config("DeepseekV41ForCausalLM", v41), "config")  # fixed on CUDA


def test_ubatch_size_microbatches_like_dbo_and_is_guarded_alike(fresh: None, cuda_platform: None) -> None:
    """vLLM microbatches on ``enable_dbo or ubatch_size > 1`` (``ParallelConfig.use_ubatching``): the same threads,
    the same shared top-k state, the same SM split."""
    from vllm.config import ParallelConfig

    with edited_sources(TOPK_MOVED):
        plugin.register()
    config = engine_config("GlmMoeDsaForCausalLM", hf("shared-topk"), enable_dbo=False)
    config.parallel_config = ParallelConfig(
        ubatch_size=2, enable_expert_parallel=True, all2all_backend="deepep_high_throughput", data_parallel_size=2
    )
    assert config.parallel_config.use_ubatching and not config.parallel_config.enable_dbo
    message = refusal(config)
    assert message.startswith("dbo_runtime refuses GlmMoeDsaForCausalLM with --ubatch-size:")
    assert "without --enable-dbo or --ubatch-size" in message


def _runner_patch(name: str, runner: str) -> Patch:
    return Patch(
        name=name, module=f"dbo_module_only_{runner}_imports", attr="f", make=lambda o: o, reason="t",
        upstream_pr="-", removal="-", lazy=True, anchors=(), runner=runner,
    )  # fmt: skip


def test_a_worker_waits_only_for_the_patches_of_the_runner_it_runs(fresh: None, cuda_platform: None) -> None:
    """An MRV2 worker never imports ``gpu_model_runner`` (``Worker._make_model_runner``): the MRV1 patches stay
    pending there and must not refuse the model; an MRV1 worker likewise for MRV2's."""
    plugin.register()
    ps = PatchSet([_runner_patch("ubatch_guard.mrv1_only", "mrv1")])
    ps.install()
    try:
        guard.bind_patch_set(ps)
        guard.check(shared(), "worker", "mrv2")  # an MRV2 worker: the MRV1 module never imports there
        assert guard.pending_required("mrv2") == []
        with pytest.raises(DboRefusal, match=r"ubatch_guard\.mrv1_only pending"):
            guard.check(shared(), "worker", "mrv1")
        assert "ubatch_guard.mrv1_only pending" in refusal(shared(), "worker")  # runner unknown: every patch counts
    finally:
        ps.uninstall()
        guard.bind_patch_set(plugin.installed_patch_set())


def test_the_runner_is_read_from_the_worker() -> None:
    from types import SimpleNamespace

    assert guard.runner_of(SimpleNamespace(use_v2_model_runner=True)) == "mrv2"
    assert guard.runner_of(SimpleNamespace(use_v2_model_runner=False)) == "mrv1"
    # A worker without the attribute: unknown where the build still has the V1 runner, V2 where it has none
    import importlib.util

    has_v1 = importlib.util.find_spec(guard.V1_RUNNER_MODULE) is not None
    assert guard.runner_of(object()) == (None if has_v1 else "mrv2")
    with pytest.raises(Exception, match=r"Patch\.runner must be one of"):
        _runner_patch("x.y", "mrv3")


def test_the_real_runner_patches_are_tagged() -> None:
    runners = {p.name: p.runner for p in plugin.all_patches() if p.runner}
    assert runners == {
        "ubatch_guard.mrv1_run": "mrv1",
        "ubatch_guard.mrv1_capture": "mrv1",
        "ubatch_guard.mrv2_finish": "mrv2",
        "sm_control.mrv1": "mrv1",
        "sm_control.mrv2": "mrv2",
        "indexer.plan_ahead.mrv1": "mrv1",
        "indexer.plan_ahead.mrv2": "mrv2",
    }
    for p in plugin.all_patches():  # every patch on a runner-only module is tagged
        if p.module in ("vllm.v1.worker.gpu_model_runner", "vllm.v1.worker.gpu_ubatch_wrapper"):
            assert p.runner == "mrv1", p.name
        if p.module == "vllm.v1.worker.gpu.ubatch_utils":
            assert p.runner == "mrv2", p.name


def test_a_broken_dependency_takes_its_dependents_out_of_force(
    fresh: None, cuda_platform: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The microbatch-thread guard broke: the top-k and schedule fixes still install, but their hooks would hand
    vLLM placeholders that nothing raises after the join. They are not in force."""
    plugin.register()
    plugin.REGISTRY.mark("ubatch_guard", "broken", "dbo_runtime: patches for ... moved")
    message = refusal(shared(), "worker")
    assert "microbatch-thread failure guard, which the per-microbatch top-k" in message and "is broken" in message
    monkeypatch.setattr(guard, "_deep_gemm_present", lambda stage: True)  # a GPU worker with DeepGEMM
    assert "microbatch-thread failure guard" in refusal(leaders_only(), "worker")  # the indexer fix needs it too


def test_a_runner_only_patch_that_breaks_refuses_only_that_runners_workers(fresh: None, cuda_platform: None) -> None:
    """Both runners' workers import both microbatch modules (``Worker.__init__`` imports ``elastic_execute``), so an
    MRV1-only patch can break in an MRV2 worker: it must refuse MRV1 workers only, not take the feature down."""
    join = Patch(
        name="ubatch_guard.test_join", module="dbo_guard_test_mrv1_module", attr="UBatchWrapper._run_ubatches",
        make=lambda o: o, reason="t", upstream_pr="-", removal="-", lazy=True, anchors=(), runner="mrv1",
    )  # fmt: skip
    with lazy_patch_in(join, "UBatchWrapper", plugin._on_lazy_failure) as (ps, apply):
        try:
            apply()
            guard.bind_patch_set(ps)
            assert plugin.REGISTRY.get("ubatch_guard").in_force  # type: ignore[union-attr]
            guard.check(shared(), "worker", "mrv2")
            with pytest.raises(DboRefusal, match=r"ubatch_guard\.test_join broken"):
                guard.check(shared(), "worker", "mrv1")
        finally:
            guard.bind_patch_set(plugin.installed_patch_set())


def test_deepseek_v41_needs_the_shared_topk_patch_tagged_for_it(fresh: None, cuda_platform: None) -> None:
    """V4.1's fix also relies on ``topk.SparseAttnIndexer.topk_indices_buffer`` (feature ``topk``, tagged V4.1)."""
    plugin.register()
    stuck = Patch(
        name="topk.SparseAttnIndexer.moved", module="dbo_module_vllm_no_longer_imports", attr="x", make=lambda o: o,
        reason="t", upstream_pr="-", removal="-", lazy=True, anchors=(), architectures=("DeepseekV41ForCausalLM",),
    )  # fmt: skip
    ps = PatchSet([stuck])
    ps.install()
    try:
        guard.bind_patch_set(ps)
        v41 = engine_config("DeepseekV41ForCausalLM", hf("deepseek-v41"))
        v41_in_release = plugin.REGISTRY.get("topk_v41").applies  # type: ignore[union-attr]
        # where the release leaves V4.1's own fix out, that refusal comes first
        assert ("topk.SparseAttnIndexer.moved pending" if v41_in_release else "is not in release") in refusal(v41, "worker")
        guard.check(shared(), "worker")  # tagged for V4.1 only
    finally:
        ps.uninstall()
        guard.bind_patch_set(plugin.installed_patch_set())


def test_a_build_without_the_worker_hooks_refuses_dsa_microbatching_up_front(fresh: None, cuda_platform: None) -> None:
    """Where the guard cannot wrap ``Worker.load_model`` (nor the base class it could inherit it from) no worker
    could check its fixes: the front-end refuses a model that needs one, and leaves every other model alone."""
    from types import SimpleNamespace

    moved = {
        "vllm.v1.worker.gpu_worker": replace_once("    def load_model(self", "    def load_weights_and_model(self"),
        "vllm.v1.worker.worker_base": replace_once("    def load_model(self", "    def load_weights_and_model(self"),
    }
    plugin.register()
    with edited_sources(moved):
        message = refusal(leaders_only())
        assert "this vLLM build has no Worker.load_model, where dbo_runtime checks in every worker" in message
        guard.check(leaders_only(enable_dbo=False), "config")  # nothing microbatches: nothing to guard
        moe = SimpleNamespace(num_hidden_layers=4, architectures=["Qwen3MoeForCausalLM"])
        guard.check(engine_config("Qwen3MoeForCausalLM", moe), "config")  # no DSA fix needed: not refused
    only_worker = {"vllm.v1.worker.gpu_worker": moved["vllm.v1.worker.gpu_worker"]}
    with edited_sources(only_worker):
        guard.check(leaders_only(), "config")  # inherited from WorkerBase: still wrapped


class NotVllmsWorker:
    """A ``--worker-cls`` that does not derive from vLLM's GPU worker."""


def test_a_worker_class_that_never_runs_the_check_is_refused(fresh: None, cuda_platform: None) -> None:
    from vllm.v1.worker.gpu_worker import Worker

    plugin.register()
    config = leaders_only()
    config.parallel_config.worker_cls = f"{__name__}.NotVllmsWorker"
    assert "is not a subclass of it, and only vllm.v1.worker.gpu_worker.Worker runs" in refusal(config)
    config.parallel_config.worker_cls = "no_such_module.Worker"
    assert "could not be imported here" in refusal(config)
    globals()["VllmsWorkerSubclass"] = type("VllmsWorkerSubclass", (Worker,), {})
    config.parallel_config.worker_cls = f"{__name__}.VllmsWorkerSubclass"
    guard.check(config, "config")
    # a subclass whose load_model may never call Worker's: the check that runs there may never run
    globals()["OverridingWorker"] = type("OverridingWorker", (Worker,), {"load_model": lambda self, **kw: None})
    config.parallel_config.worker_cls = f"{__name__}.OverridingWorker"
    assert "overrides Worker.load_model, where the check runs" in refusal(config)


def test_a_guard_hook_that_fails_in_a_worker_takes_every_fix_out_of_force(fresh: None, caplog: pytest.LogCaptureFixture) -> None:
    """Lazy failures never kill the import of vLLM's worker module (a worker without DBO needs no fix): the
    worker logs one error naming the way out, and every fix reads as not in force there."""
    import logging

    hook = Patch(
        name="guard.test", module="dbo_guard_test_worker_module", attr="Worker.load_model", make=lambda o: o,
        reason="t", upstream_pr="-", removal="-", lazy=True, anchors=(),
    )  # fmt: skip
    with lazy_patch_in(hook, "Worker", guard.on_guard_failure) as (_, apply):
        with caplog.at_level(logging.ERROR, logger="vllm.dbo_runtime"):
            apply()  # no raise
        assert all(state.verdict == "broken" for state in plugin.REGISTRY.all().values())
        assert any("DBO_RUNTIME_DISABLE=1" in r.getMessage() for r in caplog.records)


def test_without_its_worker_hooks_the_guard_refuses_where_dbo_builds_its_sm_control(fresh: None, cuda_platform: None) -> None:
    """The second veto: ``create_sm_control_context`` (patched, every DBO worker, model load) refuses a DSA model
    once the guard's worker hooks failed in the process, and lets a model that needs no fix through."""
    from types import SimpleNamespace

    from vllm.config import set_current_vllm_config

    from dbo_runtime.core.errors import DboRefusal
    from dbo_runtime.integration import sm_hooks

    plugin.register()
    guard.check_without_worker_hooks()  # hooks in place: nothing to do
    guard.on_guard_failure([], "the guard's hook guard.worker_load_model failed to apply")
    with set_current_vllm_config(leaders_only()), pytest.raises(DboRefusal) as refused:
        sm_hooks.create_sm_control_context(leaders_only().parallel_config)
    assert "guard.worker_load_model failed to apply, so this worker cannot check" in str(refused.value)
    assert "DBO_RUNTIME_DISABLE=1" in str(refused.value)
    moe = SimpleNamespace(num_hidden_layers=4, architectures=["Qwen3MoeForCausalLM"])
    with set_current_vllm_config(engine_config("Qwen3MoeForCausalLM", moe)):
        guard.check_without_worker_hooks()  # no DSA fix needed: not refused
    guard.reset()
    guard.check_without_worker_hooks()


def test_placeholders_that_could_not_be_reserved_refuse_dbo_before_warm_up(
    fresh: None, cuda_platform: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without the reserved placeholder logits an out-of-memory error on a microbatch thread can hang the step:
    the worker check (before vLLM's warm-up) refuses a DSA model under DBO instead."""
    import torch

    from dbo_runtime.core.errors import DboRefusal
    from dbo_runtime.integration import ubatch_guard

    plugin.register()
    monkeypatch.setattr(ubatch_guard, "_RESERVED", {})

    def no_memory(*args: object, **kwargs: object) -> object:
        raise torch.OutOfMemoryError("injected")

    monkeypatch.setattr(torch, "zeros", no_memory)
    ubatch_guard.reserve_placeholders(torch.device("cpu"), 4096, 8)
    with pytest.raises(DboRefusal, match="placeholder logits could not be reserved at model load"):
        guard.check(shared(), "worker", "mrv1")
    config = shared()
    config.parallel_config.enable_dbo = False
    guard.check(config, "worker", "mrv1")  # no microbatch thread: nothing to hang


def test_a_bad_plugin_setting_is_refused_before_any_worker_for_a_dbo_dsa_model(
    fresh: None, cuda_platform: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The top-k layout is read at model load in every worker: a typo there would stop the server mid-start."""
    from types import SimpleNamespace

    from dbo_runtime.core.errors import ConfigError

    plugin.register()
    monkeypatch.setenv("DBO_RUNTIME_TOPK_LAYOUT", "windowz")
    with pytest.raises(ConfigError, match=r"DBO_RUNTIME_TOPK_LAYOUT='windowz' is not allowed; allowed values: 'windows', 'copies'"):
        guard.check(leaders_only(), "config")
    guard.check(leaders_only(enable_dbo=False), "config")  # nothing microbatches: the setting is never read
    moe = SimpleNamespace(num_hidden_layers=4, architectures=["Qwen3MoeForCausalLM"])
    guard.check(engine_config("Qwen3MoeForCausalLM", moe), "config")  # no DSA model: never read either


def test_speculative_decoding_without_the_mtp_fix_is_warned(
    fresh: None, cuda_platform: None, caplog: pytest.LogCaptureFixture
) -> None:
    """Tokens stay right without the MTP hidden-buffer fix (the verifier checks every draft); acceptance drops."""
    import logging

    plugin.register()
    plugin.REGISTRY.mark("mtp_hidden", "broken", "moved")
    config = engine_config("DeepseekV4ForCausalLM", hf("deepseek-v4"))
    config.speculative_config = object()  # type: ignore[assignment]
    guard.reset()
    with caplog.at_level(logging.WARNING, logger="vllm.dbo_runtime"), edited_sources(V4_RUNS_DBO):
        guard.check(config, "worker", "mrv1")
    assert any("draft acceptance drops" in r.getMessage() for r in caplog.records)


def test_on_rocm_the_mtp_warning_follows_the_rocm_model_vllm_runs(
    fresh: None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """On ROCm vLLM imports its AMD model, never the NVIDIA one the MTP patches target, so they stay pending. The AMD
    V4 model writes at the microbatch's token offset itself: no gap, no warning. The AMD V4.1 model writes from row 0
    like the NVIDIA one, so the gap would stand (V4.1 under DBO is refused on ROCm before this point, for its
    packed top-k cache)."""
    import logging

    from dbo_runtime.core import coverage
    from dbo_runtime.integration.features import Probe

    # the coverage fact, read from the installed release's AMD model sources
    rocm_models = {
        "DeepseekV4ForCausalLM": "vllm.models.deepseek_v4.amd.model",
        "DeepseekV4ForConditionalGeneration": "vllm.models.deepseek_v4.amd.model",
        "DeepseekV41ForCausalLM": "vllm.models.deepseek_v41.amd.model",
    }
    probe = "DeepseekV4Model.forward", "dbo_current_ubatch_token_offset"
    writes = {arch for arch, module in rocm_models.items() if Probe("call", module, *probe).present()}
    assert writes == coverage.ROCM_MTP_WRITES_AT_OFFSET
    plugin.register()
    plugin.REGISTRY.mark("mtp_hidden", "broken", "its NVIDIA module never imported")
    config = engine_config("DeepseekV4ForCausalLM", hf("deepseek-v4"))
    config.speculative_config = object()  # type: ignore[assignment]
    for platform, warned in (("rocm", False), ("cuda", True)):
        monkeypatch.setattr(guard, "platform", lambda platform=platform: platform)
        guard.reset()
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="vllm.dbo_runtime"), edited_sources(V4_RUNS_DBO):
            guard.check(config, "worker", "mrv1")
        assert any("draft acceptance drops" in r.getMessage() for r in caplog.records) is warned, platform


def test_the_warm_up_check_runs_before_vllms_warm_up_and_tells_listeners_after(fresh: None, cuda_platform: None) -> None:
    from types import SimpleNamespace

    order: list[str] = []
    wrapped = guard._around_warm_up(lambda self: order.append("vllm warm-up"))
    guard.after_warm_up(lambda: order.append("listener"))
    guard.after_warm_up(lambda: (_ for _ in ()).throw(RuntimeError("a broken listener")))
    try:
        plugin.register()
        wrapped(SimpleNamespace(vllm_config=leaders_only(enable_dbo=False), use_v2_model_runner=False))
        assert order == ["vllm warm-up", "listener"]  # a failing listener never stops engine start
        with pytest.raises(DboRefusal):  # refused before vLLM's warm-up runs
            with edited_sources(TOPK_MOVED):
                plugin.uninstall()
                plugin.register()
            wrapped(SimpleNamespace(vllm_config=shared(), use_v2_model_runner=False))
        assert order == ["vllm warm-up", "listener"]
    finally:
        guard._warmed_up.clear()


def test_vllms_own_deepseek_v4_crash_under_dp_microbatching_is_refused_in_one_line(
    fresh: None, cuda_platform: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM's CuTe DSL compressor assumes aligned per-token inputs; each microbatch gets a view at its first token.
    Refused only where vLLM splits steps (DP peers), on CUDA, and while the build still assumes alignment."""
    from dbo_runtime.integration import upstream_crashes

    assert upstream_crashes.aligned_compressor_inputs() == ("kv_slot_mapping", "positions", "slot_mapping")
    plugin.register()
    message = refusal(engine_config("DeepseekV4ForCausalLM", hf("deepseek-v4")))
    assert message.startswith("dbo_runtime refuses DeepseekV4ForCausalLM with --enable-dbo: vLLM's DeepSeek-V4")
    assert "DeepGEMM" not in message  # the crash comes first: no verified release lifts it
    assert "Misaligned Tensor data" in message and "without --enable-dbo" in message and "unaligned views" in message
    for config in (
        engine_config("DeepseekV4ForCausalLM", hf("deepseek-v4"), dp=1),  # vLLM never splits a step at DP 1
        engine_config("DeepseekV4ForCausalLM", hf("deepseek-v4"), enable_dbo=False),
    ):
        guard.check(config, "config")
    monkeypatch.setattr(guard, "platform", lambda: "rocm")
    guard.check(engine_config("DeepseekV4ForCausalLM", hf("deepseek-v4")), "config")


def test_a_build_whose_compressor_takes_unaligned_views_starts_deepseek_v4(fresh: None, cuda_platform: None) -> None:
    from dbo_runtime.integration import upstream_crashes

    assert set(V4_RUNS_DBO) == {upstream_crashes.COMPRESSOR_MODULE}
    with edited_sources(V4_RUNS_DBO):
        assert upstream_crashes.aligned_compressor_inputs() == ()
        plugin.register()
        guard.check(engine_config("DeepseekV4ForCausalLM", hf("deepseek-v4")), "config")
    with edited_sources({upstream_crashes.COMPRESSOR_MODULE: lambda text: text + "\n)"}):  # unreadable: vLLM's crash is loud
        assert upstream_crashes.aligned_compressor_inputs() == ()
