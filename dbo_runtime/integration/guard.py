"""The fail-closed guard: a DBO model that needs a fix not in force does not start (else vLLM serves GLM-5.x with
wrong attention, or DeepGEMM asserts mid-serving); one line at engine start names the cause and the ways out. It
wraps stable entry points and reads only public config, so it installs even when no other patch can."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any, Literal

from dbo_runtime.core import coverage
from dbo_runtime.core.budget import BACKEND_MAX_SMS_USED, decide_comm
from dbo_runtime.core.errors import ConfigError, DboRefusal, ways_out
from dbo_runtime.core.log import get_logger
from dbo_runtime.core.settings import setting_problems
from dbo_runtime.integration import fingerprints, upstream_crashes
from dbo_runtime.integration.engine_config import model_of
from dbo_runtime.integration.features import REGISTRY
from dbo_runtime.integration.fingerprints import RELEASES
from dbo_runtime.integration.patching import Patch, PatchSet

logger = get_logger(__name__)

Stage = Literal["config", "worker"]

VERIFIED: tuple[str, ...] = tuple(RELEASES)
"""The vLLM releases a refusal names as a way out (those with recorded fingerprints)."""

_PATCH_SET: PatchSet | None = None
"""The main patch set, once installed (its statuses say which patches applied in this process)."""


def bind_patch_set(patch_set: PatchSet | None) -> None:
    global _PATCH_SET
    _PATCH_SET = patch_set


def bound_patch_set() -> PatchSet | None:
    """The main patch set the plugin installed in this process (None before, or without one)."""
    return _PATCH_SET


def platform() -> str:
    """``cuda``, ``rocm`` or ``other``, from vLLM's ``current_platform``."""
    try:
        from vllm.platforms import current_platform

        if current_platform.is_cuda():
            return "cuda"
        if current_platform.is_rocm():
            return "rocm"
    except Exception:
        pass
    return "other"


def _deep_gemm_present(stage: Stage) -> bool:
    """The front-end assumes DeepGEMM (importing it there would load its CUDA library for nothing);
    a worker asks vLLM, which is what ``create_sm_control_context`` asks."""
    if stage == "config":
        return True
    try:
        from vllm.utils.import_utils import has_deep_gemm

        return bool(has_deep_gemm())
    except Exception:
        return True


def microbatching(parallel: Any) -> bool:
    """vLLM's ``ParallelConfig.use_ubatching``: ``--enable-dbo`` or ``--ubatch-size`` above 1."""
    if parallel is None:
        return False
    try:
        ubatch_size = int(getattr(parallel, "ubatch_size", 1) or 1)
    except (TypeError, ValueError):
        ubatch_size = 2  # unreadable: assume microbatching, never the reverse
    return bool(getattr(parallel, "enable_dbo", False)) or ubatch_size > 1


def partitions_deep_gemm(parallel: Any, platform: str, stage: Stage) -> bool:
    """Whether DBO will lower DeepGEMM's SM count for this configuration (vLLM's policy, predicted
    before any all2all manager exists: a backend vLLM added later counts as partitioning)."""
    if platform not in ("cuda", "rocm"):
        return False
    backend = getattr(parallel, "all2all_backend", None)
    try:
        decision = decide_comm(
            platform=platform, enable_dbo=bool(getattr(parallel, "enable_dbo", False)),
            expert_parallel=bool(getattr(parallel, "enable_expert_parallel", False)), all2all_backend=backend,
            env_comm_sms=os.environ.get("VLLM_DBO_COMM_SMS"), has_all2all_manager=True,
            max_sms_used=BACKEND_MAX_SMS_USED.get(str(backend)), has_deep_gemm=_deep_gemm_present(stage),
            allow_unknown_backend=True,
        )
    except ConfigError:
        return True  # vLLM itself will reject the value; never assume "no partition"
    return decision.compute_knob


def _closure(feature: str) -> list[str]:
    """``feature`` and everything it requires, transitively (a fix is in force only with its dependencies)."""
    order: list[str] = []
    todo = [feature]
    while todo:
        name = todo.pop(0)
        if name not in order:
            order.append(name)
            state = REGISTRY.get(name)
            todo.extend(state.feature.requires if state is not None else ())
    return order


