"""The calling thread's DBO microbatch, read without vLLM's main-thread ``KeyError``.

vLLM 0.33.0 ``dbo_current_ubatch_id()`` (``v1/worker/ubatching.py:154-157``)
indexes ``_THREAD_ID_TO_CONTEXT`` with the calling thread and raises
``KeyError`` on the main thread while microbatch threads are registered (MRV2
between ``begin_capturable_run`` and ``finish``; MRV1 while it joins them).
``dbo_current_ubatch_token_offset()`` has the same lookup. Code that can run
on any thread (attribute getters on model modules) must use ``.get`` instead.
Both module globals are mutated in place, never rebound, so reading them
through the module on every call is exact. The module is imported on first use,
not when the plugin loads: it pulls in ``vllm.forward_context`` (seconds in a
cold API-server process that never runs a microbatch).
"""

from __future__ import annotations

import importlib
import threading
from types import ModuleType

_module: ModuleType | None = None
THREAD_TABLE: list[dict[int, int]] = []
"""vLLM's ``_THREAD_ID_TO_CONTEXT`` (one entry) once ``current_ubatch`` has imported its module. While that dict is
empty no thread of this process is a microbatch thread and ``current_ubatch`` answers ``(0, 0)`` everywhere, so
a hot getter may return its plain value after ``table and not table[0]`` without a call, in steps that do not
microbatch and outside DBO. It is bound by the first read that resolves (a model with a shared top-k buffer or an
attached group); a process whose reads never resolve keeps their early returns, which are short already. A test
that replaces ``_module`` with a stand-in must set ``THREAD_TABLE`` to its table too."""


def _ubatching() -> ModuleType:
    global _module
    if _module is None:
        _module = importlib.import_module("vllm.v1.worker.ubatching")
        THREAD_TABLE[:] = [_module._THREAD_ID_TO_CONTEXT]
    return _module


class _Resolved(threading.local):
    value: tuple[object, tuple[int, int]] | None = None
    """A class default: a missing ``threading.local`` attribute costs an ``AttributeError`` (about 0.35 us)."""


_resolved = _Resolved()
"""The calling thread's ``(UBatchContext, (id, token offset))``, resolved once per thread and checked with one
identity test: vLLM starts fresh threads for every microbatched step, a context's offset is fixed for its life,
and ``UBatchContext.__exit__`` clears its ``_CURRENT_CONTEXTS`` slot, after which the entry no longer matches."""


def current_ubatch() -> tuple[int, int]:
    """``(microbatch id, token offset in the padded batch)``; ``(0, 0)`` outside a microbatch thread."""
    module = _module or _ubatching()
    hit = _resolved.value
    if hit is not None:
        ctx, pair = hit
        contexts = module._CURRENT_CONTEXTS
        if pair[0] < len(contexts) and contexts[pair[0]] is ctx:
            return pair  # type: ignore[no-any-return]
        _resolved.value = None
    table = module._THREAD_ID_TO_CONTEXT
    if not table:
        return 0, 0
    ubatch = table.get(threading.get_ident())
    if ubatch is None:
        return 0, 0
    contexts = module._CURRENT_CONTEXTS
    ctx = contexts[ubatch] if ubatch < len(contexts) else None
    if ctx is None:
        return int(ubatch), 0
    pair = (int(ubatch), int(ctx.token_offset))
    _resolved.value = (ctx, pair)
    return pair


def ubatch_thread_id() -> int | None:
    """Microbatch id when the calling thread is a registered DBO microbatch thread, else None.

    Never raises (``ubatch_guard`` calls it from exception handlers).
    """
    try:
        ubatch = (_module or _ubatching())._THREAD_ID_TO_CONTEXT.get(threading.get_ident())
        return None if ubatch is None else int(ubatch)
    except Exception:
        return None
