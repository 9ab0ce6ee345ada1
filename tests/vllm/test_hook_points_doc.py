"""``docs/vllm-hook-points.md`` against the vLLM (and torch) installed next to the tests.

The map exists so the code's docstrings can cite facts about vLLM from inside the repository;
it is only worth citing while it is true. Every table has one location column per supported release,
and the installed release's column is checked: the target's last name must stand on a ``file:N`` (after any
decorators), a ``file:N-M`` must be the exact extent of the function, class or property, the full dotted path
must be defined there, and a target marked ``removed`` must not exist. Every patch the plugin installs must be
in the map.
"""

from __future__ import annotations

import importlib
import inspect
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

from dbo_runtime.integration import plugin, releases
from tools.hook_point_lines import locate

DOC = Path(__file__).resolve().parents[2] / "docs" / "vllm-hook-points.md"
HEADER = re.compile(r"^\| target \| (?P<releases>.+) \| relied on \|$")
LOCATION = re.compile(r"^`(?P<file>[\w/.]+\.py):(?P<start>\d+)(?:-(?P<end>\d+))?`$")
REMOVED = "removed"

Location = tuple[str, int, int | None]
"""``(file, first line, last line or None for a single line)``."""


@dataclass(frozen=True)
class Row:
    target: str
    cells: dict[str, Location | None]
    """Release -> where the target is there, or None where it does not exist there."""

    def file(self) -> str:
        """The file the target lives in, from any release that has it (a removed target is looked for there)."""
        return next(loc[0] for loc in self.cells.values() if loc is not None)


def parse(text: str) -> tuple[list[tuple[str, ...]], list[Row]]:
    """Every table's release columns, and every row; a row that does not parse fails here, never silently."""
    columns: list[tuple[str, ...]] = []
    out: list[Row] = []
    current: tuple[str, ...] = ()
    for line in text.splitlines():
        header = HEADER.match(line)
        if header:
            current = tuple(header["releases"].split(" | "))
            columns.append(current)
            continue
        if not line.startswith("| `"):
            continue
        assert current, f"a table row before any release header: {line[:80]}"
        target, *cells = (c.strip() for c in line[1:].split(" | ", len(current) + 1)[: len(current) + 1])
        parsed: dict[str, Location | None] = {}
        for release, text_cell in zip(current, cells, strict=True):
            m = LOCATION.match(text_cell)
            assert m or text_cell == REMOVED, f"{target} {release}: {text_cell!r} is neither `file:N[-M]` nor removed"
            parsed[release] = (m["file"], int(m["start"]), int(m["end"]) if m["end"] else None) if m else None
        assert any(parsed.values()), f"{target} exists in no release"
        out.append(Row(target.strip("`"), parsed))
    return columns, out


def rows() -> list[Row]:
    return parse(DOC.read_text())[1]


def installed_release() -> str | None:
    return releases.identify().release or releases.installed_version()


RELEASE = installed_release()


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


def located() -> list[object]:
    return [pytest.param(r.target, r.cells[RELEASE], id=r.target) for r in rows() if r.cells.get(RELEASE) is not None]


def removed() -> list[object]:
    return [pytest.param(r.target, r.file(), id=r.target) for r in rows() if RELEASE in r.cells and r.cells[RELEASE] is None]


def test_every_table_has_a_column_per_supported_release() -> None:
    columns, table = parse(DOC.read_text())
    assert len(table) >= 50
    assert columns and all(c == releases.SUPPORTED for c in columns), columns
    assert RELEASE in releases.SUPPORTED, f"the installed vLLM ({releases.identify().describe()}) has no column"


def test_a_malformed_cell_fails_the_parse() -> None:
    head = "| target | 0.33.0 | 0.34.0 | relied on |\n|---|---|---|---|\n"
    with pytest.raises(AssertionError, match="neither"):
        parse(head + "| `vllm.x.y` | vLLM 0.34: `vllm/x.py:3` | `vllm/x.py:4` | why |\n")
    assert parse(head + "| `vllm.x.y` | removed | `vllm/x.py:4-9` | why |\n")[1] == [
        Row("vllm.x.y", {"0.33.0": None, "0.34.0": ("vllm/x.py", 4, 9)})
    ]


@pytest.mark.parametrize(("target", "where"), located())
def test_row_points_at_its_target(target: str, where: Location) -> None:
    file, start, end = where
    path = site_packages() / file
    assert path.is_file(), f"{file} is not in the installed package"
    lines = path.read_text().splitlines()
    name = target.rsplit(".", 1)[1]
    assert start <= len(lines)
    at = start
    while lines[at - 1].strip().startswith("@"):  # an extent starts at its decorators, as inspect reports it
        at += 1
    assert name in lines[at - 1], f"{file}:{start} is {lines[at - 1].strip()!r}, not {name}"
    found = locate(site_packages(), file, target)
    assert found is not None, f"{target} is not defined or assigned in {file}"
    assert (found[1] if end is None else (found[0], found[2])) == (start if end is None else (start, end)), found
    if end is None:
        return
    assert start < end <= len(lines)
    obj = resolve(target)
    obj = obj.fget if isinstance(obj, property) else obj
    if inspect.isfunction(obj) or inspect.isclass(obj):
        source, first = inspect.getsourcelines(obj)
        assert (first, first + len(source) - 1) == (start, end), f"{target} spans {first}-{first + len(source) - 1}"


@pytest.mark.parametrize(("target", "file"), removed())
def test_removed_row_does_not_exist(target: str, file: str) -> None:
    assert resolve(target) is None, f"{target} imports in vLLM {RELEASE}, but the map says removed"
    assert locate(site_packages(), file, target) is None, f"{target} is in {file} of vLLM {RELEASE}"


def test_every_installed_patch_is_in_the_map() -> None:
    text = DOC.read_text()
    missing = [p.target for p in plugin.all_patches() if f"`{p.target}`" not in text]
    assert not missing, missing
