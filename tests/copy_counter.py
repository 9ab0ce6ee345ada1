"""Host-side counts of tensor copies, exact and independent of any profiler.

Why: ``graphs/bench_replay_planning.py`` counted "device-to-device copies per step" with the torch
profiler over a window holding the harness's own input copies, the metadata build *and* a FULL
graph replay. Whether CUPTI reports the memcpy nodes *inside* a graph replay differed between the two
variants of the same run (H200, torch 2.11 / CUDA 13.0): 9 per step for one (4 input copies + 2
build copies + 3 snapshot clones, none of the graph's) and 331 for the other (7 + the graph's own
324 per-layer output copies), for graphs with identical nodes. A count that answers "what does the
build copy into the schedule buffers" must not depend on that.

``CopyCounter`` is a ``TorchDispatchMode``: it sees every ``aten.copy_`` dispatched on *the thread
that entered it* (dispatch modes are thread-local: a microbatch thread's calls are not seen) --
explicit ``.copy_`` and slice assignment; an op that copies inside its own kernel (``clone``,
``sort``, ``masked_fill``) is seen as that op, not counted -- and classifies it like
``at::native::copy_impl`` does before it launches anything:

* ``noop`` -- destination and source are the same memory (same storage, offset, sizes, strides,
  dtype): torch returns early, no kernel, no memcpy (vLLM's ``schedule_metadata[:] = metadata`` after
  a deferred plan-ahead build is one);
* ``into_targets`` -- a real copy whose destination shares storage with one of ``targets`` (the
  schedule buffers);
* ``other`` -- every other real copy.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode


def _storage_ptr(t: torch.Tensor) -> int:
    return int(t.untyped_storage().data_ptr())


def same_memory(dst: torch.Tensor, src: torch.Tensor) -> bool:
    """``copy_impl``'s early exit: the copy would write every element onto itself."""
    return (
        _storage_ptr(dst) == _storage_ptr(src)
        and dst.storage_offset() == src.storage_offset()
        and tuple(dst.shape) == tuple(src.shape)
        and tuple(dst.stride()) == tuple(src.stride())
        and dst.dtype == src.dtype
        and dst.is_conj() == src.is_conj()
        and dst.is_neg() == src.is_neg()
    )


class CopyCounter(TorchDispatchMode):
    """Counts ``aten.copy_`` on this thread: no-ops, real copies into ``targets``, other real copies."""

    def __init__(self, targets: Iterable[torch.Tensor] = ()) -> None:
        super().__init__()
        self._targets = {_storage_ptr(t) for t in targets}
        self.noop = 0
        self.into_targets = 0
        self.other = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.ops.aten.copy_.default:
            dst, src = args[0], args[1]
            if isinstance(src, torch.Tensor) and same_memory(dst, src):
                self.noop += 1
            elif _storage_ptr(dst) in self._targets:
                self.into_targets += 1
            else:
                self.other += 1
        return func(*args, **(kwargs or {}))
