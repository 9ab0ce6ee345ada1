"""``tools/gpu/collect_records.py``: a session's runs become compact JSON lines in ``docs/records/<family>.jsonl``
(device, release, date, command, numbers; no tokens or logs); bad input is one line and exit 2, nothing written."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tools" / "gpu" / "collect_records.py"
COMMAND = "python -m pytest tests/e2e -m e2e"


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120, cwd=ROOT)


def _job(runs: Path, label: str, record: dict) -> None:
    (runs / label).mkdir(parents=True)
    (runs / label / "record.json").write_text(json.dumps({"label": label, **record}))


@pytest.fixture
def runs(tmp_path: Path) -> Path:
    engine = {"ok": True, "device": "NVIDIA H100 80GB HBM3", "vllm_version": "0.34.0", "dp": 1, "microbatched_steps": 35,
              "requests": [{"tokens": [1, 2]}], "plugin_log_lines": ["a", "b"], "engine_args": ["--model", "m"]}  # fmt: skip
    _job(tmp_path / "runs", "1gpu-x-plugin", engine)
    by_patch = {"plugin_calls_per_step_by_patch": {"indexer": 2.0, "topk": 0}}
    reps = [{"rep": 0, "warmup": True, "decode_step_ms": 9.0, "plugin_calls_per_step_by_patch": {"indexer": 50.0}},
            {"rep": 1, "warmup": False, "decode_step_ms": 9.4123456, "jit_in_step": 0, "log": "x", **by_patch},
            {"rep": 2, "warmup": False, "decode_step_ms": 9.5, "jit_in_step": 0, "plugin_calls_per_step_by_patch": {"indexer": 4.0}}]  # fmt: skip
    _job(tmp_path / "runs", "glm53-6L-eager-dbo-off-plugin", {**engine, "meta": {"what": "bench_host_cost"}, "bench": [{"requests": 32, "reps": reps}]})
    return tmp_path / "runs"


def test_runs_become_compact_lines_of_their_family(runs: Path, tmp_path: Path) -> None:
    out = tmp_path / "records"
    proc = run(str(runs), "--records", str(out), "--date", "2026-12-06", "--command", COMMAND, "--dp-emulated")
    assert proc.returncode == 0, proc.stderr
    [e2e] = [json.loads(line) for line in (out / "e2e.jsonl").read_text().splitlines()]
    assert e2e["device"] == "NVIDIA H100 80GB HBM3" and e2e["vllm"] == "0.34.0" and e2e["date"] == "2026-12-06"
    assert e2e["command"] == COMMAND and e2e["dp_emulated"] is True and e2e["microbatched_steps"] == 35
    assert "requests" not in e2e and "engine_args" not in e2e and e2e["plugin_log_lines"] == 2
    [cost] = [json.loads(line) for line in (out / "host-cost.jsonl").read_text().splitlines()]
    assert cost["bench"][0]["reps"] == [{"decode_step_ms": 9.412, "jit_in_step": 0}, {"decode_step_ms": 9.5, "jit_in_step": 0}]
    assert cost["bench"][0]["by_patch_median"] == {"calls_per_step": {"indexer": 3.0}}  # timed reps only, zeros dropped
    assert run(str(runs), "--records", str(out), "--date", "2026-12-07", "--command", COMMAND).returncode == 0
    assert len((out / "e2e.jsonl").read_text().splitlines()) == 2  # appended, never rewritten


def test_a_run_without_device_or_release_needs_them_given(tmp_path: Path) -> None:
    _job(tmp_path / "runs", "stopped", {"ok": False, "error": "stopped before it wrote a result"})
    out = tmp_path / "records"
    proc = run(str(tmp_path / "runs"), "--records", str(out), "--date", "2026-12-06", "--command", COMMAND)
    assert proc.returncode == 2 and "give --device" in proc.stderr and not out.exists()
    proc = run(str(tmp_path / "runs"), "--records", str(out), "--date", "2026-12-06", "--command", COMMAND,
               "--device", "NVIDIA H200", "--vllm", "0.33.0")  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert json.loads((out / "e2e.jsonl").read_text())["device"] == "NVIDIA H200"


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["--date", "2026-99-99", "--command", COMMAND], "argument --date"),
        (["--date", "2026-12-02"], "--command"),
    ],
)
def test_a_bad_argument_is_one_line_and_exit_2(runs: Path, tmp_path: Path, args: list[str], named: str) -> None:
    proc = run(str(runs), "--records", str(tmp_path / "records"), *args)
    assert proc.returncode == 2 and named in proc.stderr.strip().splitlines()[-1]
    assert not (tmp_path / "records").exists()


def test_a_missing_empty_or_unreadable_run_folder_writes_nothing(runs: Path, tmp_path: Path) -> None:
    out = tmp_path / "records"
    base = ["--records", str(out), "--date", "2026-12-02", "--command", COMMAND]
    assert run(str(tmp_path / "nope"), *base).returncode == 2
    (tmp_path / "empty").mkdir()
    proc = run(str(tmp_path / "empty"), *base)
    assert proc.returncode == 2 and "holds no run" in proc.stderr
    (runs / "1gpu-x-plugin" / "record.json").write_text("[1]")
    proc = run(str(runs), *base)
    assert proc.returncode == 2 and "cannot be read back" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert not out.exists()
