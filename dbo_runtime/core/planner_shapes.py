"""The planner shapes a decode step presents to DeepGEMM (which JIT-compiles one paged-MQA planner per
``(32-aligned batch, SM slots)``), derived from vLLM's microbatch split. Pure arithmetic."""

from __future__ import annotations

import bisect
from collections.abc import Sequence

from dbo_runtime.core.errors import ConfigError

BATCH_ALIGN = 32


def align_batch(rows: int, align: int = BATCH_ALIGN) -> int:
    """The aligned batch DeepGEMM templates the planner on (``kAlignedBatchSize``)."""
    return -(-int(rows) // align) * align


def aligned_buckets(max_batch: int, align: int = BATCH_ALIGN) -> list[int]:
    """Batch sizes covering every aligned bucket up to ``max_batch``."""
    if max_batch <= 0:
        raise ConfigError("max_batch", max_batch, "a positive integer")
    return list(range(align, align_batch(max_batch, align) + 1, align))


def ubatch_split(tokens_per_request: Sequence[int], num_tokens_padded: int, num_ubatches: int) -> list[tuple[int, int]]:
    """``(requests, tokens)`` of each microbatch of a step, split as vLLM splits it."""
    cu = [0]
    for n in tokens_per_request:
        cu.append(cu[-1] + int(n))
    step = int(num_tokens_padded) // num_ubatches
    ends = [step * i for i in range(1, num_ubatches)] + [cu[-1]]
    out: list[tuple[int, int]] = []
    start = 0
    for end in ends:
        first = bisect.bisect_right(cu, start) - 1
        stop = bisect.bisect_left(cu, end)
        out.append((stop - first, end - start))
        start = end
    requests, tokens = out[-1]
    out[-1] = (requests, tokens + int(num_tokens_padded) - cu[-1])
    return out


def dbo_planner_shapes(
    *,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    num_speculative_tokens: int,
    capture_sizes: Sequence[int],
    num_ubatches: int,
    decode_token_threshold: int,
    per_token_rows: bool,
) -> tuple[tuple[int, int], ...]:
    """The ``(rows, width)`` planner shapes a DBO step presents per microbatch in uniform decode."""
    q = 1 + int(num_speculative_tokens)
    width = 1 if per_token_rows else q
    floor = max(int(decode_token_threshold), int(num_ubatches), 1)
    sizes = {int(t) for t in capture_sizes if int(t) >= floor and int(t) % q == 0 and int(t) <= max_num_seqs * q}
    full = min(int(max_num_seqs) * q, int(max_num_batched_tokens)) // q * q
    if full >= floor:
        sizes.add(full)
    shapes: set[tuple[int, int]] = set()
    for tokens in sorted(sizes):
        for requests, ubatch_tokens in ubatch_split([q] * (tokens // q), tokens, int(num_ubatches)):
            rows = ubatch_tokens if per_token_rows else requests
            if rows > 0:
                shapes.add((rows, width))
    return tuple(sorted(shapes))
