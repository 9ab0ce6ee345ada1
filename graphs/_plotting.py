"""The one matplotlib import of the ``graphs/`` scripts: headless (Agg), and optional -- a machine
without matplotlib still gets every JSON result, only the PNG is skipped."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def pyplot() -> Any | None:
    """``matplotlib.pyplot`` on the Agg backend, or None without matplotlib (said once on stderr: no silent gap)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        if not _said:
            _said.append(True)
            print("note: no PNG: matplotlib is missing here (the JSON has every number; pip install matplotlib)", file=sys.stderr)
        return None
    return plt


_said: list[bool] = []

Panel = tuple[Sequence[str], Sequence[float], str]
"""(bar labels, values, value-axis label)."""


def bar_panels(path: Path, title: str, panels: Sequence[Panel], *, horizontal: bool = False, log: bool = False) -> bool:
    """The panels side by side as bar charts, saved to ``path``; False (nothing written) without matplotlib."""
    plt = pyplot()
    if plt is None:
        return False
    fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 4), squeeze=False)
    for ax, (labels, values, label) in zip(axes[0], panels, strict=True):
        (ax.barh if horizontal else ax.bar)(list(labels), list(values))
        (ax.set_xlabel if horizontal else ax.set_ylabel)(label)
        if log:
            (ax.set_xscale if horizontal else ax.set_yscale)("log")
        ax.tick_params(labelsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
