"""Indexer schedule hooks (vllm#60732): the builder plans for the whole GPU before DBO lowers DeepGEMM's SM count,
so these patches record each schedule's planned count (planning ahead in microbatched builds) and hand every logits
call, in each module that binds it by ``from``, to ``IndexerScheduleCache``."""

from __future__ import annotations

import functools
import sys
import threading
from dataclasses import dataclass
from typing import Any

from dbo_runtime.adapters.cuda_graph import prepare_capture_id
from dbo_runtime.adapters.deep_gemm import LIVE_NUM_SMS, next_n_of
from dbo_runtime.core import coverage
from dbo_runtime.core.errors import PatchError
from dbo_runtime.core.log import get_logger
from dbo_runtime.core.planner_shapes import dbo_planner_shapes
from dbo_runtime.integration import activation, guard
from dbo_runtime.integration.engine_config import decode_rows
from dbo_runtime.integration.features import REGISTRY, Feature, Probe, Upstream
from dbo_runtime.integration.fingerprints import module_file
from dbo_runtime.integration.microbatch_arming import ARMING
from dbo_runtime.integration.patching import PATCH_MARK, ArgSlots, Patch, require_parameters
from dbo_runtime.integration.ubatch_failures import record, shields_itself
from dbo_runtime.integration.ubatch_guard import placeholder_logits, reserve_placeholders
from dbo_runtime.services import schedule_cache as _sc
from dbo_runtime.services.planner_warmup import PlannerProfile
from dbo_runtime.services.runtime_stats import count_microbatched_build
from dbo_runtime.services.schedule_cache import schedule_cache
from dbo_runtime.services.sm_control import sm_control_for

logger = get_logger(__name__)

UPSTREAM_PR = "vllm-project/vllm#60732"
INDEXER_MODULE = "vllm.v1.attention.backends.mla.indexer"
BUILDER = "DeepseekV32IndexerMetadataBuilder"
SPARSE_ATTN_INDEXER_MODULE = "vllm.model_executor.layers.sparse_attn_indexer"
GLM5NEXT_MODULE = "vllm.models.glm5next.nvidia.sparse_indexer"
MRV1_RUNNER_MODULE = "vllm.v1.worker.gpu_model_runner"
MRV2_UBATCH_MODULE = "vllm.v1.worker.gpu.ubatch_utils"
DEEP_GEMM_WRAPPER = "vllm.utils.deep_gemm"

FEATURES = [
    Feature(
        coverage.INDEXER,
        "indexer schedule fix (vllm#60732)",
        requires=("ubatch_guard", "sm_control"),
        upstream=Upstream(
            "vllm#60732: the decode metadata re-plans its schedule for DeepGEMM's live SM count",
            (
                Probe("member", INDEXER_MODULE, "DeepSeekV32IndexerDecodeMetadata", "get_schedule_metadata"),
                Probe("call", SPARSE_ATTN_INDEXER_MODULE, "", "get_schedule_metadata"),
            ),
        ),
    )
]


# -- the builder's planner scope ----------------------------------------------------------------
@dataclass
class _PlanScope:
    override_sms: int | None
    defer_into: Any = None
    """The builder's ``scheduler_metadata_buffer`` when a plan-ahead build may skip its planner."""
    planned: tuple[int, int, int] | None = None
    """``(num_sms, block_kv, next_n)`` of the last planner call in this scope."""
    deferred: tuple[Any, Any] | None = None
    """``(context_lens, indices)`` of a planner call that was skipped (deferred to the call site)."""
    previous: _PlanScope | None = None

    def __enter__(self) -> _PlanScope:
        self.previous, _tls.scope = _tls.scope, self
        return self

    def __exit__(self, *exc: object) -> None:
        _tls.scope = self.previous


class _Scope(threading.local):
    scope: _PlanScope | None = None


_tls = _Scope()


def _device_index(builder: Any) -> int | None:
    device = getattr(builder, "device", None)
    if device is None or getattr(device, "type", None) != "cuda":
        return None
    return int(device.index) if device.index is not None else 0


