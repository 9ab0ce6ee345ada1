"""``tools/gpu/collect_records.py``: bad input is one line and exit 2, before anything is written (a file name is
built from ``--date`` and ``--run``, so neither may leave the docs folder)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tools" / "gpu" / "collect_records.py"


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120, cwd=ROOT)


@pytest.fixture
def runs(tmp_path: Path) -> Path:
    (tmp_path / "runs" / "job").mkdir(parents=True)
    (tmp_path / "runs" / "job" / "record.json").write_text(json.dumps({"label": "job", "ok": True}))
    return tmp_path / "runs"


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        (["--date", "../../escape"], "argument --date: '../../escape' is not allowed"),
        (["--date", ""], "argument --date: '' is not allowed"),
        (["--date", "2026-99-99"], "argument --date: '2026-99-99' is not allowed"),
        (["--date", "2026-12-02", "--run", "a/b"], "argument --run: 'a/b' is not allowed"),
    ],
)
def test_a_file_name_part_that_is_not_a_date_or_a_tag_is_refused(runs: Path, tmp_path: Path, extra: list[str], named: str) -> None:
    proc = run(str(runs), str(tmp_path / "docs"), *extra)
    assert proc.returncode == 2 and named in proc.stderr, proc.stderr
    assert not (tmp_path / "docs").exists() and not list(tmp_path.parent.glob("escape*"))


def test_a_missing_empty_or_unreadable_run_folder_writes_nothing(runs: Path, tmp_path: Path) -> None:
    docs = tmp_path / "docs"
    proc = run(str(tmp_path / "nope"), str(docs), "--date", "2026-12-02")
    assert proc.returncode == 2 and "argument run_dir" in proc.stderr
    (tmp_path / "empty").mkdir()
    proc = run(str(tmp_path / "empty"), str(docs), "--date", "2026-12-02")
    assert proc.returncode == 2 and "holds no run" in proc.stderr
    (runs / "job" / "record.json").write_text("[1]")
    proc = run(str(runs), str(docs), "--date", "2026-12-02")
    assert proc.returncode == 2 and "cannot be read back" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert not docs.exists()


def test_a_record_is_written_under_its_date_and_run(runs: Path, tmp_path: Path) -> None:
    docs = tmp_path / "docs"
    proc = run(str(runs), str(docs), "--date", "2026-12-02", "--run", "lease13")
    assert proc.returncode == 0, proc.stderr
    [written] = docs.iterdir()
    assert written.name == "2026-12-02-lease13-real-engine-job.json"
    assert json.loads(written.read_text())["run"] == "lease13"
    (tmp_path / "file").write_text("")
    proc = run(str(runs), str(tmp_path / "file"), "--date", "2026-12-02")
    assert proc.returncode == 2 and "argument docs_dir" in proc.stderr


def test_an_option_given_twice_is_one_line_and_writes_nothing(runs: Path, tmp_path: Path) -> None:
    """argparse would file the records under the last ``--date`` without a word about the first."""
    proc = run(str(runs), str(tmp_path / "docs"), "--date", "2026-12-02", "--date=2026-12-03")
    assert proc.returncode == 2 and proc.stdout == ""
    [line] = proc.stderr.strip().splitlines()
    assert line == (
        "collect_records.py: error: argument --date: given twice ('2026-12-02', then '2026-12-03'); give it once "
        "(see collect_records.py --help)"
    )
    assert not (tmp_path / "docs").exists()
