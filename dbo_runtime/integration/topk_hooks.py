"""Per-microbatch shared top-k for GLM-5.x IndexCache layers under DBO (vllm#60734): followers read the leader's
top-k from state the other microbatch overwrites (``topk_indices_buffer``, index groups' workspaces and events);
``register_layer`` attaches ``UbatchTopkState`` or refuses, and per-access hooks resolve the caller's view."""

from __future__ import annotations

import functools
import importlib
import threading
from collections.abc import Mapping
from typing import Any

from dbo_runtime.core import coverage
from dbo_runtime.core.errors import UnsupportedConfiguration, ways_out
from dbo_runtime.core.log import get_logger
from dbo_runtime.integration import fingerprints, guard
from dbo_runtime.integration.engine_config import decode_rows, model_of
from dbo_runtime.integration.features import Feature, Probe, Reliance, Upstream
from dbo_runtime.integration.patching import ArgSlots, Patch, require_parameters
from dbo_runtime.integration.ubatch_failures import MicrobatchAttr, record, shields_itself
from dbo_runtime.integration.ubatch_ids import THREAD_TABLE
from dbo_runtime.services.topk_state import UbatchTopkState, window_end_reachable

UPSTREAM_PR = "vllm#60734 (per-microbatch DSA shared-indexer top-k); see also vllm#56476 dbo_select_buffer"
REMOVAL = "remove when the supported vLLM keeps shared top-k state per DBO microbatch (vllm#60734 merged)"
ATTR = "topk_indices_buffer"
_topk_patch = functools.partial(Patch, upstream_pr=UPSTREAM_PR, removal=REMOVAL, lazy=True)
_per_access = functools.partial(_topk_patch, runs_on_ubatch_thread=True, armed_at_first_microbatch=True)
"""A patch vLLM calls on microbatch threads, in force from the first microbatched run."""

_INDEX_GROUP = "vllm.v1.attention.backends.mla.index_group"
_SPARSE_MLA = "vllm.model_executor.layers.attention.sparse_mla_attention"
_V32_ATTENTION = "vllm.models.deepseek_v32.attention"
_SPARSE_INDEXER = "vllm.model_executor.layers.sparse_attn_indexer"
_V32_MODEL = "vllm.models.deepseek_v32.nvidia.model"
_FA4_SPARSE = "vllm.v1.attention.backends.mla.flashattn_mla_sparse"
_MISTRAL_INDEXER = "vllm.models.mistral.nvidia.indexer"

V32_ARCHITECTURES = ("DeepseekV32ForCausalLM", "GlmMoeDsaForCausalLM")
SHARED_GROUP_ARCHITECTURES = (*V32_ARCHITECTURES, "MistralLarge4ForCausalLM")
"""Architectures whose followers share top-k through index groups."""

