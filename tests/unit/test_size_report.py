"""The layout's line limits (``tools/size_report.py``) hold: what runs inside vLLM, the CLI, the package, the
benchmark scripts and the two READMEs stay small enough for a newcomer to read."""

from __future__ import annotations

import shutil
from pathlib import Path

from tools import size_report

ROOT = Path(__file__).resolve().parents[2]


def test_every_part_is_within_its_limit(capsys):
    assert size_report.main(["--root", str(ROOT)]) == 0, capsys.readouterr().out
    out = capsys.readouterr().out
    assert len(out.splitlines()) == len(size_report.LIMITS)
    assert "vLLM imports: " in out and " 0 lines" not in out  # the entry points were found and counted


def test_a_part_over_its_limit_fails(tmp_path, capsys):
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, tmp_path / name)
    for folder in ("dbo_runtime", "graphs", "tools/gpu"):
        shutil.copytree(ROOT / folder, tmp_path / folder, ignore=shutil.ignore_patterns("__pycache__", "results"))
    (tmp_path / "tools/gpu/README.md").write_text("line\n" * (size_report.LIMITS["tools/gpu/README.md"] + 1))
    assert size_report.main(["--root", str(tmp_path)]) == 1
    assert "tools/gpu/README.md: 41 lines (limit 40)  OVER" in capsys.readouterr().out
