"""Replays the one-GPU DBO emulation's records (``docs/records/emulated.jsonl``) and DBO-off transparency's
(``docs/records/transparency.jsonl``) on CPU: each record's verdict must follow from the numbers it carries.

A record is written by ``tests/e2e/emulated.py`` on the GPU machine; this re-derives ``pass`` from its counters
and comparisons by each row's rule, so a record whose claim its own numbers do not support (or a hand-edited
one) fails here. Until the lead has recorded a run, no record anywhere may claim to be emulated.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.e2e import emulated

RECORDS = Path(__file__).resolve().parents[2] / "docs" / "records"
EMULATED = RECORDS / "emulated.jsonl"
TRANSPARENCY = RECORDS / "transparency.jsonl"
COMMON = ("device", "vllm", "date", "command", "dp_emulated", "row", "pass")


def _all_positive(values: list[Any]) -> bool:
    return bool(values) and all(isinstance(v, (int, float)) and v > 0 for v in values)


def problems(rec: dict[str, Any]) -> list[str]:
    """What in one record does not follow from its own numbers (empty: the record is consistent)."""
    out = [f"no {k}" for k in COMMON if k not in rec]
    row = rec.get("row", "")
    transparency = row.startswith("t-")
    if rec.get("dp_emulated") is not (not transparency):
        out.append(f"dp_emulated is {rec.get('dp_emulated')} on a {'DBO-off' if transparency else 'microbatched'} row")
    if row not in emulated.ROWS:
        return [*out, f"unknown row {row!r}"]
    if transparency:
        if "floor" in rec and rec.get("logprobs") != emulated.transparency_floor(rec):
            out.append(f"logprobs {rec.get('logprobs')!r} do not follow from its comparison and floor")
        if "floor" not in rec and rec.get("logprobs") in ("within run-to-run floor", "outside run-to-run floor"):
            out.append(f"logprobs {rec['logprobs']!r} without a floor")
        want = emulated.transparency_pass(rec)
        return out + ([] if want == rec["pass"] else [f"pass {rec['pass']} but tokens differ in {rec.get('tokens_differing')} of {rec.get('sequences')}, logprobs {rec.get('logprobs')}"])
    steps, batched = rec.get("steps") or [], rec.get("microbatched_steps") or []
    if rec["pass"]:
        if row != "repro" and not _all_positive(batched):
            out.append(f"passed without microbatching: {batched}")
        if row in ("c", "v4-mtp") and len(set(batched)) != 1:
            out.append(f"an in-engine check passed without the same microbatching: {batched}")
        if any(b is not None and s is not None and b > s for b, s in zip(batched, steps, strict=False)):
            out.append(f"more microbatched steps than steps: {batched} of {steps}")
        if rec.get("mode") == "eager" and row != "repro" and not _all_positive(rec.get("yields_per_step") or []):
            out.append(f"eager row passed without yields in its microbatched steps: {rec.get('yields_per_step')}")
    want = _expected(row, rec)
    if want is not None and want != rec["pass"]:
        out.append(f"pass is {rec['pass']}, its numbers say {want}")
    return out


def _expected(row: str, rec: dict[str, Any]) -> bool | None:
    """The row's rule on the record's comparisons (the microbatching part is checked by the caller)."""
    if rec.get("error"):
        return False
    if row == "repro":
        served = rec.get("plugin_requests") is not None and rec.get("plugin_completed") == rec.get("plugin_requests")
        return bool(rec.get("vanilla_assertion")) and not rec.get("vanilla_served") and served
    if row == "c":
        return rec["vanilla_wrong_reads"] > 0 and rec["plugin_reads"] > 0 and rec["plugin_wrong_reads"] == 0
    if row == "v4-mtp":
        return rec["vanilla_hidden_wrong"] > 0 and rec["plugin_hidden_checks"] > 0 and rec["plugin_hidden_wrong"] == 0
    if row.startswith("n-") or row in emulated.FLOORS:
        return rec.get("microbatched") is True
    if emulated.floor_row(row):
        within, _ = emulated.within_floor(rec["comparison"], rec["floor"])
        outside = row.startswith("a-") and rec.get("model") != "v32"
        return rec.get("microbatched") is True and within is not outside and rec.get("within_floor") is within
    return rec.get("same_microbatching") is True


def _read(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


GOOD = {
    "device": "NVIDIA H100 80GB HBM3", "vllm": "0.34.0", "date": "2027-01-01", "command": "python -m tests.e2e.emulated session",
    "dp_emulated": True, "model": "glm53", "mode": "eager", "steps": [35, 35], "microbatched_steps": [35, 35],
    "yields_per_step": [348.0, 348.0], "same_microbatching": True, "sequences": 32,
}  # fmt: skip
T_GOOD = {**GOOD, "row": "t-graphs", "dp_emulated": False, "sequences": 32, "differing": 0, "tokens_differing": 0, "logprobs": "bit-identical"}


def _cmp(agreement: float, dlogprob: float) -> dict[str, Any]:
    return {
        "requests": 32, "agreement": agreement, "agreement_se": 0.0, "exact_requests": 32 if agreement == 1 else 20,
        "mean_abs_dlogprob_exact": dlogprob, "dlogprob_positions": 500, "nonfinite_logprobs": 0, "missing_requests": [],
    }  # fmt: skip


FLOOR = _cmp(1.0, 2e-4)
BUG_B = {"comparison": _cmp(0.81, 0.04), "floor": FLOOR, "within_floor": False, "microbatched": True}
NOISE = {"comparison": _cmp(1.0, 5e-5), "floor": FLOOR, "within_floor": True, "microbatched": True}


@pytest.mark.parametrize(
    ("rec", "consistent"),
    [
        ({**GOOD, "row": "a-eager", **BUG_B, "pass": True}, True),
        ({**GOOD, "row": "a-eager", **NOISE, "pass": True}, False),
        ({**GOOD, "row": "a-eager", **BUG_B, "within_floor": True, "pass": True}, False),
        ({**GOOD, "row": "a-eager", **NOISE, "model": "v32", "pass": True}, True),
        ({**GOOD, "row": "a-control-eager", "microbatched": True, "pass": True}, True),
        ({**GOOD, "row": "a-control-eager", "microbatched": False, "pass": True}, False),
        ({**GOOD, "row": "b-eager", **BUG_B, "pass": True}, False),
        ({**GOOD, "row": "b-graphs", **NOISE, "pass": True}, True),
        ({**GOOD, "row": "b-graphs", **NOISE, "comparison": _cmp(0.96, 3e-4), "within_floor": False, "pass": False}, True),
        ({**GOOD, "row": "b-eager", **NOISE, "pass": True, "microbatched_steps": [35, 0]}, False),
        ({**GOOD, "row": "b-eager", **NOISE, "pass": True, "yields_per_step": [None, None]}, False),
        ({**GOOD, "row": "b-eager", **NOISE, "pass": True, "dp_emulated": False}, False),
        ({**GOOD, "row": "c", "vanilla_wrong_reads": 9, "plugin_reads": 400, "plugin_wrong_reads": 0, "pass": True, "microbatched_steps": [35, 34]}, False),
        ({**GOOD, "row": "c", "vanilla_wrong_reads": 9, "plugin_reads": 400, "plugin_wrong_reads": 0, "pass": True}, True),
        ({**GOOD, "row": "c", "vanilla_wrong_reads": 0, "plugin_reads": 400, "plugin_wrong_reads": 0, "pass": True}, False),
        ({**GOOD, "row": "repro", "vanilla_assertion": True, "vanilla_served": False, "plugin_requests": 8, "plugin_completed": 8, "pass": True}, True),
        ({**GOOD, "row": "repro", "vanilla_assertion": False, "vanilla_served": True, "plugin_requests": 8, "plugin_completed": 8, "pass": True}, False),
        ({**GOOD, "row": "mtp-k3", "microbatched_steps": [20, 20, 20], **NOISE, "pass": True}, True),
        ({**GOOD, "row": "mtp-k3", "microbatched_steps": [20, 20, 20], **BUG_B, "pass": True}, False),
        ({**GOOD, "row": "v4-mtp", "vanilla_hidden_wrong": 5, "plugin_hidden_checks": 10, "plugin_hidden_wrong": 0, "pass": True}, True),
        ({**GOOD, "row": "v4-mtp", "vanilla_hidden_wrong": 5, "plugin_hidden_checks": 10, "plugin_hidden_wrong": 1, "pass": True}, False),
        ({**T_GOOD, "pass": True}, True),
        ({**T_GOOD, "dp_emulated": True, "pass": True}, False),
        ({**T_GOOD, "differing": 7, "logprobs": "no run-to-run floor ran", "pass": True}, True),
        ({**T_GOOD, "differing": 7, "logprobs": "within run-to-run floor", "pass": True}, False),
        ({**T_GOOD, "differing": 7, "logprobs": "within run-to-run floor", "comparison": _cmp(1.0, 1e-5), "floor": _cmp(1.0, 1e-5), "floor_differing": 7, "pass": True}, True),
        ({**T_GOOD, "differing": 7, "logprobs": "within run-to-run floor", "comparison": _cmp(1.0, 1e-6), "floor": _cmp(1.0, 0.0), "floor_differing": 0, "pass": True}, False),
        ({**T_GOOD, "differing": 7, "logprobs": "within run-to-run floor", "comparison": _cmp(1.0, 1e-3), "floor": _cmp(1.0, 1e-5), "pass": True}, False),
        ({**T_GOOD, "differing": 7, "logprobs": "outside run-to-run floor", "comparison": _cmp(1.0, 1e-3), "floor": _cmp(1.0, 1e-5), "pass": True}, False),
        ({**T_GOOD, "differing": 7, "logprobs": "outside run-to-run floor", "comparison": _cmp(1.0, 1e-3), "floor": _cmp(1.0, 1e-5), "pass": False}, True),
        ({**T_GOOD, "differing": 0, "logprobs": "no run-to-run floor ran", "pass": True}, False),
        ({**T_GOOD, "logprobs": "identical-ish", "pass": True}, False),
        ({**T_GOOD, "sequences": 0, "pass": True}, False),
        ({**T_GOOD, "tokens_differing": 1, "differing": 1, "logprobs": "no run-to-run floor ran", "pass": True}, False),
        ({**T_GOOD, "differing": 32, "tokens_differing": None, "error": "tokens not compared", "pass": False}, True),
        ({**GOOD, "row": "a-graphs", "error": ["Traceback"], "differing": 0, "pass": False}, True),
    ],
)
def test_the_replay_rules_tell_a_consistent_record_from_an_inconsistent_one(rec: dict[str, Any], consistent: bool) -> None:
    assert (problems(rec) == []) is consistent, problems(rec)


def test_every_recorded_emulated_row_is_consistent_with_its_numbers() -> None:
    if not EMULATED.exists():
        claimed = [p.name for p in RECORDS.glob("*.jsonl") if any(r.get("dp_emulated") for r in _read(p))]
        assert claimed == [], f"{claimed} claim emulated rows while {EMULATED.name} is absent"
        return
    records = _read(EMULATED)
    assert records, f"{EMULATED.name} is empty"
    bad = {f"{r.get('row')} ({r.get('date')}, {r.get('vllm')})": problems(r) for r in records}
    assert {k: v for k, v in bad.items() if v} == {}
    assert all(r["family"] == "one-gpu-dbo-emulation" and r["dp_emulated"] is True for r in records)


def test_every_recorded_transparency_row_is_consistent_with_its_numbers() -> None:
    if not TRANSPARENCY.exists():
        claimed = [p.name for p in RECORDS.glob("*.jsonl") if any(r.get("family") == "dbo-off-transparency" for r in _read(p))]
        assert claimed == [], f"{claimed} hold transparency rows while {TRANSPARENCY.name} is absent"
        return
    records = _read(TRANSPARENCY)
    assert records and all(r["dp_emulated"] is False and r["row"].startswith("t-") for r in records)
    assert {r.get("row"): problems(r) for r in records if problems(r)} == {}


def test_every_eager_dbo_engine_runs_the_in_engine_checks_and_graph_engines_do_not() -> None:
    """Row c and v4-mtp count wrong reads in eager engines; a FULL graph would only count at capture."""
    s = emulated.Settings(layers=8)
    for row in ("c", "a-eager", "v4-mtp", "a-graphs", "t-eager"):
        model = "v4" if row == "v4-mtp" else s.model
        for engine, _ in emulated.needs(row, emulated.Settings(model, s.layers, s.runner)):
            checked = engine.env().get("DBO_EMULATE_TOPK_CHECK") == "1"
            assert checked == (engine.dbo and engine.mode == "eager"), (row, engine.label)


def test_only_the_ml4_control_in_graphs_avoids_vllms_workspace_lock(monkeypatch: pytest.MonkeyPatch) -> None:
    """ml4-emu-control's layers all prepare the MQA query beside the indexer, so vLLM never grows microbatch 1's
    workspace before the lock; only those engines drop that overlap."""
    monkeypatch.setattr(emulated, "UPSTREAM_WORKSPACE_BUG", False)
    for row, model in (("b-graphs", "ml4"), ("a-control-graphs", "ml4"), ("b-eager", "ml4"), ("b-graphs", "glm53")):
        for engine, _ in emulated.needs(row, emulated.Settings(model, 8)):
            avoided = engine.env().get(emulated.WORKAROUND_ENV) == "0"
            assert avoided == (engine.model == "ml4-emu-control" and engine.mode == "graphs"), (row, engine.label)


def test_records_name_the_workaround_each_engine_recorded_for_the_row_and_its_floor(tmp_path: Path) -> None:
    """Read from what each engine says vLLM used, not from this process's environment at judging time."""
    s = emulated.Settings("ml4", 8)
    for row in ("b-graphs", "b-control-graphs"):
        for engine, _ in emulated.needs(row, s):
            used = 0 if engine.model == "ml4-emu-control" else 1024
            (tmp_path / f"{engine.label}.json").write_text(json.dumps({"label": engine.label, emulated.WORKAROUND_ENV: used}))
    notes = emulated._workarounds(tmp_path, "b-graphs", s)
    assert set(notes) == {"floor_workaround"} and "ml4-emu-control-8L-v2-graphs-plugin-comm20" in notes["floor_workaround"]
    assert set(emulated._workarounds(tmp_path, "b-control-graphs", s)) == {"workaround"}