_UBATCH_UTILS = "vllm.v1.worker.ubatch_utils"
_MRV1_WRAPPER = "vllm.v1.worker.gpu_ubatch_wrapper:UBatchWrapper"
_MRV2_UBATCH = "vllm.v1.worker.gpu.ubatch_utils"
WINDOW_BOUNDARIES = (
    Reliance(
        "topk.ubatch_slices",
        (f"{_UBATCH_UTILS}:maybe_create_ubatch_slices", f"{_UBATCH_UTILS}:_pad_out_ubatch_slices",
         "vllm.v1.worker.ubatching:make_ubatch_contexts", "vllm.v1.worker.ubatching:UBatchContext.__init__"),
        "a window is the logical buffer from its microbatch's token offset: vLLM must split a step into contiguous "
        "token ranges and give each microbatch context its range's start",
    ),
    Reliance(
        "topk.ubatch_slices.mrv1",
        (f"{_MRV1_WRAPPER}._make_ubatch_metadata", f"{_MRV1_WRAPPER}._slice_model_inputs"),
        "the V1 runner runs each microbatch on its slice's tokens with that slice's start as token offset",
    ),
    Reliance(
        "topk.ubatch_slices.mrv2",
        (f"{_MRV2_UBATCH}:create_ubatch_slices", f"{_MRV2_UBATCH}:slice_model_inputs",
         f"{_MRV2_UBATCH}:UBatchRunner.begin_capturable_run"),
        "the V2 runner runs each microbatch on its slice's tokens with that slice's start as token offset",
    ),
    Reliance("topk.ubatch_metadata.mrv2", (f"{_MRV2_UBATCH}:UBatchRunner.prepare", f"{_MRV2_UBATCH}:_slice_input_batch",
             f"{_MRV2_UBATCH}:_slice_query_start_loc"),
             "the V2 runner builds each microbatch's metadata from its slice alone, query offsets from its first token"),
    Reliance("topk.ubatch_metadata.mrv1", (f"{_UBATCH_UTILS}:split_attn_metadata", f"{_UBATCH_UTILS}:_make_metadata_with_slice",
             "vllm.v1.worker.gpu_model_runner:GPUModelRunner._build_attention_metadata"),
             "the V1 runner builds each microbatch's metadata from its slice alone, query offsets from its first token"),
    Reliance("topk.shardq_start", (f"{_SPARSE_MLA}:build_shardq_metadata",),
             "ShardQ reads from topk_start, the decode token count of the metadata built: inside the microbatch's rows"),
    Reliance("topk.moe_placement.v32", (f"{_V32_MODEL}:DeepseekV32DecoderLayer.__init__",),
             "padding_reaches_live_rows: DSA's routed experts from first_k_dense_replace on, every moe_layer_freq-th"),
    Reliance("topk.moe_placement.mistral", ("vllm.models.mistral.common.layer_spec:get_layer_specs",),
             "padding_reaches_live_rows: Mistral's routed experts from first_k_dense_replace on, every moe_layer_freq-th"),
    Reliance("topk.decode_padding", (f"{_SPARSE_INDEXER}:sparse_attn_indexer",),
             "a padded decode microbatch writes B x next_n rows from its window's start: the window-end check's bound"),
)  # fmt: skip
"""The code that decides each microbatch's token range and rows, which the windows layout relies on."""

FEATURES = [
    Feature(
        coverage.TOPK_V32, "per-microbatch top-k for shared index groups (vllm#60734)", requires=("ubatch_guard",),
        relies_on=WINDOW_BOUNDARIES,
        upstream=Upstream(
            "vllm#60734: index groups keep top-k state per microbatch",
            (
                Probe("param", _INDEX_GROUP, "SparseMLAIndexGroupBuilder.__init__", "num_ubatches"),
                Probe("member", _INDEX_GROUP, "SparseMLAIndexGroup", "_topk_state"),
                Probe("uses", _INDEX_GROUP, "SparseMLAIndexGroup._convert_once", "_topk_state"),
            ),
        ),
        on_optional_skipped=lambda skipped: _fa4_scalars_skipped(skipped),
    )
]

_state: UbatchTopkState | None = None
_state_lock = threading.Lock()

logger = get_logger(__name__)


def default_state() -> UbatchTopkState:
    """The process-wide registry, resolving microbatches through vLLM's thread table."""
    global _state
    with _state_lock:
        if _state is None:
            from dbo_runtime.integration.ubatch_ids import current_ubatch

            _state = UbatchTopkState(current_ubatch)
        return _state


def current_state() -> UbatchTopkState | None:
    """The process-wide registry if a model ever created it (never creates one)."""
    return _state


def _num_ubatches(vllm_config: Any) -> int:
    if vllm_config is None:
        return 1
    from vllm.v1.worker.ubatch_utils import get_num_ubatches

    return int(get_num_ubatches(vllm_config.parallel_config))


def padding_reaches_live_rows(next_n: int, num_ubatches: int, moe_layer_freq: int, routed_experts: bool) -> bool:
    """Whether padded decode rows past a microbatch's end can land on the next one's before it reads them:
    only a dense layer between MoE layers (no DBO yield) lets a follower share a segment with the next leader."""
    return next_n > 1 and num_ubatches >= 2 and routed_experts and moe_layer_freq > 1


def _moe_layout(vllm_config: Any) -> tuple[int, bool]:
    """``(moe_layer_freq, has routed experts)`` as vLLM's DSA models read them to place their MoE layers."""
    model = vllm_config.model_config
    hf = getattr(model, "hf_text_config", None) or model.hf_config
    return int(getattr(hf, "moe_layer_freq", 1) or 1), getattr(hf, "n_routed_experts", None) is not None


