"""The activation line reaches the log of the processes where the patches work.

vLLM 0.33.0 loads general plugins in ``EngineArgs.__post_init__`` before ``LLM``
configures logging, and forks the engine core with ``plugins_loaded`` already
true, so a line that ``register()`` logs there is dropped and appears in no
process (seen in the real engine on the H200). This test runs
vLLM's real order in a fresh interpreter: plugins first, logging second, then a
fork whose child configures logging and imports a worker module (as
``run_engine_core`` / ``worker_main`` do).
"""

from __future__ import annotations

import subprocess
import sys
from importlib import metadata

CODE = r"""
import os, sys
import vllm.plugins
vllm.plugins.load_general_plugins()              # EngineArgs.__post_init__ (arg_utils.py:931)
from vllm.config.logging import LoggingConfig
from vllm.logger import configure_logging
configure_logging(LoggingConfig())               # LLM.__init__ (llm.py:338), after the plugins
sys.stderr.write("PARENT-DONE\n"); sys.stderr.flush()
pid = os.fork()
if pid == 0:
    configure_logging(LoggingConfig())           # run_engine_core / worker_main
    sys.stderr.write("CHILD-PID %d\n" % os.getpid()); sys.stderr.flush()
    import vllm.v1.worker.gpu_worker             # a lazy patch target: the worker imports it
    from vllm.v1.worker.gpu_worker import Worker
    assert hasattr(Worker, "dbo_runtime_stats"), "worker RPC method not added"
    sys.stderr.flush()
    os._exit(0)
_, status = os.waitpid(pid, 0)
sys.exit(os.waitstatus_to_exitcode(status))
"""


def test_activation_line_in_forked_worker_process() -> None:
    # vLLM logs to stdout, our markers go to stderr: one pipe keeps them in order.
    proc = subprocess.run([sys.executable, "-c", CODE], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300)
    out = proc.stdout
    assert proc.returncode == 0, out[-3000:]
    before, _, child = out.partition("PARENT-DONE\n")
    child_pid = child.split("CHILD-PID ", 1)[1].split()[0]
    lines = [line for line in out.splitlines() if f"patches installed for vLLM {metadata.version('vllm')} (verified by its code)" in line]
    assert len(lines) == 1, out[-3000:]
    # vLLM's own prefix names the process: the line comes from the child (the worker) and lists the features.
    assert f"pid={child_pid}" in lines[0] and "INFO" in lines[0], lines[0]
    for feature in ("sm_control (", "indexer (", "topk (", "stats (1)"):
        assert feature in lines[0], lines[0]
    # The parent's INFO line is dropped by vLLM's not-yet-configured logger, exactly as in the engine.
    assert "patches installed" not in before


def test_activation_line_immediately_when_logging_is_configured() -> None:
    code = (
        "from vllm.config.logging import LoggingConfig\n"
        "from vllm.logger import configure_logging\n"
        "configure_logging(LoggingConfig())\n"
        "import vllm.plugins\n"
        "vllm.plugins.load_general_plugins()\n"
        "from dbo_runtime.integration import plugin\n"
        "plugin.register(); plugin.register()\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300)
    out = proc.stdout
    assert proc.returncode == 0, out[-2000:]
    assert out.count(f"patches installed for vLLM {metadata.version('vllm')} (verified by its code)") == 1, out[-2000:]