def _make_builder_planner(original: Any) -> Any:
    slots = ArgSlots(original, ("context_lens", "block_size", "num_sms", "indices"))

    def get_paged_mqa_logits_metadata(*args: Any, **kwargs: Any) -> Any:
        scope = _tls.scope
        if scope is None:  # not inside a hooked build (or the build stepped aside)
            return original(*args, **kwargs)
        context_lens, block_size, num_sms, indices = slots.read(args, kwargs)
        if scope.override_sms is not None:
            num_sms = scope.override_sms
            args, kwargs = slots.replace("num_sms", num_sms, args, kwargs)
            if scope.defer_into is not None:
                # build() copies what we return into the first rows of this same buffer: returning
                # those rows makes that copy a no-op (torch skips a copy onto identical memory) and
                # launches no planner; the first eager call site plans into them.
                rows = schedule_cache().planner.slots(num_sms, next_n_of(context_lens)) + 1
                if rows <= int(scope.defer_into.shape[0]):
                    scope.planned = (int(num_sms), int(block_size), next_n_of(context_lens))
                    scope.deferred = (context_lens, indices)
                    return scope.defer_into[:rows]
        out = original(*args, **kwargs)
        scope.planned = (int(num_sms), int(block_size), next_n_of(context_lens))
        schedule_cache().warmup.note_plan(context_lens, int(block_size), int(num_sms), indices)
        return out

    return get_paged_mqa_logits_metadata


def _make_build(original: Any) -> Any:
    def build(self: Any, *args: Any, **kwargs: Any) -> Any:
        cache = _sc._CACHE or schedule_cache()
        if cache.steps_aside:  # an engine that never microbatches: vLLM's build as it is
            return original(self, *args, **kwargs)
        # only a microbatched build has a DBO count to plan for (and a device to read)
        device = _device_index(self) if cache.in_microbatched_build() else None
        _refresh_live_count()
        override = cache.plan_ahead_sms(device) if device is not None else None
        if override is not None:  # planned (or left) for the DBO count: only the call site makes it fit
            ARMING.arm("DeepseekV32IndexerMetadataBuilder.build (plan-ahead)")
        defer = override is not None and cache.defer_plan_ahead
        with _PlanScope(override, getattr(self, "scheduler_metadata_buffer", None) if defer else None) as scope:
            metadata = original(self, *args, **kwargs)
        decode = getattr(metadata, "decode", None)
        if decode is not None and scope.planned is not None:
            sms, block_kv, next_n = scope.planned
            if scope.deferred is not None:
                context_lens, indices = scope.deferred
                decode.dbo_schedule_state = cache.track_deferred(
                    decode.schedule_metadata, planned_sms=sms, block_kv=block_kv, next_n=next_n,
                    context_lens=context_lens, indices=indices,
                )
            else:
                decode.dbo_schedule_state = cache.track(
                    decode.schedule_metadata, planned_sms=sms, block_kv=block_kv, next_n=next_n,
                    ahead=override is not None,
                )
            if override is not None:
                cache.stats.planned_ahead += 1
        return metadata

    return build


def _make_update_draft(original: Any) -> Any:
    def update_draft_decode_metadata(self: Any, metadata: Any) -> None:
        cache = _sc._CACHE or schedule_cache()
        if cache.steps_aside:
            original(self, metadata)
            return
        decode = getattr(metadata, "decode", None)
        state = cache.state_of(decode.schedule_metadata) if decode is not None else None
        # Re-plan for the count the schedule was planned for: vLLM asserts the shape is unchanged.
        with _PlanScope(state.intended_sms if state is not None else None) as scope:
            original(self, metadata)
        if decode is None:
            return
        if state is not None:
            # vLLM re-planned into the tensor in place (no defer_into here): a deferred plan is settled.
            cache.invalidate(decode.schedule_metadata, planned_sms=scope.planned[0] if scope.planned else None)
        elif scope.planned is not None:
            sms, block_kv, next_n = scope.planned
            decode.dbo_schedule_state = cache.track(
                decode.schedule_metadata, planned_sms=sms, block_kv=block_kv, next_n=next_n
            )

    return update_draft_decode_metadata


