"""DBO_RUNTIME_SELF_TIME: plugin time excludes the vLLM original it calls through."""

from __future__ import annotations

import threading
import time
import types
from collections.abc import Callable
from pathlib import Path

import pytest

from dbo_runtime.integration.patching import Patch, PatchSet
from tests.harness import selftime


def _busy(ns: int) -> None:
    end = time.perf_counter_ns() + ns
    while time.perf_counter_ns() < end:
        pass


@pytest.fixture
def work(monkeypatch: pytest.MonkeyPatch) -> Callable[[int], None]:
    """``work(ns)`` on a clock that moves only when work runs: the sums are exact however busy the machine is."""
    now = [0]
    monkeypatch.setattr(selftime, "_clock", lambda: now[0])

    def advance(ns: int) -> None:
        now[0] += ns

    return advance


def test_exclusive_time_and_nesting(work: Callable[[int], None]) -> None:
    before = selftime.snapshot(calibrate=False)
    paused = selftime.pause_for_original(lambda: work(20_000_000))  # 20 ms in "vLLM"
    inner = selftime.time_plugin(lambda: work(2_000_000), "inner")  # 2 ms plugin

    def replacement() -> None:
        work(3_000_000)  # 3 ms plugin
        paused()
        inner()

    selftime.time_plugin(replacement, "outer")()
    after = selftime.snapshot(calibrate=False)
    assert after["calls"] - before["calls"] == 2
    assert after["total_ns"] - before["total_ns"] == 5_000_000  # 3 + 2 ms, never the 20 ms inside the original