def _check_window_end(state: UbatchTopkState, vllm_config: Any, num_ubatches: int) -> None:
    """Tell ``state`` whether this engine's padded decode rows can pass a window's end or reach the next
    microbatch's rows while it still reads them (unreadable config: yes)."""
    try:
        next_n, rows = decode_rows(vllm_config)
        tokens = int(vllm_config.scheduler_config.max_num_batched_tokens)
        freq, experts = _moe_layout(vllm_config) if next_n > 1 else (1, False)
    except Exception as exc:
        state.windows_too_short = f"the engine's sizes could not be read to bound a window ({exc!r})"
        return
    if window_end_reachable(rows, tokens, next_n, num_ubatches):
        state.windows_too_short = (
            f"with {next_n - 1} speculative tokens a decode microbatch can write up to {rows} top-k rows "
            f"(max_num_seqs x {next_n}, or a FULL-graph capture size), more than the {tokens // num_ubatches} a "
            f"window past the split is sure to hold (max_num_batched_tokens {tokens} over {num_ubatches} microbatches)"
        )
    elif padding_reaches_live_rows(next_n, num_ubatches, freq, experts):
        state.windows_too_short = (
            f"with {next_n - 1} speculative tokens a decode microbatch's padded top-k rows pass its last token into "
            f"the next microbatch's window, and with moe_layer_freq {freq} a dense layer (where DBO does not yield) "
            "can put that write before the next microbatch's followers read those rows"
        )


def _make_event() -> Any:
    """An event as vLLM's builder makes the group's own."""
    module = importlib.import_module(_INDEX_GROUP)
    factory = getattr(module, "_create_event", None)
    return factory() if factory is not None else module.torch.Event()


def _hisparse(vllm_config: Any) -> bool:
    return getattr(getattr(vllm_config, "attention_config", None), "hisparse_config", None) is not None


def honours_indexer_types() -> bool:
    """Whether this vLLM picks followers with ``compute_skip_topk_layers`` (read from source, not the version)."""
    return fingerprints.calls(_V32_ATTENTION, "DeepseekV32Attention.__init__", "compute_skip_topk_layers")


def _model_shares_topk(vllm_config: Any) -> bool:
    """Whether vLLM builds layers that reuse top-k for this config."""
    arch, hf = model_of(vllm_config, "this model")
    return hf is not None and bool(coverage.shared_topk(arch, hf, indexer_types=honours_indexer_types()))


def _refuse_hisparse() -> None:
    raise UnsupportedConfiguration(
        "dbo_runtime refuses HiSparse (attention_config.hisparse_config) with --enable-dbo and layers that reuse "
        "an earlier layer's top-k: HiSparse stages the shared top-k without a microbatch dimension and holds the "
        "index group's stream and events by reference, so microbatches would read each other's selection. "
        + ways_out(also="start without HiSparse")
    )


def _refuse(arch: str, reason: str, *, build: bool) -> None:
    """One line: the architecture, the real reason and the ways out. ``core.coverage``'s reason where it refuses
    the architecture (a fixed one's is ROCm's); elsewhere ``reason``, and where the cause is this vLLM build
    (``build``) a verified release is a way out."""
    row = coverage.BY_ARCHITECTURE.get(arch)
    if row is not None and row.refusal and (row.status == "refused" or guard.platform() == "rocm"):
        reason, ways = row.refusal, ways_out()
    else:
        ways = ways_out(verified=guard.VERIFIED if build else ())
    raise UnsupportedConfiguration(
        f"dbo_runtime refuses {arch} with --enable-dbo: its layers reuse an earlier layer's top-k, but {reason}, "
        "so under DBO one microbatch would read the other's selection with no error. " + ways
    )


def _refuse_unsupported(builder: Any, vllm_config: Any, state: UbatchTopkState) -> None:
    if _hisparse(vllm_config):
        _refuse_hisparse()
    if not state.is_model_buffer(builder.logical_topk_indices):
        arch = model_of(vllm_config, "this model")[0]
        if build := arch in SHARED_GROUP_ARCHITECTURES:
            why = "the patch that hands its indexer that buffer is not installed: this vLLM's code is not verified"
        else:
            why = "not the CUDA DSA model's: the torch.compiled generic DeepseekV2 path bakes it into its graph"
        _refuse(arch, f"its index groups use a top-k buffer dbo_runtime gives no per-microbatch view ({why})", build=build)


