"""``dbo-runtime simulate`` and the scenario engine on the CPU simulation backend.

The CPU backend is a named simulation (reference planner, fp32 logits, DeepGEMM's
schedule assertion); its GPU twin is ``graphs/scenario_suite.py`` /
``tests/gpu/test_scenario_gpu.py`` with real DeepGEMM and real CUDA graphs.
"""

from __future__ import annotations

import dataclasses
import json

import pytest

from dbo_runtime.cli.main import main
from dbo_runtime.sim.backends import SimulatedDeepGemm
from dbo_runtime.sim.scenario import SMALL, run_scenario

FAST = dataclasses.replace(SMALL, steps=2, num_layers=20, max_context=512, num_requests=6)


def test_dbo_runtime_run_is_bit_identical_with_zero_steady_replans() -> None:
    backend = SimulatedDeepGemm()
    counts: list[int] = []
    set_num_sms = backend.set_num_sms
    backend.set_num_sms = lambda n: (counts.append(n), set_num_sms(n))[1]  # type: ignore[method-assign]
    res = run_scenario(FAST, backend)
    assert res.ok, res.error or res.checks
    assert res.steady_state_replans == 0 and res.replans_total == 0 and res.planned_ahead == 4
    # every DBO step lowers DeepGEMM to the compute share and restores the whole GPU after it
    assert counts[:2] == [112, 132] and set(counts) == {112, 132} and counts[-1] == 132


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


@pytest.mark.parametrize("next_n", [1, 4])
def test_deferred_plan_ahead_eager_steps_plan_once_per_microbatch_and_stay_bit_identical(next_n: int) -> None:
    """Deferred plan-ahead on the scenario: eager DBO steps run the deferred plan at the first indexer layer
    (one planner per microbatch per step, as many as planning in the build), bit-identical to the unsplit run."""
    runs = {}
    for defer in (True, False):
        be = SimulatedDeepGemm()
        res = run_scenario(dataclasses.replace(FAST, next_n=next_n, defer_plan_ahead=defer), be)
        assert res.ok, res.error or res.checks
        assert res.replans_total == 0
        runs[defer] = (res.deferred_plans, be.planner_launches)
    assert runs[True][0] == 2 * FAST.steps and runs[False][0] == 0
    assert runs[True][1] == runs[False][1]  # moved, not added


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


def test_cli_json_verdict(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["simulate", "--json", "--backend", "cpu", "--steps", "2", "--requests", "6"])
    doc = json.loads(capsys.readouterr().out)
    assert rc == 0 and doc["verdict"] == "PASS" and doc["simulated"] is True
    by_name = {r["name"]: r for r in doc["runs"]}
    assert by_name["dbo_runtime"]["ok"] and by_name["dbo_runtime"]["steady_state_replans"] == 0
    assert by_name["vLLM (no dbo_runtime)"]["error"].startswith("DeepGEMM assertion")
    assert not by_name["schedule fix only (vllm#60732)"]["ok"]
    assert all(r["as_expected"] for r in doc["runs"])


