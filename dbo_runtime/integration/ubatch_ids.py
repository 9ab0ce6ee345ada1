"""The calling thread's microbatch; unlike ``dbo_current_ubatch_id()``, safe on any thread."""

from __future__ import annotations

import importlib
import threading
from types import ModuleType

_module: ModuleType | None = None
THREAD_TABLE: list[dict[int, int]] = []
"""vLLM's thread table once imported; empty: no microbatch thread."""


def _ubatching() -> ModuleType:
    global _module
    if _module is None:
        _module = importlib.import_module("vllm.v1.worker.ubatching")
        THREAD_TABLE[:] = [_module._THREAD_ID_TO_CONTEXT]
    return _module


class _Resolved(threading.local):
    value: tuple[object, tuple[int, int]] | None = None


_resolved = _Resolved()


def current_ubatch() -> tuple[int, int]:
    """``(microbatch id, token offset)``; ``(0, 0)`` off a microbatch thread."""
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
    """The calling thread's microbatch id, else None; never raises."""
    try:
        ubatch = (_module or _ubatching())._THREAD_ID_TO_CONTEXT.get(threading.get_ident())
        return None if ubatch is None else int(ubatch)
    except Exception:
        return None
