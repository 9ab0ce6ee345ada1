"""``docs/vllm-hook-points.md`` against the vLLM 0.33.0 (and torch) installed next to the tests.

The map exists so the code's docstrings can cite facts about vLLM from inside the repository;
it is only worth citing while it is true. Every table row names a target and a ``file:line``:
the target's last name must stand on that line (after any decorators), a ``file:N-M`` must be the exact extent of an
importable function, class or property, and every patch the plugin installs must be in the map.
"""

from __future__ import annotations

import importlib
import inspect
import re
from pathlib import Path

import pytest

from dbo_runtime.integration import plugin

DOC = Path(__file__).resolve().parents[2] / "docs" / "vllm-hook-points.md"
ROW = re.compile(r"^\| `(?P<target>[\w.]+)` \| `(?P<file>[\w/.]+\.py):(?P<start>\d+)(?:-(?P<end>\d+))?` \|")


def rows() -> list[tuple[str, str, int, int | None]]:
    out = []
    for line in DOC.read_text().splitlines():
        m = ROW.match(line)
        if m:
            out.append((m["target"], m["file"], int(m["start"]), int(m["end"]) if m["end"] else None))
    return out


def site_packages() -> Path:
    import vllm

    return Path(vllm.__file__).resolve().parents[1]


def resolve(target: str) -> object | None:
    """The object named by a dotted path, or None where its module does not import here."""
    parts = target.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        try:
            obj: object = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        except Exception:  # a module that needs a GPU build fails with other errors on a CPU box
            return None
        for name in parts[cut:]:
            owner = obj
            obj = vars(owner).get(name, None) if isinstance(owner, type) else getattr(owner, name, None)
            if obj is None:
                return None
        return obj
    return None


def test_the_map_has_rows() -> None:
    assert len(rows()) >= 50


@pytest.mark.parametrize(("target", "file", "start", "end"), rows(), ids=lambda v: v if isinstance(v, str) and "." in v else "")
def test_row_points_at_its_target(target: str, file: str, start: int, end: int | None) -> None:
    path = site_packages() / file
    assert path.is_file(), f"{file} is not in the installed package"
    lines = path.read_text().splitlines()
    name = target.rsplit(".", 1)[1]
    assert start <= len(lines)
    at = start
    while lines[at - 1].strip().startswith("@"):  # an extent starts at its decorators, as inspect reports it
        at += 1
    assert name in lines[at - 1], f"{file}:{start} is {lines[at - 1].strip()!r}, not {name}"
    if end is None:
        return
    assert start < end <= len(lines)
    obj = resolve(target)
    obj = obj.fget if isinstance(obj, property) else obj
    if inspect.isfunction(obj) or inspect.isclass(obj):
        source, first = inspect.getsourcelines(obj)
        assert (first, first + len(source) - 1) == (start, end), f"{target} spans {first}-{first + len(source) - 1}"


def test_every_installed_patch_is_in_the_map() -> None:
    text = DOC.read_text()
    missing = [p.target for p in plugin.all_patches() if f"`{p.target}`" not in text]
    assert not missing, missing