def _register_layer_patch(state: UbatchTopkState) -> Patch:
    def make(original: Any) -> Any:
        # by name: the row-width keyword differs between releases
        slots = ArgSlots(original, ("is_index_producing_layer", "vllm_config"), bound=True)

        @functools.wraps(original)
        def register_layer(self: Any, *args: Any, **kwargs: Any) -> Any:
            is_index_producing_layer, vllm_config = slots.read(args, kwargs)
            follower = not is_index_producing_layer and self.current_group is not None
            config = _current_config() if vllm_config is None else vllm_config
            num_ubatches = _num_ubatches(config)
            if num_ubatches > 1:
                if follower:
                    _refuse_unsupported(self, config, state)
                elif not is_index_producing_layer:  # no group: a top-k nothing ties it to
                    _refuse(model_of(config, "this model")[0], "it builds its sparse MLA layers without a shared index-group builder", build=False)
                elif _hisparse(config) and _model_shares_topk(config):
                    _refuse_hisparse()  # before HiSparse builds host caches for the leader
            result = original(self, *args, **kwargs)
            if follower and num_ubatches > 1 and not state.is_attached(result[0]):
                _check_window_end(state, config, num_ubatches)
                state.attach(result[0], num_ubatches, _make_event)
                # Once per process at INFO (the first group with followers); the rest at DEBUG.
                log = logger.info if state.num_groups() == 1 else logger.debug
                log(
                    "dbo_runtime: per-microbatch top-k state for index groups with followers "
                    "(%s layout, %d groups so far, %d extra bytes)",
                    state.layout, state.num_groups(), state.extra_bytes(),
                )
            return result

        return register_layer

    return _topk_patch(
        name="topk.builder_register_layer", module=_INDEX_GROUP, attr="SparseMLAIndexGroupBuilder.register_layer",
        make=make,
        anchors=(f"{_INDEX_GROUP}:SparseMLAIndexGroupBuilder.register_layer", f"{_INDEX_GROUP}:SparseMLAIndexGroup"),
        reason="allocate/attach per-microbatch top-k state when a group gets a follower under DBO; "
        "refuse HiSparse, the compiled generic path and followers built without a shared builder (ROCm DSA)",
        architectures=SHARED_GROUP_ARCHITECTURES,
    )


def _group_method_patch(name: str, method: str, make: Any) -> Patch:
    return _per_access(
        name=name, module=_INDEX_GROUP, attr=f"SparseMLAIndexGroup.{method}", make=make,
        anchors=(f"{_INDEX_GROUP}:SparseMLAIndexGroup",),  # the view is right only while no other method touches its fields
        reason="run vLLM's conversion / ready-event record on the calling microbatch's physical "
        "workspace and events instead of the group's single copy",
        architectures=SHARED_GROUP_ARCHITECTURES,
    )


CONVERT_ONCE_PARAMETERS = (
    "self", "layer_index", "logical_topk_indices", "req_id_per_token", "block_table", "block_size",
    "block_stride_rows", "return_valid_counts", "idx_mapping",
)  # fmt: skip
"""vLLM's ``_convert_once`` parameters, taken one for one."""


def _convert_once_patch(state: UbatchTopkState) -> Patch:
    """Called once per layer per step: vLLM's own signature (anchored), shielded by the ``try`` here."""
    where = "topk.group_convert_once"

    def make(original: Any) -> Any:
        require_parameters(original, CONVERT_ONCE_PARAMETERS, where)

        @shields_itself
        @functools.wraps(original)
        def _convert_once(
            self: Any, layer_index: int, logical_topk_indices: Any, req_id_per_token: Any, block_table: Any,
            block_size: int, *, block_stride_rows: int | None, return_valid_counts: bool, idx_mapping: Any = None,
        ) -> Any:
            table = THREAD_TABLE
            try:
                # no microbatch thread: the group itself (ubatch_ids.THREAD_TABLE), else the caller's view
                view = None if table and not table[0] else state.group_view(self)
                return original(
                    self if view is None else view, layer_index, logical_topk_indices, req_id_per_token, block_table,
                    block_size, block_stride_rows=block_stride_rows, return_valid_counts=return_valid_counts,
                    idx_mapping=idx_mapping,
                )  # fmt: skip
            except Exception as exc:
                if not record(where, exc):
                    raise
                return original(
                    self, layer_index, logical_topk_indices, req_id_per_token, block_table, block_size,
                    block_stride_rows=block_stride_rows, return_valid_counts=return_valid_counts, idx_mapping=idx_mapping,
                )  # fmt: skip

        return _convert_once

    return _group_method_patch(where, "_convert_once", make)


