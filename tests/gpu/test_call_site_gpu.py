"""GPU twins of the logits call-site wrapper (``indexer_hooks._make_logits``): real DeepGEMM, real CUDA.

Twin of tests/vllm/test_indexer_hooks.py, tests/unit/test_capture_counter.py and, for out of memory,
tests/vllm/test_ubatch_guard.py. No vLLM on the GPU machine, so the wrapped function is a Python function with
``vllm.utils.deep_gemm.fp8_fp4_paged_mqa_logits``'s signature over the real kernel (the wrapper binds its
arguments by that signature), and the microbatch thread table is a stand-in for vLLM's
(``ubatch_ids._module``).

1. Every DSA-family indexer geometry (heads x dim, block, next_n as the architectures' SM90 paths run them)
   under the DBO SM count: vanilla's call asserts, the wrapped call re-plans and is bit-identical to the
   full-GPU logits on every valid column.
2. A real CUDA out-of-memory error inside the kernel path on a microbatch thread: the handler hands back a
   view of the row reserved at model load -- no allocation, no raise -- and the failure is recorded.
"""

from __future__ import annotations

import json
import threading
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
import torch

from dbo_runtime.adapters.deep_gemm import DeepGemmPlanner, schedule_slots
from dbo_runtime.services import schedule_cache as sc
from dbo_runtime.services.schedule_cache import IndexerScheduleCache
from dbo_runtime.sim.backends import logits_options

DBO_SMS = 112
MAX_CTX = 8192
BLOCK = 64
CONTEXTS = [1, 63, 64, 65, 500, 2048, 4097, 8192]
GEOMETRIES = {
    # architecture: (indexer heads, head dim) of its SM90 DeepGEMM path (block 64, fp8 keys with fp32 scales)
    "DeepseekV32ForCausalLM": (64, 128),
    "GlmMoeDsaForCausalLM (GLM-5.3)": (32, 128),
    "DeepseekV4ForCausalLM": (64, 128),
    "DeepseekV41ForCausalLM": (64, 128),
    "Glm5NextForCausalLM (GLM-5.3-Flash)": (32, 128),
}


def _vllm_signature(dg: ModuleType) -> Any:
    def fp8_fp4_paged_mqa_logits(
        q: Any, kv_cache: Any, weights: Any, context_lens: Any, block_tables: Any, schedule_metadata: Any,
        max_model_len: int, indices: Any | None = None,
    ) -> Any:  # fmt: skip
        return dg.fp8_fp4_paged_mqa_logits(
            q, kv_cache, weights, context_lens, block_tables, schedule_metadata, max_model_len,
            **logits_options(dg.fp8_fp4_paged_mqa_logits),
        )  # fmt: skip

    return fp8_fp4_paged_mqa_logits


def _case(heads: int, dim: int, next_n: int, device: torch.device) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(heads * 10 + next_n)
    batch, per_req = len(CONTEXTS), MAX_CTX // BLOCK
    blocks = batch * per_req + 8
    values = (torch.randn((blocks, BLOCK * dim), generator=gen) * 0.5).to(torch.float8_e4m3fn)
    fused = torch.empty((blocks, BLOCK * (dim + 4)), dtype=torch.uint8)
    fused[:, : BLOCK * dim] = values.view(torch.uint8)
    fused[:, BLOCK * dim :] = (torch.rand((blocks, BLOCK), generator=gen) + 0.5).contiguous().view(torch.uint8)
    last = torch.tensor(CONTEXTS, dtype=torch.int32)
    lens = (last[:, None] + torch.arange(next_n, dtype=torch.int32)[None, :] - (next_n - 1)).clamp(min=1)
    return {
        "q": ((torch.randn((batch, next_n, heads, dim), generator=gen) * 0.5).to(torch.float8_e4m3fn).to(device), None),
        "kv_cache": fused.view(blocks, BLOCK, 1, dim + 4).to(device),
        "weights": torch.rand((batch * next_n, heads), generator=gen).to(device),
        "context_lens": lens.contiguous().to(device),
        "block_tables": torch.randperm(blocks, generator=gen)[: batch * per_req].view(batch, per_req).to(torch.int32).to(device),
    }


def _call(fn: Any, c: dict[str, Any], schedule: Any) -> Any:
    return fn(c["q"], c["kv_cache"], c["weights"], c["context_lens"], c["block_tables"], schedule, MAX_CTX, indices=None)


