"""Loggers under vLLM's ``vllm`` logger: our lines get its handler."""

from __future__ import annotations

import logging

ROOT = "vllm.dbo_runtime"


def get_logger(module: str) -> logging.Logger:
    suffix = module.split(".", 1)[1] if module.startswith("dbo_runtime.") else module
    return logging.getLogger(f"{ROOT}.{suffix}" if suffix else ROOT)