def _ready_patch(state: UbatchTopkState) -> Patch:
    """Every layer but a group's first returns at once, as vLLM's (anchored) code does."""
    where = "topk.group_set_logical_topk_ready"

    def make(original: Any) -> Any:
        require_parameters(original, ("self", "layer_index"), where)

        @shields_itself
        @functools.wraps(original)
        def set_logical_topk_ready(self: Any, layer_index: int) -> None:
            if layer_index != 0:
                return None
            table = THREAD_TABLE
            try:
                view = None if table and not table[0] else state.group_view(self)  # as in _convert_once_patch
                return original(self if view is None else view, layer_index)  # type: ignore[no-any-return]
            except Exception as exc:
                if not record(where, exc):
                    raise
                return original(self, layer_index)  # type: ignore[no-any-return]

        return set_logical_topk_ready

    return _group_method_patch(where, "set_logical_topk_ready", make)


class TopkIndicesBufferAttr(MicrobatchAttr):
    """A top-k buffer attribute that resolves the calling microbatch's buffer. ``marks_model_buffer``: it holds
    the DSA model's buffer; ``registers``: a model-wide buffer shared without an index group (V4.1)."""

    def __init__(self, state: UbatchTopkState, name: str = ATTR, *, marks_model_buffer: bool = False, registers: bool = False) -> None:
        super().__init__(name)
        self.state = state
        self.marks_model_buffer = marks_model_buffer
        self.registers = registers

    def resolve(self, obj: Any, value: Any) -> Any:
        return self.state.logical(value)

    def __set__(self, obj: Any, value: Any) -> None:
        obj.__dict__[self.name] = value
        if self.marks_model_buffer:
            self.state.mark_model_buffer(value)
        if self.registers:
            config = _current_config()
            num_ubatches = _num_ubatches(config)
            if num_ubatches > 1:
                _check_window_end(self.state, config, num_ubatches)
            views = self.state.register_logical(value, num_ubatches)
            anchor = f"_dbo_runtime_views_{self.name}"
            if views is not None:
                obj.__dict__[anchor] = views
            else:
                obj.__dict__.pop(anchor, None)


def _current_config() -> Any:
    from vllm.config import get_current_vllm_config_or_none

    return get_current_vllm_config_or_none()


def _descriptor_patch(
    state: UbatchTopkState, module: str, cls: str, *, model: bool = False,
    architectures: tuple[str, ...] = V32_ARCHITECTURES, optional: bool = False,
) -> Patch:
    shared_by = ("MistralLarge4ForCausalLM", "DeepseekV41ForCausalLM") if module == _SPARSE_INDEXER else ()
    return _topk_patch(
        name=f"topk.{cls}.{ATTR}", module=module, attr=f"{cls}.{ATTR}",
        make=lambda original: TopkIndicesBufferAttr(state, marks_model_buffer=model),
        reason=(
            "the model's logical top-k buffer, marked as resolvable per microbatch at its assignment (model "
            "construction); getter/setter/deleter (MRV1 proposer dels then assigns)"
            if model
            else "writers of the leader's top-k resolve the calling microbatch's logical buffer"
        ),
        adds=True, optional=optional,
        # also writes Mistral Large 4's and DeepSeek-V4.1's shared buffers
        architectures=(*architectures, *shared_by),
        runs_on_ubatch_thread=True,
        # The model's setter marks its buffer at construction, before any run: always in force.
        armed_at_first_microbatch=not model,
    )


