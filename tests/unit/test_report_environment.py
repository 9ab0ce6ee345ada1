"""``tests.harness.report.environment``: the versions a GPU result is recorded with."""

from __future__ import annotations

import importlib.util
from importlib import metadata
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.harness import report


def test_deep_gemm_version_falls_back_to_the_copy_vllm_vendors(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM 0.33 ships DeepGEMM inside its wheel (``vllm/third_party/deep_gemm``) with no distribution of
    its own, so a lookup by distribution alone reports ``deep_gemm: null`` next to a working DeepGEMM.
    Reads the real vLLM 0.33.0 here."""
    real = metadata.version

    def version(name: str) -> str:
        if "deep" in name.replace("_", "-"):
            raise metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(metadata, "version", version)
    spec = importlib.util.find_spec("vllm")
    assert spec is not None and spec.origin is not None
    assert (Path(spec.origin).parent / "third_party" / "deep_gemm" / "__init__.py").is_file(), "vLLM 0.33.0 vendors DeepGEMM"
    got = report.environment()["deep_gemm"]
    assert got is not None and got.startswith("vllm-vendored deep_gemm==") and got.split("==")[1][0].isdigit()


def _fake_vllm(tmp_path: Path, content: bytes | None) -> SimpleNamespace:
    pkg = tmp_path / "vllm"
    (pkg / "third_party" / "deep_gemm").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    if content is not None:
        (pkg / "third_party" / "deep_gemm" / "__init__.py").write_bytes(content)
    return SimpleNamespace(origin=str(pkg / "__init__.py"))


@pytest.mark.parametrize(
    ("finder", "expected"),
    [
        (lambda tmp: None, None),  # vLLM not installed
        (lambda tmp: SimpleNamespace(origin=None), None),  # a namespace package
        (lambda tmp: _fake_vllm(tmp, None), None),  # no vendored copy
        (lambda tmp: _fake_vllm(tmp, b"# \xff\xfe not utf-8\n__version__ = '9.1'\n"), "vllm-vendored deep_gemm==9.1"),
        (lambda tmp: _fake_vllm(tmp, b"VERSION = 3\n"), None),  # no version line
    ],
)
def test_vendored_deep_gemm_on_odd_installs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, finder: object, expected: str | None) -> None:
    """Odd installs give an answer, never an exception: an undecodable file raising UnicodeDecodeError
    would cost a benchmark its JSON after the engines ran."""
    spec = finder(tmp_path)  # type: ignore[operator]
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: spec)
    assert report._vendored_deep_gemm() == expected


def test_vendored_deep_gemm_survives_a_broken_finder(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(name: str) -> None:
        raise RuntimeError("a meta-path finder that raises")

    monkeypatch.setattr(importlib.util, "find_spec", broken)
    assert report._vendored_deep_gemm() is None


def test_revision_names_the_checkout_or_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    import subprocess

    root = Path(report.__file__).resolve().parents[2]
    rev = report._revision()
    if (root / ".git").exists():  # CI runs on a clone: the commit is known
        assert rev is not None and len(rev.split("+")[0]) == 12 and all(c in "0123456789abcdef" for c in rev.split("+")[0])
    else:
        assert rev is None

    def missing(*a: object, **k: object) -> None:
        raise FileNotFoundError("git")

    monkeypatch.setattr(subprocess, "run", missing)
    assert report._revision() is None
