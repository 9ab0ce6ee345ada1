"""``graphs/bench_sm_count_read.py``: the three readers of DeepGEMM's SM count, quiet and with a busy thread."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_benchmark_times_each_reader_quiet_and_busy(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "graphs" / "bench_sm_count_read.py"), "--n", "100", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    doc = json.loads((tmp_path / "bench_sm_count_read.json").read_text())
    cells = {(r["reader"], r["other_thread_busy"]) for r in doc["rows"]}
    readers = {"torch op (a read per call)", "LiveNumSms.read (writers watched)", "plain Python call"}
    assert cells == {(r, busy) for r in readers for busy in (False, True)}
    assert "torch op" in doc["op"] and doc["environment"]["switch_interval_s"] > 0
    for r in doc["rows"]:
        assert 0 < r["median_ns"] <= r["p99_ns"] and r["mean_ns"] > 0
