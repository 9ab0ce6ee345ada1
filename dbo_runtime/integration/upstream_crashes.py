"""vLLM's own crashes under microbatching (vanilla dies alike), read from its code: a build that fixes one starts."""

from __future__ import annotations

import ast

from dbo_runtime.core import coverage
from dbo_runtime.integration import fingerprints

COMPRESSOR_MODULE = "vllm.models.deepseek_v4.nvidia.ops.sparse_attn_compress_cutedsl"
PER_TOKEN_INPUTS = ("positions", "slot_mapping", "kv_slot_mapping")


def aligned_compressor_inputs() -> tuple[str, ...]:
    """Per-token inputs the CuTe DSL compressor assumes aligned (``divisibility`` > 1); none where its source is
    absent or unreadable (vLLM's crash is loud, never a wrong token)."""
    tree = fingerprints.parsed(COMPRESSOR_MODULE)
    found: set[str] = set()
    for node in ast.walk(tree) if tree is not None else ():
        if not (isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)):
            continue
        func = node.value.func
        name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
        targets = [t.id for t in node.targets if isinstance(t, ast.Name) and t.id in PER_TOKEN_INPUTS]
        for kw in node.value.keywords if name == "make_fake_tensor" and targets else ():
            if kw.arg == "divisibility" and isinstance(kw.value, ast.Constant) and kw.value.value != 1:
                found.update(targets)
    return tuple(sorted(found))


def problem(arch: str, platform: str, microbatches: bool) -> str:
    """Why vLLM itself would crash serving ``arch`` microbatched here ("" when it would not)."""
    if not microbatches or platform != "cuda" or arch not in coverage.UNALIGNED_COMPRESSOR:
        return ""
    aligned = aligned_compressor_inputs()
    if not aligned:
        return ""
    return (
        f"vLLM's DeepSeek-V4 compressor (CuTe DSL) is compiled for aligned {', '.join(aligned)}, and each "
        "microbatch reads them as a view that starts at its first token, so vLLM raises 'Misaligned Tensor data' at "
        "the first split that is not a multiple of 8 tokens (vLLM's bug; vanilla vLLM dies the same way)"
    )
