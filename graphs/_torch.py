"""Imported first by the kernel scripts: without torch, exit 3 (cannot run here) with one line.

The scripts import torch (directly or through ``dbo_runtime.sim``) at module level, so without it
Python would print a traceback before their own one-line refusals (no CUDA, no DeepGEMM) run. The
check runs on import, ahead of those imports, so the scripts keep their imports at the top."""

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


exit_without_torch(Path(sys.argv[0]).stem or "graphs")
