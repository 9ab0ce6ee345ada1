"""GPU twin: the out-of-memory placeholder logits pass through every vLLM decode top-k backend in bounds.

``ubatch_guard.placeholder_logits`` hands vLLM a view of zeros reserved at model load, rows overlapping
``ROW_STRIDE`` elements apart, instead of allocating ``[rows, max_model_len]`` (tests/vllm/test_ubatch_guard.py on
CPU; tests/gpu/test_call_site_gpu.py for the no-allocation half). The step raises after the join, so the top-k
values are never used: what must hold is that the top-k that follows in ``sparse_attn_indexer`` completes without
a fault or a raise, and that every index it writes is -1 or inside its row's length (the sparse attention kernel
gathers KV with them). Rows up to 64k tokens reach the backends' long-row paths, whose CTA geometry comes from the
row stride. A stride-0 view killed the process in the persistent backend (SIGFPE on the H200). per_row, persistent
and cooperative run on SM90 (deep_select needs SM100). The ``torch`` backend is vLLM's debug reference: its
``masked_fill`` is out of place and allocates the full logits, so after an out-of-memory error it raises again; it
is run here for its result, and named in ``docs/troubleshooting.md``. How many indices each row got is recorded in
``$OUT``, not asserted. Needs vLLM's CUDA ops, so it runs where the e2e bundle installs vLLM.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.gpu.conftest import _unavailable

MAX_CTX = 65536
TOPK = 2048
LENS = [1, 63, 2047, 2048, 2049, 4097, 8192, 32769, 65536]


@pytest.fixture(scope="module")
def indexer_topk(cuda_device: torch.device) -> Any:
    try:
        from vllm.model_executor.layers import indexer_topk
        from vllm.v1.worker import workspace
    except ImportError as exc:
        pytest.skip(f"vLLM is not installed here ({exc!r}): this twin runs with the e2e bundle")
    try:
        torch.ops._C.persistent_topk  # noqa: B018  (vLLM's compiled ops are loaded)
    except (AttributeError, RuntimeError) as exc:
        _unavailable(f"vLLM's CUDA ops are not loaded: {exc!r}")
    if workspace._manager is None:
        workspace.init_workspace_manager(cuda_device)
    return indexer_topk


@pytest.mark.parametrize("backend", ["per_row", "persistent", "cooperative", "torch"])
def test_the_placeholder_row_reads_in_bounds_through_every_topk_backend(
    cuda_device: torch.device, indexer_topk: Any, backend: str, monkeypatch: pytest.MonkeyPatch, out_dir: Any
) -> None:
    import json

    from dbo_runtime.integration import ubatch_guard

    monkeypatch.setattr(ubatch_guard, "_RESERVED", {})
    ubatch_guard.reserve_placeholders(cuda_device, MAX_CTX, len(LENS))
    seq_lens = torch.tensor(LENS, dtype=torch.int32, device=cuda_device)
    weights = torch.zeros((len(LENS), 8), dtype=torch.float32, device=cuda_device)
    logits = ubatch_guard.placeholder_logits(seq_lens.view(-1, 1), weights, MAX_CTX)
    assert logits.stride() == (ubatch_guard.ROW_STRIDE, 1) and tuple(logits.shape) == (len(LENS), MAX_CTX)
    topk = indexer_topk.get_indexer_topk(backend)
    try:
        chosen = topk.resolve_backend(logits, TOPK, len(LENS))
    except RuntimeError as exc:
        _unavailable(f"{backend} is not applicable on this GPU: {exc}")
    assert chosen == backend
    out = torch.full((len(LENS), TOPK), -7, dtype=torch.int32, device=cuda_device)
    topk(logits, seq_lens, 1, out, TOPK, MAX_CTX)
    torch.cuda.synchronize()
    selected = []
    for row, length in enumerate(LENS):
        got = out[row].cpu()
        assert int((got == -7).sum()) == 0, f"{backend}: row {row} left unwritten"
        assert int(got.min()) >= -1 and int(got.max()) < length, f"{backend}: row {row} indices outside [-1, {length})"
        selected.append(int((got >= 0).sum()))
    if out_dir is not None:
        (out_dir / f"placeholder_topk_{backend}.json").write_text(
            json.dumps({"backend": backend, "row_stride": ubatch_guard.ROW_STRIDE, "lens": LENS, "selected": selected})
        )