def _not_in_force(feature: str, arch: str, stage: Stage, runner: str | None = None) -> str:
    """Why ``feature``'s fix is not in force for ``arch`` here ("" when it is); in a worker every required patch
    of the runner it runs must have applied."""
    state = REGISTRY.get(feature)
    if state is None:
        return "dbo_runtime's patches are not installed in this process"
    if state.verdict == "provided by vLLM":
        return ""
    names = _closure(feature)
    for name in names:
        dependency = REGISTRY.get(name)
        if dependency is None or not dependency.in_force:
            what = dependency.feature.summary if dependency is not None else name
            verdict = dependency.describe() if dependency is not None else "not installed"
            needed = "" if name == feature else f", which the {state.feature.summary} needs,"
            return f"dbo_runtime's {what}{needed} is {verdict}"
    for name in names:
        dependency = REGISTRY.get(name)
        left_out = [p for p, archs in (dependency.left_out if dependency else {}).items() if not archs or arch in archs]
        if left_out:
            return f"this vLLM release leaves {', '.join(left_out)} out of dbo_runtime's {dependency.feature.summary}"  # type: ignore[union-attr]
    if _PATCH_SET is None:
        return f"dbo_runtime's {state.feature.summary} was not installed"
    bad = []
    for status in _PATCH_SET.status():
        patch = status.patch
        if patch.feature not in names or patch.optional or (patch.architectures and arch not in patch.architectures):
            continue
        if stage == "worker" and runner is not None and patch.runner not in (None, runner):
            continue
        ok = status.state == "installed" or (stage == "config" and status.state == "pending")
        if not ok:
            bad.append(f"{patch.name} {status.state}" + (f" ({status.detail})" if status.detail else ""))
    if bad:
        return f"dbo_runtime's {state.feature.summary} is incomplete: " + "; ".join(bad)
    return ""


def problem(vllm_config: Any, stage: Stage, runner: str | None = None) -> str:
    """The refusal for this configuration in this process ("" when it may start)."""
    parallel = getattr(vllm_config, "parallel_config", None)
    if not microbatching(parallel):
        return ""
    switch = "--enable-dbo" if bool(getattr(parallel, "enable_dbo", False)) else "--ubatch-size"
    arch, hf = model_of(vllm_config)
    if hf is None:
        return ""
    row = coverage.BY_ARCHITECTURE.get(arch)
    shared = coverage.shared_topk(arch, hf)
    platform_name = platform()
    head = f"dbo_runtime refuses {arch} with {switch}"
    crash = upstream_crashes.problem(arch, platform_name, _splits(parallel))  # first: no release of ours lifts it
    if crash:
        return f"{head}: {crash}. " + ways_out(also="a vLLM whose DeepSeek-V4 compressor accepts unaligned views")
    if shared:
        if row is None:
            return (
                f"{head}: {shared}, and dbo_runtime does not know how this architecture hands top-k between layers, "
                "so under DBO one microbatch could read the other's selection with no error. " + ways_out()
            )
        if row.status == "refused":
            return f"{head}: {shared}, but {row.refusal}. " + ways_out()
        if platform_name == "rocm" and row.refusal:
            return f"{head} on ROCm: {shared}, but {row.refusal}. " + ways_out()
        for feature in row.needs:
            if feature == coverage.MTP_HIDDEN:
                continue
            why = _not_in_force(feature, arch, stage, runner)
            if why:
                return (
                    f"{head}: {shared}, and {why}; vLLM's own DBO would let one microbatch read the other's "
                    "top-k with no error (silently wrong tokens). " + ways_out(verified=VERIFIED)
                )
    if coverage.uses_indexer(arch, hf) and platform_name == "cuda" and partitions_deep_gemm(parallel, platform_name, stage):
        why = _not_in_force(coverage.INDEXER, arch, stage, runner)
        if why:
            return (
                f"{head}: DBO lowers DeepGEMM's SM count for the DSA indexer, and {why}; DeepGEMM would assert "
                "'_schedule_meta_size == num_sms + 1' in the middle of serving. " + ways_out(verified=VERIFIED)
                + " (VLLM_DBO_COMM_SMS=0 also avoids the partition.)"
            )
    return ""


def _splits(parallel: Any) -> bool:
    """Whether vLLM will split steps: microbatching runs only with data-parallel peers (unreadable: assume so)."""
    try:
        return int(getattr(parallel, "data_parallel_size", 2) or 1) > 1
    except (TypeError, ValueError):
        return True


WORKER_MODULE = "vllm.v1.worker.gpu_worker"
WORKER_CLASS = f"{WORKER_MODULE}.Worker"
WORKER_HOOKS = ("load_model", "compile_or_warm_up_model")
_WORKER_DEFINERS = ((WORKER_MODULE, "Worker"), ("vllm.v1.worker.worker_base", "WorkerBase"))
"""Where the hooks may be defined: vLLM's GPU worker, or the base class it inherits them from."""