def test_threads_are_summed() -> None:
    before = selftime.snapshot(calibrate=False)["total_ns"]
    timed = selftime.time_plugin(lambda: _busy(4_000_000), "t")
    threads = [threading.Thread(target=timed) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert selftime.snapshot(calibrate=False)["total_ns"] - before >= 8_000_000


def test_objects_that_are_neither_functions_nor_descriptors_are_left_alone() -> None:
    obj = object()
    assert selftime.time_plugin(obj, "plain-object") is obj
    assert "plain-object" in selftime.snapshot(calibrate=False)["untimed"]
    snap = selftime.snapshot(calibrate=True)
    assert snap["overhead_ns_per_call"] >= 0.0 and snap["overhead_ns_per_access"] >= 0.0


def test_descriptor_and_property_accesses_are_timed_and_counted(monkeypatch: pytest.MonkeyPatch) -> None:
    """The top-k buffer descriptors were left untimed, so the published self-time missed ~950 accesses a step."""

    class Slow:
        def __get__(self, obj: object, objtype: object = None) -> int:
            if obj is None:
                return self  # type: ignore[return-value]
            _busy(100_000)
            return obj.__dict__["x"]  # type: ignore[attr-defined, no-any-return]

        def __set__(self, obj: object, value: int) -> None:
            obj.__dict__["x"] = value  # type: ignore[attr-defined]

    timed = selftime.time_plugin(Slow(), "test.descriptor")
    prop = selftime.time_plugin(property(lambda self: (_busy(100_000), 7)[1]), "test.property")
    holder = type("Holder", (), {"x": timed, "p": prop})()
    holder.x = 5
    before = selftime.snapshot(calibrate=False)
    assert [holder.x for _ in range(10)] == [5] * 10 and [holder.p for _ in range(10)] == [7] * 10
    after = selftime.snapshot(calibrate=False)
    assert after["by_patch"]["test.descriptor"] - before["by_patch"]["test.descriptor"] == 10
    assert after["by_patch"]["test.property"] - before["by_patch"].get("test.property", 0) == 10
    assert after["total_ns"] - before["total_ns"] >= 20 * 100_000
    assert after["kinds"]["test.descriptor"] == "descriptor" and after["kinds"]["test.property"] == "property"
    assert "test.descriptor" not in after["untimed"]


def test_patchset_wraps_only_with_the_instrument_and_restores_identity(monkeypatch: pytest.MonkeyPatch) -> None:
    module = types.ModuleType("fake_vllm_module_for_selftime")

    def target(x: int) -> int:
        return x + 1

    module.target = target  # type: ignore[attr-defined]
    import sys

    sys.modules[module.__name__] = module
    try:
        patch = Patch(
            name="t.target",
            module=module.__name__,
            attr="target",
            make=lambda original: lambda x: original(x) * 10,
            reason="test",
            upstream_pr="none",
            removal="test",
        )
        monkeypatch.setenv(selftime.ENV, "1")
        before = selftime.snapshot(calibrate=False)["calls"]
        ps = PatchSet([patch], instrument=selftime)
        ps.install()
        assert module.target(1) == 20  # type: ignore[attr-defined]
        assert selftime.snapshot(calibrate=False)["calls"] == before + 1
        ps.uninstall()
        assert module.target is target  # type: ignore[attr-defined]
        monkeypatch.setenv(selftime.ENV, "0")
        ps = PatchSet([patch])
        ps.install()
        assert module.target(1) == 20  # type: ignore[attr-defined]
        assert selftime.snapshot(calibrate=False)["calls"] == before + 1  # not wrapped
        ps.uninstall()
    finally:
        sys.modules.pop(module.__name__, None)


def test_threads_do_not_accumulate_records_and_calibration_is_not_counted() -> None:
    """vLLM starts two new microbatch threads per DBO step: no per-thread record may be kept."""
    before = selftime.snapshot(calibrate=False)
    timed = selftime.time_plugin(lambda: None, "t")
    for _ in range(50):
        t = threading.Thread(target=timed)
        t.start()
        t.join()
    assert not hasattr(selftime, "_all")
    mid = selftime.snapshot(calibrate=True)
    assert mid["calls"] - before["calls"] == 50 and mid["overhead_ns_per_call"] > 0
    assert selftime.snapshot(calibrate=False)["calls"] == mid["calls"]  # calibration left no calls behind


def test_the_clocks_own_charge_is_calibrated_and_a_net_figure_subtracts_it() -> None:
    """A hook with no plugin work still accrues plugin time (the clock's own switches): the calibration measures
    that charge, a hook that only calls its original accrues about that much, and the net figure takes it out."""
    net_self_us = selftime.net_self_us

    snap = selftime.snapshot(calibrate=True)
    assert snap["charged_ns_per_call"] > 0.0 and snap["charged_ns_per_access"] > 0.0
    assert "calibration" not in snap["by_patch"] and "calibration" not in snap["kinds"]
    clock_before = selftime.snapshot(calibrate=False)["total_ns"]
    paused = selftime.pause_for_original(lambda: None)
    hook = selftime.time_plugin(lambda: paused(), "test.empty-hook")
    for _ in range(2000):
        hook()
    charged = (selftime.snapshot(calibrate=False)["total_ns"] - clock_before) / 2000
    assert charged < 20 * snap["charged_ns_per_call"] + 5_000  # the same order: pure clock cost
    worker = {"self_time": {"charged_ns_per_call": 1000.0, "charged_ns_per_access": 500.0, "kinds": {"f": "function", "d": "descriptor"}}}
    assert net_self_us(10.0, {"f": 4, "d": 6}, [worker]) == pytest.approx(10.0 - 4.0 - 3.0)
    assert net_self_us(1.0, {"f": 4}, [worker]) == 0.0  # never negative
    assert net_self_us(10.0, {"f": 4}, [{"self_time": {"charged_ns_per_call": None}}]) is None  # not calibrated


def test_time_is_charged_to_the_innermost_patch_and_long_charges_are_told_apart(work: Callable[[int], None]) -> None:
    """A per-step total cannot say whether the plugin is slow per access or pays a few long charges (a kernel it
    launches, its thread descheduled): each charge goes to the innermost timed patch, and single charges over
    ``LONG_NS`` are counted apart."""
    before = selftime.snapshot(calibrate=False)
    paused = selftime.pause_for_original(lambda: work(30_000_000))  # vLLM's time: charged to nobody
    inner = selftime.time_plugin(lambda: work(2 * selftime.LONG_NS), "test.inner-long")

    def outer_body() -> None:
        work(1_000_000)
        paused()
        inner()
        for _ in range(50):
            short()

    short = selftime.time_plugin(lambda: None, "test.short")
    selftime.time_plugin(outer_body, "test.outer")()
    after = selftime.snapshot(calibrate=False)

    def delta(table: str, name: str, index: int | None = None) -> int:
        a, b = after[table].get(name), before[table].get(name)
        if index is not None:
            return (a[index] if a else 0) - (b[index] if b else 0)
        return int(a or 0) - int(b or 0)

    outer_ns, inner_ns, short_ns = delta("ns_by_patch", "test.outer"), delta("ns_by_patch", "test.inner-long"), delta("ns_by_patch", "test.short")
    assert (outer_ns, inner_ns, short_ns) == (1_000_000, 2 * selftime.LONG_NS, 0)  # its own 1 ms, not the 30 ms in the original
    assert outer_ns + inner_ns + short_ns == after["total_ns"] - before["total_ns"]  # every charge has one owner
    assert (delta("long_by_patch", "test.inner-long", 0), delta("long_by_patch", "test.inner-long", 1)) == (1, 2 * selftime.LONG_NS)
    assert delta("long_by_patch", "test.short", 0) == 0
    assert after["long_ns"] == selftime.LONG_NS


def test_a_bench_row_reports_self_time_and_long_charges_per_patch_per_step() -> None:
    def snap(ns: int, long: list[int]) -> list[dict]:
        return [{"self_time": {"ns_by_patch": {"p": ns}, "long_by_patch": {"p": long}}}]

    # a 1-token pass costs 100 ns and one long charge, the 5-token pass 100 + 4 * 50 ns and two
    s0, s1, s2 = snap(0, [0, 0]), snap(100, [1, 30]), snap(100 + 100 + 200, [3, 90])
    assert selftime.per_step_by_patch(s0, s1, s2, 5, key="ns_by_patch") == {"p": 50.0}
    assert selftime.per_step_by_patch(s0, s1, s2, 5, key="long_by_patch", index=0) == {"p": 0.25}
    assert selftime.per_step_by_patch(s0, s1, s2, 5, key="long_by_patch", index=1) == {"p": 7.5}


def test_reading_the_numbers_out_is_not_charged_to_the_plugin() -> None:
    """The stats RPC's snapshot runs the calibration (milliseconds): timed, it would land in the per-step tables."""
    assert "stats.worker_rpc" in selftime.MEASUREMENT

    def rpc() -> dict:
        return selftime.snapshot(calibrate=True)

    assert selftime.time_plugin(rpc, "stats.worker_rpc") is rpc
    assert selftime.snapshot(calibrate=False)["kinds"]["stats.worker_rpc"] == "measurement"


def test_a_garbage_collection_inside_plugin_code_is_counted_apart() -> None:
    """A collection is paid by whichever code's allocation triggers it: one that starts inside plugin code is part
    of the plugin's self time and is counted apart (``gc_count`` / ``gc_ns``); one in vLLM's code is not counted."""
    import gc

    before = selftime.snapshot(calibrate=False)
    timed = selftime.time_plugin(lambda: gc.collect(0), "collects")
    timed()
    mid = selftime.snapshot(calibrate=False)
    assert mid["gc_count"] - before["gc_count"] == 1 and mid["gc_ns"] > before["gc_ns"]
    assert mid["total_ns"] - before["total_ns"] >= mid["gc_ns"] - before["gc_ns"]  # part of the self time

    def original() -> None:
        gc.collect(0)

    paused = selftime.pause_for_original(original)
    selftime.time_plugin(lambda: paused(), "calls-vllm")()
    gc.collect(0)  # outside any plugin code
    after = selftime.snapshot(calibrate=False)
    assert after["gc_count"] == mid["gc_count"] and after["gc_ns"] == mid["gc_ns"]


@pytest.mark.parametrize("switch", ["1", "0"])
def test_the_bench_site_hands_the_plugin_the_timer_only_when_the_switch_is_on(switch: str) -> None:
    """The wheel has no self-timer: a bench run's sitecustomize (``plan.bench_env``) installs it from outside."""
    import os
    import subprocess
    import sys

    from tests.e2e import plan

    env = plan.bench_env({"DBO_RUNTIME_SELF_TIME": switch})
    code = (
        "from dbo_runtime.integration import plugin, worker_stats\n"
        "print(getattr(plugin.INSTRUMENT, '__name__', None), len(worker_stats.EXTENSIONS))\n"
        "import importlib, os\n"  # the runner's bench finds the self-timer's columns the same way
        "module, _, name = os.environ['DBO_HARNESS_ROW_HOOK'].partition(':')\n"
        "print(getattr(importlib.import_module(module), name).__name__)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == (["tests.harness.selftime", "1"] if switch == "1" else ["None", "0"]) + ["bench_row"]


@pytest.mark.parametrize("site", ["tests/harness/selftime_site", "tests/e2e/emulate/dp_peer"])
def test_a_runs_sitecustomize_finds_this_checkouts_tests_before_a_foreign_one(site: str, tmp_path: Path) -> None:
    """Another top-level ``tests`` package on ``PYTHONPATH`` (a dependency's, a user's) never shadows this checkout's:
    the site puts the checkout first, so the self-timer and the emulation load from here."""
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    foreign = tmp_path / "foreign" / "tests"
    for package in (foreign, foreign / "harness", foreign / "e2e"):
        package.mkdir(parents=True)
        (package / "__init__.py").write_text("")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(foreign.parent), str(root / site)]), "DBO_RUNTIME_SELF_TIME": "0"}
    code = "import tests.harness.selftime as s; print(s.__file__)"
    proc = subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "Error in sitecustomize" not in proc.stderr, proc.stderr[-2000:]
    assert proc.stdout.strip() == str(root / "tests" / "harness" / "selftime.py")


def _bench_row(monkeypatch: pytest.MonkeyPatch, snapshots: list[list[dict]], switch: str = "1") -> dict:
    """One rep of the runner's bench as a self-timed run makes it (the environment ``plan.bench_env`` gives it), its
    counter snapshots taken from ``snapshots``."""
    from dbo_runtime.harness import runner
    from tests.e2e import plan
    from tests.harness.engine_runner import ROW_HOOK_ENV, bench_row

    class Params:
        def __init__(self, **kw: object) -> None:
            self.max_tokens = kw["max_tokens"]

    class LLM:
        def generate(self, batch: list[object], params: Params, use_tqdm: bool = False) -> None:
            time.sleep(0.0 if params.max_tokens == 1 else 0.01)

    seq = iter(snapshots)
    monkeypatch.setattr(runner, "_stats", lambda llm: next(seq))
    monkeypatch.setenv(selftime.ENV, switch)
    monkeypatch.setenv(ROW_HOOK_ENV, plan.bench_env({selftime.ENV: switch})[ROW_HOOK_ENV])
    bench = {"max_tokens": 8, "reps": 1, "warmup": 0}
    [row] = runner.bench_reps(LLM(), Params, [1, 2], bench, 0, 1, bench_row(2))["reps"]
    return row


def test_a_self_timed_bench_reports_zero_plugin_time_as_measured(monkeypatch: pytest.MonkeyPatch) -> None:
    """Self-time counters that stay 0 in a self-timed run are a measurement (the plugin ran nothing), not a gap;
    with the switch off they measured nothing and the row says nothing."""
    stats = [{"summary": {"microbatched_builds": 0, "self_time_ns": 0}}]
    assert _bench_row(monkeypatch, [stats] * 3)["plugin_self_us_per_step"] == 0.0
    assert "plugin_self_us_per_step" not in _bench_row(monkeypatch, [stats] * 3, switch="0")


def test_a_self_timed_bench_reports_the_collections_inside_plugin_code_per_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """The self-timer counts garbage collections that started inside plugin code: per decode step, as the T-token
    pass minus the 1-token pass, like the self time they are part of."""

    def stats(ns: int, gc_n: int, gc_ns: int) -> list[dict]:
        summary = {"microbatched_builds": 0, "self_time_ns": ns, "self_time_calls": 0, "self_time_gc_count": gc_n, "self_time_gc_ns": gc_ns}
        return [{"summary": summary, "self_time": {}}]

    # a 1-token pass with one 40 us collection, then an 8-token pass with eight more (7 decode steps: 1 a step)
    row = _bench_row(monkeypatch, [stats(0, 0, 0), stats(50_000, 1, 40_000), stats(400_000, 9, 360_000)])
    assert row["plugin_gc_per_step"] == 1.0 and row["plugin_gc_us_per_step"] == 40.0


def test_an_empty_hook_is_timed_in_situ_and_kept_out_of_the_totals() -> None:
    """The warm calibration misses what the clock costs in the caches a hook meets inside a step: every
    ``SAMPLE_EVERY``-th outermost hook is preceded at its site by an empty hook of its kind, reported apart and
    subtracted by the in-situ net figure."""

    class Holder:
        x = selftime.time_plugin(selftime._Plain(), "test.access")

    hook = selftime.time_plugin(lambda: None, "test.call")
    holder = Holder()
    holder.x = 1
    before = selftime.snapshot(calibrate=False)

    def run() -> None:  # a fresh thread: its count of outermost hooks starts at 0
        for _ in range(2 * selftime.SAMPLE_EVERY):
            hook()
        for _ in range(2 * selftime.SAMPLE_EVERY):
            holder.x  # noqa: B018

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    after = selftime.snapshot(calibrate=False)
    assert after["calls"] - before["calls"] == 4 * selftime.SAMPLE_EVERY  # the empty hooks are not counted
    assert [after["in_situ_null"][k][0] - before["in_situ_null"][k][0] for k in ("call", "access")] == [2, 2]
    assert selftime.NULL_CALL not in after["by_patch"] and selftime.NULL_ACCESS not in after["ns_by_patch"]
    worker = {"self_time": {"kinds": {"f": "function", "d": "descriptor"}}}
    null = {"call": [10.0, 20_000.0], "access": [20.0, 20_000.0]}  # per decode step: 2 us a call, 1 us an access
    assert selftime.net_self_us(20.0, {"f": 4, "d": 6}, [worker], null) == pytest.approx(20.0 - 8.0 - 6.0)
    assert selftime.net_self_us(20.0, {"f": 4}, [worker], {"call": [0.0, 0.0], "access": [0.0, 0.0]}) is None
    assert selftime.net_self_us(20.0, {"d": 4}, [worker], {"call": [10.0, 20_000.0], "access": [0.0, 0.0]}) is None  # none timed