def register_builder(builder: Any, device_index: int | None = None) -> PlannerProfile | None:
    """Subscribe the cache to the builder's device and register the planner shapes its config can present."""
    cache = schedule_cache()
    # first: a DBO engine's builder must end stepping aside even if the rest fails
    if cache.note_builder(_may_microbatch(builder), writers_watched=LIVE_NUM_SMS.trusted) and cache.stats.builders_stepped_aside == 1:
        logger.info(
            "dbo_runtime: this engine never microbatches (parallel_config.use_ubatching is off: no --enable-dbo, "
            "--ubatch-size 1), so the indexer hooks hand vLLM's calls through untouched"
        )
    if not LIVE_NUM_SMS.trusted:  # a write to DeepGEMM's count could go unseen: the call site must be in force now
        ARMING.arm("an indexer builder while DeepGEMM's SM-count writers are not watched")
    if guard.platform() == "rocm":
        # DeepGEMM plans on CUDA only (ROCm's builder subclasses this one)
        return None
    device = _device_index(builder) if device_index is None else device_index
    if device is None:
        return None
    cache.attach(sm_control_for(device, int(builder.num_sms)))
    flat = bool(getattr(builder, "use_flattening", False))
    varlen = bool(getattr(builder, "supports_varlen", False))
    config = builder.vllm_config
    sched, parallel, compilation = config.scheduler_config, config.parallel_config, config.compilation_config
    mode = compilation.cudagraph_mode
    full_graphs = mode is not None and mode.has_full_cudagraphs()
    speculative = int(getattr(builder, "num_speculative_tokens", 0))
    q = 1 + speculative
    per_token = flat or varlen
    max_seqs, max_tokens = int(sched.max_num_seqs), int(sched.max_num_batched_tokens)
    profile = PlannerProfile(
        device=builder.device, block_kv=int(builder.kv_cache_spec.num_states),
        shapes=dbo_planner_shapes(
            max_num_seqs=max_seqs, max_num_batched_tokens=max_tokens, num_speculative_tokens=speculative,
            capture_sizes=tuple(compilation.cudagraph_capture_sizes or ()) if full_graphs else (),
            num_ubatches=int(parallel.num_ubatches) if parallel.use_ubatching else 2,
            decode_token_threshold=int(parallel.dbo_decode_token_threshold), per_token_rows=per_token,
        ),
        varlen=varlen, max_rows=min(max_seqs * q, max_tokens) if per_token else min(max_seqs, max_tokens),
        width=1 if per_token else q,
    )
    if not parallel.use_ubatching:  # nothing microbatches: vLLM's own planning, untouched
        cache.warmup.register_profile(device, profile, full_sms=None, microbatches=False)
        return profile
    prepare_capture_id()  # a DBO engine's captures may re-plan: find the capture-id entry point before any
    cache.warmup.register_profile(device, profile, full_sms=int(builder.num_sms))
    return profile


def reserve_builder_placeholders(builder: Any) -> None:
    """Reserve the guard's placeholder logits for a DBO engine's builder; unreadable sizes mark the guard
    broken, so the worker check refuses DBO instead of risking a hang."""
    if not _may_microbatch(builder) or guard.platform() == "rocm":  # ROCm: no DeepGEMM call site to stand in for
        return
    try:
        config = builder.vllm_config
        _, rows = decode_rows(config)  # the logits of one call: a row per padded decode token (B x next_n)
        max_model_len = int(config.model_config.max_model_len)
        device = builder.device
    except Exception as exc:
        REGISTRY.mark("ubatch_guard", "broken", f"the indexer builder's sizes could not be read to reserve the placeholder logits ({exc!r})")
        logger.error("dbo_runtime: the placeholder logits could not be sized (%r), so DBO is refused for DSA models", exc)
        return
    reserve_placeholders(device, max_model_len, rows)  # marks the guard broken itself when the allocation fails


def _may_microbatch(builder: Any) -> bool:
    """The builder's engine's ``use_ubatching``; True when unreadable."""
    try:
        return bool(builder.vllm_config.parallel_config.use_ubatching)
    except Exception:
        return True


