"""The test-only load format ``dbo_runtime_random``, kept out of the wheel.

This directory is a ``sys.path`` entry of its own: it holds the module and a ``.dist-info`` whose
``vllm.general_plugins`` entry point registers the format. vLLM finds it in any process that has the
directory on ``PYTHONPATH``, which :func:`put_on_pythonpath` arranges for the engines the e2e runs start.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping
from pathlib import Path

DIRECTORY = Path(__file__).resolve().parent


def put_on_pythonpath(environ: MutableMapping[str, str] = os.environ) -> None:
    """Prepend this directory to ``environ["PYTHONPATH"]`` once, so child processes register the format."""
    entries = [e for e in environ.get("PYTHONPATH", "").split(os.pathsep) if e]
    if str(DIRECTORY) not in entries:
        environ["PYTHONPATH"] = os.pathsep.join([str(DIRECTORY), *entries])
