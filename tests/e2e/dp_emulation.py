"""The one-GPU DBO emulation: vLLM at data-parallel size 1 microbatches as if one DP peer ran the same batch.

Test harness only: nothing under ``dbo_runtime/`` imports it. It is loaded into every vLLM process of a run by
``tests/e2e/emulate/dp_peer/sitecustomize.py`` (on ``PYTHONPATH``) when ``DBO_EMULATE_DP_PEER=1``, and patches
vLLM's targets by name right after their module is imported. It emulates only the DP peer:

- the vote: vLLM's own DP vote (``coordinate_batch_across_dp`` on the V1 runner, ``dispatch_cg_and_sync_dp`` on
  V2) runs as at DP 2 under vLLM's ``skip_dp_coordination``, where the peer's row is this rank's own: the peer
  agrees with the same batch, so ``check_ubatch_thresholds`` and ``is_last_ubatch_empty`` decide;
- the DP metadata the microbatch code expects (``DPMetadata`` for one rank; V2's ``UBatchRunner`` built at DP 1);
- the switch points of DeepEP high-throughput dispatch and combine: the no-EP MoE prepare/finalize is declared
  DBO-capable and yields where DeepEP HT's would (one yield at dispatch, two at combine).

Everything else is vLLM's own: the microbatch wrapper or runner, its threads, SM control
(``VLLM_DBO_COMM_SMS`` lowers DeepGEMM's count without EP), the indexer, the index groups, kernels, CUDA graphs.

Counters (per worker, ``llm.collective_rpc("dbo_emulation_counters")``): steps, microbatched steps (those
replayed from a FULL graph apart), yields inside steps. With ``DBO_EMULATE_TOPK_CHECK=1`` (eager only) every
follower layer's top-k read under microbatching is compared on the GPU with its own microbatch's leader's, and
DeepSeek-V4's MTP hidden buffer, after both microbatches joined, with each microbatch's rows at its token offset
(what the drafter reads in global token order).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.abc
import importlib.machinery
import inspect
import os
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

NAME = "one-GPU DBO emulation"
ENV = "DBO_EMULATE_DP_PEER"
CHECK_ENV = "DBO_EMULATE_TOPK_CHECK"
RPC = "dbo_emulation_counters"
YIELDS_PER_MOE_LAYER = 3
"""Per microbatch and MoE layer, as DeepEP HT under DBO: one yield before dispatch, two around combine."""


@dataclasses.dataclass(frozen=True)
class Target:
    """A vLLM attribute the emulation patches or calls, with the parameters it relies on (in order, a prefix of
    the real signature); ``()`` for a non-callable or a callable whose parameters it does not rely on."""

    module: str
    attribute: str
    params: tuple[str, ...] = ()
    named: tuple[str, ...] = ()
    """Parameters the emulation reads by name wherever they stand (a rename would silently change its vote)."""


_COMMON = (
    Target("vllm.v1.worker.ubatch_utils", "check_ubatch_thresholds", ("config", "num_tokens", "uniform_decode")),
    Target("vllm.v1.worker.ubatch_utils", "is_last_ubatch_empty", ("orig_num_tokens", "padded_num_tokens", "num_ubatches")),
    Target("vllm.v1.worker.dp_utils", "skip_dp_coordination"),
    Target(
        "vllm.v1.worker.dp_utils",
        "coordinate_batch_across_dp",
        ("num_tokens_unpadded", "allow_microbatching", "parallel_config", "num_tokens_padded", "uniform_decode", "cudagraph_mode"),
    ),
    Target("vllm.forward_context", "DPMetadata.make", ("parallel_config", "num_tokens", "num_tokens_across_dp_cpu")),
    Target("vllm.forward_context", "DPMetadata.num_tokens_across_dp_cpu"),
    Target("vllm.v1.worker.ubatching", "dbo_enabled"),
    Target("vllm.v1.worker.ubatching", "dbo_current_ubatch_id"),
    Target("vllm.v1.worker.ubatching", "dbo_current_ubatch_token_offset"),
    Target("vllm.v1.worker.ubatching", "dbo_yield_and_switch_from_compute_to_comm"),
    Target("vllm.v1.worker.ubatching", "dbo_yield_and_switch_from_comm_to_compute"),
    Target("vllm.v1.worker.ubatching", "dbo_switch_to_compute_sync"),
    Target("vllm.v1.worker.ubatching", "dbo_switch_to_compute"),
    Target("vllm.v1.worker.ubatching", "dbo_switch_to_comm"),
    Target("vllm.v1.worker.ubatch_utils", "create_sm_control_context", ("parallel_config",)),
    Target(
        "vllm.model_executor.layers.fused_moe.prepare_finalize.no_dp_ep",
        "MoEPrepareAndFinalizeNoDPEPModular.prepare",
        ("self", "a1", "topk_weights", "topk_ids", "num_experts", "expert_map", "apply_router_weight_on_input", "quant_config"),
    ),
    Target(
        "vllm.model_executor.layers.fused_moe.prepare_finalize.no_dp_ep",
        "MoEPrepareAndFinalizeNoDPEPModular.finalize",
        ("self", "output", "fused_expert_output", "topk_weights", "topk_ids", "apply_router_weight_on_input", "weight_and_reduce_impl"),
    ),
    Target("vllm.model_executor.layers.fused_moe.prepare_finalize.no_dp_ep", "MoEPrepareAndFinalizeNoDPEPModular.supports_dbo", ("self",)),
    Target(
        "vllm.model_executor.layers.fused_moe.prepare_finalize.no_dp_ep",
        "MoEPrepareAndFinalizeNoDPEPModular.supports_deferred_moe_finalize",
        ("self",),
    ),
    Target(
        "vllm.model_executor.layers.fused_moe.prepare_finalize.no_dp_ep",
        "MoEPrepareAndFinalizeNoDPEPMonolithic.prepare",
        ("self", "a1", "router_logits", "quant_config"),
    ),
    Target(
        "vllm.model_executor.layers.fused_moe.prepare_finalize.no_dp_ep",
        "MoEPrepareAndFinalizeNoDPEPMonolithic.finalize",
        ("self", "fused_expert_output"),
    ),
    Target("vllm.model_executor.layers.fused_moe.prepare_finalize.no_dp_ep", "MoEPrepareAndFinalizeNoDPEPMonolithic.supports_dbo", ("self",)),
    Target(
        "vllm.model_executor.layers.fused_moe.prepare_finalize.no_dp_ep",
        "MoEPrepareAndFinalizeNoDPEPMonolithic.supports_deferred_moe_finalize",
        ("self",),
    ),
    Target("vllm.v1.worker.gpu_worker", "Worker"),
    Target(
        "vllm.models.deepseek_v32.attention",
        "DeepseekV32Attention._sparse_indexer_and_attn",
        ("self", "positions"),
    ),
    Target("vllm.models.deepseek_v4.nvidia.model", "DeepseekV4Model.forward", ("self",)),
    Target("vllm.models.deepseek_v4.nvidia.model", "hc_head_fused_kernel_tilelang", ("hs_flat",)),
)
_V1 = (
    Target(
        "vllm.v1.worker.gpu_model_runner",
        "GPUModelRunner._determine_batch_execution_and_padding",
        ("self", "num_tokens", "num_reqs", "num_scheduled_tokens_np", "max_num_scheduled_tokens"),
        ("allow_microbatching", "force_uniform_decode"),
    ),
    Target(
        "vllm.v1.worker.gpu_model_runner",
        "GPUModelRunner._is_uniform_decode",
        ("max_num_scheduled_tokens", "uniform_decode_query_len", "num_tokens", "num_reqs", "force_uniform_decode"),
    ),
    Target("vllm.v1.worker.gpu_model_runner", "GPUModelRunner.execute_model", ("self", "scheduler_output")),
    Target(
        "vllm.forward_context",
        "create_forward_context",
        ("attn_metadata", "vllm_config", "dp_metadata", "cudagraph_runtime_mode", "batch_descriptor", "ubatch_slices"),
    ),
    Target("vllm.v1.worker.gpu_ubatch_wrapper", "UBatchWrapper._run_ubatches", ("self", "ubatch_metadata", "model")),
)
_V2 = (
    Target(
        "vllm.v1.worker.gpu.model_runner",
        "dispatch_cg_and_sync_dp",
        ("cudagraph_manager", "num_reqs", "num_tokens", "uniform_token_count", "dp_size", "dp_rank"),
        ("allow_ubatching", "dp_sync_state"),
    ),
    Target("vllm.v1.worker.gpu.model_runner", "maybe_build_ubatch_runner", ("vllm_config", "device", "model_state", "attn_groups", "kv_cache_config", "max_num_reqs")),
    Target("vllm.v1.worker.gpu.model_runner", "GPUModelRunner.execute_model", ("self", "scheduler_output")),
    Target("vllm.v1.worker.gpu.dp_utils", "DPSyncState.num_tokens_across_dp"),
    Target("vllm.v1.worker.gpu.ubatch_utils", "UBatchRunner", ("vllm_config", "device", "model_state", "attn_groups", "kv_cache_config", "max_num_reqs")),
    Target("vllm.v1.worker.gpu.ubatch_utils", "UBatchRunner.begin_capturable_run", ("self", "model", "model_inputs", "ubatch_state")),
    Target("vllm.v1.worker.gpu.cudagraph_utils", "BatchExecutionDescriptor.num_ubatches"),
    Target("vllm.v1.worker.gpu.cudagraph_utils", "BatchExecutionDescriptor.cg_mode"),
)
_ML4 = (Target("vllm.models.mistral.nvidia.attention", "MistralMLAAttention.forward", ("self", "positions")),)
TARGETS: dict[str, tuple[Target, ...]] = {
    "0.33.0": _COMMON + _V1 + _V2,
    "0.34.0": _COMMON + _V2 + _ML4,
}
"""Every vLLM attribute the emulation reaches, per release (0.34.0 has no V1 runner, 0.33.0 no Mistral Large 4)."""
RUNNERS = {"0.33.0": ("v1", "v2"), "0.34.0": ("v2",)}


def release_of(version: str) -> str | None:
    """The table release a vLLM version string belongs to (``0.34.0``, ``0.34.0+cu130`` -> ``0.34.0``)."""
    base = version.split("+", 1)[0]
    return base if base in TARGETS else None


def resolve(target: Target) -> Any:
    """The live object a target names (import its module, walk the dotted attribute)."""
    obj: Any = importlib.import_module(target.module)
    for part in target.attribute.split("."):
        obj = getattr(obj, part) if not isinstance(obj, type) else _class_attr(obj, part)
    return obj


def _class_attr(cls: type, name: str) -> Any:
    """A class member without binding; dataclass fields (declared, maybe without default) by their annotation."""
    for klass in cls.__mro__:
        if name in vars(klass):
            value = vars(klass)[name]
            return value.__func__ if isinstance(value, (staticmethod, classmethod)) else value
        if name in getattr(klass, "__annotations__", {}):
            return dataclasses.MISSING
    raise AttributeError(f"{cls.__qualname__} has no attribute {name!r}")


def problems(release: str) -> list[str]:
    """What differs between a release's table and the installed vLLM: one line per missing target or parameter."""
    out = []
    for target in TARGETS[release]:
        where = f"{target.module}:{target.attribute}"
        try:
            obj = resolve(target)
        except (ImportError, AttributeError) as exc:
            out.append(f"{where} is missing ({exc})")
            continue
        if target.params:
            if not callable(obj):
                out.append(f"{where} is not callable")
                continue
            names = tuple(inspect.signature(obj).parameters)
            if names[: len(target.params)] != target.params or not set(target.named) <= set(names):
                out.append(f"{where} takes {names}, the emulation relies on {target.params} and {target.named}")
    return out


