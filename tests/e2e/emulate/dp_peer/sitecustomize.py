"""Loads the one-GPU DBO emulation (``tests/e2e/dp_emulation.py``) into every Python process of a run.

On ``PYTHONPATH`` of the run, so the front-end, the engine core and the workers all start with it; it does
nothing unless ``DBO_EMULATE_DP_PEER=1``. The checkout's root joins ``sys.path`` so ``tests.e2e`` imports.
"""

import os
import sys
from pathlib import Path

if os.environ.get("DBO_EMULATE_DP_PEER") == "1":
    _root = str(Path(__file__).resolve().parents[4])
    if _root not in sys.path:
        sys.path.append(_root)
    from tests.e2e import dp_emulation

    dp_emulation.install()
