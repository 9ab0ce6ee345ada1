"""Provenance for every figure and result file of the benches: device, versions, date, command (not the wheel's)."""

from __future__ import annotations

import datetime as _dt
import json
import platform
import sys
from importlib import metadata
from pathlib import Path
from typing import Any


def _dist_version(*names: str) -> str | None:
    for name in names:
        try:
            return f"{name}=={metadata.version(name)}"
        except metadata.PackageNotFoundError:
            continue
    return None


def _vendored_deep_gemm() -> str | None:
    """The version of the DeepGEMM vLLM vendors, read from its file (an import would load CUDA)."""
    import re
    from importlib.util import find_spec

    try:
        spec = find_spec("vllm")
        if spec is None or not spec.origin:
            return None
        init = Path(spec.origin).parent / "third_party" / "deep_gemm" / "__init__.py"
        text = init.read_text(encoding="utf-8", errors="replace")
    except Exception:
        return None
    found = re.search(r"""^__version__\s*=\s*['"]([^'"]+)['"]""", text, re.MULTILINE)
    return f"vllm-vendored deep_gemm=={found.group(1)}" if found else None


def _revision() -> str | None:
    """The checkout's commit (``+dirty`` with local changes); None outside a git checkout."""
    import subprocess

    root = Path(__file__).resolve().parents[2]
    if not (root / ".git").exists():
        return None  # an unpacked tree
    try:
        rev = subprocess.run(["git", "-C", str(root), "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True, timeout=5)
        if rev.returncode != 0:
            return None
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    return rev.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def environment() -> dict[str, Any]:
    import torch

    env: dict[str, Any] = {
        "date": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "deep_gemm": _dist_version("tokenspeed-deepgemm", "deep-gemm", "deep_gemm", "sgl-deep-gemm") or _vendored_deep_gemm(),
        "vllm": _dist_version("vllm"),
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "revision": _revision(),
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        env.update(device=props.name, sms=props.multi_processor_count, capability=f"{props.major}.{props.minor}")
    else:
        env.update(device="cpu", sms=None, capability=None)
    return env


def write_json(path: Path, document: dict[str, Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document, indent=2, default=str) + "\n")
    return path
