"""The one matplotlib import of the ``graphs/`` scripts: headless (Agg), and optional -- a machine
without matplotlib still gets every JSON result, only the PNG is skipped."""

from __future__ import annotations

import sys
from typing import Any


def pyplot() -> Any | None:
    """``matplotlib.pyplot`` on the Agg backend, or None when matplotlib is not installed (said once on stderr, so
    a missing PNG is never a silent gap: the plugin does not depend on matplotlib, only the development set-up
    installs it, and a GPU machine may lack it)."""
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
