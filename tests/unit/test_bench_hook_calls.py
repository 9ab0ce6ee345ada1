"""``graphs/bench_hook_calls.py`` runs on the installed vLLM's real classes and leaves vLLM as it found it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.forked import Scenario, run_forked

ROOT = Path(__file__).resolve().parents[2]


RUNS = {"warm": ("--n", "1000", "--reps", "1"), "cold": ("--cold", "1", "--reps", "1")}
"""The two timed runs the tests read: the default back-to-back blocks (short) and ``--cold``."""

@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Scenario]]:
    """Both runs as a user runs the script, each from a fresh interpreter but for the shared import of the vLLM
    modules the benchmark times (``tests/forked.py``). Per run: its --out folder and what it returned."""
    out = tmp_path_factory.mktemp("bench")
    script = str(ROOT / "graphs" / "bench_hook_calls.py")
    scenarios = {name: f"run_script({script!r}, *{[*args, '--out', str(out / name)]!r})" for name, args in RUNS.items()}
    prelude = (  # the vLLM modules the benchmark imports first thing, before it touches the plugin
        f"import importlib, sys\nsys.path.insert(0, {str(ROOT)!r})\nfrom graphs.bench_hook_calls import MODULES\n"
        "for module in MODULES:\n    importlib.import_module(module)\n"
    )
    done = run_forked(prelude, scenarios, cwd=ROOT)
    return {name: (out / name, done[name]) for name in RUNS}


def _run_ok(runs: dict[str, tuple[Path, Scenario]], name: str) -> tuple[Path, str]:
    """The run must succeed with the plugin side really patched (register() would otherwise log its failure and
    leave vLLM vanilla on that side)."""
    out, run = runs[name]
    assert run.code == 0, run.stderr[-2000:]
    assert "PatchError" not in run.stderr and "not installed" not in run.stderr
    return out, run.stdout


def test_the_benchmark_times_every_hooked_access_against_vanilla(runs: dict[str, tuple[Path, Scenario]]) -> None:
    out, _ = _run_ok(runs, "warm")
    doc = json.loads((out / "bench_hook_calls.json").read_text())
    accesses = {(r["access"], r["thread"]) for r in doc["rows"]}
    assert ("SparseAttnIndexer.topk_indices_buffer", "ubatch 1") in accesses and len(accesses) == 35
    # an engine that never split a step, the main thread of one that has (hooks armed), a microbatch thread
    assert {t for _, t in accesses} == {"main", "main, armed", "ubatch 1"}
    assert "topk.DeepseekV32Attention.topk_indices_buffer" in doc["armable_patches"]
    assert "topk.DeepseekV32Model.topk_indices_buffer" not in doc["armable_patches"]  # its setter acts at load
    # vLLM's real decode-metadata build (stub planner): main thread only, where vLLM builds; and the same build in an
    # engine without DBO, where the hooks step aside
    for build in ("DeepseekV32IndexerMetadataBuilder.build (stub planner)", "DeepseekV32IndexerMetadataBuilder.build, no DBO (hooks step aside)"):
        assert (build, "main") in accesses and (build, "ubatch 1") not in accesses and (build, "main, armed") not in accesses
    assert ("SharedTopkIndicesBuffer.topk_indices_buffer (leader)", "main") in accesses
    # the two kernel-calling hooks, timed around a no-op kernel on both sides
    assert ("SparseMLAIndexGroup._convert_once (stub kernel)", "ubatch 1") in accesses
    assert ("fp8_fp4_paged_mqa_logits call site (stub kernel)", "main") in accesses
    for thread in ("main", "main, armed", "ubatch 1"):  # the engine's per-step counts, weighted by each access's cost
        row = doc["per_step_78l"][thread]
        assert row["accesses"] == 473 and isinstance(row["added_us"], float)
        assert row["with_build_us"] == row["added_us"] + row["build_added_us"]
    for row in doc["rows"]:
        assert row["plugin_ns"] > 0 and (row["vanilla_ns"] is None) == (row["access"] == "ubatch_ids.current_ubatch")
    from dbo_runtime.integration.releases import installed_version

    assert doc["environment"]["vllm"].endswith(str(installed_version()))


def test_a_bad_argument_is_argparses_error_and_exit_2() -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "graphs" / "bench_hook_calls.py"), "--reps", "0"], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2 and "error: argument --reps: invalid value '0'" in proc.stderr.strip().splitlines()[-1]


def test_the_per_step_estimate_weights_each_access_by_the_engines_count() -> None:
    sys.path.insert(0, str(ROOT))
    from graphs.bench_hook_calls import BUILD, PER_STEP_78L, per_step

    rows = [{"access": name, "thread": t, "added_ns": 100.0 if t == "main" else 200.0} for name in PER_STEP_78L for t in ("main", "ubatch 1")]
    est = per_step(rows)
    assert est["main"] == {"accesses": 473, "added_us": 47.3, "build_added_us": None, "with_build_us": None}
    assert est["ubatch 1"]["added_us"] == 94.6
    est = per_step([*rows, {"access": BUILD, "thread": "main", "added_ns": 5000.0}])  # one build per step, on main
    assert est["main"]["with_build_us"] == 52.3 and est["ubatch 1"]["with_build_us"] == 99.6


def test_with_cold_the_default_block_is_a_few_hundred_accesses(runs: dict[str, tuple[Path, Scenario]]) -> None:
    """--cold times every access alone after K reads: the back-to-back default of 200000 would run for days."""
    out, stdout = _run_ok(runs, "cold")
    assert json.loads((out / "bench_hook_calls_cold.json").read_text())["n"] == 200
    assert f"results: {out / 'bench_hook_calls_cold.json'}" in stdout.splitlines()


def test_a_setting_that_would_change_what_is_timed_is_one_line_before_anything_runs() -> None:
    import os

    for name, value, said in (
        ("DBO_RUNTIME_DISABLE", "1", "DBO_RUNTIME_DISABLE=1 leaves vLLM as shipped"),
        ("DBO_RUNTIME_SELF_TIME", "1", "DBO_RUNTIME_SELF_TIME=1 wraps every hook"),
        ("DBO_RUNTIME_TOPK_LAYOUT", "bogus", "DBO_RUNTIME_TOPK_LAYOUT"),
        ("DBO_RUNTIME_DISABEL", "1", "did you mean DBO_RUNTIME_DISABLE"),
    ):
        proc = subprocess.run(
            [sys.executable, str(ROOT / "graphs" / "bench_hook_calls.py"), "--n", "100", "--reps", "1"],
            capture_output=True, text=True, timeout=120, env={**os.environ, name: value},
        )  # fmt: skip
        assert proc.returncode == 2, (name, proc.stderr[-500:])
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and said in lines[0], (name, lines)
