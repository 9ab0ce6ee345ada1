"""Fingerprints of the vLLM code each patch relies on (its *anchors*), read from source without importing it, since
the front-end guard must know before any worker imports it: a patch installs only where they equal those recorded
for this release (trusted by code, not version). Comments and formatting do not count, decorators do."""

from __future__ import annotations

import ast
import functools
import hashlib
import importlib.util
import json
import pathlib
import sys
import textwrap
from collections.abc import Iterable, Sequence

MISSING = "missing"
"""The fingerprint of an anchor whose file, class or function does not exist."""
EXCLUDED = "excluded"
"""Recorded for a patch left out of a release's set on purpose: never compared or installed there."""
OUT_OF_SET = (MISSING, EXCLUDED)
RECORD = pathlib.Path(__file__).with_name("recorded_fingerprints.json")
try:  # an import error here would make vLLM skip the plugin (guard included): fail at register instead
    RELEASES: dict[str, dict[str, str]] = json.loads(RECORD.read_text(encoding="utf-8"))
    RECORD_PROBLEM = ""
except (OSError, ValueError) as _exc:
    RELEASES, RECORD_PROBLEM = {}, f"{RECORD.name} unreadable ({_exc!r})"


@functools.lru_cache(maxsize=1)
def _vllm_root() -> pathlib.Path | None:
    """The importable ``vllm`` package directory (``tools/record_release.py`` reads another one instead)."""
    module = sys.modules.get("vllm")
    origin = getattr(module, "__file__", None) if module is not None else None
    if origin is None:
        spec = importlib.util.find_spec("vllm")
        origin = spec.origin if spec is not None else None
    return pathlib.Path(origin).parent if origin else None


def module_file(module: str) -> pathlib.Path | None:
    """The source file of a ``vllm.*`` module, found by path."""
    root = _vllm_root()
    if root is None or not module.startswith("vllm."):
        return None
    base = root.joinpath(*module.split(".")[1:])
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


@functools.lru_cache(maxsize=64)
def read_source(module: str) -> str | None:
    """The module's source text (cached; tests replace this function)."""
    path = module_file(module)
    if path is None:
        return None
    try:
        return path.read_text(encoding="utf-8")
    except OSError:
        return None


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def _find_block(lines: Sequence[str], start: int, stop: int, name: str, indent: int) -> tuple[int, int] | None:
    """``(first, end)`` line indices of ``def name`` / ``class name`` at ``indent``."""
    prefixes = (f"def {name}(", f"async def {name}(", f"class {name}(", f"class {name}:")
    for i in range(start, stop):
        line = lines[i]
        if _indent(line) != indent or not line.lstrip().startswith(prefixes):
            continue
        end = i + 1
        while end < stop:
            text = lines[end]
            stripped = text.strip()
            # the block ends at the first code line back at its own indentation
            # bracket there still belongs to a multi-line signature.
            if stripped and not stripped.startswith("#") and _indent(text) <= indent and stripped[0] not in ")]}":
                break
            end += 1
        return i, end
    return None


def _decorated_from(lines: Sequence[str], first: int, indent: int) -> int:
    """The first decorator line of the block at ``first`` (a decorator decides what the name is bound to)."""
    start = first
    for i in range(first - 1, -1, -1):
        stripped = lines[i].strip()
        if not stripped or stripped.startswith("#") or _indent(lines[i]) > indent:
            continue
        if _indent(lines[i]) < indent or not (stripped.startswith("@") or stripped[0] in ")]}"):
            break
        if stripped.startswith("@"):
            start = i
    return start


def source_block(module: str, qualname: str) -> str | None:
    """The source of ``qualname`` in ``module``, its decorators included, or None."""
    text = read_source(module)
    if text is None:
        return None
    lines = text.splitlines()
    start, stop, indent = 0, len(lines), 0
    span: tuple[int, int] | None = None
    for part in qualname.split("."):
        span = _find_block(lines, start, stop, part, indent)
        if span is None:
            return None
        start, stop = span[0] + 1, span[1]
        body = next((ln for ln in lines[start:stop] if ln.strip() and not ln.strip().startswith((")", "#"))), None)
        indent = _indent(body) if body is not None else indent + 4
    assert span is not None
    first = _decorated_from(lines, span[0], _indent(lines[span[0]]))
    return "\n".join(lines[first : span[1]])


_VERSION_FIELDS = frozenset({"type_params", "type_comment", "kind"})
"""AST fields that depend on the Python version parsing the code, not on the code."""


