"""The repository stands on its own: no file points outside it, and every doc it cites exists.

Files used to cite ``../shared/...`` (a sibling directory of the development machine), an
absolute path of a build machine, and a hook-point document the repository did not have; a
reader of a clone could follow none of them.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCANNED = ["README.md", "Makefile", "pyproject.toml", ".ci", "dbo_runtime", "tests", "graphs", "docs", "requirements"]
RAW_RECORDS = ("docs/gpu-runs/", "graphs/results/")
"""Raw logs and JSON written by GPU runs: records of what ran there, not text a reader follows."""

OUTSIDE = [
    re.compile(r"\.\./shared\b"),
    re.compile(r"(?<![\w.])shared/(?:docs|gpu|hooks|seeds)/"),
    re.compile(r"(?<![\w:])/work/"),
    re.compile(r"(?<![\w:])/home/\w"),
]


def text_files() -> list[Path]:
    out = []
    for entry in SCANNED:
        path = ROOT / entry
        candidates = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
        for p in candidates:
            rel = p.relative_to(ROOT).as_posix()
            if "__pycache__" in rel or rel.startswith(RAW_RECORDS) or p.suffix in {".png", ".pyc", ".whl"}:
                continue
            out.append(p)
    return out


def test_scan_sees_the_files_that_used_to_point_outside() -> None:
    rels = {p.relative_to(ROOT).as_posix() for p in text_files()}
    assert {"README.md", "docs/results.md", "tests/vllm/conftest.py", "tests/fakes/fake_pynvml.py"} <= rels


@pytest.mark.parametrize("pattern", OUTSIDE, ids=lambda p: p.pattern)
def test_no_file_points_outside_the_repository(pattern: re.Pattern[str]) -> None:
    this = Path(__file__).resolve()
    hits = []
    for path in text_files():
        if path.resolve() == this:
            continue
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if pattern.search(line):
                hits.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not hits, "\n".join(hits)


def test_every_cited_doc_exists() -> None:
    cited = re.compile(r"\bdocs/([\w.-]+\.md)\b")
    missing = []
    for path in text_files():
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            for name in cited.findall(line):
                if not (ROOT / "docs" / name).is_file():
                    missing.append(f"{path.relative_to(ROOT)}:{number}: docs/{name}")
    assert not missing, "\n".join(missing)
