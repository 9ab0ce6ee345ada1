"""Loads the one-GPU DBO emulation (``tests/e2e/dp_emulation.py``) into every Python process of a run.

On ``PYTHONPATH`` of the run, so the front-end, the engine core and the workers all start with it; it does
nothing unless ``DBO_EMULATE_DP_PEER=1``. The checkout's root joins ``sys.path`` so ``tests.e2e`` imports. Being the
run's one sitecustomize, it also loads the self-timer (``tests/harness/selftime.py``) under ``DBO_RUNTIME_SELF_TIME``.
"""

import os
import sys
from pathlib import Path

_root = str(Path(__file__).resolve().parents[4])
if (os.environ.get("DBO_EMULATE_DP_PEER") == "1" or "DBO_RUNTIME_SELF_TIME" in os.environ) and sys.path[:1] != [_root]:
    sys.path.insert(0, _root)  # first: a foreign top-level ``tests`` package must not win
if os.environ.get("DBO_EMULATE_DP_PEER") == "1":
    from tests.e2e import dp_emulation

    dp_emulation.install()
if "DBO_RUNTIME_SELF_TIME" in os.environ:
    from tests.harness import selftime

    if selftime.enabled():
        selftime.install()