def _joined_values(values: list[object]) -> list[object]:
    """An f-string's parts without empty constants, adjacent constants merged (differs across Pythons)."""
    out: list[object] = []
    for value in values:
        if isinstance(value, ast.Constant) and isinstance(value.value, str):
            if not value.value:
                continue
            last = out[-1] if out else None
            if isinstance(last, ast.Constant) and isinstance(last.value, str):
                out[-1] = ast.Constant(value=last.value + value.value)
                continue
        out.append(value)
    return out


def canonical_dump(node: object) -> str:
    """``ast.dump`` that renders the same for the same code on every Python vLLM supports."""
    if isinstance(node, ast.AST):
        parts = []
        for name, value in ast.iter_fields(node):
            if isinstance(node, ast.JoinedStr) and name == "values":
                value = _joined_values(value)
            if name in _VERSION_FIELDS or value is None or value == []:
                continue
            parts.append(f"{name}={canonical_dump(value)}")
        return f"{type(node).__name__}({', '.join(parts)})"
    if isinstance(node, list):
        return "[" + ", ".join(canonical_dump(item) for item in node) + "]"
    return repr(node)


def fingerprint_text(block: str | None) -> str:
    if block is None:
        return MISSING
    try:
        canonical = canonical_dump(ast.parse(textwrap.dedent(block)))
    except SyntaxError:
        canonical = "\n".join(line.rstrip() for line in block.splitlines())
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


@functools.lru_cache(maxsize=256)
def anchor_fingerprint(anchor: str) -> str:
    module, _, qualname = anchor.partition(":")
    return fingerprint_text(source_block(module, qualname))


def fingerprint(anchors: Iterable[str]) -> str:
    """One hash over every ``module:qualname`` anchor (any missing anchor makes it ``MISSING``)."""
    parts = []
    for anchor in anchors:
        one = anchor_fingerprint(anchor)
        if one == MISSING:
            return MISSING
        parts.append(one)
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


@functools.lru_cache(maxsize=128)
def parsed(module: str, qualname: str = "") -> ast.AST | None:
    """The parsed ``qualname`` of ``module`` (the whole module for ``""``), or None; read-only (cached)."""
    text = read_source(module) if not qualname else source_block(module, qualname)
    if text is None:
        return None
    try:
        tree = ast.parse(textwrap.dedent(text))
    except SyntaxError:
        return None
    return tree.body[0] if qualname and tree.body else tree


def _defines(body: Iterable[ast.stmt], name: str) -> bool:
    for stmt in body:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and stmt.name == name:
            return True
        targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target] if isinstance(stmt, ast.AnnAssign) else []
        if any(isinstance(t, ast.Name) and t.id == name for t in targets):
            return True
    return False


def has_param(module: str, qualname: str, name: str) -> bool:
    """Whether the function ``qualname`` takes a parameter ``name``."""
    node = parsed(module, qualname)
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return False
    args = node.args
    names = [a.arg for a in (*args.posonlyargs, *args.args, *args.kwonlyargs)]
    names += [a.arg for a in (args.vararg, args.kwarg) if a is not None]
    return name in names


def has_member(module: str, qualname: str, name: str) -> bool:
    """Whether the class ``qualname`` (module for ``""``) defines ``name`` in its own body."""
    node = parsed(module, qualname)
    if isinstance(node, ast.ClassDef):
        return _defines(node.body, name) or any(
            isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id == "self"
            and target.attr == name
            for stmt in node.body
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)) and stmt.name == "__init__"
            for sub in ast.walk(stmt)
            for target in (sub.targets if isinstance(sub, ast.Assign) else [sub.target] if isinstance(sub, ast.AnnAssign) else [])
        )  # fmt: skip
    if isinstance(node, ast.Module):
        return _defines(node.body, name)
    return False


def _named(node: ast.AST, name: str) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == name) or (isinstance(node, ast.Name) and node.id == name)


def uses(module: str, qualname: str, name: str) -> bool:
    """Whether code in ``qualname`` (module for ``""``) reads something named ``name``."""
    node = parsed(module, qualname)
    return node is not None and any(_named(sub, name) for sub in ast.walk(node))


def calls(module: str, qualname: str, name: str) -> bool:
    """Whether code in ``qualname`` (module for ``""``) calls something named ``name``."""
    node = parsed(module, qualname)
    return node is not None and any(isinstance(sub, ast.Call) and _named(sub.func, name) for sub in ast.walk(node))


def clear_caches() -> None:
    read_source.cache_clear()
    parsed.cache_clear()
    anchor_fingerprint.cache_clear()
    _vllm_root.cache_clear()
