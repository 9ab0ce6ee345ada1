"""``ubatch_ids.current_ubatch`` caches the calling thread's microbatch; the cache must follow vLLM's contexts."""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any

from dbo_runtime.integration import ubatch_ids


def _enter(ubatching: Any, ctx: Any) -> None:
    """What ``UBatchContext.__enter__`` does to the two module globals (the rest needs streams)."""
    ubatching._THREAD_ID_TO_CONTEXT[threading.get_ident()] = ctx.id
    ubatching._CURRENT_CONTEXTS[ctx.id] = ctx


def _exit(ubatching: Any, ctx: Any) -> None:
    """What ``UBatchContext.__exit__`` does to them."""
    ubatching._CURRENT_CONTEXTS[ctx.id] = None
    del ubatching._THREAD_ID_TO_CONTEXT[threading.get_ident()]


def test_a_thread_reused_for_a_later_context_sees_the_new_offset() -> None:
    from vllm.v1.worker import ubatching

    saved = list(ubatching._CURRENT_CONTEXTS)
    ubatching._CURRENT_CONTEXTS[:] = [None, None]
    seen: list[tuple[int, int]] = []

    def body() -> None:
        first = SimpleNamespace(id=1, token_offset=7)
        _enter(ubatching, first)
        seen.append(ubatch_ids.current_ubatch())
        seen.append(ubatch_ids.current_ubatch())  # from the cache
        _exit(ubatching, first)
        seen.append(ubatch_ids.current_ubatch())  # the thread left its microbatch
        second = SimpleNamespace(id=1, token_offset=3)
        _enter(ubatching, second)
        seen.append(ubatch_ids.current_ubatch())
        _exit(ubatching, second)

    try:
        worker = threading.Thread(target=body)
        worker.start()
        worker.join(10)
    finally:
        ubatching._CURRENT_CONTEXTS[:] = saved
    assert seen == [(1, 7), (1, 7), (0, 0), (1, 3)]


def test_the_main_thread_is_never_cached() -> None:
    from vllm.v1.worker import ubatching

    assert not ubatching._THREAD_ID_TO_CONTEXT
    assert ubatch_ids.current_ubatch() == (0, 0)
    assert getattr(ubatch_ids._resolved, "value", None) is None

