"""The plugin inside the real vLLM (each supported release): entry point, idempotence, trust by fingerprint, transaction."""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Iterator
from typing import Any

import pytest
import vllm.v1.worker.gpu.ubatch_utils  # noqa: F401  (imported so its patches apply at install)

from dbo_runtime.core.errors import PatchError
from dbo_runtime.integration import plugin
from dbo_runtime.integration.patching import Patch, resolve_owner

HAS_V1_RUNNER = importlib.util.find_spec("vllm.v1.worker.gpu_ubatch_wrapper") is not None
"""Model Runner V1 exists in this release (0.33.0 has both runners, 0.34.0 only V2)."""
if HAS_V1_RUNNER:
    importlib.import_module("vllm.v1.worker.gpu_ubatch_wrapper")


def targets() -> dict[str, Any]:
    """Every patch target's current object (the guard's too), resolved freshly (identity is what counts)."""
    from dbo_runtime.integration.guard import guard_patches

    out = {}
    for patch in [*plugin.all_patches(), *guard_patches()]:
        module = importlib.import_module(patch.module) if not patch.lazy else importlib.sys.modules.get(patch.module)  # type: ignore[attr-defined]
        if module is None:
            continue
        try:
            out[patch.name] = getattr(*resolve_owner(module, patch.attr))
        except AttributeError:
            continue
    return out


@pytest.fixture
def unpatched() -> Iterator[dict[str, Any]]:
    plugin.uninstall()
    yield targets()
    plugin.uninstall()


