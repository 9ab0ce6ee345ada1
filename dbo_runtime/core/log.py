"""Loggers that show up where vLLM's own lines do.

vLLM configures one handler on the ``vllm`` logger (``vllm/logger.py``,
``DEFAULT_LOGGING_CONFIG``, honouring ``VLLM_LOGGING_LEVEL`` and
``VLLM_CONFIGURE_LOGGING``) and nothing else; a ``dbo_runtime.*`` logger would
have no handler and its INFO lines ("N patches installed", the DBO budget, the
planner warm-up) would be dropped. Naming ours ``vllm.dbo_runtime.*`` makes them
children of that logger: same handler, level and format, whenever vLLM
configures logging, and plain Python defaults without vLLM.
"""

from __future__ import annotations

import logging

ROOT = "vllm.dbo_runtime"


def get_logger(module: str) -> logging.Logger:
    """``get_logger(__name__)`` -> ``vllm.dbo_runtime.<module path below the package>``."""
    suffix = module.split(".", 1)[1] if module.startswith("dbo_runtime.") else module
    return logging.getLogger(f"{ROOT}.{suffix}" if suffix else ROOT)
