"""The one matplotlib import of the ``graphs/`` scripts: headless (Agg), and optional -- a machine
without matplotlib still gets every JSON result, only the PNG is skipped."""

from __future__ import annotations

from typing import Any


def pyplot() -> Any | None:
    """``matplotlib.pyplot`` on the Agg backend, or None when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt
