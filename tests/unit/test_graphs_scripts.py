"""``graphs/`` scripts on a machine that cannot run them: one line naming what is missing, exit 3 (as every
``dbo-runtime`` command that cannot run here); a bad value is exit 2.

Not a ``ModuleNotFoundError`` traceback (``import deep_gemm``) on a machine without DeepGEMM,
with or without CUDA.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

from tests.forked import Scenario, run_forked

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = sorted(p.name for p in (ROOT / "graphs").glob("*.py") if not p.name.startswith("_"))  # _plotting.py: a helper
ENGINE = {
    "bench_real_engine.py": "a CUDA GPU and vLLM 0.33.0 or 0.34.0",
    "bench_dbo_engine.py": "two CUDA GPUs and vLLM 0.33.0 or 0.34.0",
    "bench_host_cost.py": "a CUDA GPU and vLLM 0.33.0 or 0.34.0",
}
"""Real-engine benchmarks: they need vLLM and GPUs, not DeepGEMM directly."""
CPU = ["bench_hook_calls.py", "bench_sm_count_read.py"]
"""CPU benchmarks: on the real vLLM classes (they need vLLM), or of a torch op read (torch only); no GPU."""
NEEDS_VLLM = ["bench_hook_calls.py"]
"""CPU benchmarks that refuse without vLLM (``bench_sm_count_read.py`` times a stand-in op there instead)."""
GPU = [s for s in SCRIPTS if s not in CPU]
KERNELS = [s for s in GPU if s not in ENGINE]


def load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"graphs_{name[:-3]}", ROOT / "graphs" / name)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_script_is_covered() -> None:
    assert SCRIPTS == [
        "bench_dbo_engine.py",
        "bench_dbo_stack.py",
        "bench_hook_calls.py",
        "bench_host_cost.py",
        "bench_indexer_schedule.py",
        "bench_planner_warmup.py",
        "bench_real_engine.py",
        "bench_replay_planning.py",
        "bench_sm_count_read.py",
        "scenario_suite.py",
    ]


@pytest.fixture(scope="module")
def without_cuda(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Scenario, Path]]:
    """Every GPU script run as a user runs it, each in a fresh interpreter but for the shared torch import (every
    script imports it first; ``tests/forked.py``). Per script: what it returned and its --out folder."""
    out = tmp_path_factory.mktemp("no_cuda")
    scenarios = {name: f"run_script({str(ROOT / 'graphs' / name)!r}, '--out', {str(out / name)!r})" for name in GPU}
    done = run_forked("import torch\n", scenarios)
    return {name: (done[name], out / name) for name in GPU}


@pytest.mark.parametrize("name", GPU)
def test_without_cuda_one_line_and_exit_3(name: str, without_cuda: dict[str, tuple[Scenario, Path]]) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA; the no-CUDA path is exercised on the CPU box")
    run, out = without_cuda[name]
    code, stdout, stderr = run.code, run.stdout, run.stderr
    assert code == 3, stderr[-2000:]
    [line] = stderr.strip().splitlines()
    need = ENGINE.get(name, "a CUDA GPU and DeepGEMM")
    assert line.startswith(f"{name[:-3]}: needs {need}: no CUDA device") and "Traceback" not in stderr
    assert stdout == "" and not (out.exists() and any(out.iterdir()))


BAD_VALUES = {
    "bench_dbo_engine.py": ("--reps", "0", "an integer >= 1"),
    "bench_dbo_stack.py": ("--requests", "1", "an integer >= 2"),
    "bench_hook_calls.py": ("--n", "5", "integers in [100, 10000000]"),
    "bench_host_cost.py": ("--depths", "0", "comma-separated layer counts >= 1"),
    "bench_indexer_schedule.py": ("--dbo-sms", "x", "an integer >= 2, a multiple of 2"),
    "bench_planner_warmup.py": ("--spec-tokens", "4", "integers in [0, 3]"),
    "bench_real_engine.py": ("--budget-s", "-1", "a finite number of seconds > 0"),
    "bench_replay_planning.py": ("--max-context", "100", "an integer >= 64, a multiple of 64"),
    "bench_sm_count_read.py": ("--n", "5", "integers in [100, 10000000]"),
    "scenario_suite.py": ("--steps", "-3", "an integer >= 1"),
}


@pytest.mark.parametrize("name", SCRIPTS)
def test_a_bad_value_is_one_line_before_any_gpu_check(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every range is checked as argparse parses, before the "needs a GPU" refusal, so a bad value is caught
    on any machine, not only on the GPU machine."""
    monkeypatch.setenv("DG_JIT_CACHE_DIR", str(tmp_path / "jit"))  # the kernel scripts set a default at import
    flag, value, allowed = BAD_VALUES[name]
    with pytest.raises(SystemExit) as exit_:
        load(name).main([flag, value, "--out", str(tmp_path / "out")])
    assert exit_.value.code == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line == f"{name[:-3]}: error: argument {flag}: invalid value {value!r}: allowed {allowed}"
    assert not (tmp_path / "out").exists()


def test_the_indexer_benchmark_takes_even_sm_counts_and_two_different_ones(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """vLLM keeps DeepGEMM's share even, and the cold path needs a count the DBO count is not."""
    monkeypatch.setenv("DG_JIT_CACHE_DIR", str(tmp_path / "jit"))
    mod = load("bench_indexer_schedule.py")
    for argv, line in (
        (["--dbo-sms", "111"], "argument --dbo-sms: invalid value '111': allowed an integer >= 2, a multiple of 2"),
        (["--cold-sms", "112"], "argument --cold-sms: 112 is not allowed; allowed values: an even count other than --dbo-sms (112)"),
    ):
        with pytest.raises(SystemExit) as exit_:
            mod.main([*argv, "--out", str(tmp_path / "out")])
        assert exit_.value.code == 2
        got = capsys.readouterr().err.strip().splitlines()[-1]
        assert got.startswith(f"bench_indexer_schedule: error: {line}"), got


@pytest.mark.parametrize("name", KERNELS)
def test_cuda_without_deepgemm_one_line_and_exit_3(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("DG_JIT_CACHE_DIR", str(tmp_path / "jit"))  # the benchmark sets a default at import
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setitem(sys.modules, "deep_gemm", None)  # `import deep_gemm` raises ImportError
    assert load(name).main(["--out", str(tmp_path / "out")]) == 3
    out, err = capsys.readouterr()
    [line] = err.strip().splitlines()
    assert line.startswith(f"{name[:-3]}: needs a CUDA GPU and DeepGEMM: DeepGEMM does not import (ModuleNotFoundError")
    assert out == ""


@pytest.mark.parametrize("name", NEEDS_VLLM)
def test_cpu_benchmark_without_vllm_one_line_and_exit_3(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` raises ImportError
    assert load(name).main(["--out", str(tmp_path / "out")]) == 3
    out, err = capsys.readouterr()
    [line] = err.strip().splitlines()
    assert line.startswith(name[:-3]) and "needs vLLM 0.33.0 or 0.34.0" in line and out == ""
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("name", sorted(ENGINE))
def test_gpus_without_vllm_one_line_and_exit_3(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from importlib import metadata

    real_version = metadata.version

    def version(dist: str) -> str:
        if dist == "vllm":
            raise metadata.PackageNotFoundError(dist)
        return real_version(dist)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(metadata, "version", version)
    assert load(name).main(["--out", str(tmp_path / "out")]) == 3
    out, err = capsys.readouterr()
    [line] = err.strip().splitlines()
    assert line.startswith(f"{name[:-3]}: needs {ENGINE[name]}: vLLM is not installed") and out == ""


@pytest.mark.parametrize("name", SCRIPTS)
def test_without_out_nothing_committed_is_written(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A script run without --out writes into graphs/results/local/, which git ignores, so trying one never
    rewrites the committed graphs/results/*.json that docs/performance.md cites; those take --out graphs/results."""
    import argparse

    from graphs._args import RESULTS, SCRATCH

    monkeypatch.setenv("DG_JIT_CACHE_DIR", str(tmp_path / "jit"))  # the kernel scripts set a default at import
    seen: dict[str, object] = {}

    def stop(self: argparse.ArgumentParser, args: object = None, namespace: object = None) -> argparse.Namespace:
        seen["out"] = vars(real_parse(self, []))["out"]
        raise SystemExit(0)

    real_parse = argparse.ArgumentParser.parse_args
    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", stop)
    with pytest.raises(SystemExit):
        load(name).main([])
    assert Path(str(seen["out"])) == SCRATCH and SCRATCH.parent == RESULTS
    probe = "graphs/results/local/bench_hook_calls.json"
    ignored = subprocess.run(["git", "check-ignore", "-q", probe], cwd=ROOT, capture_output=True)
    assert ignored.returncode == 0, f"{probe} is not git-ignored"
    committed = subprocess.run(["git", "check-ignore", "-q", "graphs/results/bench_hook_calls.json"], cwd=ROOT, capture_output=True)
    assert committed.returncode == 1


# -- bench_replay_planning: what it counts, on a CPU (the H200 run printed 9 vs 331 "dtod copies/step") ---------
def _event(name: str, device: str = "DeviceType.CUDA") -> object:
    from types import SimpleNamespace

    return SimpleNamespace(name=name, device_type=device)


def test_replay_planning_profiler_window_counts_by_kind() -> None:
    bench = load("bench_replay_planning.py")
    events = (
        [_event("void paged_mqa_logits_metadata<32, 132>(...)")] * 4
        + [_event("Memcpy DtoD (Device -> Device)")] * 648
        + [_event("Memcpy HtoD (Pinned -> Device)")] * 2
        + [_event("aten::copy_", "DeviceType.CPU")] * 50  # host ops never count
    )
    counted = bench._count(events, steps=2)
    assert (counted["planner_kernels"], counted["memcpy_dtod"], counted["memcpy_other"]) == (2, 324, 1)
    assert counted["top_device_events"]["Memcpy DtoD (Device -> Device)"] == 324


@pytest.mark.parametrize(("defer", "planners", "copies"), [(False, 2, 2), (True, 0, 0)])
def test_replay_planning_host_counts_are_exact_per_build(defer: bool, planners: int, copies: int) -> None:
    """The counts that answer "what does a FULL-graph DBO step's build launch", without a profiler: per step,
    plan_at_build plans and copies once per microbatch; deferred does neither (the graph plans for itself)."""
    import dataclasses

    from dbo_runtime.sim.backends import SimulatedDeepGemm
    from dbo_runtime.sim.scenario import SMALL, Scenario

    bench = load("bench_replay_planning.py")
    sc = Scenario(dataclasses.replace(SMALL, defer_plan_ahead=defer), SimulatedDeepGemm())
    inputs = []
    for _ in range(3):
        sc.new_inputs()
        inputs.append((sc.context_lens.clone(), sc.block_table.clone(), sc.q.clone(), sc.weights.clone()))
    host = bench.host_counts(sc, inputs, replay=lambda: None)  # a replay runs no Python
    assert host == {
        "build_planner_launches": planners,
        "build_schedule_copies": copies,
        "build_schedule_noop_copies": 0,
        "call_site_deferred_plans": 0,
        "call_site_replans": 0,
    }
    rows = {"v": {"host_per_step": host, "profiler_replay_window_per_step": {"planner_kernels": 2.0,
                                                                           "memcpy_dtod": 324.0, "memcpy_other": 0.0}}}
    assert bench.consistency_notes(rows) == []

    def eager_step() -> None:  # not a replay: the call sites run, and a deferred schedule is planned there
        with sc.control.partition(sc.budget, compute_knob=sc.knob):
            sc.join(sc.start())

    eager = bench.host_counts(sc, inputs[:1], replay=eager_step)
    assert eager["call_site_deferred_plans"] == (2 if defer else 0) and eager["call_site_replans"] == 0
    rows["v"]["host_per_step"] = eager
    assert bool(bench.consistency_notes(rows)) is defer


def test_replay_planning_flags_replay_windows_that_differ() -> None:
    bench = load("bench_replay_planning.py")
    host = dict.fromkeys(bench.HOST_KEYS, 0.0)
    rows = {
        "plan_at_build": {"host_per_step": host, "profiler_replay_window_per_step":
                          {"planner_kernels": 2.0, "memcpy_dtod": 0.0, "memcpy_other": 0.0}},
        "deferred": {"host_per_step": host, "profiler_replay_window_per_step":
                     {"planner_kernels": 2.0, "memcpy_dtod": 324.0, "memcpy_other": 0.0}},
    }
    [note] = bench.consistency_notes(rows)
    assert note.startswith("profiler artefact: replay-window memcpy_dtod") and "host_per_step" in note


def test_real_engine_bench_warms_the_machine_first_and_keeps_partial_results(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The first engine of a fresh machine compiles kernels during its start and first decode passes
    (measured on 2x H200: 43 s start, 97 ms step vs 16 s and 17-20 ms warm), which would land on the
    variant timed first; and a time limit that stops the benchmark must still leave its JSON. Launch is
    faked (no GPU in CI; the GPU twin is the benchmark itself on the H200)."""
    import json

    from dbo_runtime.harness import launch as launch_mod

    mod = load("bench_real_engine.py")
    labels: list[str] = []

    def fake_launch(spec: object, workdir: Path, progress: object = None) -> dict:
        label = spec.label  # type: ignore[attr-defined]
        labels.append(label)
        doc = json.loads((tmp_path / "bench_real_engine.json").read_text()) if labels[1:] else None
        if doc is not None:  # the JSON already holds every earlier engine
            assert [f"{r['variant']}-{r['rep']}" for r in doc["runs"]] == labels[:-1] and doc["complete"] is False
        cold = label == "warmup-0"
        rep = {"warmup": False, "decode_step_ms": 97.0 if cold else 17.0, "decode_tok_per_s": 1.0, "plugin_self_us_per_step": 100.0}
        return {"ok": True, "start_s": [43.0 if cold else 16.0], "bench": [{"reps": [rep]}]}

    monkeypatch.setattr(mod, "refuse_without_engine", lambda name, gpus: None)
    monkeypatch.setattr(launch_mod, "launch", fake_launch)
    assert mod.main(["--reps", "2", "--out", str(tmp_path)]) == 0
    assert labels == ["warmup-0", "plugin-0", "vanilla-0", "plugin-1", "vanilla-1", "plugin-selftime-0"]
    doc = json.loads((tmp_path / "bench_real_engine.json").read_text())
    assert doc["complete"] is True
    summary = doc["summary"]
    assert summary["start_s"]["plugin"] == summary["start_s"]["vanilla"] == 16.0  # the cold engine is not in the A/B
    assert summary["goals"]["decode_step_overhead"] == 0.0
    with pytest.raises(SystemExit):
        mod.main(["--warmup-engines", "-1", "--out", str(tmp_path)])


@pytest.mark.parametrize("name", KERNELS)
def test_without_torch_one_line_and_exit_3(name: str) -> None:
    """Outside the venv these scripts say what is missing in one line (exit 3), not ModuleNotFoundError
    (exit 1)."""
    block = (
        "import sys, runpy\n"
        "class NoTorch:\n"
        "    def find_spec(self, fullname, path=None, target=None):\n"
        "        if fullname == 'torch' or fullname.startswith('torch.'):\n"
        "            raise ImportError('No module named torch')\n"
        "sys.meta_path.insert(0, NoTorch())\n"
        f"sys.argv = [{str(ROOT / 'graphs' / name)!r}]\n"
        "runpy.run_path(sys.argv[0], run_name='__main__')\n"
    )
    proc = subprocess.run([sys.executable, "-c", block], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 3, proc.stderr[-2000:]
    assert proc.stderr.strip() == f"{name[:-3]}: needs a CUDA GPU and DeepGEMM: torch is not installed; nothing measured"



def test_dbo_engine_bench_runs_one_backend_group_at_a_time(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """All seven DP-2 configurations alive at once put seven engines on each GPU, and on 2x H200 the
    seventh died of CUDA OOM. So the groups run one after the other, each side by side in turns, each into
    its own JSON. Engines are faked (no GPU in CI; the GPU twin is the benchmark on the two-H200
    machine)."""
    import json

    from dbo_runtime.harness import turns
    from tests.harness import machine

    mod = load("bench_dbo_engine.py")
    groups: list[list[tuple[str, list[str], dict[str, str]]]] = []
    # per label: rank 0's and rank 1's step per timed rep (None: an invalid measurement on that rank)
    steps = {
        "ht-dbo-off": ([30.0, 31.0, 40.0], [32.0, 29.0, 41.0]),
        "ht-dbo-plugin": ([70.0, 66.0, 90.0], [71.0, 65.0, 89.0]),
        "ht-dbo-plugin-selftime": ([72.0, 67.0, 91.0], [73.0, 68.0, 92.0]),
        "ll-dbo-off": ([4.0, 5.0, 4.5], [4.2, 4.8, 4.6]),
        "ll-dbo-plugin": ([6.0, None, 5.0], [6.2, 5.8, 5.1]),
        "ll-dbo-vanilla": ([5.0, 6.0, 4.0], [5.5, 6.1, 4.4]),
        "ll-dbo-plugin-selftime": ([5.5, 5.6, 5.7], [5.4, 5.5, 5.6]),
    }
    selftime = {"ht-dbo-plugin-selftime": [[600.0, 500.0, 700.0], [650.0, 550.0, 750.0]],
                "ll-dbo-plugin-selftime": [[60.0, 70.0, 80.0], [65.0, 75.0, 85.0]]}

    def fake_run_interleaved(specs: list, work: Path, reps: int, **_: object) -> dict:
        groups.append([(s.label, list(s.engine_args), dict(s.env)) for s in specs])
        out = {}
        for s in specs:
            ranks = []
            for r in (0, 1):
                timed = [
                    {"decode_step_ms": st, "decode_tok_per_s": 1000.0 * (r + 1) + i,
                     "plugin_self_us_per_step": selftime.get(s.label, [[None] * 3] * 2)[r][i], "microbatched_builds": 62}
                    for i, st in enumerate(steps[s.label][r][:reps])
                ]
                ranks.append({"reps": [{"warmup": True, "decode_step_ms": 999.0, "decode_tok_per_s": 1.0}, *timed]})
            out[s.label] = {"ok": True, "bench": ranks, "turn_order": []}
        return out

    monkeypatch.setattr(machine, "refuse_without_engine", lambda name, gpus: None)
    monkeypatch.setattr(turns, "run_interleaved", fake_run_interleaved)
    assert mod.main(["--reps", "3", "--out", str(tmp_path)]) == 0
    assert [[label for label, _, _ in g] for g in groups] == [
        ["ht-dbo-off", "ht-dbo-plugin", "ht-dbo-plugin-selftime"],
        ["ll-dbo-off", "ll-dbo-plugin", "ll-dbo-vanilla", "ll-dbo-plugin-selftime"],
    ]
    for (label, args, env) in groups[0]:
        assert "deepep_high_throughput" in args and "--enforce-eager" in args and "NVSHMEM_QP_DEPTH" not in env, label
        assert any(a.endswith("/shared-topk") for a in args) and ("--enable-dbo" in args) == ("off" not in label)
    for (label, args, env) in groups[1]:
        assert "deepep_low_latency" in args and "--enforce-eager" not in args and env["NVSHMEM_QP_DEPTH"] == "8192", label
        assert any(a.endswith("/shared-topk-h2048") for a in args) and "FULL_DECODE_ONLY" in " ".join(args)
        assert ("--enable-dbo" in args) == ("off" not in label)
        assert env.get("DBO_RUNTIME_DISABLE") == ("1" if label == "ll-dbo-vanilla" else None)

    ll = json.loads((tmp_path / "bench_dbo_engine_ll.json").read_text())
    rows = ll["configs"]
    assert rows["ll-dbo-off"]["decode_step_ms"] == [4.2, 5.0, 4.6]  # the slower rank, the warm-up left out
    assert rows["ll-dbo-plugin"]["decode_step_ms"] == [6.2, 5.1]  # rep 1 dropped: rank 0 invalid
    assert rows["ll-dbo-plugin"]["decode_step_ms_by_rep"] == [6.2, None, 5.1]
    assert rows["ll-dbo-plugin"]["decode_tok_per_s"] == [3000.0, 3004.0]  # both ranks' rates, kept reps
    assert rows["ll-dbo-plugin"]["median_step_ms"] == pytest.approx(5.65)
    assert rows["ll-dbo-vanilla"]["median_step_ms"] == 5.5
    assert rows["ll-dbo-plugin-selftime"]["plugin_self_us_per_step"] == 72.5  # median over ranks and kept reps
    summary = ll["summary"]
    assert summary["ll_dbo_plugin_over_off"] == pytest.approx(5.65 / 4.6)
    assert summary["ll_dbo_plugin_over_vanilla"] == pytest.approx(5.65 / 5.5)
    paired = summary["ll_dbo_plugin_over_vanilla_paired"]  # reps 0 and 2 only: rep 1 of the plugin was dropped
    assert paired["n"] == 2 and paired["min"] == pytest.approx(6.2 / 5.5) and paired["max"] == pytest.approx(5.1 / 4.4)
    assert summary["ll_plugin_self_us_per_step"] == 72.5
    ht = json.loads((tmp_path / "bench_dbo_engine_ht.json").read_text())
    assert ht["group"] == "ht" and ht["configs"]["ht-dbo-off"]["median_step_ms"] == 32.0
    assert ht["summary"]["ht_dbo_plugin_over_off"] == pytest.approx(71.0 / 32.0)
    assert ht["summary"]["ht_plugin_self_us_per_step"] == 625.0
    assert set(ht["summary"]) == {"ht_dbo_plugin_over_off", "ht_dbo_plugin_over_off_paired", "ht_plugin_self_us_per_step"}

    groups.clear()
    assert mod.main(["--backends", "ll,ht", "--out", str(tmp_path / "order")]) == 0  # the order given
    assert [g[0][0] for g in groups] == ["ll-dbo-off", "ht-dbo-off"]
    capsys.readouterr()
    for bad, said in [("xx", "'xx'"), ("ht,zz", "'zz'"), (",", "','")]:
        with pytest.raises(SystemExit) as exit_:
            mod.main(["--backends", bad, "--out", str(tmp_path)])
        assert exit_.value.code == 2
        line = capsys.readouterr().err.strip().splitlines()[-1]
        assert line == (
            f"bench_dbo_engine: error: argument --backends: {said} is not allowed; allowed values: ht, ll (comma-separated)"
        )


def test_real_engine_plot_leaves_out_unmeasured_reps(tmp_path: Path) -> None:
    """The runner reports decode_step_ms None for a rep a loaded host made unmeasurable; the plot leaves
    it out as the summary does, instead of raising in statistics.median."""
    mod = load("bench_real_engine.py")
    runs = [
        {"variant": v, "rep": 0, "ok": True, "start_s": [16.0], "decode_step_ms": [17.0, None], "decode_tok_per_s": [1.0, None],
         "plugin_self_us_per_step": None, "error": None}
        for v in ("plugin", "vanilla")
    ]
    summary = mod._summary(runs)
    assert summary["decode_step_ms"]["n"] == [1, 1]
    mod._plot(runs, summary, tmp_path / "plot.png")
    from graphs._plotting import pyplot

    assert (tmp_path / "plot.png").exists() == (pyplot() is not None)


def test_host_cost_bench_plans_the_matrix_and_reports_per_step_and_per_layer() -> None:
    """Engines are faked (no GPU in CI; the GPU twin is the benchmark itself on the H200)."""
    mod = load("bench_host_cost.py")
    configs = mod.configurations(["glm53", "v32"], [6, 61, 78], ["eager", "graphs"], ["off", "emu"])
    assert len(configs) == 24 and len({c["label"] for c in configs}) == 24
    [config] = [c for c in configs if c["label"] == "glm53-78L-eager-dbo-emu"]
    specs = mod.specs_for(config, steps=16, reps=5)
    assert [s.label for s in specs] == [f"glm53-78L-eager-dbo-emu-{v}" for v in ("plugin", "vanilla", "selftime")]
    args = specs[0].engine_args
    overrides = json.loads(args[args.index("--hf-overrides") + 1])
    assert overrides == {"num_hidden_layers": 78, "index_topk_freq": 4, "index_skip_topk_offset": 3}
    assert "--enable-dbo" in args and "--enforce-eager" in args and args[args.index("--dbo-decode-token-threshold") + 1] == "4"
    # every engine microbatches through the emulation; vanilla at 0 comm SMs (more crashes it), the self-timed at 20
    assert [(s.env["DBO_EMULATE_DP_PEER"], s.env["VLLM_DBO_COMM_SMS"], s.cold_jit_cache) for s in specs] == [("1", "0", True), ("1", "0", True), ("1", "20", True)]
    assert specs[1].env["DBO_RUNTIME_DISABLE"] == "1" and "DBO_RUNTIME_DISABLE" not in specs[0].env
    assert specs[2].env["DBO_RUNTIME_SELF_TIME"] == "1" and all(s.bench["coordinated"] for s in specs)
    [off] = [c for c in configs if c["label"] == "glm53-78L-eager-dbo-off"]
    envs = [s.env for s in mod.specs_for(off, steps=16, reps=5)]
    assert envs[:2] == [{}, {"DBO_RUNTIME_DISABLE": "1"}] and envs[2]["DBO_RUNTIME_SELF_TIME"] == "1"
    assert envs[2]["PYTHONPATH"].split(os.pathsep)[0].endswith("selftime_site")  # the self-timer is outside the wheel

    def rec(steps: list[float], **extra: object) -> dict:
        reps = [{"warmup": True, "decode_step_ms": 999.0}] + [{"warmup": False, "decode_step_ms": x, **extra} for x in steps]
        return {"ok": True, "bench": [{"reps": reps}]}

    records = {
        "glm53-78L-eager-dbo-emu-plugin": rec([201.0, 202.0, 200.0], jit_in_step=0),
        "glm53-78L-eager-dbo-emu-vanilla": rec([200.0, 200.0, 200.0]),
        "glm53-78L-eager-dbo-emu-selftime": rec(
            [210.0] * 3, plugin_self_us_per_step=390.0, plugin_self_net_us_per_step=78.0, plugin_calls_per_step=780.0,
            plugin_self_in_situ_net_us_per_step=40.0,
            plugin_calls_per_step_by_patch={"topk.SparseAttnIndexer.topk_indices_buffer": 42.0}, jit_in_step=0,
            plugin_self_us_per_step_by_patch={"indexer.logits.sparse_attn_indexer": 300.0},
            plugin_long_per_step_by_patch={"indexer.logits.sparse_attn_indexer": {"count": 1.0, "us": 250.0}},
            plugin_gc_us_per_step=30.0, plugin_gc_per_step=0.5,
        ),
    }  # fmt: skip
    row = mod.summarize(config, records)
    assert row["plugin_over_vanilla_paired"] == {"median": 1.005, "min": 1.0, "max": 1.01, "n": 3}
    assert row["self_us_per_step"] == 390.0 and row["self_us_per_layer"] == 5.0
    assert row["hooked_calls_per_step"] == 780.0 and row["hooked_calls_per_layer"] == 10.0
    assert row["self_ns_per_hooked_call"] == 500.0 and abs(row["self_share_of_step"] - 390e-3 / 200.0) < 1e-12
    assert row["calls_per_step_by_patch"] == {"topk.SparseAttnIndexer.topk_indices_buffer": 42.0}
    assert row["self_net_us_per_step"] == 78.0 and row["self_net_ns_per_hooked_call"] == 100.0
    assert abs(row["self_net_share_of_step"] - 78e-3 / 200.0) < 1e-12
    assert row["self_in_situ_net_us_per_step"] == 40.0 and abs(row["self_in_situ_net_share_of_step"] - 40e-3 / 200.0) < 1e-12
    assert row["jit_in_step"] == {"plugin": [0, 0, 0], "selftime": [0, 0, 0]}
    assert row["self_us_per_step_by_patch"] == {"indexer.logits.sparse_attn_indexer": 300.0}
    assert row["long_per_step_by_patch"] == {"indexer.logits.sparse_attn_indexer": {"count": 1.0, "us": 250.0}}
    assert row["step_time_warnings"] == [] and row["engine_failures"] == []
    assert row["gc_in_plugin_us_per_step"] == 30.0 and row["gc_in_plugin_per_step"] == 0.5


def test_host_cost_bench_names_the_engines_that_failed_and_why() -> None:
    """An engine that died (for one, of CUDA OOM: twelve 78-layer engines outgrow one H200) leaves its figures
    empty; the row says which engine, what the harness recognised in its log, and how many reps it kept."""
    mod = load("bench_host_cost.py")
    [config] = mod.configurations(["v32"], [61], ["eager"], ["off"])
    rep = {"warmup": False, "decode_step_ms": 200.0}
    records = {
        "v32-61L-eager-dbo-off-plugin": {"ok": True, "bench": [{"reps": [rep] * 3}]},
        "v32-61L-eager-dbo-off-vanilla": {"ok": False, "error": "EngineDeadError: ...", "failure_signatures": ["cuda_oom", "engine_dead"], "bench": [{"reps": [rep]}]},
    }  # fmt: skip
    row = mod.summarize(config, records)
    assert row["engine_failures"] == ["vanilla: the engine failed (cuda_oom, engine_dead) after 1 timed rep(s)", "selftime: no run"]
    records["v32-61L-eager-dbo-off-vanilla"] = {"ok": False, "stopped_by_session_limit": True, "bench": [{"reps": [rep] * 2}]}
    assert mod.summarize(config, records)["engine_failures"] == ["selftime: no run"]  # a limit is not a failure


def test_host_cost_bench_says_when_its_step_times_are_not_a_measurement() -> None:
    """The shapes of a measured 78-layer graphs run: one pair of reps, a rep 160x the other, a rep whose 1-token
    pass outlasted the full one (a compile in it), and decode steps a third of the timed pass."""
    mod = load("bench_host_cost.py")
    [config] = [c for c in mod.configurations(["glm53"], [78], ["graphs"], ["emu"])]

    def rec(*reps: tuple[float | None, float, float]) -> dict:
        rows = [{"warmup": True, "decode_step_ms": 1.0, "prefill_s": 0.5, "total_s": 0.6}]
        rows += [{"warmup": False, "decode_step_ms": ms, "prefill_s": p, "total_s": t} for ms, p, t in reps]
        return {"ok": True, "bench": [{"reps": rows}]}

    records = {
        "glm53-78L-graphs-dbo-emu-plugin": rec((21.6, 0.51, 0.84), (9.0, 0.53, 0.67)),
        "glm53-78L-graphs-dbo-emu-vanilla": rec((18.1, 0.57, 0.84), (None, 6.05, 0.68)),
        "glm53-78L-graphs-dbo-emu-selftime": rec((6.6, 0.51, 0.61), (1450.7, 0.50, 22.26)),
    }
    records["glm53-78L-graphs-dbo-emu-selftime"]["bench"][0]["reps"][1]["jit_in_step"] = 2
    del records["glm53-78L-graphs-dbo-emu-selftime"]["bench"][0]["reps"][2]["prefill_s"]  # an older record
    said = mod.summarize(config, records)["step_time_warnings"]
    assert said[0].startswith("1 plugin/vanilla pair(s) of reps (fewer than 3)")
    assert "plugin: reps differ 2.4x (9.0 to 21.6 ms per step)" in said[1]
    assert "plugin: the decode steps are 30% of the full pass" in said[2]
    assert "vanilla: 1 rep(s) without a decode step" in said[3]
    assert any(w.startswith("selftime: reps differ 219.8x") for w in said)
    assert "selftime: 2 planner compile(s) inside timed steps (jit_in_step)" in said


def test_host_cost_bench_summarizes_a_run_a_limit_stopped(tmp_path: Path) -> None:
    """``--from-runs``: a time limit killed the benchmark and its engines; the reps each engine finished
    (``rankN.partial.json``) still make the configuration's row, without a GPU."""
    from dataclasses import asdict

    mod = load("bench_host_cost.py")
    [config] = [c for c in mod.configurations(("glm53",), (78,), ("eager",), ("emu",))]
    runs = tmp_path / "bench_host_cost_runs"
    for spec in mod.specs_for(config, 16, 2):
        run = runs / spec.label
        run.mkdir(parents=True)
        (run / "spec.json").write_text(json.dumps(asdict(spec), default=str))
        reps = [{"rep": 0, "warmup": True, "decode_step_ms": 999.0}, {"rep": 1, "warmup": False, "decode_step_ms": 300.0}]
        if spec.label.endswith("-plugin"):
            reps[1]["decode_step_ms"] = 303.0
        if spec.label.endswith("-selftime"):
            reps[1].update(plugin_self_us_per_step=900.0, plugin_calls_per_step=450.0, plugin_self_us_per_step_by_patch={"p": 900.0})
        (run / "rank0.partial.json").write_text(json.dumps({"bench": {"reps": reps}}))
    out = tmp_path / "out"
    assert mod.main(["--from-runs", str(runs), "--only", config["label"], "--out", str(out)]) == 0
    doc = json.loads((out / "bench_host_cost.json").read_text())
    [row] = doc["configs"]
    assert row["plugin_over_vanilla_paired"]["median"] == pytest.approx(1.01) and row["self_us_per_step"] == 900.0
    assert row["self_us_per_step_by_patch"] == {"p": 900.0} and doc["environment"]["stopped_by_session_limit"] is True
    assert not set(mod.ENGINE_ONLY) & set(doc["args"])  # no engine option's default recorded for runs it did not shape


def test_host_cost_bench_refuses_a_runs_directory_it_cannot_use(tmp_path: Path) -> None:
    """An empty or foreign directory, or a run that cannot be read, is one error (exit 2) and writes nothing: the
    committed results must never be overwritten by a file of nulls."""
    mod = load("bench_host_cost.py")
    out = tmp_path / "out"
    (tmp_path / "empty").mkdir()
    assert mod.main(["--from-runs", str(tmp_path / "empty"), "--only", "glm53-6L-eager-dbo-off", "--out", str(out)]) == 2
    broken = tmp_path / "junk" / "glm53-6L-eager-dbo-off-plugin"
    broken.mkdir(parents=True)
    (broken / "record.json").write_text("{not json")
    assert mod.main(["--from-runs", str(tmp_path / "junk"), "--only", "glm53-6L-eager-dbo-off", "--out", str(out)]) == 2
    (broken / "record.json").write_text("{}")  # readable, but no run of this benchmark
    assert mod.main(["--from-runs", str(tmp_path / "junk"), "--only", "glm53-6L-eager-dbo-off", "--out", str(out)]) == 2
    (broken / "record.json").write_text(json.dumps({"label": broken.name, "ok": True, "bench": 5}))  # a foreign shape
    assert mod.main(["--from-runs", str(tmp_path / "junk"), "--only", "glm53-6L-eager-dbo-off", "--out", str(out)]) == 2
    (broken / "record.json").write_text(json.dumps({"label": broken.name}))  # a run, but no timed rep: a file of nulls
    assert mod.main(["--from-runs", str(tmp_path / "junk"), "--only", "glm53-6L-eager-dbo-off", "--out", str(out)]) == 2
    (broken / "record.json").write_text("[]")  # JSON, not a record
    assert mod.main(["--from-runs", str(tmp_path / "junk"), "--only", "glm53-6L-eager-dbo-off", "--out", str(out)]) == 2
    # another engine's run filed under this name: plugin and vanilla would swap in the ratio
    (broken / "record.json").write_text(json.dumps({"label": "glm53-6L-eager-dbo-off-vanilla", "ok": True, "bench": [{"reps": [{"decode_step_ms": 1.0}]}]}))
    assert mod.main(["--from-runs", str(tmp_path / "junk"), "--only", "glm53-6L-eager-dbo-off", "--out", str(out)]) == 2
    assert not out.exists()


def test_host_cost_bench_runs_graph_rows_with_their_own_step_count(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A replayed step is a few milliseconds: graph rows take ``--graphs-steps`` decode steps per pass, eager rows
    ``--steps`` (engines faked: no GPU in CI; the GPU twin is the benchmark on the H200)."""
    from dbo_runtime.harness import turns
    from tests.harness import machine

    mod = load("bench_host_cost.py")
    seen: dict[str, int] = {}
    groups: list[list[str]] = []

    def fake_run_interleaved(specs: list, work: Path, reps: int, **_: object) -> dict:
        seen.update({s.label: s.bench["max_tokens"] for s in specs})
        groups.append([s.label for s in specs])
        return {s.label: {"ok": True, "bench": [{"reps": []}]} for s in specs}

    monkeypatch.setattr(machine, "refuse_without_engine", lambda name, gpus: None)
    monkeypatch.setattr(turns, "run_interleaved", fake_run_interleaved)
    monkeypatch.setattr(mod, "_plot", lambda rows, path: None)
    monkeypatch.setattr(mod, "gpu_gib", lambda: None)  # NVML's answer is this machine's, not the test's
    argv = ["--models", "glm53", "--depths", "6", "--dbo", "emu", "--reps", "1", "--out", str(tmp_path)]
    assert mod.main([*argv, "--steps", "8"]) == 0
    assert {label: n for label, n in seen.items() if label.endswith("-plugin")} == {
        "glm53-6L-eager-dbo-emu-plugin": 8, "glm53-6L-graphs-dbo-emu-plugin": 128,
    }  # fmt: skip
    assert mod.main([*argv, "--graphs-steps", "64"]) == 0 and seen["glm53-6L-graphs-dbo-emu-vanilla"] == 64
    with pytest.raises(SystemExit):
        mod.main([*argv, "--graphs-steps", "1"])
    # one configuration's three engines alive at a time by default; --at-once 2 puts both rows in one set of turns
    assert [len(g) for g in groups] == [3, 3, 3, 3] and groups[0][0] == "glm53-6L-eager-dbo-emu-plugin"
    groups.clear()
    assert mod.main([*argv, "--at-once", "2"]) == 0 and [len(g) for g in groups] == [6]
    for bad in ("0", "25", ""):
        with pytest.raises(SystemExit):
            mod.main([*argv, "--at-once", bad])


def test_host_cost_bench_refuses_more_engines_at_once_than_the_gpu_holds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Twelve 78-layer engines outgrow an H200 part-way (CUDA OOM after minutes of start-up): refused before any
    engine starts, in one line naming ``--at-once`` and what fits (engines faked: no GPU in CI; the GPU's memory
    is NVML's, ``adapters.nvml``, here a stand-in)."""
    from dbo_runtime.harness import turns
    from tests.harness import machine

    mod = load("bench_host_cost.py")
    deep = mod.configurations(["glm53", "v32"], [78], ["eager"], ["off", "emu"])
    assert mod.memory_problem(deep, 2, 139.8) is None  # six engines, about 96 GiB
    said = mod.memory_problem(deep, 4, 139.8)
    assert said is not None and said.startswith("argument --at-once: 4 is not allowed") and said.endswith("allowed values: --at-once 1, 2")
    assert "78 layers 16.0" in said
    assert mod.memory_problem(mod.configurations(["glm53"], [6], ["eager", "graphs"], ["off", "emu"]), 4, 139.8) is None
    assert "none: one configuration" in str(mod.memory_problem(deep, 1, 40.0))
    # consecutive groups: a smaller --at-once can group worse (here 2 pairs the two deep rows, 3 does not), so every
    # value that fits is named
    mixed = mod.configurations(["glm53"], [6, 78, 6], ["eager"], ["off", "emu"])  # 21, 21, 48, 48, 21, 21 GiB
    assert str(mod.memory_problem(mixed, 4, 92.0)).endswith("allowed values: --at-once 1, 3")
    assert 7.0 < mod.engine_gib({"depth": 30}) < 16.0 < mod.engine_gib({"depth": 120})  # other depths on the line

    launched: list[str] = []
    monkeypatch.setattr(machine, "refuse_without_engine", lambda name, gpus: None)
    monkeypatch.setattr(mod, "gpu_gib", lambda: 139.8)
    monkeypatch.setattr(turns, "run_interleaved", lambda specs, *a, **k: launched.extend(s.label for s in specs) or {})
    with pytest.raises(SystemExit) as exit_:
        mod.main(["--depths", "78", "--modes", "eager", "--at-once", "4", "--out", str(tmp_path / "out")])
    assert exit_.value.code == 2 and launched == [] and not (tmp_path / "out").exists()
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith("bench_host_cost: error: argument --at-once: 4 is not allowed for these rows on this GPU")


def _host_cost_figure(rows: list[dict], tmp_path: Path) -> Any:
    """The one figure ``bench_host_cost._plot`` draws for ``rows``, caught at ``savefig`` (close it with ``_close``)."""
    from graphs._plotting import pyplot

    plt = pyplot()
    if plt is None:
        pytest.fail("matplotlib is a dev dependency (make setup): the plot cannot be checked without it")
    mod = load("bench_host_cost.py")
    drawn: list = []
    monkeypatch = pytest.MonkeyPatch()
    monkeypatch.setattr(plt.Figure, "savefig", lambda fig, path, **kw: drawn.append(fig))
    try:
        mod._plot(rows, tmp_path / "plot.png")
    finally:
        monkeypatch.undo()
    (fig,) = drawn
    return fig


def _close(fig: Any) -> None:
    from graphs._plotting import pyplot

    pyplot().close(fig)


def test_host_cost_plot_says_na_for_a_row_without_vanilla_and_colours_by_records(tmp_path: Path) -> None:
    """A row whose vanilla engine never finished has no ratio and no share: the figure says n/a rather than
    drawing a zero bar (which reads as "costs nothing"), and rows merged from two leases get two colours."""
    measured = {"label": "v32-6L-eager-dbo-off", "plugin_over_vanilla_paired": {"median": 1.01, "n": 5}, "self_net_share_of_step": 0.0004,
                "source": "docs/gpu-runs/2026-12-04-lease20-hostcost"}  # fmt: skip
    unmeasured = {"label": "v32-61L-eager-dbo-off", "plugin_over_vanilla_paired": None, "self_net_share_of_step": None,
                  "source": "docs/gpu-runs/2026-12-02-lease14-hostcost"}  # fmt: skip
    fig = _host_cost_figure([measured, unmeasured], tmp_path)
    for ax in fig.axes[:2]:
        assert [t.get_text() for t in ax.texts] == ["n/a"] and ax.texts[0].get_position()[0] == 1
        bars = ax.patches
        assert bars[0].get_facecolor() != bars[1].get_facecolor()
    (legend,) = fig.legends  # the figure's, below the panels: inside a panel it covered bars
    assert fig.axes[1].get_legend() is None
    assert [t.get_text() for t in legend.get_texts()] == ["2026-12-04-lease20-hostcost", "2026-12-02-lease14-hostcost"]
    assert "one GPU: not recorded\n" in fig._suptitle.get_text()
    _close(fig)
    # a mixed set names the device it has and counts the rows without one, never as a device of its own
    fig = _host_cost_figure([{**measured, "device": "NVIDIA H200"}, unmeasured], tmp_path)
    assert "one GPU: NVIDIA H200 (1 row(s) with no device recorded)\n" in fig._suptitle.get_text()
    _close(fig)


def test_host_cost_plot_draws_no_ratio_bar_from_fewer_pairs_than_a_measurement(tmp_path: Path) -> None:
    """Two pairs of reps are not a step ratio (``step_time_warnings`` says so): the panel names the pairs instead
    of drawing a bar and its spread; the self-time share, measured per rep, is still drawn."""
    row = {"label": "glm53-61L-eager-dbo-emu", "plugin_over_vanilla_paired": {"median": 0.48, "min": 0.12, "max": 0.84, "n": 2},
           "self_net_share_of_step": 0.0076, "device": "NVIDIA H100 80GB HBM3"}  # fmt: skip
    fig = _host_cost_figure([row], tmp_path)
    ratio, share = fig.axes[:2]
    assert [t.get_text() for t in ratio.texts] == ["n/a: 2 pair(s)"] and ratio.patches[0].get_height() == 0
    assert not ratio.containers[1:]  # no error bar
    assert not share.texts and share.patches[0].get_height() == pytest.approx(0.76)
    _close(fig)


def test_host_cost_plot_names_the_device_even_when_one_lease_drew_it(tmp_path: Path) -> None:
    """A figure drawn from one lease has no legend; its title still says which GPU the numbers hold for."""
    row = {"label": "v32-6L-eager-dbo-emu", "plugin_over_vanilla_paired": {"median": 1.0}, "self_net_share_of_step": 0.002,
           "source": "docs/gpu-runs/2026-12-05-lease21-hostcost", "device": "NVIDIA H100 80GB HBM3"}  # fmt: skip
    fig = _host_cost_figure([row, {**row, "label": "glm53-6L-eager-dbo-emu"}], tmp_path)
    assert not fig.legends and "one GPU: NVIDIA H100 80GB HBM3\n" in fig._suptitle.get_text()
    _close(fig)


def test_a_benchmark_says_which_files_it_wrote(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """One stderr line with the files that exist (no PNG named where matplotlib did not make one)."""
    from graphs._args import say_written

    (tmp_path / "x.json").write_text("{}")
    say_written("bench_x", tmp_path / "x.json", tmp_path / "x.png")
    assert capsys.readouterr().err == f"bench_x: wrote {tmp_path / 'x.json'}\n"
    say_written("bench_x", tmp_path / "y.json")
    assert capsys.readouterr().err == "bench_x: wrote nothing\n"


def test_host_cost_plot_draws_the_pairs_spread_around_each_median(tmp_path: Path) -> None:
    """Fresh engines differ more than the plugin costs: the ratio panel shows each row's min-max of the pairs, so
    a median of 1.31 from pairs that reach 1.03 is not read as a 31 % cost. A row without a spread gets none."""
    spread = {"label": "v32-61L-eager-dbo-off", "plugin_over_vanilla_paired": {"median": 1.31, "min": 1.03, "max": 1.31, "n": 3},
              "self_net_share_of_step": 0.00006, "device": "NVIDIA H100 80GB HBM3"}  # fmt: skip
    bare = {**spread, "label": "glm53-61L-eager-dbo-off", "plugin_over_vanilla_paired": {"median": 0.92}}
    fig = _host_cost_figure([bare, spread], tmp_path)
    (bars,) = fig.axes[0].collections  # one errorbar set: the row with a spread only
    (segment,) = bars.get_segments()
    assert segment[0][0] == segment[1][0] == 1
    assert sorted(round(float(y), 2) for _, y in segment) == [1.03, 1.31]
    assert fig.axes[0].get_ylabel().endswith("(paired median, min-max)")
    _close(fig)


def test_host_cost_check_parses_and_starts_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--check`` (what the GPU session script runs before installing): the arguments are parsed by the one
    parser, a good set exits 0 having written nothing, a bad one is the same one line as a real run."""
    mod = load("bench_host_cost.py")
    out = tmp_path / "out"
    assert mod.main(["--check", "--only", "glm53-78L-eager-dbo-off", "--at-once", "1", "--out", str(out)]) == 0
    assert capsys.readouterr().err == "bench_host_cost: arguments ok: 1 configuration(s)\n" and not out.exists()
    with pytest.raises(SystemExit):
        mod.main(["--check", "--modes", "eagre"])
    assert "argument --modes: invalid value 'eagre'" in capsys.readouterr().err