# ---------------------------------------------------------------------------------------------- counters


class _Counters:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.runner: str | None = None
        self.in_step = False
        self.steps = 0
        self.microbatched_steps = 0
        self.microbatched_graph_steps = 0
        self.votes_outside_steps = 0
        self.microbatched_outside_steps = 0
        self.yields_in_steps = 0
        self.yields_outside_steps = 0
        self.topk_reads = 0
        self.topk_wrong: Any = None  # a device int64 tensor, created on the first check
        self.mtp_hidden_checks = 0
        self.mtp_hidden_wrong: Any = None  # the same, for microbatches whose MTP hidden rows are not their own

    def snapshot(self) -> dict[str, Any]:
        eager = self.microbatched_steps - self.microbatched_graph_steps
        return {
            "emulation": NAME,
            "dp_emulated": True,
            "pid": os.getpid(),
            "runner": self.runner,
            "steps": self.steps,
            "microbatched_steps": self.microbatched_steps,
            "microbatched_graph_steps": self.microbatched_graph_steps,
            "microbatched_outside_steps": self.microbatched_outside_steps,
            "votes_outside_steps": self.votes_outside_steps,
            "yields_in_steps": self.yields_in_steps,
            "yields_outside_steps": self.yields_outside_steps,
            "yields_per_eager_microbatched_step": (self.yields_in_steps / eager) if eager else None,
            "topk_reads": self.topk_reads,
            "topk_wrong_reads": int(self.topk_wrong.item()) if self.topk_wrong is not None else 0,
            "mtp_hidden_checks": self.mtp_hidden_checks,
            "mtp_hidden_wrong": int(self.mtp_hidden_wrong.item()) if self.mtp_hidden_wrong is not None else 0,
        }