def _exit_code(argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as exc:
        return int(exc.code or 0)


def test_cli_bad_value_is_argparses_line_and_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert _exit_code(["simulate", "--requests", "1", "--backend", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith("dbo-runtime simulate: error: argument --requests: invalid value '1'")


def test_a_failing_microbatch_never_leaves_the_other_parked() -> None:
    from dbo_runtime.sim.microbatch import MicrobatchContext, start_microbatches

    def fails_late(ctx: MicrobatchContext) -> None:
        ctx.yield_()
        raise ValueError("layer 1 failed")

    def keeps_yielding(ctx: MicrobatchContext) -> None:
        for _ in range(10):
            ctx.yield_()

    with pytest.raises(ValueError, match="layer 1 failed"):
        start_microbatches([fails_late, keeps_yielding]).finish()


def test_microbatches_run_in_dbo_order() -> None:
    from dbo_runtime.sim.microbatch import MicrobatchContext, current_ubatch, start_microbatches

    order: list[tuple[int, int, int]] = []

    def body(ctx: MicrobatchContext) -> None:
        for layer in range(3):
            ub, offset = current_ubatch()
            order.append((layer, ub, offset))
            ctx.yield_()

    start_microbatches([body, body], token_offsets=[0, 8]).finish()
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
    for flag, value in (("--steps", "0"), ("--requests", "100000")):
        with pytest.raises(SystemExit) as exc:
            main(["simulate", "--backend", "cpu", flag, value])
        assert exc.value.code == 2 and f"argument {flag}: invalid value '{value}'" in capsys.readouterr().err
    assert main(["simulate", "--backend", "cpu", "--comm-sms", "200"]) == 2
    assert "--comm-sms=200" in capsys.readouterr().err
    monkeypatch.setenv("VLLM_DBO_COMM_SMS", "abc")
    assert main(["simulate", "--backend", "cpu"]) == 2
    assert "VLLM_DBO_COMM_SMS='abc'" in capsys.readouterr().err
    monkeypatch.setenv("VLLM_DBO_COMM_SMS", "21")  # clamped to 20 by vLLM's DeepEP HT manager: allowed
    assert main(["simulate", "--backend", "cpu", "--no-contrast", "--steps", "1", "--requests", "4", "--json"]) == 0
    # the worker's SM90 rule: DeepGEMM's share rounds down to even, so simulate says 110 (not 111), as
    # sms and the worker do
    assert "compute 110/132" in json.loads(capsys.readouterr().out)["budget"]
    monkeypatch.delenv("VLLM_DBO_COMM_SMS")
    assert main(["simulate", "--backend", "cpu", "--comm-sms", "131"]) == 2  # compute 1 rounds to 0: refused, as by sms
    assert "--comm-sms=131" in capsys.readouterr().err


def test_simulate_reads_the_servers_environment(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """simulate reads what the server reads: a bad DBO_RUNTIME_PLANNER_WARM_MAX_BATCH is one error line,
    not a traceback followed by PASS; DBO_RUNTIME_TOPK_LAYOUT picks the simulated layout, and a bad one is
    refused."""
    quick = ["simulate", "--backend", "cpu", "--no-contrast", "--steps", "1", "--requests", "4", "--json"]
    monkeypatch.setenv("DBO_RUNTIME_PLANNER_WARM_MAX_BATCH", "abc")
    assert main(quick) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "DBO_RUNTIME_PLANNER_WARM_MAX_BATCH='abc' is not allowed" in err[0], err
    monkeypatch.delenv("DBO_RUNTIME_PLANNER_WARM_MAX_BATCH")
    monkeypatch.setenv("DBO_RUNTIME_TOPK_LAYOUT", "foo")
    assert main(quick) == 2
    assert "DBO_RUNTIME_TOPK_LAYOUT='foo'" in capsys.readouterr().err
    monkeypatch.setenv("DBO_RUNTIME_TOPK_LAYOUT", "copies")
    assert main(quick) == 0
    assert json.loads(capsys.readouterr().out)["runs"][0]["config"]["topk_layout"] == "copies"
    assert main([*quick, "--topk-layout", "windows"]) == 0  # the flag wins over the environment
    assert json.loads(capsys.readouterr().out)["runs"][0]["config"]["topk_layout"] == "windows"


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


# -- the command as a user meets it ------------------------------------------


def _lines(text: str) -> list[str]:
    return text.splitlines()


def test_text_report_fits_100_columns_and_explains_the_red_rows(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """One run, the whole text report: no line wider than 100 or padded; the crashed contrast shows no counts
    for steps that never ran; the verdict says the red rows are vLLM's failures, reproduced."""
    monkeypatch.delenv("COLUMNS", raising=False)
    assert main(["simulate", "--backend", "cpu", "--steps", "2", "--requests", "6"]) == 0
    lines = _lines(capsys.readouterr().out)
    too_wide = [line for line in lines if len(line) > 100]
    padded = [line for line in lines if line != line.rstrip()]
    assert not too_wide and not padded, (too_wide, padded)
    [row] = [line for line in lines if line.startswith("vLLM (no dbo_runtime)")]
    cells = row.split()
    assert "0/2" in cells and "crash: assertion" in row
    assert cells[-5:-1] == ["-", "-", "-", "-"], row  # logits, top-k, follower reads, re-plans: no step ran
    assert lines[-1].startswith("verdict: PASS: ") and "rows are vLLM's bugs" in lines[-1]


def test_verdict_line_explains_the_red_rows(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--backend", "cpu", "--steps", "1", "--requests", "4"]) == 0
    verdict = _lines(capsys.readouterr().out)[-1]
    assert verdict.startswith("verdict: PASS: ") and "rows are vLLM's bugs" in verdict


def test_without_contrast_the_verdict_is_the_fix_alone(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--backend", "cpu", "--steps", "1", "--requests", "4", "--no-contrast"]) == 0
    assert _lines(capsys.readouterr().out)[-1].startswith("verdict: PASS: bit-identical at every step")


def test_progress_shows_when_piped(capsys: pytest.CaptureFixture[str]) -> None:
    """Progress goes to stderr as a line per step: a long run must not sit silent for minutes."""
    assert main(["simulate", "--backend", "cpu", "--steps", "2", "--requests", "4", "--no-contrast", "--json"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["verdict"] == "PASS"  # stdout stays the JSON document
    assert "dbo-runtime simulate: dbo_runtime: step 1/2\n" in err and "dbo-runtime simulate: dbo_runtime: step 2/2\n" in err


def _record_configs(monkeypatch: pytest.MonkeyPatch) -> list:
    """Replace the scenario run by a recorder: these tests are about what simulate asks for, not the run."""
    from dbo_runtime.sim import scenario

    seen: list = []

    def fake(config, backend, mode="eager", *, progress=None):  # type: ignore[no-untyped-def]
        seen.append(config)
        return scenario.ScenarioResult(mode, backend.name, backend.simulated, dataclasses.asdict(config), "", 0, 0)

    monkeypatch.setattr(scenario, "run_scenario", fake)
    return seen


def test_glm53_on_the_cpu_runs_a_short_default(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """The GPU preset (20 steps x 32 requests) takes minutes on a 2-core CPU: the CPU default is short."""
    from dbo_runtime.sim.scenario import GLM53

    seen = _record_configs(monkeypatch)
    main(["simulate", "--backend", "cpu", "--preset", "glm53", "--json"])
    assert seen and all((c.steps, c.num_requests) == (2, 8) for c in seen)
    assert all((c.heads, c.head_dim, c.max_context, c.index_topk) == (GLM53.heads, GLM53.head_dim, GLM53.max_context, GLM53.index_topk) for c in seen)
    main(["simulate", "--backend", "cpu", "--preset", "glm53", "--steps", "20", "--requests", "32", "--json"])
    assert seen[-1].steps == 20 and seen[-1].num_requests == 32  # explicit flags win


def test_help_is_plain_text_and_every_option_says_what_it_does() -> None:
    import argparse

    from dbo_runtime.cli.main import build_parser

    parser = build_parser()
    [sub] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    for name, command in sub.choices.items():
        text = command.format_help()
        for markup in ("``", ":func:", ":class:", ":mod:", ".. "):
            assert markup not in text, (name, markup)
        for action in command._actions:
            assert action.help and action.help.strip(), (name, action.option_strings)


def test_comm_sms_zero_expects_the_topk_bug_not_the_crash(capsys: pytest.CaptureFixture[str]) -> None:
    """VLLM_DBO_COMM_SMS=0: no partition, so vLLM does not assert; only the top-k bug is left."""
    rc = _exit_code(["simulate", "--comm-sms", "0", "--json", "--steps", "2"])
    out = capsys.readouterr().out
    doc = json.loads(out)
    assert rc == 0 and doc["verdict"] == "PASS", out[-2000:]
    vanilla = next(r for r in doc["runs"] if r["name"].startswith("vLLM (no dbo_runtime)"))
    assert vanilla["expect"] == "topk-mismatch" and vanilla["as_expected"]
