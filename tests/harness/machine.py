"""Can the real vLLM engine run here, and in how much GPU memory? One answer, in the same words, for tests, benchmarks and scripts (not the wheel's)."""

from __future__ import annotations

import sys


def engine_missing(gpus: int) -> str | None:
    """Why the real engine cannot run here, or None."""
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA device (torch.cuda.is_available() is False)"
    if torch.cuda.device_count() < gpus:
        return f"needs {gpus} GPUs, {torch.cuda.device_count()} visible"
    from dbo_runtime.integration import releases

    if releases.installed_version() is None:
        return "vLLM is not installed"
    match = releases.identify()
    if match.release is None:
        return f"needs a vLLM release dbo_runtime verifies, found {match.describe()}"
    return None


def refuse_without_engine(script: str, gpus: int, done: str = "nothing measured") -> int | None:
    """Exit status 3 with one line on stderr when ``script`` cannot run the engine here, else None."""
    missing = engine_missing(gpus)
    if missing is None:
        return None
    from dbo_runtime.integration.releases import SUPPORTED

    need = {1: "a CUDA GPU", 2: "two CUDA GPUs"}.get(gpus, f"{gpus} CUDA GPUs")
    print(f"{script}: needs {need} and vLLM {' or '.join(SUPPORTED)}: {missing}; {done}", file=sys.stderr)
    return 3

def gpu_gib() -> float | None:
    """The smallest GPU's total memory per NVML (no CUDA context here): a rough guard; None where NVML cannot say
    or a GPU is MIG-sliced."""
    from dbo_runtime.adapters import nvml

    try:
        gpus = nvml.query().gpus
    except nvml.NvmlUnavailable:
        return None
    if any(g.mig_enabled for g in gpus):
        return None
    totals = [g.memory_total_bytes for g in gpus if g.memory_total_bytes]
    return min(totals) / 2**30 if totals else None


__all__ = ["engine_missing", "gpu_gib", "refuse_without_engine"]
