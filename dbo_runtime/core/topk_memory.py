"""What per-microbatch top-k state costs in device memory, per layout (``docs/topk-memory.md``).

The calculator behind ``dbo-runtime simulate``'s memory line and the docs, kept apart from the state itself
(``services/topk_state.py``): it needs no tensor, and the layer pattern comes from the one rule that mirrors
how vLLM builds the layers (``core.coverage.v32_followers``).
"""

from __future__ import annotations

from collections.abc import Sequence

from dbo_runtime.core.coverage import v32_followers
from dbo_runtime.core.errors import ConfigError


def index_leaders(
    num_layers: int,
    index_topk_freq: int = 1,
    index_skip_topk_offset: int = 2,
    index_topk_pattern: str | None = None,
) -> list[bool]:
    """Which layers run the indexer (vLLM 0.33.0 ``models/deepseek_v32/attention.py:166-177``)."""
    if index_topk_freq < 1:
        raise ConfigError("index_topk_freq", index_topk_freq, "an integer >= 1")
    config = {
        "num_hidden_layers": num_layers,
        "index_topk_freq": index_topk_freq,
        "index_skip_topk_offset": index_skip_topk_offset,
        "index_topk_pattern": index_topk_pattern,
    }
    followers = set(v32_followers(config))
    return [layer not in followers for layer in range(num_layers)]


def groups_with_followers(leaders: Sequence[bool]) -> int:
    """Index groups (a leader and the followers after it) that have at least one follower."""
    return sum(1 for i, is_leader in enumerate(leaders) if is_leader and i + 1 < len(leaders) and not leaders[i + 1])


def max_decode_rows(max_num_batched_tokens: int, max_num_seqs: int, max_decode_query_len: int = 1) -> int:
    """vLLM's ``get_sparse_mla_index_group_max_rows`` (``index_group.py:406-411``)."""
    return min(max_num_batched_tokens, max_num_seqs * max_decode_query_len)


def padded_decode_rows(max_num_seqs: int, next_n: int, max_num_batched_tokens: int, largest_full_graph: int = 0) -> int:
    """The most rows one indexer call writes in decode (logits, top-k): ``next_n`` per request, padding requests
    included. vLLM's padded decode path gives every request ``next_n`` rows, and FULL CUDA graphs pad a uniform
    decode batch with whole requests up to the capture size; no step holds more than ``max_num_batched_tokens``."""
    return min(max(max_num_seqs * next_n, largest_full_graph), max_num_batched_tokens)


def topk_memory_bytes(
    *,
    num_layers: int,
    index_topk_freq: int,
    index_skip_topk_offset: int,
    index_topk: int,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    max_decode_query_len: int = 1,
    index_topk_pattern: str | None = None,
    index_dtype_bytes: int = 4,
) -> dict[str, int]:
    """Device bytes each extra microbatch costs, for both layouts: ``copies`` counts the logical buffer, each
    group's physical workspace and its int32 valid counts; ``windows`` allocates nothing."""
    leaders = index_leaders(num_layers, index_topk_freq, index_skip_topk_offset, index_topk_pattern)
    groups = groups_with_followers(leaders)
    rows = max_decode_rows(max_num_batched_tokens, max_num_seqs, max_decode_query_len)
    copies = 0
    if groups:
        copies = max_num_batched_tokens * index_topk * index_dtype_bytes
        copies += groups * (rows + 1) * (index_topk * index_dtype_bytes + 4)
    return {"copies": copies, "windows": 0, "groups_with_followers": groups, "max_decode_rows": rows}
