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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from dbo_runtime.core.errors import DboRefusal
from dbo_runtime.integration import guard, plugin
from dbo_runtime.integration.patching import Patch, PatchSet
from tests.fakes.vllm_build import edited_sources, replace_once

MODELS = Path(__file__).resolve().parents[1] / "e2e" / "models"
TOPK_MOVED = {
    "vllm.v1.attention.backends.mla.index_group": replace_once(
        "workspace_rows = self.max_decode_rows", "workspace_rows = self.max_decode_rows + 0"
    )
}
INDEXER_MOVED = {"vllm.v1.attention.backends.mla.indexer": replace_once("self.num_sms = sm_count", "self.num_sms = int(sm_count)")}
WAYS_OUT = ("without --enable-dbo", "install a vLLM build dbo_runtime verifies", "DBO_RUNTIME_DISABLE=1")


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
    monkeypatch.setattr(guard, "_platform", lambda: "cuda")


@pytest.fixture()
def fresh() -> Iterator[None]:
    plugin.uninstall()
    yield
    plugin.uninstall()


def shared() -> Any:
    return engine_config("GlmMoeDsaForCausalLM", hf("shared-topk"))


def leaders_only(**kw: Any) -> Any:
    return engine_config("DeepseekV32ForCausalLM", hf("deepseek-v32"), **kw)


def refusal(config: Any, stage: guard.Stage = "config") -> str:
    with pytest.raises(DboRefusal) as err:
        guard.check(config, stage)
    message = str(err.value)
    assert "\n" not in message
    return message


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

    plugin.register()
    for config in (shared(), leaders_only(), leaders_only(backend="deepep_low_latency")):
        guard.check(config, "config")
    for name in V32_MODULES:
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
    assert "per-microbatch top-k for shared index groups (vllm#60734) is unverified (code differs from vLLM 0.33.0" in message
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
    upstream = {
        "vllm.v1.attention.backends.mla.index_group": replace_once("    def _convert_once(", "    def _topk_state(self):\n        return self\n\n    def _convert_once(")
    }
    with edited_sources(upstream):
        plugin.register()
    patch_set = plugin.installed_patch_set()
    assert patch_set is not None and not [p for p in patch_set.patches if p.feature in ("topk", "topk_v41")]
    guard.check(shared(), "config")
    guard.check(shared(), "worker")


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
    monkeypatch.setattr(guard, "_platform", lambda: "rocm")
    v41 = {"num_hidden_layers": 4, "compress_ratios": [0, 1, 1, 0], "index_source_layer_ids": [1]}
    message = refusal(engine_config("DeepseekV41ForCausalLM", v41))
    assert "on ROCm" in message and "per-source packed top-k cache" in message
    monkeypatch.setattr(guard, "_platform", lambda: "cuda")
    guard.check(engine_config("DeepseekV41ForCausalLM", v41), "config")  # fixed on CUDA
