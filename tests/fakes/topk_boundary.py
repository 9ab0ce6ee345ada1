"""Boundary fakes for the top-k tests on a CPU box (twinned by tests/gpu/test_topk_isolation_gpu.py).

On CPU torch, ``torch.Event.record`` raises ("cpu backend doesn't support
events"), vLLM's ``current_stream()`` raises on the unspecified platform, and
``triton_convert_req_index_to_global_index`` is a Triton kernel. These stand in
for exactly those three things and record who recorded / waited on what, so
the tests can check that every wait is on the waiting microbatch's own event.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


class FakeEvent:
    """Stands in for ``torch.Event``: remembers which microbatch recorded it last."""

    def __init__(self, who: Callable[[], int]) -> None:
        self.who = who
        self.recorded_by: int | None = None
        self.records = 0

    def record(self, stream: Any = None) -> None:
        self.recorded_by = self.who()
        self.records += 1


class FakeStream:
    """Stands in for ``torch.Stream``; logs ``(waiter microbatch, recorder microbatch)`` per wait."""

    def __init__(self, name: str, who: Callable[[], int], log: list[tuple[str, int, int | None]]) -> None:
        self.name = name
        self.who = who
        self.log = log

    def wait_event(self, event: FakeEvent) -> None:
        self.log.append((self.name, self.who(), event.recorded_by))

    def wait_stream(self, stream: Any) -> None:
        pass

    def __enter__(self) -> FakeStream:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


def fake_convert(
    req_id: torch.Tensor,
    block_table: torch.Tensor,
    token_indices: torch.Tensor,
    BLOCK_SIZE: int = 64,
    BLOCK_STRIDE_ROWS: int | None = None,
    NUM_TOPK_TOKENS: int = 2048,
    *,
    return_valid_counts: bool = False,
    out: torch.Tensor | None = None,
    valid_counts_out: torch.Tensor | None = None,
    idx_mapping: torch.Tensor | None = None,
    **_: Any,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Torch reference of vLLM's ``triton_convert_req_index_to_global_index`` docstring formula."""
    rows = req_id.long() if idx_mapping is None else idx_mapping[req_id.long()].long()
    max_blocks = block_table.shape[1]
    block = torch.div(token_indices, BLOCK_SIZE, rounding_mode="floor")
    valid = (token_indices >= 0) & (block < max_blocks)
    gathered = torch.gather(block_table[rows].long(), 1, block.clamp(0, max_blocks - 1).long())
    phys = torch.where(valid, gathered * BLOCK_SIZE + token_indices % BLOCK_SIZE, -1).to(token_indices.dtype)
    counts = valid.sum(dim=1).to(torch.int32)
    if out is not None:
        out.copy_(phys)
        phys = out
    if valid_counts_out is not None:
        valid_counts_out.copy_(counts)
        counts = valid_counts_out
    return (phys, counts) if return_valid_counts else phys
