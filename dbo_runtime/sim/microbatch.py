"""Microbatch threads scheduled as vLLM's DBO schedules them, without vLLM: one running Python at a time, handing
over at each ``yield_``, on shared compute and comm streams; ``current_ubatch()`` is ``(0, 0)`` off them."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

_THREAD_TO_UBATCH: dict[int, tuple[int, int]] = {}


def current_ubatch() -> tuple[int, int]:
    """``(microbatch id, token offset)`` of the calling thread; ``(0, 0)`` elsewhere."""
    return _THREAD_TO_UBATCH.get(threading.get_ident(), (0, 0))


class MicrobatchAborted(RuntimeError):
    """The other microbatch failed; this one unwinds instead of waiting forever."""


@dataclass
class MicrobatchContext:
    """One microbatch's thread-side context (vLLM's ``UBatchContext``)."""

    id: int
    wait_event: threading.Event
    signal_event: threading.Event
    barrier: threading.Barrier
    aborted: threading.Event = field(default_factory=threading.Event)
    token_offset: int = 0
    compute_stream: Any = None
    comm_stream: Any = None
    compute_done: Any = None
    comm_done: Any = None

    def __enter__(self) -> MicrobatchContext:
        _THREAD_TO_UBATCH[threading.get_ident()] = (self.id, self.token_offset)
        self.barrier.wait()
        self.wait_event.wait()
        self.wait_event.clear()
        self._use(self.compute_stream)
        return self

    def __exit__(self, *exc: object) -> None:
        _THREAD_TO_UBATCH.pop(threading.get_ident(), None)
        self.signal_event.set()
        self.wait_event.clear()

    @staticmethod
    def _use(stream: Any) -> None:
        if stream is not None:
            import torch

            torch.cuda.set_stream(stream)

    def yield_(self) -> None:
        """Hand the CPU to the other microbatch."""
        self.signal_event.set()
        self.wait_event.wait()
        self.wait_event.clear()
        if self.aborted.is_set():
            raise MicrobatchAborted(f"microbatch {self.id}: the other microbatch failed")
        self._use(self.compute_stream)

    def comm(self, work: Callable[[], None]) -> None:
        """Run ``work`` on the comm stream after this microbatch's compute, then come back."""
        if self.comm_stream is None:
            self.yield_()
            work()
            self.yield_()
            return
        self.compute_done.record(self.compute_stream)
        self.yield_()
        self._use(self.comm_stream)
        self.comm_stream.wait_event(self.compute_done)
        work()
        self.comm_done.record(self.comm_stream)
        self.yield_()
        self._use(self.compute_stream)
        self.compute_stream.wait_event(self.comm_done)


@dataclass
class MicrobatchRun:
    """Threads of one step; ``start()`` parks them, ``finish()`` releases and joins (MRV2's split)."""

    contexts: list[MicrobatchContext]
    threads: list[threading.Thread]
    results: dict[int, Any]
    errors: list[BaseException]

    def finish(self) -> list[Any]:
        self.contexts[0].wait_event.set()
        for t in self.threads:
            t.join()
        if self.errors:
            raise self.errors[0]
        return [self.results[i] for i in range(len(self.contexts))]


def start_microbatches(
    bodies: Sequence[Callable[[MicrobatchContext], Any]], *, token_offsets: Sequence[int] | None = None,
    compute_stream: Any = None, comm_stream: Any = None, device: int | None = None,
) -> MicrobatchRun:  # fmt: skip
    """Start one parked thread per body; every body must yield the same number of times."""
    n = len(bodies)
    barrier = threading.Barrier(n + 1)
    aborted = threading.Event()
    events = [threading.Event() for _ in range(n)]
    gpu_events: list[tuple[Any, Any]] = [(None, None)] * n
    if compute_stream is not None:
        import torch

        gpu_events = [(torch.cuda.Event(), torch.cuda.Event()) for _ in range(n)]
    offsets, streams = token_offsets if token_offsets is not None else [0] * n, (compute_stream, comm_stream)
    contexts = [
        MicrobatchContext(i, events[i], events[(i + 1) % n], barrier, aborted, offsets[i], *streams, *gpu_events[i])
        for i in range(n)
    ]
    results: dict[int, Any] = {}
    errors: list[BaseException] = []

    def runner(ctx: MicrobatchContext, body: Callable[[MicrobatchContext], Any]) -> None:
        if device is not None:
            import torch

            torch.cuda.set_device(device)
            if compute_stream is not None:
                # Touch cuBLAS handles outside the capture, as vLLM's capture threads do.
                with torch.cuda.stream(compute_stream):
                    torch.cuda.current_blas_handle()
        try:
            with ctx:
                results[ctx.id] = body(ctx)
        except BaseException as exc:  # re-raised on the main thread by finish()
            if not isinstance(exc, MicrobatchAborted):
                errors.append(exc)
            # Never leave the other microbatch parked forever: it unwinds at its next yield.
            aborted.set()
            for other in contexts:
                other.wait_event.set()

    threads = [threading.Thread(target=runner, args=(c, b), name=f"ubatch-{c.id}") for c, b in zip(contexts, bodies)]
    for t in threads:
        t.start()
    barrier.wait()
    return MicrobatchRun(contexts, threads, results, errors)
