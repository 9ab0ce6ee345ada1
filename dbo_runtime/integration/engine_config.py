"""What the guard and the hooks both read of vLLM's config."""

from __future__ import annotations

from typing import Any


def padded_decode_rows(max_num_seqs: int, next_n: int, max_num_batched_tokens: int, largest_full_graph: int = 0) -> int:
    """Rows one decode indexer call writes at most, padding included."""
    return min(max(max_num_seqs * next_n, largest_full_graph), max_num_batched_tokens)


def decode_rows(vllm_config: Any) -> tuple[int, int]:
    """``(next_n, padded decode rows)``; raises if unreadable (callers fail closed)."""
    sched = vllm_config.scheduler_config
    spec = getattr(vllm_config, "speculative_config", None)
    next_n = 1 + int(getattr(spec, "num_speculative_tokens", 0) or 0) if spec is not None else 1
    compilation = vllm_config.compilation_config
    mode = compilation.cudagraph_mode
    full = mode is not None and mode.has_full_cudagraphs()
    largest = max((int(x) for x in compilation.cudagraph_capture_sizes or ()), default=0) if full else 0
    return next_n, padded_decode_rows(int(sched.max_num_seqs), next_n, int(sched.max_num_batched_tokens), largest)


def model_of(vllm_config: Any, unknown: str = "unknown architecture") -> tuple[str, Any]:
    """``(architecture, HF text config or None)``; ``unknown`` when vLLM gives no architecture."""
    model_config = getattr(vllm_config, "model_config", None)
    arch = getattr(model_config, "architecture", None) if model_config is not None else None
    if not arch:
        archs = getattr(model_config, "architectures", None) or []
        arch = archs[0] if archs else unknown
    hf = getattr(model_config, "hf_text_config", None) or getattr(model_config, "hf_config", None)
    return str(arch), hf
