"""Emulates, for the e2e guard runs only, a vLLM build whose top-k code differs from vLLM 0.33.0.

On ``PYTHONPATH`` of one run (``tests/e2e/plan.py``), so every process of that run (front-end, engine core,
workers) starts with it. It changes nothing in vLLM: only the text dbo_runtime fingerprints for
``SparseMLAIndexGroupBuilder.register_layer`` reads as a development build with an edited line would.
"""

import functools

from dbo_runtime.integration import fingerprints

_MODULE = "vllm.v1.attention.backends.mla.index_group"
_real = fingerprints.read_source.__wrapped__


@functools.lru_cache(maxsize=64)
def _read(module: str) -> str | None:
    text = _real(module)
    if module == _MODULE and text is not None:
        text = text.replace("workspace_rows = self.max_decode_rows", "workspace_rows = self.max_decode_rows + 0", 1)
    return text


fingerprints.read_source = _read
fingerprints.clear_caches = lambda: (_read.cache_clear(), fingerprints.anchor_fingerprint.cache_clear(), fingerprints.parsed.cache_clear())
