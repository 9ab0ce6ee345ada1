"""``dbo-runtime simulate`` and the scenario engine on the CPU simulation backend.

The CPU backend is a named simulation (reference planner, fp32 logits, DeepGEMM's
schedule assertion); its GPU twin is ``graphs/scenario_suite.py`` /
``tests/gpu/test_scenario_gpu.py`` with real DeepGEMM and real CUDA graphs.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest

from dbo_runtime.cli.main import main
from dbo_runtime.core.errors import ConfigError
from dbo_runtime.sim.backends import SimulatedDeepGemm
from dbo_runtime.sim.scenario import SMALL, run_scenario

FAST = dataclasses.replace(SMALL, steps=2, num_layers=20, max_context=512, num_requests=6)


def test_dbo_runtime_run_is_bit_identical_with_zero_steady_replans() -> None:
    res = run_scenario(FAST, SimulatedDeepGemm())
    assert res.ok, res.error or res.checks
    assert res.steady_state_replans == 0 and res.replans_total == 0 and res.planned_ahead == 4
    kinds = [e["event"] for e in res.timeline]
    assert kinds[0] == "announced" and kinds[1:] == ["entered", "exited"] * FAST.steps
    assert {e["compute"] for e in res.timeline if e["event"] == "entered"} == {112}


def test_without_schedule_fix_the_logits_kernel_asserts() -> None:
    res = run_scenario(dataclasses.replace(FAST, fix_schedule=False, isolate_topk=False), SimulatedDeepGemm())
    assert res.error.startswith("DeepGEMM assertion") and "_schedule_meta_size" in res.error
    assert not res.ok


def test_without_topk_isolation_followers_read_the_other_microbatch() -> None:
    res = run_scenario(dataclasses.replace(FAST, isolate_topk=False), SimulatedDeepGemm())
    assert not res.error and not res.ok
    assert all(c.follower_mismatch > 0 for c in res.checks)
    # Leaders are unaffected: their own logits and top-k stay bit-identical.
    assert all(c.logits_mismatch_rows == 0 and c.topk_mismatch_rows == 0 for c in res.checks)


def test_upstream_call_site_replan_costs_one_planner_per_microbatch_per_step() -> None:
    res = run_scenario(dataclasses.replace(FAST, plan_ahead=False), SimulatedDeepGemm())
    assert res.ok and [c.replans for c in res.checks] == [2, 2]


@pytest.mark.parametrize("layout", ["windows", "copies"])
def test_topk_layouts_both_isolate(layout: str) -> None:
    res = run_scenario(dataclasses.replace(FAST, topk_layout=layout), SimulatedDeepGemm())
    assert res.ok
    assert (res.topk_extra_bytes == 0) is (layout == "windows")


def test_next_n_4_uses_sm90_half_slots() -> None:
    res = run_scenario(dataclasses.replace(FAST, next_n=4), SimulatedDeepGemm())
    assert res.ok, res.error


def test_graph_modes_need_a_gpu() -> None:
    with pytest.raises(ConfigError, match="mode='mrv1'"):
        run_scenario(FAST, SimulatedDeepGemm(), "mrv1")


def test_cli_json_verdict(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["simulate", "--json", "--backend", "cpu", "--steps", "2", "--requests", "6"])
    doc = json.loads(capsys.readouterr().out)
    assert rc == 0 and doc["verdict"] == "PASS" and doc["simulated"] is True
    by_name = {r["name"]: r for r in doc["runs"]}
    assert by_name["dbo_runtime"]["ok"] and by_name["dbo_runtime"]["steady_state_replans"] == 0
    assert by_name["vLLM 0.33.0 (no dbo_runtime)"]["error"].startswith("DeepGEMM assertion")
    assert not by_name["schedule fix only (vllm#60732)"]["ok"]
    assert all(r["as_expected"] for r in doc["runs"])


def test_cli_bad_value_is_one_line() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "dbo_runtime", "simulate", "--requests", "1", "--backend", "cpu"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "--requests='1'" in proc.stderr and "Traceback" not in proc.stderr


def test_a_failing_microbatch_never_leaves_the_other_parked() -> None:
    from dbo_runtime.sim.microbatch import MicrobatchContext, run_microbatches

    def fails_late(ctx: MicrobatchContext) -> None:
        ctx.yield_()
        raise ValueError("layer 1 failed")

    def keeps_yielding(ctx: MicrobatchContext) -> None:
        for _ in range(10):
            ctx.yield_()

    with pytest.raises(ValueError, match="layer 1 failed"):
        run_microbatches([fails_late, keeps_yielding])


def test_microbatches_run_in_dbo_order() -> None:
    from dbo_runtime.sim.microbatch import MicrobatchContext, current_ubatch, run_microbatches

    order: list[tuple[int, int, int]] = []

    def body(ctx: MicrobatchContext) -> None:
        for layer in range(3):
            ub, offset = current_ubatch()
            order.append((layer, ub, offset))
            ctx.yield_()

    run_microbatches([body, body], token_offsets=[0, 8])
    assert order == [(0, 0, 0), (0, 1, 8), (1, 0, 0), (1, 1, 8), (2, 0, 0), (2, 1, 8)]
    assert current_ubatch() == (0, 0)  # the main thread is never a microbatch


def test_real_deepgemm_gets_real_indexer_shapes() -> None:
    from dbo_runtime.sim.scenario import DEEPGEMM_INDEXER_SHAPES, for_backend

    class FakeRealDeepGemm(SimulatedDeepGemm):
        """Stands for a real-DeepGEMM backend on CPU (GPU twin: tests/gpu/test_scenario_gpu.py)."""

        simulated = False

    widened = for_backend(SMALL, FakeRealDeepGemm())
    assert (widened.heads, widened.head_dim) in DEEPGEMM_INDEXER_SHAPES
    assert for_backend(SMALL, SimulatedDeepGemm()) is SMALL


def test_cli_errors_name_the_flag_and_read_the_env(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--backend", "cpu", "--steps", "0"]) == 2
    assert "--steps='0'" in capsys.readouterr().err
    assert main(["simulate", "--backend", "cpu", "--requests", "100000"]) == 2
    assert "--requests='100000'" in capsys.readouterr().err
    assert main(["simulate", "--backend", "cpu", "--comm-sms", "200"]) == 2
    assert "--comm-sms=200" in capsys.readouterr().err
    monkeypatch.setenv("VLLM_DBO_COMM_SMS", "abc")
    assert main(["simulate", "--backend", "cpu"]) == 2
    assert "VLLM_DBO_COMM_SMS='abc'" in capsys.readouterr().err
    monkeypatch.setenv("VLLM_DBO_COMM_SMS", "21")  # clamped to 20 by vLLM's DeepEP HT manager: allowed
    assert main(["simulate", "--backend", "cpu", "--no-contrast", "--steps", "1", "--requests", "4", "--json"]) == 0
    assert "compute 111/132" in json.loads(capsys.readouterr().out)["budget"]


def test_simulate_runs_without_rich(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """The GPU machine or a --no-deps install may lack rich: plain output, same verdict."""
    import builtins

    real_import = builtins.__import__

    def no_rich(name: str, *args: object, **kwargs: object) -> object:
        if name == "rich" or name.startswith("rich."):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(builtins, "__import__", no_rich)
    assert main(["simulate", "--backend", "cpu", "--steps", "1", "--requests", "4", "--no-contrast"]) == 0
    assert "verdict: PASS" in capsys.readouterr().out
