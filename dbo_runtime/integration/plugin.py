"""The vLLM general plugin. ``register`` (once per process, no ``try`` around it) is idempotent, never touches
CUDA, installs the guard (unless ``DBO_RUNTIME_DISABLE=1``), then as one transaction each feature whose fingerprints
match and that vLLM lacks; one left out is no error unless ``DBO_RUNTIME_STRICT=1`` (the guard refuses it for DBO)."""

from __future__ import annotations

import threading

from dbo_runtime.core.errors import PatchError
from dbo_runtime.core.log import get_logger
from dbo_runtime.core.switches import parse_switch, switch_problems
from dbo_runtime.integration import activation, guard, releases
from dbo_runtime.integration.catalog import all_features, all_patches
from dbo_runtime.integration.features import REGISTRY, FeatureState, excluded_optional, verify
from dbo_runtime.integration.patching import Instrument, Patch, PatchSet
from dbo_runtime.integration.releases import ReleaseMatch

logger = get_logger("dbo_runtime.plugin")

_lock = threading.Lock()
_patch_set: PatchSet | None = None
_guard_set: PatchSet | None = None
INSTRUMENT: Instrument | None = None
"""Wraps every fix's replacement when set before ``register`` (a measurement harness's sitecustomize)."""


def installed_patch_set() -> PatchSet | None:
    return _patch_set


def feature_states(patches: list[Patch] | None = None, match: ReleaseMatch | None = None) -> dict[str, FeatureState]:
    """Every feature's verdict against the vLLM on disk (what ``register`` would install; ``doctor``)."""
    chosen = patches if patches is not None else all_patches()
    match = match or releases.identify(chosen)
    return verify(all_features(), chosen, match.recorded, match.label)


def _install_guard() -> None:
    global _guard_set
    if _guard_set is not None and _guard_set.installed:
        return
    guard_set = PatchSet(guard.guard_patches())
    guard_set.failure_listeners.append(guard.on_guard_failure)
    try:
        guard_set.install()
    except Exception as exc:
        # without the guard a DBO model could run vanilla's silent corruption
        raise PatchError(
            f"dbo_runtime cannot install its guard in this vLLM ({exc!r}); nothing is patched. Ways out: install a "
            f"vLLM release dbo_runtime verifies ({', '.join(releases.SUPPORTED)}), or set DBO_RUNTIME_DISABLE=1 to "
            "run vLLM without dbo_runtime"
        ) from exc
    _guard_set = guard_set


def register() -> None:
    """Entry point of ``vllm.general_plugins``; safe to call any number of times."""
    global _patch_set
    with _lock:
        if _patch_set is not None and _patch_set.installed:
            activation.flush()
            return
        for problem in switch_problems():
            logger.warning("dbo_runtime: %s", problem)
        if parse_switch("DBO_RUNTIME_DISABLE"):
            logger.info("dbo_runtime: DBO_RUNTIME_DISABLE is set; vLLM left unpatched (vLLM's own DBO behaviour)")
            return
        strict = parse_switch("DBO_RUNTIME_STRICT")
        _install_guard()
        try:
            every = all_patches()
            match = releases.identify(every)
            patches = [p for p in every if releases.part_of(p, match.recorded)]
            states = feature_states(every, match)  # all of them: what the release leaves out is a verdict too
            skip = excluded_optional(patches, match.recorded, match.label)
            for feature in all_features():
                own = {name: why for name, why in skip.items() if name.partition(".")[0] == feature.name}
                if own and feature.on_optional_skipped is not None:
                    feature.on_optional_skipped(own)
        except Exception as exc:
            REGISTRY.clear()
            if strict:
                raise
            logger.error("dbo_runtime: could not verify this vLLM (%r); no fix is installed", exc, exc_info=True)
            return
        REGISTRY.set_all(states)
        shortfall = {name: s for name, s in states.items() if not s.in_force and s.applies}
        if shortfall and strict:
            raise PatchError(
                f"dbo_runtime (DBO_RUNTIME_STRICT=1): not in force on {match.describe()}: " + "; ".join(f"{n}: {s.describe()}" for n, s in shortfall.items())
            )
        chosen = [p for p in patches if states[p.feature].installs and p.name not in skip]
        patch_set = PatchSet(chosen, instrument=INSTRUMENT)
        try:
            patch_set.install()
        except Exception as exc:
            for name, state in states.items():
                if state.installs:
                    REGISTRY.mark(name, "not installed", f"install failed: {exc!r}")
            if strict:
                raise
            logger.error("dbo_runtime: patch set not installed (%r); vLLM left untouched", exc, exc_info=True)
            return
        _patch_set = patch_set
        guard.bind_patch_set(patch_set)
        patch_set.failure_listeners.append(_on_lazy_failure)
        patch_set.lazy_listeners.append(lambda module: activation.flush())
        activation.set_summary(lambda: activation.summary_line(patch_set, REGISTRY.all(), match.describe(), skip))
    # outside the lock: the line may stay pending (activation.py)
    activation.flush()


def _on_lazy_failure(patches: list[Patch], message: str) -> None:
    """A feature is broken where a patch every runner needs failed (runner-only ones are judged per worker)."""
    for feature in {p.feature for p in patches if p.runner is None}:
        REGISTRY.mark(feature, "broken", message)


def _forget_runtime_state() -> None:
    """Drop what the hooks built at run time."""
    import sys

    guard_module = sys.modules.get("dbo_runtime.integration.ubatch_guard")
    if guard_module is not None:
        guard_module._RESERVED.clear()
    cache = sys.modules.get("dbo_runtime.services.schedule_cache")
    if cache is not None:
        cache.detach_schedule_cache()
    failures = sys.modules.get("dbo_runtime.integration.ubatch_failures")
    if failures is not None:
        failures.FAILURES.take()
    topk = sys.modules.get("dbo_runtime.integration.topk_hooks")
    state = topk.current_state() if topk is not None else None
    if state is not None:
        import gc

        gc.collect()  # an engine already shut down but held in a reference cycle is not a live model
        alive = state.attached_alive()
        if alive:
            # teardown cannot refuse; a live model would share top-k again
            logger.error(
                "dbo_runtime: uninstalled while %d index group(s) or model buffer(s) with per-microbatch top-k state "
                "are alive: a DBO step of that model would share top-k across microbatches again (vLLM's bug); "
                "shut that engine down before it runs another step",
                alive,
            )
        state.clear()


def uninstall() -> None:
    """Restore every original vLLM object (the guard's too)."""
    global _patch_set, _guard_set
    with _lock:
        if _patch_set is not None:
            _patch_set.uninstall()
        if _guard_set is not None:
            _guard_set.uninstall()
        _patch_set = None
        _guard_set = None
        guard.bind_patch_set(None)
        guard.reset()
        REGISTRY.clear()
        _forget_runtime_state()