def _start_serving() -> None:
    """vLLM's start-up is over: later first planner launches count as in-step."""
    cache = schedule_cache()
    first = not cache.warmup.serving
    cache.warmup.start_serving()
    stats = cache.stats
    if first and (stats.warmups or stats.warm_failures or stats.jit_at_start):
        logger.info(
            "dbo_runtime: start-up cost: %d paged-MQA planner variants compiled at load in %.1f s (%d failed), %d "
            "more met first by vLLM's own start-up runs; every later first launch counts as jit_in_step "
            "(a persistent DG_JIT_CACHE_DIR makes the next start cheap)",
            stats.warmups, stats.warm_ns / 1e9, stats.warm_failures, stats.jit_at_start,
        )


def _make_builder_init(original: Any) -> Any:
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        activation.flush()
        # Runs inside vLLM's model load: registering the planner profile (and its warm-up) is an
        # optimisation and must never stop engine start (the call site plans on demand anyway).
        try:
            register_builder(self)
        except PatchError as exc:  # arming failed: its feature is marked broken, the first microbatched run stops
            logger.error("dbo_runtime: %s", exc)
        except Exception as exc:
            if "register_builder" not in _logged:
                _logged.add("register_builder")
                logger.warning("dbo_runtime: indexer planner profile not registered (%r); planners compile on first use", exc)
        reserve_builder_placeholders(self)

    return __init__


_logged: set[str] = set()


# -- call sites -----------------------------------------------------------------------------------
LOGITS_PARAMETERS = (
    "q", "kv_cache", "weights", "context_lens", "block_tables", "schedule_metadata", "max_model_len", "indices",
)  # fmt: skip
"""The logits function's parameters without ``logits_dtype``."""
LOGITS_DTYPE_PARAMETERS = (*LOGITS_PARAMETERS[:-1], "logits_dtype", "indices")
"""The same with ``logits_dtype`` (the placeholder takes that dtype)."""


def _fitted(schedule_metadata: Any, context_lens: Any, indices: Any, kv_cache: Any) -> Any:
    """The caller's schedule when it fits DeepGEMM's SMs now (or nothing microbatches), else the cache's re-plan."""
    cache = _sc._CACHE or schedule_cache()
    if cache.steps_aside or cache.fits(schedule_metadata):
        return schedule_metadata
    return cache.resolve(schedule_metadata, context_lens, indices, kv_cache)


def _make_logits(original: Any, where: str = "indexer.logits") -> Any:
    """The call site, in vLLM's own (anchored) signature. It shields itself: on a microbatch thread a failure is
    recorded and answered with placeholder logits, no kernel and no allocation; the step raises after the join."""
    import inspect

    try:
        parameters = dict(inspect.signature(original).parameters)
    except (TypeError, ValueError):
        parameters = {}
    if tuple(parameters) == LOGITS_DTYPE_PARAMETERS:  # with vLLM's own default dtype
        return _make_logits_with_dtype(original, where, parameters["logits_dtype"].default)
    require_parameters(original, LOGITS_PARAMETERS, where)

    @shields_itself
    def fp8_fp4_paged_mqa_logits(
        q: Any, kv_cache: Any, weights: Any, context_lens: Any, block_tables: Any, schedule_metadata: Any,
        max_model_len: int, indices: Any = None,
    ) -> Any:
        try:
            return original(
                q, kv_cache, weights, context_lens, block_tables,
                _fitted(schedule_metadata, context_lens, indices, kv_cache), max_model_len=max_model_len,
                indices=indices,
            )  # fmt: skip
        except Exception as exc:
            if not record(where, exc):
                raise
            return placeholder_logits(context_lens, weights, max_model_len)

    return fp8_fp4_paged_mqa_logits


def _make_logits_with_dtype(original: Any, where: str, default_dtype: Any) -> Any:
    @shields_itself
    def fp8_fp4_paged_mqa_logits(
        q: Any, kv_cache: Any, weights: Any, context_lens: Any, block_tables: Any, schedule_metadata: Any,
        max_model_len: int, logits_dtype: Any = default_dtype, indices: Any = None,
    ) -> Any:
        try:
            return original(
                q, kv_cache, weights, context_lens, block_tables,
                _fitted(schedule_metadata, context_lens, indices, kv_cache), max_model_len=max_model_len,
                logits_dtype=logits_dtype, indices=indices,
            )  # fmt: skip
        except Exception as exc:
            if not record(where, exc):
                raise
            return placeholder_logits(context_lens, weights, max_model_len, logits_dtype)

    return fp8_fp4_paged_mqa_logits


