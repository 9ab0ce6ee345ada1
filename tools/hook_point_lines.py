"""Finds where each row of ``docs/vllm-hook-points.md`` stands in a vLLM source tree, by reading its AST.

Run ``python tools/hook_point_lines.py ROOT`` (``ROOT`` holds ``vllm/``, e.g. an unpacked wheel or a
``site-packages``) to print, per row, the cell a new release column would get: ``file:N`` or ``file:N-M`` in the
shape of the row's newest located cell, or ``removed``. It proposes; the reviewer reads the code behind each
"relied on" before writing the column.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "vllm-hook-points.md"


def qualname(root: Path, target: str) -> list[str]:
    """The names after the longest module prefix of ``target`` that is a file or package under ``root``."""
    parts = target.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        base = root.joinpath(*parts[:cut])
        if base.with_suffix(".py").is_file() or (base / "__init__.py").is_file():
            return parts[cut:]
    return parts[1:]


def _body(nodes: list[ast.stmt]) -> Iterator[ast.stmt]:
    """Statements of a scope, looking into ``if``/``try`` blocks (conditional definitions), not ``if TYPE_CHECKING:``."""
    for node in nodes:
        yield node
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            continue
        if isinstance(node, ast.If | ast.Try):
            for block in (node.body, node.orelse, getattr(node, "handlers", []), getattr(node, "finalbody", [])):
                for inner in block:
                    yield from _body(inner.body if isinstance(inner, ast.ExceptHandler) else [inner])


def _binding(scope: list[ast.stmt], name: str, in_class: bool) -> tuple[int, int] | None:
    """Where ``name`` is assigned or imported in a scope, or (in a class) first assigned to ``self.name``."""
    for node in _body(scope):
        if isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                return node.lineno, node.lineno
        if isinstance(node, ast.ImportFrom):
            for alias in node.names:
                if (alias.asname or alias.name) == name:
                    return alias.lineno, alias.lineno
    for node in ast.walk(ast.Module(body=scope, type_ignores=[])):
        if isinstance(node, ast.Dict) and not in_class:  # e.g. vllm.envs' table of lazy variables
            for key, value in zip(node.keys, node.values):
                if isinstance(key, ast.Constant) and key.value == name:
                    return key.lineno, value.end_lineno or value.lineno
    if in_class:
        hits = [
            t.lineno
            for node in ast.walk(ast.Module(body=scope, type_ignores=[]))
            if isinstance(node, ast.Assign | ast.AnnAssign)
            for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
            if isinstance(t, ast.Attribute) and t.attr == name and isinstance(t.value, ast.Name) and t.value.id == "self"
        ]
        if hits:
            return min(hits), min(hits)
    return None


def locate(root: Path, file: str, target: str) -> tuple[int, int, int] | None:
    """``(extent start, name line, extent end)`` of ``target`` in ``root/file``, or None where it is not there.

    A definition spans its decorators to its last line; a binding (assignment, import, ``self.x =``) is one line.
    """
    path = root / file
    if not path.is_file():
        return None
    scope = ast.parse(path.read_text()).body
    names = qualname(root, target)
    for depth, name in enumerate(names):
        last = depth == len(names) - 1
        found = next(
            (n for n in _body(scope) if isinstance(n, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and n.name == name),
            None,
        )
        if found is not None and (last or isinstance(found, ast.ClassDef)):
            if last:
                start = min([d.lineno for d in found.decorator_list] + [found.lineno])
                return start, found.lineno, found.end_lineno or found.lineno
            scope = found.body
            continue
        if not last:
            return None
        line = _binding(scope, name, in_class=depth > 0)
        return None if line is None else (line[0], line[0], line[1])
    return None


def cell(root: Path, file: str, target: str, span: bool) -> str:
    where = locate(root, file, target)
    if where is None:
        return "removed"
    start, at, end = where
    return f"{file}:{start}-{end}" if span else f"{file}:{at}"


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: hook_point_lines.py ROOT", file=sys.stderr)
        return 2
    root = Path(argv[0])
    sys.path.insert(0, str(ROOT))
    from tests.vllm.test_hook_points_doc import rows

    for row in rows():
        file, _start, end = next(loc for loc in reversed(row.cells.values()) if loc is not None)
        print(f"{row.target}\t{cell(root, file, row.target, end is not None)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