@pytest.mark.parametrize("next_n", [1, 2, 4])
@pytest.mark.parametrize("arch", list(GEOMETRIES))
def test_every_family_geometry_is_bit_identical_under_the_dbo_count(
    deep_gemm: ModuleType,
    cuda_device: torch.device,
    arch: str,
    next_n: int,
    out_dir: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from dbo_runtime.integration.indexer_hooks import _make_logits

    heads, dim = GEOMETRIES[arch]
    planner = DeepGemmPlanner()
    cache = IndexerScheduleCache(planner)
    monkeypatch.setattr(sc, "_CACHE", cache)
    total = int(deep_gemm.get_num_sms())
    vanilla = _vllm_signature(deep_gemm)
    c = _case(heads, dim, next_n, cuda_device)
    schedule = planner.plan(c["context_lens"], BLOCK, total)
    ref = _call(vanilla, c, schedule).clone()
    cache.track(schedule, planned_sms=total, block_kv=BLOCK, next_n=next_n)
    deep_gemm.set_num_sms(DBO_SMS)
    with pytest.raises(Exception, match="_schedule_meta_size"):
        _call(vanilla, c, schedule)  # vLLM 0.33.0 under DBO
    got = _call(_make_logits(vanilla), c, schedule)
    torch.cuda.synchronize()
    valid = torch.arange(MAX_CTX, device=cuda_device)[None, :] < c["context_lens"].reshape(-1, 1)
    wrong = int(((got.view(torch.int32) != ref.view(torch.int32)) & valid).sum().item())
    rows = schedule_slots(DBO_SMS, next_n) + 1
    if out_dir is not None:
        name = arch.split(" ")[0]
        (out_dir / f"call_site_{name}_next_n{next_n}.json").write_text(
            json.dumps({"arch": arch, "heads": heads, "dim": dim, "next_n": next_n, "replans": cache.stats.replans, "wrong": wrong, "rows": rows})
        )
    assert wrong == 0 and cache.stats.replans == 1


def test_out_of_memory_on_a_microbatch_thread_allocates_nothing_and_never_raises(
    cuda_device: torch.device, monkeypatch: pytest.MonkeyPatch
) -> None:
    from dbo_runtime.integration import indexer_hooks, ubatch_guard, ubatch_ids
    from dbo_runtime.integration.patching import _shielded

    monkeypatch.setattr(ubatch_guard, "_RESERVED", {})
    c = _case(32, 128, 1, cuda_device)
    # what register_builder does at model load: a row per decode token of the largest step
    ubatch_guard.reserve_placeholders(cuda_device, MAX_CTX, int(c["context_lens"].numel()))

    def out_of_memory(q: Any, kv_cache: Any, weights: Any, context_lens: Any, block_tables: Any, schedule_metadata: Any,
                      max_model_len: int, indices: Any | None = None) -> Any:  # fmt: skip
        return torch.empty((1 << 45,), dtype=torch.uint8, device=cuda_device)  # 32 TiB: a real CUDA OOM

    [patch] = [p for p in indexer_hooks.patches() if p.name == "indexer.logits.sparse_attn_indexer"]
    wrapped = _shielded(patch, patch.make(out_of_memory), out_of_memory)  # what PatchSet installs
    table = {threading.get_ident(): 1}  # this thread is DBO microbatch 1 (vLLM's thread table, absent here)
    monkeypatch.setattr(ubatch_ids, "_module", SimpleNamespace(_THREAD_ID_TO_CONTEXT=table, _CURRENT_CONTEXTS=[]))
    ubatch_guard.FAILURES.take()
    schedule = torch.zeros((2, 2), dtype=torch.int32, device=cuda_device)  # allocated before the measured window
    # The call site takes the schedule as right for the SM count in force (no re-plan, which allocates its own
    # schedule): what is measured is the kernel's out-of-memory failure and the handler's answer to it.
    monkeypatch.setattr(sc.IndexerScheduleCache, "fits", lambda self, s: True)
    torch.cuda.synchronize()
    before = torch.cuda.memory_stats(cuda_device)["allocation.all.allocated"]
    out = _call(wrapped, c, schedule)
    after = torch.cuda.memory_stats(cuda_device)["allocation.all.allocated"]
    [(where, ubatch, exc)] = ubatch_guard.FAILURES.take()
    assert where == "indexer.logits.sparse_attn_indexer" and ubatch == 1 and isinstance(exc, torch.OutOfMemoryError)
    assert after == before, f"the handler allocated {after - before} blocks"
    assert tuple(out.shape) == (len(CONTEXTS), MAX_CTX) and out.stride() == (ubatch_guard.ROW_STRIDE, 1)
    assert out.dtype == torch.float32
    assert torch.topk(out, 4, dim=1).values.abs().sum().item() == 0.0  # a downstream kernel reads it in bounds