SLICE_PLANNER_PARAMETERS = ("context_lens", "block_size", "num_sms", "indices")


def _make_slice_planner(original: Any) -> Any:
    """SM100 chunked decode plans each row slice: plan for DeepGEMM's live count (what the kernel asserts) and
    track it as such: the call site neither re-plans it nor records a second planner into a capture."""
    require_parameters(original, SLICE_PLANNER_PARAMETERS, "indexer.slice_planner")

    def get_paged_mqa_logits_metadata(context_lens: Any, block_size: int, num_sms: int, indices: Any = None) -> Any:
        cache = _sc._CACHE or schedule_cache()
        if cache.steps_aside:
            return original(context_lens, block_size, num_sms, indices=indices)
        live = cache.live_num_sms()
        schedule = original(context_lens, block_size, live, indices=indices)
        cache.track(schedule, planned_sms=live, block_kv=int(block_size), next_n=next_n_of(context_lens))
        return schedule

    return get_paged_mqa_logits_metadata


UBATCH_UTILS = "vllm.v1.worker.ubatch_utils"
ALIAS = "deep_gemm_set_num_sms"
MRV1_WRAPPER_CALL = "vllm.v1.worker.gpu_ubatch_wrapper:UBatchWrapper.__call__"


def write_timing() -> tuple[str, ...]:
    """What ``LiveNumSms`` relies on besides the writers: every runner turns the count through the alias, on the
    main thread, around the microbatch threads' whole life."""
    mrv1 = (MRV1_WRAPPER_CALL,) if module_file(MRV1_WRAPPER_CALL.partition(":")[0]) is not None else ()
    return (
        f"{UBATCH_UTILS}:SMControlContextManager",
        f"{UBATCH_UTILS}:create_sm_control_context",
        *mrv1,
        "vllm.v1.worker.gpu.ubatch_utils:UBatchRunner.begin_capturable_run",
    )


def _refresh_live_count() -> None:
    """Once per step (main thread): re-read DeepGEMM's count at the next call site, and distrust the cache if a
    watched writer was rebound behind the plugin (in every step: without plan-ahead no build knows it microbatches)."""
    if LIVE_NUM_SMS.trusted and not LIVE_NUM_SMS.bindings_intact():
        LIVE_NUM_SMS.distrust()
        return
    LIVE_NUM_SMS.stale()


def _binding(module: str, attr: str) -> tuple[str, Any, str, Any]:
    """Where ``module.attr`` lives and what it holds now (the hook just installed there)."""
    loaded = sys.modules[module]
    return module, loaded, attr, vars(loaded).get(attr)


def _restore_alias() -> None:
    """Uninstall hands the alias vLLM's own function, even where it was bound to our wrapper."""
    module = sys.modules.get(UBATCH_UTILS)
    current: Any = getattr(module, ALIAS, None)
    hook = "indexer.sm_writes."
    while str(getattr(current, PATCH_MARK, "")).startswith(hook) and getattr(current, "__wrapped__", None) is not None:
        current = current.__wrapped__
    if module is not None and current is not None:
        setattr(module, ALIAS, current)


