"""FA4 sparse MLA's never-evicted varlen-scalar cache stays at one entry under the windows layout.

``vllm.v1.attention.backends.mla.flashattn_mla_sparse`` needs the CUDA flash-attention
extensions to import, so the target is checked in the real 0.33.0 source text and the
patch's ``make`` is exercised on a ``functools.cache``d stand-in with the same signature.
"""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path

import torch

from dbo_runtime.integration.topk_hooks import _fa4_scalars_patch
from dbo_runtime.services.topk_state import TopkLayout, UbatchTopkState


def _index_group(logical: torch.Tensor) -> object:
    """vLLM's real SparseMLAIndexGroup (a plain dataclass); no stream or events exist on CPU, so those are None."""
    from vllm.v1.attention.backends.mla.index_group import SparseMLAIndexGroup

    return SparseMLAIndexGroup(
        logical_topk_indices=logical,
        physical_topk_indices=torch.zeros((9, 4), dtype=torch.int32),
        valid_topk_counts=torch.zeros(9, dtype=torch.int32),
        side_stream=None,  # type: ignore[arg-type]
        logical_topk_ready=None,  # type: ignore[arg-type]
        physical_topk_ready=None,  # type: ignore[arg-type]
        has_indexer=True,
        num_layers=2,
    )


def test_target_exists_in_vllm_0_33_source() -> None:
    spec = importlib.util.find_spec("vllm")
    assert spec is not None and spec.origin is not None
    src = (Path(spec.origin).parent / "v1/attention/backends/mla/flashattn_mla_sparse.py").read_text()
    assert "@cache\ndef _fa4_varlen_scalars(\n    num_tokens: int, num_kv_rows: int, device: torch.device" in src
    assert "_fa4_varlen_scalars(\n            self.topk_indices_buffer.shape[0]" in src


def test_window_lengths_share_one_cache_entry_and_values_match() -> None:
    calls: list[int] = []

    @functools.cache
    def scalars(num_tokens: int, num_kv_rows: int, device: torch.device) -> tuple[torch.Tensor, ...]:
        calls.append(num_tokens)
        return (
            torch.arange(num_tokens + 1, dtype=torch.int32),
            torch.zeros(num_tokens + 1, dtype=torch.int32),
            torch.full((num_tokens,), num_kv_rows, dtype=torch.int32),
        )

    state = UbatchTopkState(lambda: (1, 3), layout=TopkLayout.WINDOWS)
    base = torch.zeros((64, 4), dtype=torch.int32)
    state.mark_model_buffer(base)
    wrapped = _fa4_scalars_patch(state).make(scalars)
    cpu = torch.device("cpu")
    assert wrapped(64, 7, cpu) is scalars(64, 7, cpu)  # nothing attached yet: unchanged key
    group = _index_group(base)  # kept: the per-microbatch state lives as long as its group
    state.attach(group, 2, lambda: None)
    windows = [wrapped(64 - offset, 7, cpu) for offset in (3, 10, 31, 40)]
    assert all(w is windows[0] for w in windows) and calls == [64]
    n = 5  # what the kernel slices: identical to a cache entry made for the window length itself
    reference = (torch.arange(n + 1, dtype=torch.int32), torch.zeros(n + 1, dtype=torch.int32), torch.full((n,), 7))
    got = windows[0]
    assert torch.equal(got[0][: n + 1], reference[0]) and torch.equal(got[1][: n + 1], reference[1])
    assert torch.equal(got[2][:n], reference[2].to(torch.int32))
