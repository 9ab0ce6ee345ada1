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


def _ubatching() -> ModuleType:
    global _module
    if _module is None:
        _module = importlib.import_module("vllm.v1.worker.ubatching")
    return _module


def current_ubatch_id() -> int:
    """Microbatch id of the calling thread; 0 outside DBO and on the main thread."""
    return int((_module or _ubatching())._THREAD_ID_TO_CONTEXT.get(threading.get_ident(), 0))


def current_ubatch() -> tuple[int, int]:
    """``(microbatch id, token offset in the padded batch)``; ``(0, 0)`` outside a microbatch thread."""
    module = _module or _ubatching()
    table = module._THREAD_ID_TO_CONTEXT
    if not table:
        return 0, 0
    ubatch = table.get(threading.get_ident())
    if ubatch is None:
        return 0, 0
    contexts = module._CURRENT_CONTEXTS
    ctx = contexts[ubatch] if ubatch < len(contexts) else None
    return int(ubatch), int(ctx.token_offset) if ctx is not None else 0


def ubatch_thread_id() -> int | None:
    """Microbatch id when the calling thread is a registered DBO microbatch thread, else None.

    Never raises (``ubatch_guard`` calls it from exception handlers).
    """
    try:
        ubatch = (_module or _ubatching())._THREAD_ID_TO_CONTEXT.get(threading.get_ident())
        return None if ubatch is None else int(ubatch)
    except Exception:
        return None