def _sm_writes_patch(name: str, module: str, attr: str) -> Patch:
    """A writer of DeepGEMM's SM count: after each write the call site's cached count is re-read."""
    writer = f"{module}.{attr}"

    def make(original: Any) -> Any:
        @functools.wraps(original)
        def set_num_sms(num_sms: int) -> None:
            ARMING.arm(writer)  # before the count changes: from here on a schedule may not fit the live count
            (_sc._CACHE or schedule_cache()).stop_stepping_aside()
            try:
                original(num_sms)
            finally:
                LIVE_NUM_SMS.stale()

        return set_num_sms

    def uninstalled() -> None:
        LIVE_NUM_SMS.unwatch(writer)
        # Both: the alias may have bound the wrapper's hook while its own patch was skipped or failed.
        _restore_alias()

    return Patch(
        name=name, module=module, attr=attr, make=make, anchors=(f"{DEEP_GEMM_WRAPPER}:set_num_sms", *write_timing()),
        reason="mark the indexer call site's cached DeepGEMM SM count stale after every write, so the call site "
        "reads the count once per change instead of calling DeepGEMM's torch op (a dispatch and a GIL release) "
        "once per indexer layer; a write also ends the indexer hooks' stepping aside for the process",
        upstream_pr="none (a dbo_runtime cost measure)",
        removal="the call site stops asking DeepGEMM for its live count (vLLM records the planned count itself, #60732)",
        lazy=True, optional=True,
        on_install=lambda: LIVE_NUM_SMS.watch(writer, _binding(module, attr)), on_uninstall=uninstalled,
    )


# -- plan-ahead scopes ----------------------------------------------------------------------------
def _make_mrv1_build_attention_metadata(original: Any) -> Any:
    slots = ArgSlots(original, ("ubatch_slices",), bound=True)

    def _build_attention_metadata(self: Any, *args: Any, **kwargs: Any) -> Any:
        if slots.get("ubatch_slices", args, kwargs) is None:
            return original(self, *args, **kwargs)
        ARMING.arm("GPUModelRunner._build_attention_metadata")  # plan-ahead leaves the schedule to the call site
        count_microbatched_build()
        with schedule_cache().microbatched_build():
            return original(self, *args, **kwargs)

    return _build_attention_metadata


def _make_mrv2_prepare(original: Any) -> Any:
    slots = ArgSlots(original, ("for_capture",), bound=True)

    def prepare(self: Any, *args: Any, **kwargs: Any) -> Any:
        ARMING.arm("UBatchRunner.prepare")  # plan-ahead leaves the schedule to the call site
        count_microbatched_build(for_capture=bool(slots.get("for_capture", args, kwargs)))
        with schedule_cache().microbatched_build():
            return original(self, *args, **kwargs)

    return prepare


def _logits_patch(label: str, module: str, caller: str, reason: str, removal: str, architectures: tuple[str, ...] = ()) -> Patch:
    """A module that binds the logits function by ``from``, and its caller there."""
    return Patch(
        name=f"indexer.logits.{label}", module=module, attr="fp8_fp4_paged_mqa_logits",
        make=functools.partial(_make_logits, where=f"indexer.logits.{label}"),
        anchors=(f"{DEEP_GEMM_WRAPPER}:fp8_fp4_paged_mqa_logits", f"{module}:{caller}"),
        architectures=architectures, reason=reason, upstream_pr=UPSTREAM_PR, removal=removal, lazy=True,
        runs_on_ubatch_thread=True,
        # until then every schedule matches the count in force: vLLM's own function
        armed_at_first_microbatch=True,
    )


