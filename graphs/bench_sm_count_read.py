"""What the indexer call site pays to learn DeepGEMM's live SM count, per call, quiet and with a busy thread.

DeepGEMM's ``get_num_sms`` is a torch op, which releases the GIL: another busy Python thread may then hold it for
a whole switch interval. ``LiveNumSms`` reads the count once per write instead. Timed per call: the op (vLLM's
vendored one, else a stand-in of the same schema), ``LiveNumSms.read`` and a plain call, each quiet and with one
spinning thread (read the median and the 99th percentile).

    python graphs/bench_sm_count_read.py [--n 20000] [--out graphs/results]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from graphs._args import add_out, integer, say_written  # noqa: E402
from graphs._plotting import bar_panels  # noqa: E402


def deep_gemm_op() -> tuple[Callable[[], int], str]:
    """vLLM's vendored DeepGEMM ``get_num_sms`` (a torch op) when it loads, else a stand-in op of the same schema."""
    try:
        from vllm.third_party import deep_gemm

        op = deep_gemm.get_num_sms
        op()
        return op, "vllm.third_party.deep_gemm.get_num_sms (torch op)"
    except Exception:
        import torch

        if not hasattr(torch.ops, "dbo_runtime_bench") or not hasattr(torch.ops.dbo_runtime_bench, "get_num_sms"):
            lib = torch.library.Library("dbo_runtime_bench", "DEF")
            lib.define("get_num_sms() -> int")
            lib.impl("get_num_sms", lambda: 132, "CompositeExplicitAutograd")
            _LIBS.append(lib)
        return torch.ops.dbo_runtime_bench.get_num_sms, "stand-in torch op get_num_sms() -> int (torch.library)"


_LIBS: list[Any] = []
"""Keeps the stand-in library registered for the life of the process."""


def _time(fn: Callable[[], Any], n: int) -> dict[str, float]:
    clock = time.perf_counter_ns
    samples = []
    for _ in range(n):
        started = clock()
        fn()
        samples.append(clock() - started)
    samples.sort()
    return {"median_ns": float(samples[n // 2]), "p99_ns": float(samples[min(n - 1, (n * 99) // 100)]),
            "mean_ns": statistics.fmean(samples)}  # fmt: skip


@contextlib.contextmanager
def _spinner() -> Iterator[None]:
    """One other Python thread that always wants the GIL."""
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            pass

    thread = threading.Thread(target=spin, name="bench-spinner", daemon=True)
    thread.start()
    time.sleep(0.05)
    try:
        yield
    finally:
        stop.set()
        thread.join()


def measure(n: int) -> dict[str, Any]:
    from dbo_runtime.adapters.deep_gemm import LiveNumSms

    op, source = deep_gemm_op()
    live = LiveNumSms(lambda: op)
    for writer in LiveNumSms.WRITERS:
        live.watch(writer)

    def plain() -> int:
        return 132

    readers = {"torch op (a read per call)": op, "LiveNumSms.read (writers watched)": live.read, "plain Python call": plain}
    rows = []
    for busy in (False, True):
        for name, fn in readers.items():
            fn()
            with _spinner() if busy else contextlib.nullcontext():
                timing = _time(fn, n)
            rows.append({"reader": name, "other_thread_busy": busy, **timing})
    return {"n": n, "op": source, "rows": rows}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench_sm_count_read", description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=integer(100, 10_000_000), default=20_000, help="calls timed per reader and condition (default 20000)")
    add_out(parser)
    args = parser.parse_args(argv)
    import os

    from tests.harness.report import environment, write_json

    out = Path(args.out)
    doc = {**measure(args.n), "environment": {**environment(), "cpus": os.cpu_count(), "switch_interval_s": sys.getswitchinterval()}}
    write_json(out / "bench_sm_count_read.json", doc)
    print(f"op: {doc['op']}")
    print(f"{'reader':<36} {'busy thread':<11} {'median ns':>10} {'p99 ns':>12} {'mean ns':>12}")
    for r in doc["rows"]:
        print(f"{r['reader']:<36} {r['other_thread_busy']!s:<11} {r['median_ns']:10.0f} {r['p99_ns']:12.0f} {r['mean_ns']:12.0f}")
    labels = [f"{r['reader']}\n({'busy' if r['other_thread_busy'] else 'quiet'})" for r in doc["rows"]]
    panels = [(labels, [r[key] for r in doc["rows"]], f"{key[:-3]} ns per call (log)") for key in ("median_ns", "mean_ns")]
    bar_panels(out / "bench_sm_count_read.png", f"DeepGEMM SM count readers ({doc['op']})", panels, horizontal=True, log=True)
    say_written("bench_sm_count_read", out / "bench_sm_count_read.json", out / "bench_sm_count_read.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
