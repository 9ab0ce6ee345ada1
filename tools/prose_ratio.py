"""Share of each product file's bytes that are comments and docstrings.

    python tools/prose_ratio.py [--limit PCT] [PATH ...]

Prints ``share% path`` per file (default: every ``.py`` under ``dbo_runtime/``), largest first, and exits
1 if any file is above the limit (20 %). A docstring is a string statement that opens a module, class or
function body, or that follows an assignment (an attribute docstring). Stdlib only.
"""

from __future__ import annotations

import argparse
import ast
import io
import tokenize
from pathlib import Path

LIMIT = 20.0


def docstring_lines(tree: ast.Module) -> set[int]:
    """First lines of the string statements that are docstrings."""
    starts = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if not isinstance(body, list):
            continue
        for i, stmt in enumerate(body):
            if not (isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant) and isinstance(stmt.value.value, str)):
                continue
            opens_body = i == 0 and isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
            follows_assignment = i > 0 and isinstance(body[i - 1], ast.Assign | ast.AnnAssign)
            if opens_body or follows_assignment:
                starts.add(stmt.lineno)
    return starts


def prose_bytes(source: str) -> int:
    """Bytes of comment tokens plus docstring tokens in ``source``."""
    starts = docstring_lines(ast.parse(source))
    total = 0
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT or (token.type == tokenize.STRING and token.start[0] in starts):
            total += len(token.string.encode())
    return total


def share(path: Path) -> float:
    """Prose share in percent; 0 for a file with no code at all (a package's ``__init__`` whose docstring
    describes the package has nothing to weigh it against)."""
    source = path.read_text()
    tree = ast.parse(source)
    if not tree.body or (tree.body == [tree.body[0]] and isinstance(tree.body[0], ast.Expr)):
        return 0.0
    size = len(source.encode())
    return 100.0 * prose_bytes(source) / size


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit", type=float, default=LIMIT, help="highest share allowed, in percent (default 20)")
    parser.add_argument("--top", type=int, help="list only the N highest shares (every file over the limit still counts)")
    parser.add_argument("paths", nargs="*", type=Path, help="files (default: dbo_runtime/**/*.py)")
    args = parser.parse_args(argv)
    root = Path(__file__).resolve().parents[1]
    paths = args.paths or sorted((root / "dbo_runtime").rglob("*.py"))
    shares = sorted(((share(p), p) for p in paths), reverse=True)
    for pct, path in shares[: args.top]:
        shown = path.resolve().relative_to(root) if path.resolve().is_relative_to(root) else path
        print(f"{pct:5.1f}% {shown}{'  (over ' + format(args.limit, 'g') + '%)' if pct > args.limit else ''}")
    over = [p for pct, p in shares if pct > args.limit]
    print(f"{len(over)} of {len(shares)} files above {args.limit:g}%")
    return 1 if over else 0


if __name__ == "__main__":
    raise SystemExit(main())
