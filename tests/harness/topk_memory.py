"""What per-microbatch top-k state costs in device memory, per layout (docs/topk-memory.md); needs no tensor.
Sizing arithmetic for the docs, benches and tests (not the wheel's)."""

from __future__ import annotations

from collections.abc import Sequence

from dbo_runtime.core.topk_memory import index_leaders


def groups_with_followers(leaders: Sequence[bool]) -> int:
    """Index groups (a leader and its followers) with at least one follower."""
    return sum(1 for i, is_leader in enumerate(leaders) if is_leader and i + 1 < len(leaders) and not leaders[i + 1])


def max_decode_rows(max_num_batched_tokens: int, max_num_seqs: int, max_decode_query_len: int = 1) -> int:
    """vLLM's ``get_sparse_mla_index_group_max_rows``."""
    return min(max_num_batched_tokens, max_num_seqs * max_decode_query_len)


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
    """Device bytes each extra microbatch costs, per layout (``windows`` allocates nothing)."""
    leaders = index_leaders(num_layers, index_topk_freq, index_skip_topk_offset, index_topk_pattern)
    groups = groups_with_followers(leaders)
    rows = max_decode_rows(max_num_batched_tokens, max_num_seqs, max_decode_query_len)
    copies = 0
    if groups:
        copies = max_num_batched_tokens * index_topk * index_dtype_bytes
        copies += groups * (rows + 1) * (index_topk * index_dtype_bytes + 4)
    return {"copies": copies, "windows": 0, "groups_with_followers": groups, "max_decode_rows": rows}
