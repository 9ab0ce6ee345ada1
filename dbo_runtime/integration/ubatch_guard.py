"""No exception escapes dbo_runtime code on a DBO microbatch thread; failures are raised after the join.

Why (vLLM 0.33.0): MRV1 ``UBatchWrapper._run_ubatches`` / ``_capture_ubatches``
(``v1/worker/gpu_ubatch_wrapper.py``) and MRV2 ``UBatchRunner.begin_capturable_run``
(``v1/worker/gpu/ubatch_utils.py``) run one thread per microbatch, and the
threads hand the CPU to each other at every ``dbo_yield``
(``v1/worker/ubatching.py``, ``UBatchContext._cpu_yield``). When one thread
raises, its ``UBatchContext.__exit__`` wakes the partner once; the partner runs
to its next yield and then waits for a hand-off that never comes. The main
thread's ``join()`` blocks forever and the other DP ranks block in the next
all-to-all: the DP group hangs with no traceback (MRV1 drops the thread's
exception; MRV2 records it but reports it only after the join that never
returns -- its own comment says so).

So every dbo_runtime hook that runs on a microbatch thread (the top-k
descriptors, property and group methods in ``topk_hooks``, the indexer
call-site wrappers in ``indexer_hooks``, and through them ``ubatch_ids`` and
``IndexerScheduleCache.resolve``) catches its own failure and calls
``record(where, exc)``:

* On a microbatch thread the failure is recorded and the hook returns a
  placeholder that keeps the step moving in lock-step with the partner and the
  other ranks: vLLM's own value (the shared buffer, the group itself) or, for
  the logits kernel, zero logits without a launch. Placeholders may be wrong;
  that is acceptable only because the step never returns them: the patched
  join points below raise ``MicrobatchFailure`` on the main thread once the
  threads are joined, and vLLM's engine core treats that like any model error
  (fatal, with the original traceback as ``__cause__``). A plugin failure is
  therefore never silently wrong and never a hang.
* Off a microbatch thread (non-DBO steps, model construction, the main
  thread) ``record`` returns False and the hook re-raises as before.

A failure recorded by a microbatch thread of a spawner that is not patched
here (vLLM 0.33.0 has exactly the three above) is raised at the next patched
join rather than lost.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from dbo_runtime.core.errors import MicrobatchFailure
from dbo_runtime.core.log import get_logger
from dbo_runtime.integration import ubatch_ids
from dbo_runtime.integration.features import Feature
from dbo_runtime.integration.patching import Patch

logger = get_logger(__name__)

FEATURES = [Feature("ubatch_guard", "microbatch-thread failure guard")]

MRV1_MODULE = "vllm.v1.worker.gpu_ubatch_wrapper"
MRV2_MODULE = "vllm.v1.worker.gpu.ubatch_utils"
UPSTREAM_PR = "none yet (vLLM does not wake the partner microbatch when one thread dies)"
REMOVAL = "vLLM's microbatch hand-off unwinds every thread when one raises and re-raises on the main thread"


@dataclass
class UbatchFailures:
    """Failures recorded on microbatch threads since the last join check (process-wide)."""

    pending: list[tuple[str, int, BaseException]] = field(default_factory=list)
    recorded_total: int = 0
    by_where: dict[str, int] = field(default_factory=dict)
    _logged: set[str] = field(default_factory=set)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def record(self, where: str, exc: BaseException) -> bool:
        """Record ``exc`` if the calling thread is a DBO microbatch thread; False means "re-raise it"."""
        ubatch = ubatch_ids.ubatch_thread_id()
        if ubatch is None:
            return False
        with self._lock:
            self.pending.append((where, ubatch, exc))
            self.recorded_total += 1
            self.by_where[where] = self.by_where.get(where, 0) + 1
            first = where not in self._logged
            self._logged.add(where)
        try:
            if first:
                logger.error(
                    "dbo_runtime: %s failed on DBO microbatch %d (%r); continuing the microbatch with a "
                    "placeholder so no thread is left waiting, and raising on the main thread after the join",
                    where,
                    ubatch,
                    exc,
                    exc_info=exc,
                )
            else:
                logger.debug("dbo_runtime: %s failed again on DBO microbatch %d: %r", where, ubatch, exc)
        except Exception:  # a broken log handler must not undo the guarantee
            pass
        return True

    def take(self) -> list[tuple[str, int, BaseException]]:
        with self._lock:
            taken, self.pending = self.pending, []
        return taken

    def raise_pending(self, also: BaseException | None = None) -> None:
        """On the main thread after the join: raise what the microbatches recorded, if anything
        (``also``: the error vLLM itself raised at the join, named in the message)."""
        if self.pending:
            taken = self.take()
            if taken:
                raise MicrobatchFailure(taken, also)


FAILURES = UbatchFailures()


def record(where: str, exc: BaseException) -> bool:
    """``FAILURES.record``: True when recorded (microbatch thread), False when the caller must re-raise."""
    try:
        return FAILURES.record(where, exc)
    except Exception:
        return False


_RESERVED: dict[tuple[str, Any], Any] = {}
"""One zero row ``[1, max_model_len]`` per (device, dtype), allocated at model load (``reserve_placeholders``)."""


def reserve_placeholders(device: Any, max_model_len: int) -> None:
    """Allocate, at model load, the zero rows ``placeholder_logits`` hands out instead of allocating.

    Why ahead of time: the typical failure at the logits call site is CUDA out of memory, and then
    allocating a full ``[rows, max_model_len]`` placeholder fails too; a second exception on a microbatch
    thread is the hang the guard exists to prevent. The rows cost ``4 * max_model_len`` bytes per dtype.
    """
    import torch

    for dtype in (torch.float32, torch.bfloat16):
        key = (str(device), dtype)
        row = _RESERVED.get(key)
        if row is not None and int(row.shape[1]) >= max_model_len:
            continue
        try:
            _RESERVED[key] = torch.zeros((1, max_model_len), dtype=dtype, device=device)
        except Exception as exc:  # model load goes on; a failure then falls back to allocating
            logger.warning("dbo_runtime: could not reserve the placeholder logits row (%r)", exc)


def placeholder_logits(context_lens: Any, weights: Any, max_model_len: Any) -> Any:
    """Logits of ``fp8_fp4_paged_mqa_logits``'s shape and dtype, without a kernel, an allocation or a raise.

    ``[B * next_n, max_model_len]`` (``context_lens`` is ``[B, next_n]``, or one length per row for SM100
    varlen) in the weights' dtype (bf16 on SM100, fp32 elsewhere): a stride-0 view of the row reserved at
    model load, so every row reads the same valid memory and kernels that honour ``stride(0)`` (vLLM's
    top-k and upcast kernels do) stay in bounds. The values are never used: the step raises after the join.
    Without a reserved row it falls back to allocating zeros, then to a view of ``weights``.
    """
    try:
        import torch

        rows, width = int(context_lens.numel()), int(max_model_len)
        dtype = weights.dtype if weights.is_floating_point() else torch.float32
        row = _RESERVED.get((str(context_lens.device), dtype))
        if row is not None and int(row.shape[1]) >= width:
            return row[:, :width].expand(rows, width)
        try:
            return torch.zeros((rows, width), dtype=dtype, device=context_lens.device)
        except Exception:
            return weights.reshape(-1)[:1].expand(rows, width)
    except Exception:
        return weights


# -- join points ------------------------------------------------------------------------------------
def _checked_join(original: Callable[..., Any], *, drop_new_graphs: bool = False) -> Callable[..., Any]:
    def joined(self: Any, *args: Any, **kwargs: Any) -> Any:
        graphs = self.__dict__.get("cudagraphs") if drop_new_graphs else None
        before = set(graphs) if graphs is not None else set()
        try:
            result = original(self, *args, **kwargs)
        except BaseException as exc:
            FAILURES.raise_pending(exc)  # the recorded cause first, vLLM's own error named in it
            raise
        try:
            FAILURES.raise_pending()
        except MicrobatchFailure:
            if graphs is not None:
                # Never keep a graph whose capture ran a placeholder.
                for key in set(graphs) - before:
                    del graphs[key]
            raise
        return result

    return joined


def _make_mrv1_run(original: Any) -> Any:
    return _checked_join(original)


def _make_mrv1_capture(original: Any) -> Any:
    return _checked_join(original, drop_new_graphs=True)


def _make_mrv2_begin(original: Any) -> Any:
    def begin_capturable_run(self: Any, *args: Any, **kwargs: Any) -> Any:
        finish = original(self, *args, **kwargs)

        def finish_checked() -> Any:
            try:
                result = finish()
            except BaseException as exc:
                FAILURES.raise_pending(exc)
                raise
            FAILURES.raise_pending()
            return result

        # abort_pending_run() calls _pending_finish: route it through the check too, so a failure
        # recorded in an aborted capture is reported there (vLLM logs it) and not at the next step.
        if self.__dict__.get("_pending_finish") is finish:
            self._pending_finish = finish_checked
        return finish_checked

    return begin_capturable_run


def patches() -> list[Patch]:
    common = dict(upstream_pr=UPSTREAM_PR, removal=REMOVAL, lazy=True)
    return [
        Patch(
            name="ubatch_guard.mrv1_run",
            module=MRV1_MODULE,
            attr="UBatchWrapper._run_ubatches",
            make=_make_mrv1_run,
            reason="after the microbatch threads are joined, raise what dbo_runtime hooks recorded on them "
            "(they never raise there: a dead microbatch thread hangs the join and the DP group)",
            **common,  # type: ignore[arg-type]
        ),
        Patch(
            name="ubatch_guard.mrv1_capture",
            module=MRV1_MODULE,
            attr="UBatchWrapper._capture_ubatches",
            make=_make_mrv1_capture,
            reason="same for a FULL-graph DBO capture; a graph captured with a placeholder is dropped",
            **common,  # type: ignore[arg-type]
        ),
        Patch(
            name="ubatch_guard.mrv2_finish",
            module=MRV2_MODULE,
            attr="UBatchRunner.begin_capturable_run",
            make=_make_mrv2_begin,
            reason="wrap the returned finish() (and abort_pending_run's) so it raises what dbo_runtime hooks "
            "recorded on the microbatch threads after joining them",
            **common,  # type: ignore[arg-type]
        ),
    ]


__all__ = ["FAILURES", "UbatchFailures", "patches", "placeholder_logits", "record", "reserve_placeholders"]
