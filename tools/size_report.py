"""Line counts the layout is held to: what vLLM imports, the CLI, the package, the scripts and the READMEs.

    python tools/size_report.py [--root DIR]

Prints each count against its limit and exits 1 if any is over (0 if none): the limits keep the part of
the project a newcomer must read, and the part that runs inside vLLM, small enough to read in an hour.

"vLLM imports" is the import closure of the wheel's ``vllm.general_plugins`` entry points (read from
``pyproject.toml``), found with ``ast``: module-level and function-level imports both count, and so does
a string naming one of the package's modules (``importlib.import_module`` of a listed name), since any
of them may run inside vLLM. Stdlib only.
"""

from __future__ import annotations

import argparse
import ast
import re
import tomllib
from pathlib import Path

PACKAGE = "dbo_runtime"
LIMITS = {"vLLM imports": 6_500, "cli/": 1_500, f"{PACKAGE}/": 10_000, "graphs/": 2_500, "README.md": 150,
          "tools/gpu/README.md": 40}
"""Most lines each part may have."""
MODULE_NAME = re.compile(rf"^{PACKAGE}(?:\.\w+)+(?::\w+)?$")


def entry_points(root: Path) -> tuple[str, ...]:
    """The modules vLLM loads first: the values of the wheel's ``vllm.general_plugins`` entry points."""
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    plugins = project.get("entry-points", {}).get("vllm.general_plugins", {})
    return tuple(value.partition(":")[0] for value in plugins.values())


def modules(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every module of the package."""
    found = {}
    for path in sorted((root / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def imported(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The package's modules that ``name`` imports anywhere in its body, with their parent packages."""
    tree = ast.parse(path.read_text(), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            targets.add(base)
            targets.update(f"{base}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and MODULE_NAME.match(node.value):
            targets.add(node.value.partition(":")[0])
    result = set()
    for target in targets:
        parts = target.split(".")
        for i in range(1, len(parts) + 1):  # importing a.b.c runs a/__init__ and a.b/__init__ too
            prefix = ".".join(parts[:i])
            if prefix in known:
                result.add(prefix)
    return result


def closure(roots: tuple[str, ...], known: dict[str, Path]) -> set[str]:
    seen: set[str] = set()
    todo = [r for r in roots if r in known]
    for r in list(todo):
        parts = r.split(".")
        todo.extend(".".join(parts[:i]) for i in range(1, len(parts)) if ".".join(parts[:i]) in known)
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo.extend(imported(name, known[name], known) - seen)
    return seen


def lines(paths: list[Path]) -> int:
    return sum(len(p.read_text().splitlines()) for p in paths)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parents[1])
    parser.add_argument("--list", action="store_true", help="also list the modules vLLM imports")
    args = parser.parse_args(argv)
    known = modules(args.root)
    loaded = closure(entry_points(args.root), known)
    counts = {
        "vLLM imports": lines([known[m] for m in loaded]),
        "cli/": lines([p for m, p in known.items() if m.startswith(PACKAGE + ".cli")]),
        f"{PACKAGE}/": lines(list(known.values())),
        "graphs/": lines(sorted((args.root / "graphs").glob("*.py"))),
        "README.md": lines([args.root / "README.md"]),
        "tools/gpu/README.md": lines([args.root / "tools" / "gpu" / "README.md"]),
    }
    over = 0
    for part, count in counts.items():
        over += count > LIMITS[part]
        print(f"{part}: {count} lines (limit {LIMITS[part]}){'  OVER' if count > LIMITS[part] else ''}")
    if args.list:
        for m in sorted(loaded):
            print(f"  {lines([known[m]]):5d} {m}")
    return 1 if over else 0


if __name__ == "__main__":
    raise SystemExit(main())
