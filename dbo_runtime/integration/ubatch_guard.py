"""No exception escapes dbo_runtime code on a DBO microbatch thread (its partner would wait forever: a DP hang with no
traceback). Shielded patches record failures (``ubatch_failures``) and go on with a placeholder; the join points
patched here raise ``MicrobatchFailure`` on the main thread, caused by the original: fatal, never wrong or a hang."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from dbo_runtime.core.errors import MicrobatchFailure
from dbo_runtime.core.log import get_logger
from dbo_runtime.integration.features import REGISTRY, Feature
from dbo_runtime.integration.microbatch_arming import ARMING
from dbo_runtime.integration.patching import Patch
from dbo_runtime.integration.ubatch_failures import FAILURES, record, shields_itself

logger = get_logger(__name__)

FEATURES = [Feature("ubatch_guard", "microbatch-thread failure guard")]

MRV1_MODULE = "vllm.v1.worker.gpu_ubatch_wrapper"
MRV2_MODULE = "vllm.v1.worker.gpu.ubatch_utils"
UBATCHING = "vllm.v1.worker.ubatching"
UPSTREAM_PR = "none yet (vLLM does not wake the partner microbatch when one thread dies)"
REMOVAL = "vLLM's microbatch hand-off unwinds every thread when one raises and re-raises on the main thread"


ROW_STRIDE = 512
"""Elements between the placeholder's rows: never 0 (vLLM's persistent top-k divides by the stride)."""

_RESERVED: dict[tuple[str, Any], Any] = {}
"""One zero buffer per (device, dtype), allocated at model load."""


def _device_key(device: Any) -> str:
    """``cuda`` and ``cuda:N`` name one device as reserved and as read: the index is resolved once, at load."""
    import torch

    d = torch.device(device)
    if d.type == "cuda" and d.index is None:
        d = torch.device("cuda", torch.cuda.current_device())
    return str(d)


def reserve_placeholders(device: Any, max_model_len: int, max_rows: int = 1) -> None:
    """Allocate, at model load, the zeros ``placeholder_logits`` hands out (a handler must not allocate)."""
    import torch

    need = int(max_model_len) + ROW_STRIDE * max(int(max_rows), 1)
    for dtype in (torch.float32, torch.bfloat16):
        key = (_device_key(device), dtype)
        buf = _RESERVED.get(key)
        if buf is not None and int(buf.numel()) >= need:
            continue
        try:
            _RESERVED[key] = torch.zeros((need,), dtype=dtype, device=device)
        except Exception as exc:  # the guard's worker check refuses DBO before warm-up
            REGISTRY.mark("ubatch_guard", "broken", f"the placeholder logits could not be reserved at model load ({exc!r})")
            logger.error(
                "dbo_runtime: could not reserve the placeholder logits (%r): without them an out-of-memory error at "
                "the indexer call site on a microbatch thread can hang the step, so DBO is refused for DSA models",
                exc,
            )


def placeholder_logits(context_lens: Any, weights: Any, max_model_len: Any, dtype: Any = None) -> Any:
    """Logits of ``fp8_fp4_paged_mqa_logits``'s shape and dtype, without a kernel, an allocation or a raise: an
    overlapping-row view of the reserved zeros (values never used: the step raises after the join); else a new
    tensor, else ``weights``; never a stride-0 view."""
    try:
        import torch

        rows, width = int(context_lens.numel()), int(max_model_len)
        if dtype is None:
            dtype = weights.dtype if weights.is_floating_point() else torch.float32
        buf = _RESERVED.get((str(context_lens.device), dtype))
        if buf is not None and int(buf.numel()) >= width + ROW_STRIDE * max(rows - 1, 0):
            return buf.as_strided((rows, width), (ROW_STRIDE, 1))
        return torch.zeros((rows, width), dtype=dtype, device=context_lens.device)
    except Exception:
        return weights


def _checked_join(original: Callable[..., Any], where: str, *, drop_new_graphs: bool = False) -> Callable[..., Any]:
    def joined(self: Any, *args: Any, **kwargs: Any) -> Any:
        ARMING.arm(where)  # before the threads start
        graphs = self.__dict__.get("cudagraphs") if drop_new_graphs else None
        before = set(graphs) if graphs is not None else set()
        try:
            result = original(self, *args, **kwargs)
        except BaseException as exc:
            FAILURES.raise_pending(exc)
            raise
        try:
            FAILURES.raise_pending()
        except MicrobatchFailure:
            if graphs is not None:
                # never keep a graph whose capture ran a placeholder
                for key in set(graphs) - before:
                    del graphs[key]
            raise
        return result

    return joined


def _make_mrv2_begin(original: Any) -> Any:
    def begin_capturable_run(self: Any, *args: Any, **kwargs: Any) -> Any:
        ARMING.arm("UBatchRunner.begin_capturable_run")
        finish = original(self, *args, **kwargs)

        def finish_checked() -> Any:
            try:
                result = finish()
            except BaseException as exc:
                FAILURES.raise_pending(exc)
                raise
            FAILURES.raise_pending()
            return result

        # abort_pending_run() finishes too: report a failure of an aborted capture there
        if self.__dict__.get("_pending_finish") is finish:
            self._pending_finish = finish_checked
        return finish_checked

    return begin_capturable_run


CONTEXT_ENTER = "ubatch_guard.context_enter"


def _make_context_enter(original: Any) -> Any:
    """The net under the join points: a thread entering a microbatch context arms the set if no runner did,
    before any model code runs there. A failure is recorded, never raised here (the partner would hang)."""

    @shields_itself
    def __enter__(self: Any) -> Any:
        context = original(self)
        if not ARMING.armed:
            try:
                ARMING.arm("UBatchContext.__enter__")
            except Exception as exc:
                record(CONTEXT_ENTER, exc)
                return context
            try:
                logger.warning(
                    "dbo_runtime: a DBO microbatch thread started outside the runner calls dbo_runtime hooks; the "
                    "per-access hooks were put in force on the thread itself, before the model ran there"
                )
            except Exception:
                pass
        return context

    return __enter__


def patches() -> list[Patch]:
    patch = functools.partial(Patch, upstream_pr=UPSTREAM_PR, removal=REMOVAL, lazy=True)
    return [
        patch(
            name="ubatch_guard.mrv1_run", runner="mrv1", module=MRV1_MODULE, attr="UBatchWrapper._run_ubatches",
            make=functools.partial(_checked_join, where="UBatchWrapper._run_ubatches"),
            reason="arm the per-access hooks before the first microbatched run's threads start; after the threads "
            "are joined, raise what dbo_runtime hooks recorded on them "
            "(they never raise there: a dead microbatch thread hangs the join and the DP group)",
        ),
        patch(
            name="ubatch_guard.mrv1_capture", runner="mrv1", module=MRV1_MODULE, attr="UBatchWrapper._capture_ubatches",
            make=functools.partial(_checked_join, where="UBatchWrapper._capture_ubatches", drop_new_graphs=True),
            reason="same for a FULL-graph DBO capture; a graph captured with a placeholder is dropped",
        ),
        patch(
            name="ubatch_guard.mrv2_finish", runner="mrv2", module=MRV2_MODULE,
            attr="UBatchRunner.begin_capturable_run", make=_make_mrv2_begin,
            reason="wrap the returned finish() (and abort_pending_run's) so it raises what dbo_runtime hooks "
            "recorded on the microbatch threads after joining them",
        ),
        patch(
            name=CONTEXT_ENTER, module=UBATCHING, attr="UBatchContext.__enter__", make=_make_context_enter,
            reason="every microbatch thread registers here: put the patches armed at the first microbatched run "
            "in force before its model code runs, on a path that reached microbatch threads without the join points",
            runs_on_ubatch_thread=True,
        ),
    ]