def test_paired_engines_run_the_engine_core_in_their_own_process_and_the_records_say_so() -> None:
    """In-process, every request is added before the first step: paired engines see the same batches."""
    for row in ("a-control-eager", "b-graphs", "mtp-k3", "t-eager"):
        for engine, _ in emulated.needs(row, emulated.Settings()):
            assert engine.env()["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0", (row, engine.label)
    recorded = [r for r in _read(EMULATED) if "engine_core" in r]
    assert recorded and all(r["engine_core"] == "in-process" for r in recorded)


@pytest.mark.parametrize("mode", ["eager", "graphs"])
def test_comm_rows_are_judged_against_the_same_comm_change_on_the_control(mode: str) -> None:
    """``b-*`` lower DeepGEMM's SM count for every GEMM: their floor is that change where bug B cannot act."""
    floor = f"b-control-{mode}"
    assert emulated.with_floors([f"b-{mode}"]) == [floor, f"b-{mode}"]
    engines = [e for e, _ in emulated.needs(floor, emulated.Settings())]
    control = emulated.CONTROLS["glm53"]
    assert [(e.model, e.plugin, e.comm_sms) for e in engines] == [(control, True, 20), (control, True, 0)]
    assert emulated.floor_row(floor) is None and emulated.floor_row(f"a-{mode}") == f"a-control-{mode}"


def _write_results(out: Path, engine: emulated.Engine, requests: list[dict[str, Any]]) -> None:
    result = {"ok": True, "dbo_runtime": engine.plugin, "passes": {"accuracy": {"requests": requests}}}
    (out / f"{engine.label}.json").write_text(json.dumps(result))


def _requests(lp: float, token: int = 5) -> list[dict[str, Any]]:
    return [{"tokens": [token, token], "logprobs": [{str(token): -1.0}, {str(token): lp}]} for _ in range(4)]


@pytest.mark.parametrize(
    ("plugin_lp", "again_lp", "plugin_token", "logprobs", "passed"),
    [
        (-1.0, -1.0, 5, "bit-identical", True),
        (-1.0 + 1e-6, -1.0 + 1e-6, 5, "within run-to-run floor", True),
        (-1.0 + 1e-6, -1.0, 5, "outside run-to-run floor", False),
        (-1.5, -1.0, 5, "outside run-to-run floor", False),
        (-1.0, None, 6, "no run-to-run floor ran", False),
        (-1.0 + 1e-6, None, 5, "no run-to-run floor ran", True),
    ],
)
def test_transparency_is_judged_on_tokens_and_on_vanillas_own_run_to_run_drift(
    tmp_path: Path, plugin_lp: float, again_lp: float | None, plugin_token: int, logprobs: str, passed: bool
) -> None:
    """DBO off, vanilla is not bit-repeatable past index_topk: the plugin may move logprobs as far as vanilla moves
    them between two runs, never a token."""
    engines = emulated.needs("t-eager", emulated.Settings("glm53"))
    vanilla, plugin, again = (e for e, _ in engines)
    assert (vanilla.plugin, plugin.plugin, again.plugin, again.replica) == (False, True, False, 1)
    _write_results(tmp_path, vanilla, _requests(-1.0))
    _write_results(tmp_path, plugin, _requests(plugin_lp, plugin_token))
    if again_lp is not None:
        _write_results(tmp_path, again, _requests(again_lp))
    rec = emulated.verdict("t-eager", emulated.Settings("glm53"), tmp_path)
    assert (rec.get("logprobs"), rec["pass"]) == (logprobs, passed)
    assert rec["tokens_differing"] == (0 if plugin_token == 5 else 4)


def test_a_transparency_floor_engine_that_was_planned_but_did_not_run_leaves_no_verdict(tmp_path: Path) -> None:
    """A session's replica that crashed or never started is an error, not a pass on tokens alone."""
    engines = [e for e, _ in emulated.needs("t-graphs", emulated.Settings("v32"))]
    _write_results(tmp_path, engines[0], _requests(-1.0))
    _write_results(tmp_path, engines[1], _requests(-1.0 + 1e-6))
    (tmp_path / "plan.json").write_text(json.dumps([e.label for e in engines]))
    (tmp_path / f"{engines[2].label}.log").write_text("RuntimeError: CUDA out of memory")
    rec = emulated.verdict("t-graphs", emulated.Settings("v32"), tmp_path)
    assert rec["pass"] is False and "out of memory" in rec["error"][0]


@pytest.mark.parametrize("unpatched", ["plugin", "vanilla"])
def test_a_pair_whose_engines_did_not_load_what_their_labels_say_leaves_no_verdict(tmp_path: Path, unpatched: str) -> None:
    """A "plugin" engine that vLLM started without dbo_runtime (its entry point not installed) makes two vanilla
    engines agree: that is an error naming the engine, never a pass."""
    engines = [e for e, _ in emulated.needs("t-eager", emulated.Settings("glm53"))]
    for engine in engines:
        _write_results(tmp_path, engine, _requests(-1.0))
        result = json.loads((tmp_path / f"{engine.label}.json").read_text())
        wrong = engine.plugin if unpatched == "plugin" else not engine.plugin and engine.replica == 0
        result["dbo_runtime"] = engine.plugin is not wrong
        (tmp_path / f"{engine.label}.json").write_text(json.dumps(result))
    rec = emulated.verdict("t-eager", emulated.Settings("glm53"), tmp_path)
    assert rec["pass"] is False and "dbo_runtime" in " ".join(rec["error"])
    for engine in engines:  # the same results, each engine as its label says: a verdict
        result = json.loads((tmp_path / f"{engine.label}.json").read_text())
        (tmp_path / f"{engine.label}.json").write_text(json.dumps({**result, "dbo_runtime": engine.plugin}))
    assert emulated.verdict("t-eager", emulated.Settings("glm53"), tmp_path)["pass"] is True


def test_a_result_that_does_not_say_whether_dbo_runtime_was_in_force_is_trusted_only_when_asked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    engines = [e for e, _ in emulated.needs("t-eager", emulated.Settings("glm53"))]
    for engine in engines:
        (tmp_path / f"{engine.label}.json").write_text(json.dumps({"ok": True, "passes": {"accuracy": {"requests": _requests(-1.0)}}}))
    rec = emulated.verdict("t-eager", emulated.Settings("glm53"), tmp_path)
    assert rec["pass"] is False and "--trust-labels" in " ".join(rec["error"])
    monkeypatch.setattr(emulated, "TRUST_LABELS", True)
    assert emulated.verdict("t-eager", emulated.Settings("glm53"), tmp_path)["pass"] is True


def test_judge_and_plan_refuse_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    assert emulated.main(["judge", "--out", str(tmp_path / "nope"), "--rows", "t-eager"]) == 2
    assert "is not a folder" in capsys.readouterr().err
    (tmp_path / "transparency.jsonl").write_text("")
    assert emulated.main(["judge", "--out", str(tmp_path), "--rows", "t-eager"]) == 2
    assert "holds no session records" in capsys.readouterr().err
    (tmp_path / "transparency.jsonl").write_text(json.dumps({"device": "d", "vllm": "v", "date": "x", "command": "c"}) + "\n")
    assert emulated.main(["judge", "--out", str(tmp_path), "--rows", "t-eager"]) == 2  # records, no engine results
    assert "holds no result of the engines" in capsys.readouterr().err
    # a session that planned other engines (its own --rows): refused, naming them, not judged as failures
    (tmp_path / "plan.json").write_text(json.dumps(["other-engine"]))
    assert emulated.main(["judge", "--out", str(tmp_path), "--rows", "t-eager"]) == 2
    assert "ran no engine" in (err := capsys.readouterr().err) and "its engines: other-engine" in err
    assert not list(tmp_path.glob("*-judged.jsonl"))

    def refused(*argv: str) -> str:
        """``plan ARGV``'s one argparse line (exit 2)."""
        with pytest.raises(SystemExit) as stop:
            emulated.main(["plan", *argv])
        assert stop.value.code == 2
        return capsys.readouterr().err

    assert "--at-once" in refused("--rows", "t-eager", "--at-once", "0")
    # three 78-layer engines of about 26 GiB each ran out of an H100's memory: refused before any install; an H200 holds five
    monkeypatch.setattr(emulated, "_card_gib", lambda: (79, True))
    assert emulated.main(["plan", "--layers", "78", "--at-once", "2"]) == 0
    assert "do not fit 75 of the GPU's 79 GiB; at most 2" in refused("--layers", "78", "--at-once", "3")
    monkeypatch.setattr(emulated, "_card_gib", lambda: (139, True))
    assert emulated.main(["plan", "--layers", "78", "--at-once", "5"]) == 0
    capsys.readouterr()
    for rows in ("", ","):
        assert "argument --rows" in refused("--rows", rows)


@pytest.mark.parametrize("model", ["glm53", "ml4"])
def test_each_model_is_judged_against_its_own_control(model: str) -> None:
    """The a/b/c/n rows of a model run its follower model and, as their floor, its control (no followers): Mistral
    Large 4's floor is ``ml4-emu-control``, never GLM-5.3 geometry."""
    s = emulated.Settings(model, 61)
    rows = emulated.with_floors(["a-eager", "b-graphs", "c", "n-eager", "n-control-eager"])
    engines = {row: {e.model for e, _ in emulated.needs(row, s)} for row in rows}
    control, followers = emulated.CONTROLS[model], emulated.FOLLOWERS[model]
    assert rows == ["a-control-eager", "b-control-graphs", "a-eager", "b-graphs", "c", "n-eager", "n-control-eager"]
    assert engines == {r: {control if "control" in r else followers} for r in rows}
    assert emulated._gib(rows, s) == emulated.GIB_PER_ENGINE[(model, 61)]


def test_judging_again_replaces_the_earlier_judged_records(tmp_path: Path) -> None:
    """Re-judging a folder is the documented workflow: its ``*-judged.jsonl`` holds one record per row, not one
    per judge run."""
    engines = [e for e, _ in emulated.needs("t-eager", emulated.Settings("glm53"))]
    for engine in engines:
        _write_results(tmp_path, engine, _requests(-1.0))
    (tmp_path / "plan.json").write_text(json.dumps([e.label for e in engines]))
    (tmp_path / "transparency.jsonl").write_text(json.dumps({"device": "d", "vllm": "v", "date": "x", "command": "c"}) + "\n")
    (tmp_path / "transparency-judged.jsonl").write_text(json.dumps({"row": "t-graphs"}) + "\n")  # another row's: kept
    for _ in range(2):
        assert emulated.main(["judge", "--out", str(tmp_path), "--rows", "t-eager", "--model", "glm53"]) == 0
    judged = (tmp_path / "transparency-judged.jsonl").read_text().splitlines()
    assert [json.loads(line)["row"] for line in judged] == ["t-graphs", "t-eager"]


def _counters(steps: int, graph: int, yields_in: int, yields_outside: int, runner: str = "v1") -> list[dict[str, Any]]:
    return [{"steps": steps, "microbatched_steps": steps, "microbatched_graph_steps": graph, "yields_in_steps": yields_in,
             "yields_outside_steps": yields_outside, "topk_reads": 0, "topk_wrong_reads": 0, "runner": runner}]  # fmt: skip


@pytest.mark.parametrize(
    ("graph", "yields_in", "yields_outside", "microbatched", "unswitched"),
    [(0, 300, 0, 10, 0), (0, 0, 0, 0, 10), (10, 0, 6, 10, 0), (10, 0, 0, 0, 10), (4, 0, 6, 4, 6)],
)
def test_a_split_step_whose_threads_never_switched_is_not_counted_as_microbatched(
    graph: int, yields_in: int, yields_outside: int, microbatched: int, unswitched: int
) -> None:
    """Microbatches that ran one after the other (the emulated all2all never yielded) cannot show either bug: an
    eager step needs a yield inside it, a replayed one a yield at capture, or the row would pass on nothing."""
    result = {"passes": {"accuracy": {"counters_before": [], "counters_after": _counters(10, graph, yields_in, yields_outside)}}}
    c = emulated._counted(result, "accuracy")
    assert (c["microbatched_steps"], c["unswitched_steps"], c["runners"]) == (microbatched, unswitched, ["v1"])
    assert emulated._counted({"passes": {}}, "accuracy") == {"yields_per_step": None, "runners": []}


def test_a_record_whose_engines_ran_another_runner_fails_and_says_which(tmp_path: Path) -> None:
    """vLLM may pick its runner itself: a record must describe the runner that ran, never the one asked for."""
    s = emulated.Settings(runner="v1")
    for engine, _ in emulated.needs("c", s):
        counters = {"counters_before": [], "counters_after": _counters(10, 0, 300, 0, runner="v2")}
        result = {"ok": True, "dbo_runtime": engine.plugin, "passes": {"accuracy": {"requests": _requests(-1.0), **counters}}}
        (tmp_path / f"{engine.label}.json").write_text(json.dumps(result))
    emulated.records(["c"], s, tmp_path, {"device": "d", "vllm": "0.33.0", "date": "2026-12-08", "command": "x"})
    record = json.loads((tmp_path / "emulated.jsonl").read_text())
    assert record["pass"] is False and record["error"] == "the engines ran the v2 runner, not v1"


def test_a_session_without_a_gpu_is_one_line_and_exit_3(tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """No engine can start: the project's exit 3, with no record that would read as a failed row."""
    monkeypatch.setattr(emulated, "refuse_without_engine", lambda script, gpus, done: print(f"{script}: needs a CUDA GPU; {done}") or 3)
    assert emulated.main(["session", "--rows", "c", "--out", str(tmp_path / "s")]) == 3
    assert "no record written" in capsys.readouterr().out and not (tmp_path / "s").exists()
