"""Installing dbo_runtime never changes the user's vLLM, torch or CUDA wheels, and the CI setup never moves torch.

vLLM pins torch exactly, and pip re-checks the requirements of an installed vLLM whenever it installs
something that depends on it (next to a vLLM installed without its dependencies it even picks another vLLM
release). So dbo_runtime depends on neither: an installed vLLM is judged by its code at engine start. The pip
checks run pip itself, offline, against this venv's real vLLM (the test runs once per supported release);
the setup checks run the real script with a recording stand-in for Python.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]
LOCKS = ("requirements/vllm-cpu-lock.txt", "requirements/dev-lock.txt")
UNTOUCHABLE = re.compile(r"^(vllm|torch|torchvision|torchaudio|triton|cuda-.*|nvidia-(?!ml-py$).*)$")
"""vLLM, torch and the CUDA wheels: what an install of dbo_runtime must never add, replace or remove."""


def package_requirements() -> dict[str, Requirement]:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    return {(r := Requirement(d)).name: r for d in deps}


def lock_lines(path: str) -> list[str]:
    return [ln.strip() for ln in (ROOT / path).read_text().splitlines() if ln.strip() and not ln.startswith("#")]


def test_the_package_asks_for_neither_vllm_nor_torch_nor_a_cuda_wheel() -> None:
    reqs = package_requirements()
    assert not [name for name in reqs if UNTOUCHABLE.match(name.lower())], sorted(reqs)


def _pip_dry_run(tmp_path: Path, *flags: str) -> tuple[subprocess.CompletedProcess[str], list[str]]:
    report = tmp_path / "report.json"
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--dry-run", "--no-index", "--no-build-isolation",
         "--disable-pip-version-check", "-q", "--report", str(report), *flags, str(ROOT)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    names = [i["metadata"]["name"] for i in json.loads(report.read_text())["install"]] if proc.returncode == 0 else []
    return proc, names


def test_pip_install_next_to_this_vllm_adds_only_dbo_runtime(tmp_path: Path) -> None:
    """``pip install /path/to/dbo_runtime``, plain and ``--no-deps``, next to this venv's vLLM release: pip
    (offline, so it can only keep what is installed) plans to install dbo-runtime and nothing else."""
    for flags in ((), ("--no-deps",)):
        proc, names = _pip_dry_run(tmp_path, *flags)
        assert proc.returncode == 0, (flags, proc.stderr[-2000:])
        assert names == ["dbo-runtime"], (flags, names)
        assert not [n for n in names if UNTOUCHABLE.match(n.lower())]
    assert metadata.version("vllm") in ("0.33.0", "0.34.0")


def test_every_lock_pins_exactly_and_leaves_vllm_out() -> None:
    """Each lock line is one exact pin, no package is pinned in both locks, the CPU lock pins torch once,
    and vLLM is not in a lock: the setup installs it on its own, without dependencies."""
    names: list[str] = []
    for path in LOCKS:
        for line in lock_lines(path):
            req = Requirement(line)
            assert [s.operator for s in req.specifier] == ["=="] and req.marker is None, f"{path}: {line}"
            names.append(req.name.lower())
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)
    assert [Requirement(ln).name for ln in lock_lines(LOCKS[0])].count("torch") == 1
    assert "vllm" not in names


RECORDER = """#!{python}
import json, os, shutil, sys
args = sys.argv[1:]
if args[:2] == ["-m", "venv"]:  # the setup's base Python: make the venv's python this recorder
    os.makedirs(os.path.join(args[2], "bin"), exist_ok=True)
    shutil.copy(__file__, os.path.join(args[2], "bin", "python"))
    sys.exit(0)
with open(os.environ["RECORD"], "a") as out:
    out.write(json.dumps(args) + "\\n")
missing = os.environ.get("MISSING_WHEEL")
if missing and "-r" in args and args[args.index("-r") + 1] == "requirements/vllm-cpu-lock.txt":
    print(f"ERROR: No matching distribution found for {{missing}}", file=sys.stderr)
    sys.exit(1)
"""


def run_setup(tmp_path: Path, **env: str) -> list[list[str]]:
    """``.ci/setup-venv`` with a stand-in Python that records every call instead of installing."""
    stub = tmp_path / "python-stub"
    stub.write_text(RECORDER.format(python=sys.executable))
    stub.chmod(0o755)
    record = tmp_path / "calls.jsonl"
    record.write_text("")
    proc = subprocess.run(
        ["bash", str(ROOT / ".ci" / "setup-venv")],
        env={**os.environ, "VENV": str(tmp_path / "venv"), "PYTHON": str(stub), "RECORD": str(record),
             "VLLM": metadata.version("vllm"), **env},
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    return [json.loads(line) for line in record.read_text().splitlines()]


def pip_installs(calls: list[list[str]]) -> list[list[str]]:
    return [c[3:] for c in calls if c[:3] == ["-m", "pip", "install"]]


def test_setup_installs_every_lock_and_vllm_without_dependencies(tmp_path: Path) -> None:
    installs = pip_installs(run_setup(tmp_path))
    assert installs and all("--no-deps" in args for args in installs), installs
    installed = [a for args in installs for a in args]
    assert all(lock in installed for lock in LOCKS)
    assert f"vllm=={metadata.version('vllm')}" in installed  # the release the venv is for, VLLM=
    assert not any(a.startswith("torch") for a in installed)  # torch comes from the lock, pinned


def test_setup_without_the_locks_torch_wheel_installs_an_exact_torch_and_the_rest_without_dependencies(
    tmp_path: Path,
) -> None:
    """Where the lock's CPU torch wheel is missing, the one install with dependencies is an exact torch;
    the rest of the lock still goes in ``--no-deps``, less its torch line."""
    [locked_torch] = [ln for ln in lock_lines(LOCKS[0]) if Requirement(ln).name == "torch"]
    installs = pip_installs(run_setup(tmp_path, MISSING_WHEEL=locked_torch))
    with_deps = [args for args in installs if "--no-deps" not in args]
    assert len(with_deps) == 1, with_deps
    [torch_pin] = [a for a in with_deps[0] if not a.startswith("-")]
    assert [s.operator for s in Requirement(torch_pin).specifier] == ["=="] and Requirement(torch_pin).name == "torch"
    rest = tmp_path / "venv" / "lock-without-torch.txt"
    assert ["-r", str(rest)] == next(args[-2:] for args in installs if str(rest) in args)
    assert lock_lines(str(rest)) == [ln for ln in lock_lines(LOCKS[0]) if ln != locked_torch]


def test_setup_does_nothing_while_the_locks_and_pyproject_are_unchanged(tmp_path: Path) -> None:
    """The stamp keyed on the locks and pyproject.toml makes a second setup of the same venv install nothing."""
    assert run_setup(tmp_path) != []
    assert run_setup(tmp_path) == []
