"""The activation line reaches the log of the processes where the patches work, and the lazy patches land there.

vLLM 0.33.0 loads general plugins in ``EngineArgs.__post_init__`` before ``LLM``
configures logging, and forks the engine core with ``plugins_loaded`` already
true, so a line that ``register()`` logs there is dropped and appears in no
process (seen in the real engine on the H200). The script runs
vLLM's real order in a fresh interpreter: plugins first, logging second, then a
fork whose child configures logging and imports a worker module (as
``run_engine_core`` / ``worker_main`` do), where every lazy patch must land.

Each scenario runs in a forked child of one interpreter that has imported vLLM's logging and plugin modules
(neither loads a plugin nor configures logging): one vLLM import for all (``tests/forked.py``).
"""

from __future__ import annotations

from importlib import metadata

import pytest

from tests.forked import Scenario, run_forked

LINE = f"patches installed for vLLM {metadata.version('vllm')} (verified by its code)"

WORKER_ORDER = r"""
import importlib, importlib.util
vllm.plugins.load_general_plugins()              # EngineArgs.__post_init__
heavy = [m for m in ("vllm.v1.worker.gpu_model_runner", "vllm.v1.worker.gpu_ubatch_wrapper",
                     "vllm.v1.worker.gpu.model_runner", "vllm.v1.attention.backends.mla.indexer") if m in sys.modules]
assert not heavy, f"register() imported worker modules: {heavy}"
configure_logging(LoggingConfig())               # LLM.__init__, after the plugins
sys.stderr.write("PARENT-DONE\n"); sys.stderr.flush()
pid = os.fork()
if pid == 0:
    configure_logging(LoggingConfig())           # run_engine_core / worker_main
    sys.stderr.write("CHILD-PID %d\n" % os.getpid()); sys.stderr.flush()
    import vllm.v1.worker.gpu_worker             # a lazy patch target: the worker imports it
    from vllm.v1.worker.gpu_worker import Worker
    assert hasattr(Worker, "dbo_runtime_stats"), "worker RPC method not added"
    sys.stdout.flush(); sys.stderr.flush()
    try:
        from dbo_runtime.integration import plugin, sm_hooks
        v1 = importlib.util.find_spec("vllm.v1.worker.gpu_ubatch_wrapper") is not None
        runner = "vllm.v1.worker.gpu_model_runner" if v1 else "vllm.v1.worker.gpu.model_runner"
        importlib.import_module(runner)  # imports the microbatch wrapper or runner, the indexer builder, ...
        import vllm.v1.worker.gpu.ubatch_utils as w2
        import vllm.v1.worker.ubatch_utils as vu
        from dbo_runtime.integration.patching import PATCH_MARK
        # each runner's alias has a wrapper of its own, marked with its own patch, wrapping vLLM's function
        aliases = [(w2, "sm_control.mrv2")]
        if v1:
            import vllm.v1.worker.gpu_ubatch_wrapper as w
            aliases.append((w, "sm_control.mrv1"))
            assert w.create_sm_control_context is not w2.create_sm_control_context
        for mod, name in aliases:
            assert getattr(mod.create_sm_control_context, PATCH_MARK) == name, mod
            assert mod.create_sm_control_context.__wrapped__ is vu.create_sm_control_context
        assert not hasattr(sm_hooks.create_sm_control_context, PATCH_MARK)
        patch_set = plugin.installed_patch_set()
        states = {s.patch.name: s.state for s in patch_set.status()}
        modules = {p.name: p.module for p in patch_set.patches}
        stuck = [n for n, st in states.items() if st == "pending" and modules[n] in sys.modules]
        assert not stuck, stuck
        runner_patches = ("sm_control.mrv1", "indexer.plan_ahead.mrv1") if v1 else ("sm_control.mrv2", "indexer.plan_ahead.mrv2")
        assert all(states[n] == "installed" for n in runner_patches), states
        assert v1 or not [n for n in states if n.endswith("mrv1")], states
        sys.stderr.write("LAZY-OK %d\n" % sum(st == "installed" for st in states.values()))
    except BaseException:
        sys.stderr.write("LAZY-FAILED\n"); traceback.print_exc()
    sys.stdout.flush(); sys.stderr.flush()
    os._exit(0)
_, status = os.waitpid(pid, 0)
assert os.waitstatus_to_exitcode(status) == 0, status
"""
"""vLLM's order in an engine: plugins, then logging, then a forked worker that imports the runner modules."""

LOGGING_FIRST = r"""
configure_logging(LoggingConfig())
vllm.plugins.load_general_plugins()
from dbo_runtime.integration import plugin
plugin.register(); plugin.register()
"""
"""Logging configured before the plugins load (an offline ``LLM`` after the first, a server)."""

SCENARIOS = {"worker order": WORKER_ORDER, "logging first": LOGGING_FIRST}


@pytest.fixture(scope="module")
def scenario_logs() -> dict[str, Scenario]:
    """Per scenario: its exit code and what it wrote, vLLM's log (stdout) and the markers (stderr) in one stream."""
    prelude = (
        "import os, sys, traceback\n"
        "import vllm.plugins\n"
        "from vllm.config.logging import LoggingConfig\n"
        "from vllm.logger import configure_logging\n"
    )
    return run_forked(prelude, SCENARIOS, merged=True, timeout=300)


def test_activation_line_in_forked_worker_process(scenario_logs: dict[str, Scenario]) -> None:
    run = scenario_logs["worker order"]
    out = run.stdout
    assert run.code == 0, out[-3000:]
    before, _, child = out.partition("PARENT-DONE\n")
    child_pid = child.split("CHILD-PID ", 1)[1].split()[0]
    lines = [line for line in out.splitlines() if LINE in line]
    assert len(lines) == 1, out[-3000:]
    # vLLM's own prefix names the process: the line comes from the child (the worker) and lists the features.
    assert f"pid={child_pid}" in lines[0] and "INFO" in lines[0], lines[0]
    for feature in ("sm_control (", "indexer (", "topk (", "stats (1)"):
        assert feature in lines[0], lines[0]
    # The parent's INFO line is dropped by vLLM's not-yet-configured logger, exactly as in the engine.
    assert "patches installed" not in before


def test_fresh_process_patches_runner_modules_imported_after_register(scenario_logs: dict[str, Scenario]) -> None:
    """In a worker the runner modules load after the plugin: every lazy patch must still land.

    (An eager patch that imports a lazy patch's module during install leaves that patch
    stuck 'pending'; the worker order runs the real order in a clean interpreter.)
    """
    run = scenario_logs["worker order"]
    assert run.code == 0 and "LAZY-OK" in run.stdout, run.stdout[-3000:]


def test_activation_line_immediately_when_logging_is_configured(scenario_logs: dict[str, Scenario]) -> None:
    """Operators grep vLLM's log for 'dbo_runtime:': the line goes through vLLM's handler (our loggers are
    children of vLLM's), once however often ``register`` runs."""
    run = scenario_logs["logging first"]
    out = run.stdout
    assert run.code == 0, out[-2000:]
    lines = [line for line in out.splitlines() if LINE in line]
    assert len(lines) == 1, out[-2000:]
    assert "INFO" in lines[0] and "dbo_runtime: " in lines[0], lines[0]
