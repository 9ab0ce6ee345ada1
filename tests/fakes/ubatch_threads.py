"""Run callables as DBO microbatches on vLLM 0.33.0's own ``UBatchContext`` threads (CPU).

vLLM's ``make_ubatch_contexts`` / ``UBatchContext`` and ``dbo_yield`` are used as they are; only what
cannot exist on a CPU box stands in: the compute / comm streams (``FakeStream``) and the forward context
(``cudagraph_runtime_mode`` is the only field ``UBatchContext`` reads), and ``ubatching.current_stream``
(vLLM's raises on a platform without streams) returns the fake compute stream while the step runs.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from dbo_runtime.integration import ubatch_ids
from tests.fakes.topk_boundary import FakeStream


@dataclass
class _ForwardContext:
    cudagraph_runtime_mode: Any


def _who() -> int:
    return ubatch_ids.current_ubatch()[0]


def run_microbatches(bodies: Sequence[Callable[[int], None]], token_offsets: Sequence[int], timeout: float = 20) -> None:
    """``bodies[u](u)`` on microbatch thread ``u``, in DBO's order (each ``dbo_yield`` hands over)."""
    from vllm.config import CUDAGraphMode
    from vllm.v1.worker import ubatching

    log: list[tuple[str, int, int | None]] = []
    compute = FakeStream("compute", _who, log)
    saved = ubatching.current_stream
    ubatching.current_stream = lambda: compute
    try:
        _run(ubatching, bodies, token_offsets, timeout, compute, log, CUDAGraphMode.NONE)
    finally:
        ubatching.current_stream = saved


def _run(ubatching: Any, bodies: Sequence[Callable[[int], None]], token_offsets: Sequence[int], timeout: float,
         compute: FakeStream, log: list[tuple[str, int, int | None]], mode: Any) -> None:
    barrier = threading.Barrier(len(bodies) + 1)
    contexts = ubatching.make_ubatch_contexts(
        num_micro_batches=len(bodies),
        compute_stream=compute,
        comm_stream=FakeStream("comm", _who, log),
        forward_contexts=[_ForwardContext(mode) for _ in bodies],
        ready_barrier=barrier,
        token_offsets=list(token_offsets),
    )
    errors: list[BaseException] = []

    def thread(u: int) -> None:
        try:
            with contexts[u]:
                bodies[u](u)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=thread, args=(u,), daemon=True) for u in range(len(bodies))]
    for t in threads:
        t.start()
    barrier.wait()
    contexts[0].cpu_wait_event.set()
    for t in threads:
        t.join(timeout=timeout)
    assert not any(t.is_alive() for t in threads), f"microbatch threads hung; errors: {errors!r}"
    if errors:
        raise errors[0]