def _worker_hooks_missing() -> list[str]:
    """The worker entry points the guard wraps that this build lacks (read from source, before any worker)."""
    return [
        f"Worker.{name}" for name in WORKER_HOOKS
        if all(fingerprints.source_block(module, f"{cls}.{name}") is None for module, cls in _WORKER_DEFINERS)
    ]


def _needs_worker_check(vllm_config: Any) -> bool:
    """Whether the worker stage could refuse this model: it shares top-k, or runs the DSA indexer."""
    arch, hf = model_of(vllm_config)
    return hf is not None and bool(coverage.shared_topk(arch, hf) or coverage.uses_indexer(arch, hf))


def _custom_worker_problem(parallel: Any) -> str:
    """A ``--worker-cls`` that is not vLLM's GPU worker (nor a subclass) never runs the worker check."""
    name = str(getattr(parallel, "worker_cls", "auto") or "auto")
    if name in ("auto", WORKER_CLASS):
        return ""
    try:
        from vllm.utils.import_utils import resolve_obj_by_qualname
        from vllm.v1.worker.gpu_worker import Worker

        cls = resolve_obj_by_qualname(name)
        if isinstance(cls, type) and issubclass(cls, Worker):
            overridden = [hook for hook in WORKER_HOOKS if getattr(cls, hook, None) is not getattr(Worker, hook, None)]
            if not overridden:
                return ""
            why = f"overrides {', '.join(f'Worker.{h}' for h in overridden)}, where the check runs"
        else:
            why = "is not a subclass of it"
    except Exception as exc:
        why = f"could not be imported here ({type(exc).__name__}: {exc})"
    return f"--worker-cls {name} {why}, and only {WORKER_CLASS} runs dbo_runtime's worker check"


def _guard_problem(vllm_config: Any) -> str:
    parallel = getattr(vllm_config, "parallel_config", None)
    if not microbatching(parallel) or not _needs_worker_check(vllm_config):
        return ""
    missing = _worker_hooks_missing()
    why = (
        f"this vLLM build has no {', '.join(missing)}, where dbo_runtime checks in every worker that its fixes applied"
        if missing
        else _custom_worker_problem(parallel)
    )
    if not why:
        return ""
    arch, _ = model_of(vllm_config)
    return f"dbo_runtime refuses {arch} with microbatching: {why}. " + ways_out(verified=VERIFIED)


V1_RUNNER_MODULE = "vllm.v1.worker.gpu_model_runner"


def runner_of(worker: Any) -> str | None:
    """The model runner a vLLM worker runs: ``Worker.use_v2_model_runner`` where the build has both runners,
    ``"mrv2"`` where it has no V1 runner at all (a release without it has no such attribute either)."""
    value = getattr(worker, "use_v2_model_runner", None)
    if value is None:
        has_v2_only = fingerprints.module_file(V1_RUNNER_MODULE) is None and fingerprints.module_file(WORKER_MODULE) is not None
        return "mrv2" if has_v2_only else None
    return "mrv2" if bool(value) else "mrv1"


def check(vllm_config: Any, stage: Stage, runner: str | None = None) -> None:
    """Raise ``DboRefusal`` when ``problem`` finds one (the guard's single decision point)."""
    message = _guard_problem(vllm_config) if stage == "config" else ""
    message = message or problem(vllm_config, stage, runner)
    if message:
        raise DboRefusal(message)
    if stage == "config" and microbatching(getattr(vllm_config, "parallel_config", None)) and _needs_worker_check(vllm_config):
        for setting in setting_problems():  # read only at model load, in every worker: refused here in one line
            raise setting
    if stage == "worker":
        _report_worker(vllm_config, runner)


_reported: set[int] = set()


def reset() -> None:
    """Forget what this process reported (``plugin.uninstall``: a later install reports afresh)."""
    _reported.clear()
    _hooks_failed.clear()


def pending_required(runner: str | None = None) -> list[str]:
    """Required lazy patches whose module was never imported in this process (the other runner's excluded)."""
    if _PATCH_SET is None:
        return []
    return [
        s.patch.name for s in _PATCH_SET.status()
        if s.state == "pending" and not s.patch.optional and (runner is None or s.patch.runner in (None, runner))
    ]


