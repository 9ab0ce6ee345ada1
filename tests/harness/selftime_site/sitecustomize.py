"""Loads the self-timer (``tests/harness/selftime.py``) into every Python process of a bench run.

On ``PYTHONPATH`` of the run (``tests.e2e.plan.bench_env``), so the front-end, the engine core and the workers
all start with it; it does nothing unless ``DBO_RUNTIME_SELF_TIME`` is on. The checkout's root goes first on
``sys.path`` so ``tests.harness`` imports.
"""

import sys
from pathlib import Path

_root = str(Path(__file__).resolve().parents[3])
if sys.path[:1] != [_root]:  # first: a foreign top-level ``tests`` package must not win
    sys.path.insert(0, _root)
from tests.harness import selftime  # noqa: E402

if selftime.enabled():
    selftime.install()
