"""The vLLM general plugin: ``register()`` and ``uninstall()``.

vLLM calls every ``vllm.general_plugins`` entry point with no arguments, once
per process, in the API server, each engine core, each worker and the model
inspection subprocess (``plugins/__init__.py:77-90``). So ``register`` must be
idempotent, cheap, and must not initialise CUDA; it installs the whole patch
set as one transaction or nothing.

Environment:

* ``DBO_RUNTIME_DISABLE=1`` -- patch nothing.
* ``DBO_RUNTIME_STRICT=1`` -- an unsupported vLLM version or a failed install
  raises instead of logging one line.

A value of either that ``core.switches`` does not recognise never raises here (vLLM
has no guard around ``register``): it is logged as one warning naming the variable
and the allowed values, and read as DISABLE on / STRICT off.
"""

from __future__ import annotations

import importlib
import threading
from importlib import metadata

from dbo_runtime.core.errors import PatchError
from dbo_runtime.core.log import get_logger
from dbo_runtime.core.switches import parse_switch, switch_problems
from dbo_runtime.integration import activation
from dbo_runtime.integration.patching import Patch, PatchSet

logger = get_logger("dbo_runtime.plugin")

SUPPORTED_VLLM = "0.33"
"""Major.minor of the vLLM releases whose source the patch set was written against."""

FEATURE_MODULES: tuple[str, ...] = (
    "dbo_runtime.integration.capture_hooks",
    "dbo_runtime.integration.sm_hooks",
    "dbo_runtime.integration.indexer_hooks",
    "dbo_runtime.integration.topk_hooks",
    "dbo_runtime.integration.ubatch_guard",
    "dbo_runtime.integration.worker_stats",
)
"""Each module exposes ``patches() -> list[Patch]``; order is install order."""

_lock = threading.Lock()
_patch_set: PatchSet | None = None


def _truthy(name: str) -> bool:
    return parse_switch(name)


def vllm_version() -> str | None:
    try:
        return metadata.version("vllm")
    except metadata.PackageNotFoundError:
        return None


def version_supported(version: str | None) -> bool:
    if version is None:
        return False
    parts = version.split("+")[0].split(".")
    return ".".join(parts[:2]) == SUPPORTED_VLLM


def all_patches() -> list[Patch]:
    out: list[Patch] = []
    for name in FEATURE_MODULES:
        out.extend(importlib.import_module(name).patches())
    return out


def installed_patch_set() -> PatchSet | None:
    return _patch_set


def register() -> None:
    """Entry point of ``vllm.general_plugins``; safe to call any number of times."""
    global _patch_set
    with _lock:
        if _patch_set is not None and _patch_set.installed:
            activation.flush()
            return
        for problem in switch_problems():
            logger.warning("dbo_runtime: %s", problem)
        if _truthy("DBO_RUNTIME_DISABLE"):
            logger.info("dbo_runtime: DBO_RUNTIME_DISABLE is set; vLLM left unpatched")
            return
        version = vllm_version()
        if not version_supported(version):
            msg = (
                f"dbo_runtime supports vLLM {SUPPORTED_VLLM}.x, found {version or 'no vLLM'}; "
                "nothing patched (DBO with DSA models keeps vLLM's own behaviour)"
            )
            if _truthy("DBO_RUNTIME_STRICT"):
                raise PatchError(msg)
            logger.warning("%s", msg)
            return
        try:
            # Building the list imports the feature modules; vLLM does not catch a plugin's
            # exception, so a failure here must not stop engine start (unless strict).
            patch_set = PatchSet(all_patches())
            patch_set.install()
        except Exception as exc:
            if _truthy("DBO_RUNTIME_STRICT"):
                raise
            logger.error("dbo_runtime: patch set not installed (%r); vLLM left untouched", exc, exc_info=True)
            return
        _patch_set = patch_set
        activation.set_summary(lambda: activation_line(patch_set, version))
        patch_set.lazy_listeners.append(_flush_activation)
    # Outside the lock: the line may be pending until vLLM configures logging (see activation.py).
    activation.flush()


def _flush_activation(module: str) -> None:
    activation.flush()


def activation_line(patch_set: PatchSet, version: str | None) -> str:
    """``dbo_runtime: N patches installed for vLLM 0.33.0 (...)``, as logged once in each process."""
    from dbo_runtime import __version__

    groups: dict[str, list[str]] = {}
    states = patch_set.status()
    for status in states:
        feature, _, rest = status.patch.name.partition(".")
        groups.setdefault(feature, []).append(rest or feature)
    applied = sum(1 for s in states if s.state == "installed")
    waiting = sum(1 for s in states if s.state == "pending")
    skipped = [s.patch.name for s in states if s.state == "skipped"]
    listing = "; ".join(f"{feature}: {', '.join(names)}" for feature, names in groups.items())
    text = (
        f"dbo_runtime: {len(patch_set.patches)} patches installed for vLLM {version} (dbo_runtime {__version__}; "
        f"{applied} applied in this process, {waiting} apply when vLLM imports their module"
        + (f", {len(skipped)} optional skipped: {', '.join(skipped)}" if skipped else "")
        + f") -- {listing}"
    )
    return text


def uninstall() -> None:
    """Restore every original vLLM object."""
    global _patch_set
    with _lock:
        if _patch_set is not None:
            _patch_set.uninstall()
        _patch_set = None