COUNTERS = _Counters()


def _vote(microbatched: bool, graph: bool) -> None:
    with COUNTERS.lock:
        if COUNTERS.in_step:
            COUNTERS.steps += 1
            COUNTERS.microbatched_steps += int(microbatched)
            COUNTERS.microbatched_graph_steps += int(microbatched and graph)
        else:
            COUNTERS.votes_outside_steps += 1
            COUNTERS.microbatched_outside_steps += int(microbatched)


def _count_yields(n: int) -> None:
    with COUNTERS.lock:
        if COUNTERS.in_step:
            COUNTERS.yields_in_steps += n
        else:
            COUNTERS.yields_outside_steps += n


def _step(runner: str, execute_model: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(execute_model)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        COUNTERS.runner = runner
        COUNTERS.in_step = True
        try:
            return execute_model(self, *args, **kwargs)
        finally:
            COUNTERS.in_step = False

    return wrapper


# ---------------------------------------------------------------------------------------------- the vote


class PeerConfig:
    """``ParallelConfig`` as a DP-2 rank 0 sees it: the vote's only view of the peer."""

    data_parallel_size = 2
    data_parallel_rank = 0

    def __init__(self, config: Any) -> None:
        self._config = config

    def __getattr__(self, name: str) -> Any:
        return getattr(self._config, name)


def peer_vote(
    parallel_config: Any, num_tokens_unpadded: int, num_tokens_padded: int, allow_microbatching: bool, uniform_decode: bool, cudagraph_mode: int
) -> tuple[bool, Any]:
    """vLLM's V1 vote with a peer that runs the same batch: ``(should_ubatch, num_tokens_across_dp)`` for one rank."""
    from vllm.v1.worker.dp_utils import coordinate_batch_across_dp, skip_dp_coordination

    with skip_dp_coordination():
        should, across, _ = coordinate_batch_across_dp(
            num_tokens_unpadded=num_tokens_unpadded,
            allow_microbatching=allow_microbatching,
            parallel_config=PeerConfig(parallel_config),
            num_tokens_padded=num_tokens_padded,
            uniform_decode=uniform_decode,
            cudagraph_mode=cudagraph_mode,
        )
    return bool(should), across[:1].clone()


def _patch_v1_runner(module: Any) -> None:
    cls = module.GPUModelRunner
    determine = cls._determine_batch_execution_and_padding
    signature = inspect.signature(determine)

    @functools.wraps(determine)
    def determine_with_peer(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = determine(self, *args, **kwargs)
        config = self.parallel_config
        if config.data_parallel_size != 1 or not config.use_ubatching:
            return result
        call = signature.bind(self, *args, **kwargs)
        call.apply_defaults()
        a = call.arguments
        cudagraph_mode, batch_descriptor, _, _, stats = result
        uniform = self._is_uniform_decode(
            max_num_scheduled_tokens=a["max_num_scheduled_tokens"],
            uniform_decode_query_len=self.uniform_decode_query_len,
            num_tokens=a["num_tokens"],
            num_reqs=a["num_reqs"],
            force_uniform_decode=a["force_uniform_decode"],
        )
        should, across = peer_vote(
            config, a["num_tokens"], batch_descriptor.num_tokens, a["allow_microbatching"], uniform, cudagraph_mode.value
        )
        _vote(should, should and cudagraph_mode.name == "FULL")
        return cudagraph_mode, batch_descriptor, should, across, stats

    cls._determine_batch_execution_and_padding = determine_with_peer
    cls.execute_model = _step("v1", cls.execute_model)
    from vllm.v1.worker.gpu_ubatch_wrapper import UBatchWrapper

    run = UBatchWrapper._run_ubatches

    @functools.wraps(run)
    def run_logged(self: Any, ubatch_metadata: Any, model: Any) -> Any:
        out = run(self, ubatch_metadata, _logged(model))
        _after_join()
        return out

    UBatchWrapper._run_ubatches = run_logged


def _logged(model: Callable[..., Any]) -> Callable[..., Any]:
    """The model as a microbatch thread runs it, printing what it raises: vLLM keeps a microbatch's exception
    until the join, and a sibling parked on a handoff that never comes turns the crash into a silent hang."""

    def forward(*args: Any, **kwargs: Any) -> Any:
        try:
            return model(*args, **kwargs)
        except BaseException as exc:
            sys.stderr.write(f"{NAME}: microbatch raised {type(exc).__name__}: {exc}\n")
            sys.stderr.flush()
            raise

    return forward


def _patch_v2_runner(module: Any) -> None:
    from vllm.v1.worker.dp_utils import skip_dp_coordination
    from vllm.v1.worker.gpu.ubatch_utils import UBatchRunner

    dispatch = module.dispatch_cg_and_sync_dp
    signature = inspect.signature(dispatch)

    @functools.wraps(dispatch)
    def dispatch_with_peer(*args: Any, **kwargs: Any) -> Any:
        call = signature.bind(*args, **kwargs)
        call.apply_defaults()
        a = call.arguments
        if a["dp_size"] != 1 or not a["allow_ubatching"] or a.get("dp_sync_state") is not None:
            return dispatch(*args, **kwargs)
        a["dp_size"], a["dp_rank"] = 2, 0
        with skip_dp_coordination():
            desc, sync = dispatch(*call.args, **call.kwargs)
        if sync is not None:
            sync = dataclasses.replace(sync, num_tokens_across_dp=sync.num_tokens_across_dp[:1].clone())
        microbatched = desc.num_ubatches > 1
        _vote(microbatched, microbatched and desc.cg_mode.name == "FULL")
        return desc, sync

    build = module.maybe_build_ubatch_runner

    @functools.wraps(build)
    def build_at_dp1(vllm_config: Any, *args: Any, **kwargs: Any) -> Any:
        config = vllm_config.parallel_config
        if config.use_ubatching and config.data_parallel_size == 1:
            return UBatchRunner(vllm_config, *args, **kwargs)
        return build(vllm_config, *args, **kwargs)

    begin = UBatchRunner.begin_capturable_run

    @functools.wraps(begin)
    def begin_logged(self: Any, model: Any, *args: Any, **kwargs: Any) -> Any:
        finish = begin(self, _logged(model), *args, **kwargs)

        def finish_checked() -> Any:
            out = finish()
            _after_join()
            return out

        return finish_checked

    UBatchRunner.begin_capturable_run = begin_logged
    module.dispatch_cg_and_sync_dp = dispatch_with_peer
    module.maybe_build_ubatch_runner = build_at_dp1
    module.GPUModelRunner.execute_model = _step("v2", module.GPUModelRunner.execute_model)


# ---------------------------------------------------------------------------------------------- DP metadata


def _patch_forward_context(module: Any) -> None:
    dp_metadata_cls = module.DPMetadata
    make = _class_attr(dp_metadata_cls, "make")

    def make_for_one_rank(parallel_config: Any, num_tokens: int, num_tokens_across_dp_cpu: Any) -> Any:
        if parallel_config.data_parallel_size == 1 and not parallel_config.use_sequence_parallel_moe:
            assert int(num_tokens_across_dp_cpu[0]) == num_tokens, (num_tokens_across_dp_cpu, num_tokens)
            return dp_metadata_cls(num_tokens_across_dp_cpu)
        return make(parallel_config, num_tokens, num_tokens_across_dp_cpu)

    dp_metadata_cls.make = staticmethod(make_for_one_rank)

    create = module.create_forward_context
    signature = inspect.signature(create)

    @functools.wraps(create)
    def create_with_dp_metadata(*args: Any, **kwargs: Any) -> Any:
        """V1's microbatch wrapper asserts the step's forward context carries DP metadata."""
        call = signature.bind(*args, **kwargs)
        slices = call.arguments.get("ubatch_slices")
        if slices is not None and call.arguments.get("dp_metadata") is None:
            import torch

            total = sum(s.num_tokens for s in slices)
            call.arguments["dp_metadata"] = dp_metadata_cls(torch.tensor([total], dtype=torch.int32))
            return create(*call.args, **call.kwargs)
        return create(*args, **kwargs)

    module.create_forward_context = create_with_dp_metadata


# ---------------------------------------------------------------------------------------------- switch points


def _dispatch_switch() -> None:
    """Where DeepEP HT's dispatch yields: before the kernel (to the other microbatch), back with a sync after."""
    from vllm.v1.worker import ubatching

    if ubatching.dbo_enabled():
        _count_yields(1)
        ubatching.dbo_yield_and_switch_from_compute_to_comm()
        ubatching.dbo_switch_to_compute_sync()


def _combine_switch() -> None:
    """Where DeepEP HT's combine yields: before the kernel, and again after its receiver's copy."""
    from vllm.v1.worker import ubatching

    if ubatching.dbo_enabled():
        _count_yields(2)
        ubatching.dbo_yield_and_switch_from_compute_to_comm()
        ubatching.dbo_switch_to_compute()
        ubatching.dbo_switch_to_comm()
        ubatching.dbo_yield_and_switch_from_comm_to_compute()


def _patch_prepare_finalize(module: Any) -> None:
    for cls in (module.MoEPrepareAndFinalizeNoDPEPModular, module.MoEPrepareAndFinalizeNoDPEPMonolithic):
        prepare, finalize = cls.prepare, cls.finalize

        def prepare_then_dispatch(self: Any, *args: Any, _prepare: Callable[..., Any] = prepare, **kwargs: Any) -> Any:
            result = _prepare(self, *args, **kwargs)
            _dispatch_switch()
            return result

        def finalize_then_combine(self: Any, *args: Any, _finalize: Callable[..., Any] = finalize, **kwargs: Any) -> Any:
            result = _finalize(self, *args, **kwargs)
            _combine_switch()
            return result

        cls.prepare = functools.wraps(prepare)(prepare_then_dispatch)
        cls.finalize = functools.wraps(finalize)(finalize_then_combine)
        cls.supports_dbo = lambda self: True
        # DeepEP HT's answer: its finalize (the combine) always runs, so its switch points always do
        cls.supports_deferred_moe_finalize = lambda self: False


# ---------------------------------------------------------------------------------------------- top-k check


def _topk_checked(run: Callable[..., Any], leads: Callable[[Any], bool], buffer: Callable[[Any], Any]) -> Callable[..., Any]:
    """``run(self, positions, ...)`` (one layer's sparse attention) with each follower's read of the logical top-k
    (``buffer(self)``, as the layer reads it) compared with its own microbatch's last leader's, counted on the GPU."""
    from vllm.v1.worker import ubatching

    leader_rows: dict[int, Any] = {}

    @functools.wraps(run)
    def checked(self: Any, positions: Any, *args: Any, **kwargs: Any) -> Any:
        if not ubatching.dbo_enabled():
            return run(self, positions, *args, **kwargs)
        ubatch = ubatching.dbo_current_ubatch_id()
        rows = int(positions.shape[0])
        leader = leads(self)
        if not leader and ubatch in leader_rows:
            expected = leader_rows[ubatch]
            n = min(rows, expected.shape[0])
            wrong = (buffer(self)[:n] != expected[:n]).any()
            with COUNTERS.lock:
                if COUNTERS.topk_wrong is None:
                    COUNTERS.topk_wrong = wrong.new_zeros((), dtype=_int64())
                COUNTERS.topk_wrong += wrong
                COUNTERS.topk_reads += 1
        out = run(self, positions, *args, **kwargs)
        if leader:
            leader_rows[ubatch] = buffer(self)[:rows].clone()
        return out

    return checked


def _patch_topk_check(module: Any) -> None:
    """DeepSeek-V3.2 / GLM-5.x: a layer leads when it runs its indexer (not ``skip_topk``)."""
    cls = module.DeepseekV32Attention
    cls._sparse_indexer_and_attn = _topk_checked(
        cls._sparse_indexer_and_attn, lambda a: a.indexer is not None and not a.skip_topk, lambda a: a.topk_indices_buffer
    )


def _patch_ml4_topk_check(module: Any) -> None:
    """Mistral Large 4: a layer leads when it has an indexer (``index_sharing`` "full"); every layer's sparse MLA
    reads the top-k through its impl (the indexer's buffer on a leader, the shared one on a follower)."""
    cls = module.MistralMLAAttention
    cls.forward = _topk_checked(cls.forward, lambda a: a.indexer is not None, lambda a: a.attn.impl.topk_indices_buffer)


_MTP_ROWS: list[tuple[int, Any, Any]] = []
"""(token offset, rows written, the whole buffer) per microbatch of the step under way (V4 MTP hidden check)."""
_V4_MODEL = threading.local()


def _patch_mtp_hidden_check(module: Any) -> None:
    """Record what each microbatch writes into V4's MTP hidden buffer (the rows handed to the hc head right after
    the copy); ``_after_join`` compares the buffer with them at each microbatch's own offset."""
    from vllm.v1.worker import ubatching

    cls = module.DeepseekV4Model
    forward, head = cls.forward, module.hc_head_fused_kernel_tilelang

    @functools.wraps(forward)
    def forward_tracked(self: Any, *args: Any, **kwargs: Any) -> Any:
        _V4_MODEL.model = self
        try:
            return forward(self, *args, **kwargs)
        finally:
            _V4_MODEL.model = None

    @functools.wraps(head)
    def head_recorded(hidden_states: Any, *args: Any, **kwargs: Any) -> Any:
        model = getattr(_V4_MODEL, "model", None)
        if model is not None and ubatching.dbo_enabled():
            buffer = model._mtp_hidden_buffer  # the plugin's view on a microbatch thread: its base is the buffer
            if buffer is not None:
                whole = buffer if buffer._base is None else buffer._base
                _MTP_ROWS.append((ubatching.dbo_current_ubatch_token_offset(), hidden_states.flatten(1).clone(), whole))
        return head(hidden_states, *args, **kwargs)

    cls.forward = forward_tracked
    module.hc_head_fused_kernel_tilelang = head_recorded


def _after_join() -> None:
    """After both microbatches joined: each one's MTP hidden rows must sit at its own token offset."""
    if not _MTP_ROWS:
        return
    rows = list(_MTP_ROWS)
    _MTP_ROWS.clear()
    with COUNTERS.lock:
        for offset, written, whole in rows:
            wrong = (whole[offset : offset + written.shape[0]] != written).any()
            if COUNTERS.mtp_hidden_wrong is None:
                COUNTERS.mtp_hidden_wrong = wrong.new_zeros((), dtype=_int64())
            COUNTERS.mtp_hidden_wrong += wrong
            COUNTERS.mtp_hidden_checks += 1


def _int64() -> Any:
    import torch

    return torch.int64


# ---------------------------------------------------------------------------------------------- the worker RPC


def _patch_worker(module: Any) -> None:
    def dbo_emulation_counters(self: Any) -> dict[str, Any]:
        return COUNTERS.snapshot()

    module.Worker.dbo_emulation_counters = dbo_emulation_counters


# ---------------------------------------------------------------------------------------------- installation

PATCHES: dict[str, Callable[[Any], None]] = {
    "vllm.forward_context": _patch_forward_context,
    "vllm.model_executor.layers.fused_moe.prepare_finalize.no_dp_ep": _patch_prepare_finalize,
    "vllm.v1.worker.gpu_model_runner": _patch_v1_runner,
    "vllm.v1.worker.gpu.model_runner": _patch_v2_runner,
    "vllm.v1.worker.gpu_worker": _patch_worker,
}
"""Module -> what is patched right after that module is imported."""
CHECK_PATCHES: dict[str, Callable[[Any], None]] = {
    "vllm.models.deepseek_v32.attention": _patch_topk_check,
    "vllm.models.mistral.nvidia.attention": _patch_ml4_topk_check,
    "vllm.models.deepseek_v4.nvidia.model": _patch_mtp_hidden_check,
}
PATCHED: list[str] = []


@functools.lru_cache(maxsize=1)
def _release() -> str:
    """The installed vLLM's table release; an unknown build is refused (a patch on the wrong code proves nothing)."""
    from importlib import metadata

    version = metadata.version("vllm")
    release = release_of(version)
    if release is None:
        raise RuntimeError(f"{NAME}: no target table for vLLM {version} (tables: {', '.join(TARGETS)})")
    return release


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs a patch right after its module's code ran, before anyone else can bind its names."""

    def __init__(self, patches: dict[str, Callable[[Any], None]]) -> None:
        self.patches = patches

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        patch = self.patches.get(fullname)
        if patch is None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _PatchingLoader(spec.loader, patch, fullname)
                return spec
        return None


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, loader: Any, patch: Callable[[Any], None], name: str) -> None:
        self.loader, self.patch, self.name = loader, patch, name

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Any:
        return self.loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self.loader.exec_module(module)
        _release()
        self.patch(module)
        PATCHED.append(self.name)


def install(topk_check: bool | None = None) -> list[str]:
    """Patch every target now (modules already imported) or right after its module is imported. Returns the
    modules patched now. Idempotent per process."""
    if getattr(install, "done", False):
        return []
    install.done = True  # type: ignore[attr-defined]
    patches = dict(PATCHES)
    if topk_check if topk_check is not None else os.environ.get(CHECK_ENV) == "1":
        patches.update(CHECK_PATCHES)
    now = []
    for name, patch in list(patches.items()):
        if name in sys.modules:
            _release()
            patch(sys.modules[name])
            PATCHED.append(name)
            now.append(name)
            del patches[name]
    if patches:
        sys.meta_path.insert(0, _AfterImport(patches))
    return now


def enabled() -> bool:
    return os.environ.get(ENV) == "1"


SITE = Path(__file__).parent / "emulate" / "dp_peer"
"""The ``sitecustomize`` that loads the emulation into every process of a run."""


def pythonpath() -> str:
    """``PYTHONPATH`` for an engine started from this checkout: the emulation's loader, the checkout, the caller's."""
    return os.pathsep.join(p for p in (str(SITE), str(SITE.parents[3]), os.environ.get("PYTHONPATH", "")) if p)


def engine_env(comm_sms: int) -> dict[str, str]:
    """What an engine process needs to microbatch under the emulation with ``comm_sms`` communication SMs (the
    engine's own arguments still ask for DBO: ``--enable-dbo`` with expert parallelism)."""
    return {"PYTHONPATH": pythonpath(), ENV: "1", "VLLM_DBO_COMM_SMS": str(comm_sms)}