def _shared_buffer_patch(state: UbatchTopkState) -> Patch:
    where = "topk.SharedTopkIndicesBuffer.topk_indices_buffer"

    def make(original: Any) -> Any:
        fget, fset, fdel = original.fget, original.fset, original.fdel

        @shields_itself
        def topk_indices_buffer(self: Any) -> Any:
            try:
                value = fget(self)
                table = THREAD_TABLE
                if table and not table[0]:  # no microbatch thread: the buffer itself (ubatch_ids.THREAD_TABLE)
                    return value
                return state.logical(value)
            except Exception as exc:
                if not record(where, exc):
                    raise
                return fget(self)

        return property(topk_indices_buffer, fset, fdel, original.__doc__)

    return _per_access(
        name=where, module=_SPARSE_MLA, attr=f"SharedTopkIndicesBuffer.{ATTR}", make=make,
        # windows are right only while every reader indexes from its own microbatch's row 0
        anchors=tuple(f"{_SPARSE_MLA}:{c}" for c in ("SharedTopkIndicesBuffer", "SparseMLACommonImpl", "SparseMLACommonMetadataBuilder")),
        reason="followers' sparse MLA impls read the calling microbatch's logical buffer",
        architectures=SHARED_GROUP_ARCHITECTURES,
    )


FA4_SCALARS = "topk.fa4_varlen_scalars"
"""Optional: skipped where FA4 sparse MLA is absent."""


def _fa4_scalars_skipped(skipped: Mapping[str, str]) -> None:
    """Without it the windows layout would grow FA4's never-evicted cache: the layout falls back."""
    if FA4_SCALARS in skipped and fa4_module_present():
        default_state().windows_unsafe = (
            f"{FA4_SCALARS} is not installed ({skipped[FA4_SCALARS]}), so FA4 sparse MLA would "
            "cache three device tensors per split point, never evicted"
        )


def fa4_module_present() -> bool:
    """Whether this vLLM ships FA4 sparse MLA (found without importing it)."""
    return fingerprints.module_file(_FA4_SPARSE) is not None


def _fa4_scalars_patch(state: UbatchTopkState) -> Patch:
    """FA4's never-evicted scalar cache, keyed on the full buffer's rows instead of a window's: the scalars are
    prefixes the caller slices, so the values are identical and a new split point adds no entry."""

    def make(original: Any) -> Any:
        def _fa4_varlen_scalars(num_tokens: int, num_kv_rows: int, device: Any) -> Any:
            try:
                rows = state.max_logical_rows()
            except Exception:
                # vLLM's own key is correct (only one more cache entry), so no failure to report.
                logger.debug("dbo_runtime: FA4 scalar key fell back to num_tokens", exc_info=True)
                rows = 0
            return original(rows if 0 < num_tokens < rows else num_tokens, num_kv_rows, device)

        return _fa4_varlen_scalars

    return _per_access(
        name=FA4_SCALARS, module=_FA4_SPARSE, attr="_fa4_varlen_scalars", make=make,
        reason="keep FA4's never-evicted varlen-scalar cache at one entry when microbatch 1 reads a window "
        "of the logical top-k buffer (a new window length per split point would leak device memory)",
        optional=True,
    )


def patches(state: UbatchTopkState | None = None) -> list[Patch]:
    """All top-k patches, bound to ``state`` (the process registry by default)."""
    st = state if state is not None else default_state()
    return [
        _register_layer_patch(st), _convert_once_patch(st), _ready_patch(st), _shared_buffer_patch(st),
        _descriptor_patch(st, _V32_ATTENTION, "DeepseekV32Attention"),
        _descriptor_patch(st, _V32_ATTENTION, "DeepseekV32Indexer"),
        _descriptor_patch(st, _SPARSE_INDEXER, "SparseAttnIndexer"),
        _descriptor_patch(st, _V32_MODEL, "DeepseekV32Model", model=True),
        # Mistral Large 4 hands its buffer to each leader's indexer; optional and fail-closed: where skipped
        # nothing marks the buffer and register_layer refuses
        _descriptor_patch(
            st, _MISTRAL_INDEXER, "MistralIndexer", model=True, architectures=("MistralLarge4ForCausalLM",), optional=True
        ),
        _fa4_scalars_patch(st),
    ]