def test_a_self_timed_bench_subtracts_the_empty_hooks_of_the_same_decode_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    """The in-situ charge is taken over the decode steps it is subtracted from (T-token pass less 1-token pass),
    not over the process's life (its profile run, captures and prefills)."""

    def stats(ns: int, calls: int, null: tuple[int, int, int, int]) -> list[dict]:
        names = ("self_time_null_call_n", "self_time_null_call_ns", "self_time_null_access_n", "self_time_null_access_ns")
        summary = {"microbatched_builds": 0, "self_time_ns": ns, "self_time_calls": calls, **dict(zip(names, null, strict=True))}
        return [{"summary": summary, "self_time": {"by_patch": {"f": calls}, "kinds": {"f": "function"}}}]

    # start-up charged 10 empty calls 50 us each; later each costs 1 us: a pass of 8 calls and 1 empty call, then 8 of them
    before, one, full = (0, 0, (10, 500_000, 0, 0)), (10_000, 8, (11, 501_000, 0, 0)), (90_000, 72, (19, 509_000, 0, 0))
    row = _bench_row(monkeypatch, [stats(*before), stats(*one), stats(*full)])
    assert row["plugin_self_us_per_step"] == 10.0 and row["plugin_calls_per_step"] == 8.0
    assert row["plugin_self_in_situ_net_us_per_step"] == pytest.approx(10.0 - 8 * 1.0)