def test_entry_point_is_loaded_by_vllm(unpatched: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    import vllm.plugins

    monkeypatch.setattr(vllm.plugins, "plugins_loaded", False)
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    vllm.plugins.load_general_plugins()
    ps = plugin.installed_patch_set()
    assert ps is not None and ps.installed
    from dbo_runtime.integration.patching import PATCH_MARK

    assert getattr(vllm.v1.worker.gpu.ubatch_utils.create_sm_control_context, PATCH_MARK) == "sm_control.mrv2"
    if HAS_V1_RUNNER:
        from vllm.v1.worker import gpu_ubatch_wrapper

        assert getattr(gpu_ubatch_wrapper.create_sm_control_context, PATCH_MARK) == "sm_control.mrv1"


def test_register_twice_is_once_and_uninstall_restores_identity(unpatched: dict[str, Any]) -> None:
    plugin.register()
    first = plugin.installed_patch_set()
    patched = targets()
    plugin.register()
    assert plugin.installed_patch_set() is first and targets() == patched
    changed = [name for name in unpatched if patched[name] is not unpatched[name]]
    assert changed, "register() patched nothing"
    plugin.uninstall()
    after = targets()
    for name, original in unpatched.items():
        assert after[name] is original, name


def test_a_version_string_is_not_what_is_trusted(unpatched: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """Another version string over identical code: every feature installs (the code is what is verified)."""
    from dbo_runtime.integration import releases
    from dbo_runtime.integration.features import REGISTRY

    monkeypatch.setattr(releases, "installed_version", lambda: "0.99.1")
    plugin.register()
    ps = plugin.installed_patch_set()
    assert ps is not None and ps.installed
    assert all(state.verdict == "verified" or not state.applies for state in REGISTRY.all().values())
    from dbo_runtime.integration import activation

    release = releases.identify().release
    assert release in releases.SUPPORTED
    assert f"patches installed for vLLM {release} (verified by its code) " in activation._summary()  # type: ignore[misc]


def test_strict_mode_raises_on_an_unverified_feature(unpatched: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.fakes.vllm_build import edited_sources, replace_once

    monkeypatch.setenv("DBO_RUNTIME_STRICT", "1")
    moved = {"vllm.v1.attention.backends.mla.index_group": replace_once("workspace_rows = self.max_decode_rows", "workspace_rows = self.max_decode_rows + 0")}
    with edited_sources(moved), pytest.raises(PatchError, match=r"topk: unverified \(code differs from vLLM [0-9.]+ at topk\.builder_register_layer"):
        plugin.register()


def test_an_unverified_feature_installs_none_of_its_patches(unpatched: dict[str, Any]) -> None:
    """The code a topk patch relies on moved: no topk patch installs, every other feature does."""
    from tests.fakes.vllm_build import edited_sources, replace_once

    moved = {"vllm.v1.attention.backends.mla.index_group": replace_once("workspace_rows = self.max_decode_rows", "workspace_rows = self.max_decode_rows + 0")}
    with edited_sources(moved):
        plugin.register()
    ps = plugin.installed_patch_set()
    assert ps is not None
    names = {p.name for p in ps.patches}
    assert not any(n.startswith("topk.") for n in names)
    assert not any(n.startswith("topk_v41.") for n in names)  # it needs topk
    assert {"indexer.builder_build", "sm_control.mrv2", "ubatch_guard.mrv2_finish"} <= names
    assert ({"sm_control.mrv1", "ubatch_guard.mrv1_run"} <= names) == HAS_V1_RUNNER


def test_a_changed_plan_ahead_target_leaves_the_indexer_fix_in_force_without_it(
    unpatched: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Plan-ahead only spares the call site's re-plan (vllm#60732's path stays in force): where its target changed,
    the indexer fix installs without it and says so in doctor; nothing is refused, even under STRICT."""
    from dbo_runtime.cli import doctor
    from dbo_runtime.integration import guard, releases
    from dbo_runtime.integration.features import REGISTRY
    from tests.fakes.vllm_build import edited_sources, replace_once

    monkeypatch.setenv("DBO_RUNTIME_STRICT", "1")  # a feature not in force would raise here
    # its FULL-graph manager anchor: UBatchRunner.prepare, its other, is also code the top-k windows rely on
    line = "        self.use_aux_hidden_state_outputs = False\n"
    edited = {"vllm.v1.worker.gpu.cudagraph_utils": replace_once(line, line + "        edited = 0\n")}
    with edited_sources(edited):
        assert releases.identify().differing == ("indexer.plan_ahead.mrv2",)
        plugin.register()
        features = {f["name"]: f for f in doctor.collect()["features"]}
    release = releases.identify().release
    degraded = f"in force (without optional indexer.plan_ahead.mrv2: code differs from vLLM {release})"
    assert REGISTRY.get("indexer").describe() == degraded  # type: ignore[union-attr]
    assert features["indexer"]["in_force"] and features["indexer"]["state"] == degraded
    ps = plugin.installed_patch_set()
    assert ps is not None
    names = {p.name for p in ps.patches}
    assert "indexer.plan_ahead.mrv2" not in names and {"indexer.builder_build", "indexer.logits.sparse_attn_indexer"} <= names
    assert guard._not_in_force("indexer", "DeepseekV32ForCausalLM", "config") == ""


def test_disable_env_skips(unpatched: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DBO_RUNTIME_DISABLE", "1")
    plugin.register()
    assert plugin.installed_patch_set() is None
    assert all(targets()[n] is o for n, o in unpatched.items())


def test_failed_install_leaves_vllm_untouched_but_the_guard_in_place(
    unpatched: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    from dbo_runtime.integration.features import REGISTRY
    from dbo_runtime.integration.guard import guard_patches

    real = plugin.all_patches

    def with_broken_last() -> list[Patch]:
        broken = Patch(
            name="sm_control.broken",
            module="vllm.v1.worker.ubatch_utils",
            attr="SMControlContextManager.no_such_method",
            make=lambda o: o,
            reason="test",
            upstream_pr="-",
            removal="-",
            anchors=(),  # passes verification; fails when the transaction prepares it
        )
        return [*real(), broken]

    monkeypatch.setattr(plugin, "all_patches", with_broken_last)
    plugin.register()  # logs, does not raise
    assert plugin.installed_patch_set() is None
    guarded = {p.name for p in guard_patches()}
    after = targets()
    assert all(after[n] is o for n, o in unpatched.items() if n not in guarded)
    from vllm.engine.arg_utils import EngineArgs

    assert EngineArgs.create_engine_config is not unpatched["guard.engine_config"]  # the guard stays
    assert REGISTRY.get("topk") is not None and REGISTRY.get("topk").verdict == "not installed"  # type: ignore[union-attr]
    plugin.uninstall()
    monkeypatch.setenv("DBO_RUNTIME_STRICT", "1")
    with pytest.raises(PatchError, match="broken"):
        plugin.register()
    assert all(targets()[n] is o for n, o in unpatched.items() if n not in guarded)


def test_every_patch_documents_itself() -> None:
    from pathlib import Path

    table = (Path(__file__).parents[2] / "docs" / "patches.md").read_text()
    for patch in plugin.all_patches():
        assert patch.reason and patch.upstream_pr and patch.removal, patch.name
        assert f"`{patch.name}`" in table, f"{patch.name} missing from docs/patches.md"


def test_docs_patch_table_is_generated_from_the_patches() -> None:
    from pathlib import Path

    from dbo_runtime.integration import releases
    from tools.patch_table import render

    committed = (Path(__file__).parents[2] / "docs" / "patches.md").read_text()
    if releases.identify().release == releases.SUPPORTED[-1]:
        assert committed == render(), "regenerate under the newest release: python tools/patch_table.py > docs/patches.md"
    else:  # an anchor can depend on what the release has (Model Runner V1): the table is the newest release's
        rows = {line.split("|")[1].strip() for line in render().splitlines() if line.startswith("| `")}
        assert rows == {line.split("|")[1].strip() for line in committed.splitlines() if line.startswith("| `")}


def test_lazy_patch_failure_leaves_the_running_set_and_marks_its_patches_broken(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, caplog: Any
) -> None:
    """A module imported late whose required target moved: none of its patches apply, the patches already
    in force stay (the engine may be running with them), and the failure reaches the listeners."""
    import sys

    from dbo_runtime.integration.patching import PatchSet

    name = "dbo_lazy_target_rollback"
    (tmp_path / f"{name}.py").write_text("def present():\n    return 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import vllm.v1.worker.ubatch_utils as uu

    original = uu.create_sm_control_context
    ps = PatchSet(
        [
            Patch(name="eager", module="vllm.v1.worker.ubatch_utils", attr="create_sm_control_context",
                  make=lambda o: (lambda pc: o(pc)), reason="t", upstream_pr="-", removal="-"),
            Patch(name="lazy.ok", module=name, attr="present", make=lambda o: (lambda: 2), reason="t", upstream_pr="-",
                  removal="-", lazy=True),
            Patch(name="lazy.moved", module=name, attr="absent", make=lambda o: o, reason="t", upstream_pr="-",
                  removal="-", lazy=True),
        ]
    )
    failures: list[tuple[list[str], str]] = []
    ps.failure_listeners.append(lambda patches, message: failures.append(([p.name for p in patches], message)))
    ps.install()
    try:
        patched = uu.create_sm_control_context
        assert patched is not original
        module = importlib.import_module(name)
        assert uu.create_sm_control_context is patched and ps.installed  # the running set is untouched
        assert module.present() == 1  # the module's patches went in all together or not at all
        states = {st.patch.name: st.state for st in ps.status()}
        assert states == {"eager": "installed", "lazy.ok": "broken", "lazy.moved": "broken"}
        assert failures and failures[0][0] == ["lazy.ok", "lazy.moved"] and "none of them is installed" in caplog.text
    finally:
        ps.uninstall()
        sys.modules.pop(name, None)
    assert uu.create_sm_control_context is original


def test_broken_feature_module_does_not_stop_vllm(unpatched: dict[str, Any], monkeypatch: pytest.MonkeyPatch, caplog: Any) -> None:
    def broken() -> list[Patch]:
        raise ImportError("feature module failed to import")

    monkeypatch.setattr(plugin, "all_patches", broken)
    plugin.register()  # vLLM calls plugins without a try: this must not raise
    assert plugin.installed_patch_set() is None and "no fix is installed" in caplog.text
    from vllm.engine.arg_utils import EngineArgs

    assert EngineArgs.create_engine_config is not unpatched["guard.engine_config"]  # the guard refuses DBO models
    plugin.uninstall()
    monkeypatch.setenv("DBO_RUNTIME_STRICT", "1")
    with pytest.raises(ImportError):
        plugin.register()


def test_self_time_times_every_patch_descriptors_included(unpatched: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """Descriptors are timed too: without them the published self-time would miss the top-k accesses."""
    import vllm.model_executor.layers.attention.sparse_mla_attention
    import vllm.model_executor.layers.sparse_attn_indexer
    import vllm.models.deepseek_v32.attention  # noqa: F401

    from dbo_runtime.integration import worker_stats
    from tests.harness import selftime

    monkeypatch.setattr(worker_stats, "EXTENSIONS", [])
    monkeypatch.setattr(plugin, "INSTRUMENT", None)
    selftime.install()
    plugin.register()
    untimed = set(selftime.snapshot(calibrate=False)["untimed"])
    assert not untimed & {p.name for p in plugin.all_patches()}, untimed
    kinds = selftime.snapshot(calibrate=False)["kinds"]
    assert kinds["topk.DeepseekV32Attention.topk_indices_buffer"] == "descriptor"
    assert kinds["topk.SharedTopkIndicesBuffer.topk_indices_buffer"] == "property"


def test_uninstall_forgets_what_the_hooks_built_at_run_time(unpatched: dict[str, Any]) -> None:
    import torch

    from dbo_runtime.integration import ubatch_failures, ubatch_guard
    from dbo_runtime.services import schedule_cache as sc
    from dbo_runtime.services.sm_control import SMControl

    plugin.register()
    ubatch_guard.reserve_placeholders(torch.device("cpu"), 64)
    ubatch_failures.FAILURES.pending.append(("x", 1, RuntimeError("left over")))
    control = SMControl(0, 132)  # an engine's control that outlives the plugin
    cache = sc.schedule_cache()
    cache.attach(control)
    assert control._subscribers
    plugin.uninstall()
    assert ubatch_guard._RESERVED == {} and ubatch_failures.FAILURES.pending == []
    assert not control._subscribers and sc.schedule_cache() is cache  # it publishes to nobody; the cache stays


def test_uninstall_under_a_live_model_with_topk_state_is_an_error(unpatched: dict[str, Any], caplog: pytest.LogCaptureFixture) -> None:
    """uninstall() cannot refuse (it is teardown), but a live model whose index groups carry per-microbatch top-k
    state would run DBO steps on vLLM's shared state again: that is said at ERROR, and only then."""
    import logging

    import torch

    from dbo_runtime.integration import topk_hooks

    class Group:  # an index group: weak-referenceable, with a __dict__ for its state
        def __init__(self) -> None:
            self.logical_topk_indices = torch.zeros(8, 2, dtype=torch.int32)

    caplog.set_level(logging.INFO, logger="vllm.dbo_runtime")
    plugin.register()
    plugin.uninstall()
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    plugin.register()
    state = topk_hooks.default_state()
    group = Group()
    state.attach(group, 2, object)
    plugin.uninstall()
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "1 index group(s) or model buffer(s)" in errors[0] and "shut that engine down" in errors[0]
    assert not hasattr(group, "_dbo_runtime_topk_state")  # and the state is still taken off the group


def test_a_differing_fa4_scalar_cache_turns_the_default_topk_layout_to_copies(
    unpatched: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``topk.fa4_varlen_scalars`` is optional (FA4 sparse MLA may be absent), but where its code differs from
    vLLM 0.33.0 the windows layout would grow FA4's never-evicted cache: the registry is told before any model."""
    from dbo_runtime.integration import topk_hooks

    real = plugin.excluded_optional
    monkeypatch.setattr(
        plugin, "excluded_optional", lambda patches, recorded, against: {**real(patches, recorded, against), topk_hooks.FA4_SCALARS: f"code differs from {against}"}
    )
    plugin.register()
    try:
        reason = topk_hooks.default_state().windows_unsafe
        assert reason is not None and "code differs" in reason and "never evicted" in reason
    finally:
        plugin.uninstall()
    assert topk_hooks.default_state().windows_unsafe is None
    monkeypatch.setattr(topk_hooks, "fa4_module_present", lambda: False)  # a build without FA4: no cache to grow
    plugin.register()
    try:
        assert topk_hooks.default_state().windows_unsafe is None
    finally:
        plugin.uninstall()


def test_an_unreadable_fingerprint_record_refuses_dbo_models_instead_of_losing_the_guard(
    unpatched: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A wheel without its recorded fingerprints (a repackaged or copied tree) must not make vLLM skip the plugin:
    the guard installs, no fix does, and a DBO model that needs one is refused."""
    from vllm.engine.arg_utils import EngineArgs

    from dbo_runtime.integration import fingerprints, guard, releases

    monkeypatch.setattr(releases, "RELEASES", {})  # what fingerprints.py leaves when the file cannot be read
    monkeypatch.setattr(fingerprints, "RECORD_PROBLEM", "recorded_fingerprints.json unreadable (FileNotFoundError())")
    with pytest.raises(PatchError, match=r"recorded_fingerprints\.json unreadable"):
        releases.identify()
    plugin.register()
    assert EngineArgs.create_engine_config is not unpatched["guard.engine_config"]
    assert plugin.installed_patch_set() is None
    assert "not installed" in guard._not_in_force("indexer", "DeepseekV32ForCausalLM", "config")


def test_the_wheel_ships_the_fingerprint_record() -> None:
    import tomllib
    from pathlib import Path

    project = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())
    assert "recorded_fingerprints.json" in project["tool"]["setuptools"]["package-data"]["dbo_runtime.integration"]
