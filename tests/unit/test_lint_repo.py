"""``tools/lint_repo.py`` finds each kind of violation it exists for, and passes a clean checkout.

The repository itself is linted by ``make lint`` / ``make test``; this only checks the tool, on a
planted checkout in a temporary directory. The planted texts are built from pieces so that this file
holds none of them.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LINT = ROOT / "tools" / "lint_repo.py"


def plant(root: Path, *, dirty: bool) -> None:
    (root / "docs").mkdir(parents=True)
    (root / "docs" / "performance.md").write_text("# Performance\n")
    (root / "dbo_runtime").mkdir()
    (root / "tests").mkdir()
    when = "as in " + "run 15" if dirty else "DeepGEMM asserts on a stale schedule"
    (root / "dbo_runtime" / "mod.py").write_text(
        f'"""A module."""\n\nX = "run 15 is data, not prose"\n\n\ndef f() -> int:\n    """{when}."""\n    return 1  # {when}\n'
    )
    sibling = "../sha" + "red/seeds/a.json" if dirty else "docs/performance.md"
    cited = "docs/" + ("missing" if dirty else "performance") + ".md"
    (root / "tests" / "notes.md").write_text(f"See {sibling}.\nAnd {cited}.\n")
    (root / "tests" / "helper.py").write_text("# the value is used" + " to pick a bucket (purpose, not history)\n")
    (root / "docs" / "guide.md").write_text("# Guide\n\nMeasured on " + ("the " + "lease 3 machine" if dirty else "one H200") + ".\n")
    (root / "docs" / "records").mkdir()
    (root / "docs" / "records" / "e2e.jsonl").write_text('{"date": "2026-12-05", "run": "lea' + 'se 3"}\n')  # data: never flagged


def lint(root: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(LINT), "--root", str(root)], capture_output=True, text=True, timeout=60)


def test_a_planted_violation_of_each_kind_is_one_line_and_exit_1(tmp_path: Path) -> None:
    plant(tmp_path, dirty=True)
    proc = lint(tmp_path)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    found = proc.stdout.splitlines()
    assert [line.split(": ", 1)[0] for line in found] == [
        "tests/notes.md:1",  # points outside
        "tests/notes.md:2",  # a doc that does not exist
        "dbo_runtime/mod.py:7",  # history in a docstring
        "dbo_runtime/mod.py:8",  # history in a comment (the string constant on line 3 is data)
        "docs/" + "guide.md:3",  # history in a doc (the records are data)
    ], found
    assert "points outside the repository" in found[0] and "missing.md, which does not exist" in found[1]
    assert all("tells history ('run 15')" in line for line in found[2:4])
    assert "tells history ('lease 3')" in found[4]


def test_a_clean_checkout_passes(tmp_path: Path) -> None:
    plant(tmp_path, dirty=False)
    proc = lint(tmp_path)
    assert (proc.returncode, proc.stdout) == (0, ""), proc.stdout + proc.stderr
