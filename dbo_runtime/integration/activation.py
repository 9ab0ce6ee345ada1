"""The one log line that tells an operator dbo_runtime is active in a process.

Why this is not simply ``logger.info`` in ``register()``: vLLM 0.33.0 calls
general plugins from ``EngineArgs.__post_init__`` (``engine/arg_utils.py:931``),
*before* ``LLM.__init__`` configures logging (``entrypoints/llm.py:338``), so
the ``vllm`` logger has no handler yet and an INFO line is dropped. The engine
core and the workers are then forked with ``plugins_loaded`` already true
(``plugins/__init__.py:84``), so ``register()`` never runs in them and nothing
is logged where the patches actually work (measured on the H200: the "patches
installed" line appeared in no process's log).

So the line is *pending* per process (keyed by pid, which a fork changes) and
is emitted at the first trigger that finds vLLM's handler configured:
``register()`` itself, a lazy patch being applied when a worker imports its
module (the model runner, the indexer, the attention backends -- always after
``configure_logging`` in ``run_engine_core`` / ``worker_main``), and the
once-per-model hooks (SM budget announce, indexer builder construction).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable

from dbo_runtime.core.log import ROOT, get_logger

logger = get_logger(__name__)

_lock = threading.Lock()
_summary: Callable[[], str] | None = None
_emitted_pid: int | None = None


def vllm_logging_configured() -> bool:
    """True once some handler would print our INFO lines (vLLM's ``dictConfig`` or the application's)."""
    node: logging.Logger | None = logging.getLogger(ROOT)
    while node is not None:
        if node.handlers:
            return True
        if not node.propagate:
            return False
        node = node.parent
    return False


def set_summary(summary: Callable[[], str] | None) -> None:
    """Install the text of the line (a callable, so lazy patches applied later are counted)."""
    global _summary, _emitted_pid
    with _lock:
        _summary = summary
        _emitted_pid = None


def flush() -> bool:
    """Emit the pending line in this process if logging is configured; True when it was emitted now."""
    global _emitted_pid
    pid = os.getpid()
    if _emitted_pid == pid or _summary is None:
        return False
    with _lock:
        if _emitted_pid == pid or _summary is None or not vllm_logging_configured():
            return False
        _emitted_pid = pid
        text = _summary()
    logger.info("%s", text)
    return True


def emitted_in_this_process() -> bool:
    return _emitted_pid == os.getpid()


__all__ = ["emitted_in_this_process", "flush", "set_summary", "vllm_logging_configured"]