def _report_worker(vllm_config: Any, runner: str | None) -> None:
    pid = os.getpid()
    if pid in _reported:
        return
    _reported.add(pid)
    arch, _ = model_of(vllm_config)
    pending = pending_required(runner)
    if pending:
        logger.info(
            "dbo_runtime: %d patches never applied in this process because %s never imported their module: %s",
            len(pending), arch, ", ".join(pending),
        )
    row = coverage.BY_ARCHITECTURE.get(arch)
    speculative = getattr(vllm_config, "speculative_config", None) is not None
    parallel = getattr(vllm_config, "parallel_config", None)
    if speculative and row is not None and coverage.MTP_HIDDEN in row.needs and microbatching(parallel):
        why = "" if platform() == "rocm" and arch in coverage.ROCM_MTP_WRITES_AT_OFFSET else _not_in_force(coverage.MTP_HIDDEN, arch, "worker", runner)
        if why:
            logger.warning(
                "dbo_runtime: %s with speculative decoding under microbatching: %s, so one microbatch's MTP hidden "
                "states can overwrite the other's before the drafter reads them (tokens stay correct; draft "
                "acceptance drops)",
                arch, why,
            )


# -- the guard's own patches --------------------------------------------------------------------
def _after(original: Any, stage: Stage, config_of: Any) -> Any:
    @functools.wraps(original)
    def guarded(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        check(config_of(self, result), stage, runner_of(self) if stage == "worker" else None)
        return result

    return guarded


_warmed_up: list[Callable[[], None]] = []


def after_warm_up(listener: Callable[[], None], *, remove: bool = False) -> None:
    """Call ``listener`` whenever a worker's ``compile_or_warm_up_model`` returns: start-up is over."""
    if remove:
        while listener in _warmed_up:
            _warmed_up.remove(listener)
    elif listener not in _warmed_up:
        _warmed_up.append(listener)


_hooks_failed: list[str] = []
"""Why the guard's worker hooks are missing in this process (``on_guard_failure``); empty while they are in place."""


def on_guard_failure(patches: list[Patch], message: str) -> None:
    """The guard's worker hooks could not be applied here: no fix counts as in force, and
    ``check_without_worker_hooks`` refuses where DBO builds its SM control."""
    _hooks_failed.append(message)
    for name in REGISTRY.all():
        REGISTRY.mark(name, "broken", "dbo_runtime's worker guard could not be installed in this process")
    logger.error(
        "%s: this worker cannot check that dbo_runtime's fixes applied; do not run DBO with a DSA model here, "
        "or set DBO_RUNTIME_DISABLE=1 to run vLLM's own DBO knowingly",
        message,
    )


def check_without_worker_hooks() -> None:
    """The second veto, where every DBO worker builds its SM control: acts only when the guard's worker hooks
    failed in this process."""
    if not _hooks_failed:
        return
    try:
        from vllm.config import get_current_vllm_config_or_none

        config = get_current_vllm_config_or_none()
    except Exception:
        config = None
    if config is not None and not _needs_worker_check(config):
        return
    arch = model_of(config)[0] if config is not None else "this model"
    raise DboRefusal(
        f"dbo_runtime refuses {arch} with microbatching: {_hooks_failed[0].removeprefix('dbo_runtime: ')}, so this "
        "worker cannot check that dbo_runtime's fixes applied. " + ways_out(verified=VERIFIED)
    )


def _around_warm_up(original: Any) -> Any:
    @functools.wraps(original)
    def guarded(self: Any, *args: Any, **kwargs: Any) -> Any:
        check(getattr(self, "vllm_config", None), "worker", runner_of(self))
        result = original(self, *args, **kwargs)
        for listener in list(_warmed_up):
            try:
                listener()
            except Exception as exc:  # a counter must never stop engine start
                logger.debug("dbo_runtime: warm-up listener failed: %r", exc)
        return result

    return guarded


def guard_patches() -> list[Patch]:
    veto = functools.partial(
        Patch, upstream_pr="none (vLLM has no plugin veto on a configuration)",
        removal="the supported vLLM ships both DBO fixes for every DSA architecture", anchors=(),
    )
    return [
        veto(
            name="guard.engine_config", module="vllm.engine.arg_utils", attr="EngineArgs.create_engine_config",
            make=lambda original: _after(original, "config", lambda self, result: result),
            reason="refuse, before any worker starts, a DBO configuration whose model needs a dbo_runtime fix "
            "that is not in force in this vLLM build",
        ),
        veto(
            name="guard.worker_load_model", module=WORKER_MODULE, attr="Worker.load_model",
            make=lambda original: _after(original, "worker", lambda self, result: getattr(self, "vllm_config", None)),
            reason="after the model is built (lazy patches applied or failed): refuse a DBO model whose fix is "
            "not in force in this worker",
            lazy=True,
        ),
        veto(
            name="guard.worker_warm_up", module=WORKER_MODULE, attr="Worker.compile_or_warm_up_model",
            make=_around_warm_up,
            reason="before vLLM's warm-up and graph capture (indexer builders and the KV cache exist by now): the "
            "same check",
            lazy=True,
        ),
    ]
