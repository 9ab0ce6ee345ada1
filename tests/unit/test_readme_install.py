"""README's install section says when a plain ``pip install`` keeps the user's torch.

It used to promise "your installed ones are kept" unconditionally; that holds only next to a
vLLM installed with its dependencies. vLLM pins torch exactly, so next to a ``--no-deps`` vLLM
pip installs that torch over the user's. The pin quoted in the README is read here from the
installed vLLM's own metadata, so the sentence stays true for the vLLM the tests run against.
"""

from __future__ import annotations

import re
from importlib import metadata
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"


def install_section() -> str:
    text = README.read_text()
    start = text.index("## Install next to vLLM")
    end = text.index("\n## ", start + 1)
    return text[start:end]


def vllm_torch_pin() -> str:
    pins = [r for r in metadata.requires("vllm") or [] if re.match(r"torch\s*==", r)]
    assert len(pins) == 1, pins
    return pins[0].split("==", 1)[1].split(";")[0].strip()


def test_no_unconditional_promise_to_keep_torch() -> None:
    assert "your installed ones are kept" not in install_section()


def test_names_vllms_torch_pin_and_the_command_that_keeps_torch() -> None:
    section = install_section()
    assert f"torch {vllm_torch_pin()}" in section
    assert "--no-deps" in section and "replacing your torch" in section
    assert "pip install --no-deps /path/to/dbo_runtime" in section
    assert "pip install rich nvidia-ml-py" in section
