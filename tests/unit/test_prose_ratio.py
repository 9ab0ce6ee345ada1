"""Product files stay at most 20 % comment and docstring bytes (``tools/prose_ratio.py``): the code says
what it does, the docstrings the contract and why, in a few lines; measurements belong in the docs."""

from __future__ import annotations

from pathlib import Path

from tools import prose_ratio

ROOT = Path(__file__).resolve().parents[2]


def test_every_product_file_is_at_most_a_fifth_prose(capsys):
    assert sorted((ROOT / "dbo_runtime").rglob("*.py")), "no product files found"
    assert prose_ratio.main([]) == 0, capsys.readouterr().out


def test_the_tool_counts_comments_and_docstrings_not_other_strings(tmp_path):
    source = '"""Doc."""\n\nX = "not prose"\n"""Attribute doc."""\n\n\ndef f():  # why\n    return "text"\n'
    path = tmp_path / "m.py"
    path.write_text(source)
    prose = len('"""Doc."""') + len('"""Attribute doc."""') + len("# why")
    assert prose_ratio.prose_bytes(source) == prose
    assert prose_ratio.share(path) == 100.0 * prose / len(source)
    assert prose_ratio.main([str(path), "--limit", "99"]) == 0
    assert prose_ratio.main([str(path)]) == 1


def test_a_package_marker_with_only_its_docstring_is_not_weighed(tmp_path):
    path = tmp_path / "__init__.py"
    path.write_text('"""What this package holds."""\n')
    assert prose_ratio.share(path) == 0.0
