"""The package's import graph keeps one direction, so each layer can be read, tested and loaded alone.

``integration`` (the only code that names vLLM) -> ``services`` -> ``core``; ``adapters`` wrap third-party
GPU knobs beneath services. The tools around the plugin (``harness``, ``sim``, ``cli``) sit above it, and
nothing inside the plugin reaches up to them or into ``tests``. Every ``import`` counts, at module level
or inside a function, and so does a string that names one of the package's modules (``importlib.import_module``,
``sys.modules.get``): a hidden or dynamic import that goes upward still ties the layers together, it only
hides the tie until the code runs.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "dbo_runtime"

ALLOWED = {
    "core": {"core"},
    "adapters": {"adapters", "core"},
    "services": {"services", "adapters", "core"},
    "integration": {"integration", "services", "adapters", "core"},
    "sim": {"sim", "services", "adapters", "core"},
    "harness": {"harness", "integration", "services", "adapters", "core"},
    "cli": {"cli", "harness", "sim", "integration", "services", "adapters", "core"},
    "__main__": {"cli"},
}
"""Layer -> the layers its modules may import (the package root, which holds only the version, is free)."""
CORE_NEVER_AT_MODULE_LEVEL = ("vllm", "deep_gemm", "deep_ep")
"""The core stays importable on a box without them: it is pure policy and value types."""


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted((ROOT / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


MODULES = _modules()


def _imports(name: str) -> list[tuple[str, bool]]:
    """(imported module, at module level) for every import statement of ``name``, relative ones resolved."""
    path = MODULES[name]
    tree = ast.parse(path.read_text(), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    nested = {id(n) for fn in ast.walk(tree) if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef) for n in ast.walk(fn)}
    out = []
    for node in ast.walk(tree):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            submodules = [f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in MODULES]
            targets = submodules or [base]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in MODULES:
            targets = [node.value]
        out.extend((target, id(node) not in nested) for target in targets)
    return out


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _internal(target: str) -> str | None:
    """The package module that ``target`` names, or None for anything outside the package."""
    while target and target not in MODULES:
        target = target.rpartition(".")[0]
    return target or None


def _graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {name: set() for name in MODULES}
    for name in MODULES:
        for target, _ in _imports(name):
            inner = _internal(target)
            if inner and inner != name and inner != PACKAGE:
                graph[name].add(inner)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_every_module_has_a_layer():
    layers = {_layer(name) for name in MODULES if name != PACKAGE}
    assert layers <= set(ALLOWED), f"modules outside every known layer: {sorted(layers - set(ALLOWED))}"


def test_no_import_cycle_among_the_package_modules():
    cycles = _cycles(_graph())
    assert not cycles, "import cycles (module and function-level imports):\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_each_layer_imports_only_downward():
    upward = []
    for name in MODULES:
        if name == PACKAGE:
            continue
        for target, _ in _imports(name):
            inner = _internal(target)
            if inner and inner != PACKAGE and _layer(inner) not in ALLOWED[_layer(name)]:
                upward.append(f"{name} imports {inner}")
    assert not upward, "imports against the layering:\n" + "\n".join(sorted(set(upward)))


def test_the_core_imports_no_vllm_or_deepgemm_at_module_level():
    found = [
        f"{name} imports {target}"
        for name in MODULES
        if _layer(name) == "core"
        for target, module_level in _imports(name)
        if module_level and target.split(".")[0] in CORE_NEVER_AT_MODULE_LEVEL
    ]
    assert not found, "\n".join(found)


def test_nothing_in_the_package_imports_the_tests():
    found = [f"{name} imports {target}" for name in MODULES for target, _ in _imports(name) if target.split(".")[0] == "tests"]
    assert not found, "\n".join(found)


def test_the_walk_sees_function_level_and_relative_imports(tmp_path, monkeypatch):
    """The checks above are only as good as the walk: it must see an import hidden inside a function."""
    package = tmp_path / PACKAGE / "core"
    package.mkdir(parents=True)
    (tmp_path / PACKAGE / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("def f():\n    from dbo_runtime.integration import b\n    from . import c\n")
    (package / "d.py").write_text("import importlib\nM = importlib.import_module('dbo_runtime.core.c')\n")
    (tmp_path / PACKAGE / "integration").mkdir()
    (tmp_path / PACKAGE / "integration" / "__init__.py").write_text("")
    (tmp_path / PACKAGE / "integration" / "b.py").write_text("from dbo_runtime.core import a\n")
    (package / "c.py").write_text("")
    monkeypatch.setitem(globals(), "ROOT", tmp_path)
    monkeypatch.setitem(globals(), "MODULES", _modules())
    assert ("dbo_runtime.integration.b", False) in _imports("dbo_runtime.core.a")
    assert ("dbo_runtime.core.c", False) in _imports("dbo_runtime.core.a")
    assert ("dbo_runtime.core.c", True) in _imports("dbo_runtime.core.d")
    assert _cycles(_graph()) == [["dbo_runtime.core.a", "dbo_runtime.integration.b"]]
