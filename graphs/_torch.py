"""Imported first by the kernel scripts: without torch, one line and exit 3 instead of an import traceback ahead of
the scripts' own refusals (no CUDA, no DeepGEMM)."""

from __future__ import annotations

import sys
from pathlib import Path

EXIT_NO_DEVICE = 3


def exit_without_torch(script: str) -> None:
    """Exit with status 3 (cannot run here) and one line when torch is not installed (worded like the engine scripts')."""
    try:
        import torch  # noqa: F401  (the scripts import it next anyway)
    except ImportError:
        print(f"{script}: needs a CUDA GPU and DeepGEMM: torch is not installed; nothing measured", file=sys.stderr)
        raise SystemExit(EXIT_NO_DEVICE) from None


def refuse_without_kernels(script: str, done: str = "nothing measured") -> int | None:
    """Exit status 2 with one line on stderr when ``script`` cannot run real DeepGEMM here, else None."""
    from dbo_runtime.sim.backends import real_kernels_missing

    missing = real_kernels_missing()
    if missing is None:
        return None
    print(f"{script}: needs a CUDA GPU and DeepGEMM: {missing}; {done}", file=sys.stderr)
    return 2


exit_without_torch(Path(sys.argv[0]).stem or "graphs")