def patches() -> list[Patch]:
    removal_cache = "vLLM records the planned SM count on the decode metadata and re-plans at the call site (#60732)"
    logits_reason = (
        "hand the schedule to IndexerScheduleCache: re-plan once per SM count when DeepGEMM's live count "
        "differs (DBO), always record the planner inside CUDA-graph capture"
    )
    builder = functools.partial(Patch, module=INDEXER_MODULE, upstream_pr=UPSTREAM_PR, removal=removal_cache, lazy=True)
    plan_ahead = functools.partial(
        Patch, upstream_pr="none (improvement over #60732: zero steady-state re-plans)",
        removal="vLLM passes the microbatch SM budget to the indexer builder", lazy=True,
        optional=True,  # without it the call site re-plans for the live count (#60732's path): slower, as correct
    )
    return [
        builder(
            name="indexer.builder_init", attr=f"{BUILDER}.__init__", make=_make_builder_init,
            reason="register the planner shapes vLLM will run microbatched (FULL capture sizes, the full "
            "max_num_seqs batch, from the builder's vLLM config) so the DBO SM count's planner is JIT-compiled "
            "at model load, never in a step or a capture",
            removal="DeepGEMM planner compiled ahead for the DBO count upstream",
            on_install=lambda: guard.after_warm_up(_start_serving),
            on_uninstall=lambda: guard.after_warm_up(_start_serving, remove=True),
        ),
        builder(
            name="indexer.builder_planner", attr="get_paged_mqa_logits_metadata", make=_make_builder_planner,
            anchors=(
                f"{DEEP_GEMM_WRAPPER}:get_paged_mqa_logits_metadata",
                f"{INDEXER_MODULE}:{BUILDER}.build",
                f"{INDEXER_MODULE}:{BUILDER}.update_draft_decode_metadata",
            ),
            reason="learn the SM count build()/update_draft_decode_metadata() planned for; while a runner builds "
            "microbatch metadata, plan for the DBO count (plan-ahead: no call-site re-plan) at the first eager "
            "call site instead of in build() (a FULL-graph replay re-plans in the graph and never reads it)",
        ),
        builder(
            name="indexer.builder_build", attr=f"{BUILDER}.build", make=_make_build,
            reason="attach (planned SMs, block size, next_n) to each new decode schedule; a new build is a new "
            "cache entry. In a process whose engines never microbatch (and whose writes to DeepGEMM's count are "
            "watched) it steps aside, with the planner and call-site hooks: vLLM's build as it is",
        ),
        builder(
            name="indexer.builder_update_draft", attr=f"{BUILDER}.update_draft_decode_metadata",
            make=_make_update_draft,
            reason="seq_lens are rewritten in place: drop cached re-plans; re-plan for the schedule's own count "
            "(vLLM asserts an unchanged shape)",
        ),
        _logits_patch("sparse_attn_indexer", SPARSE_ATTN_INDEXER_MODULE, "sparse_attn_indexer",
                      logits_reason + " (custom-op path and the DSA model's direct call)", removal_cache),
        _logits_patch("glm5next", GLM5NEXT_MODULE, "sparse_attn_indexer_kpool", logits_reason + " (GLM-5-Next kpool indexer)",
                      removal_cache, architectures=("Glm5NextForCausalLM", "Glm5NextForConditionalGeneration")),
        builder(
            name="indexer.slice_planner", module=SPARSE_ATTN_INDEXER_MODULE, attr="get_paged_mqa_logits_metadata",
            make=_make_slice_planner,
            anchors=(
                f"{DEEP_GEMM_WRAPPER}:get_paged_mqa_logits_metadata",
                f"{SPARSE_ATTN_INDEXER_MODULE}:_varlen_decode_rows",
            ),
            reason="the SM100 chunked decode re-plans each row slice for the whole batch's planned count and runs "
            "the logits kernel on it: plan the slice for DeepGEMM's live count (DBO) and track it for the call site",
            # A cost measure: without it the call site re-plans the slice for the live count (one more planner).
            optional=True, runs_on_ubatch_thread=True, armed_at_first_microbatch=True,
        ),
        _sm_writes_patch("indexer.sm_writes.deep_gemm", DEEP_GEMM_WRAPPER, "set_num_sms"),
        _sm_writes_patch("indexer.sm_writes.ubatch_alias", UBATCH_UTILS, ALIAS),
        plan_ahead(
            name="indexer.plan_ahead.mrv1", runner="mrv1", module=MRV1_RUNNER_MODULE,
            attr="GPUModelRunner._build_attention_metadata", make=_make_mrv1_build_attention_metadata,
            reason="metadata built with ubatch_slices is for a microbatched step: plan the schedule for the DBO "
            "compute count up front",
        ),
        plan_ahead(
            name="indexer.plan_ahead.mrv2", runner="mrv2", module=MRV2_UBATCH_MODULE, attr="UBatchRunner.prepare",
            make=_make_mrv2_prepare,
            # a deferred plan is safe only while FULL microbatched replays come from graphs captured after arming
            anchors=(f"{MRV2_UBATCH_MODULE}:UBatchRunner.prepare", "vllm.v1.worker.gpu.cudagraph_utils:ModelCudaGraphManager"),
            reason="UBatchRunner.prepare builds per-microbatch metadata: plan the schedule for the DBO compute "
            "count up front",
        ),
    ]
