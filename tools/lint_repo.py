"""Repository hygiene, run by ``make lint`` and ``make test`` after ruff and mypy.

    python tools/lint_repo.py [--root DIR]

Prints one line per violation, ``path:line: message``, and exits 1 if there is any (0 if none):

* a file points outside the repository (a sibling ``../shared`` directory, a machine's absolute
  path): a reader of a clone can follow none of them;
* a file cites a ``docs/*.md`` that does not exist;
* a comment or docstring in the code (``dbo_runtime/``, ``tests/``, ``graphs/``, ``tools/``), or a line of
  the docs (``docs/``, ``README.md``), tells when or who (a lease, a session or run number, a review, an
  issue item, "used to") instead of why. History belongs in git; the GPU records (``docs/records``) are
  data and may carry dates.

Stdlib only, so it runs before anything is installed.
"""

from __future__ import annotations

import argparse
import ast
import io
import re
import sys
import tokenize
from collections.abc import Iterator
from pathlib import Path

SCANNED = ["README.md", "Makefile", "pyproject.toml", ".ci", "dbo_runtime", "tests", "graphs", "docs", "requirements"]
"""Where no file may point outside the repository and every cited doc must exist."""
RAW_RECORDS = ("docs/records/", "graphs/results/")
"""Records and JSON written by GPU runs: data about what ran there, not text a reader follows."""
BINARY = {".png", ".pyc", ".whl", ".tgz", ".gz"}

OUTSIDE = [
    re.compile(r"\.\./shared\b"),
    re.compile(r"(?<![\w.])shared/(?:docs|gpu|hooks|seeds)/"),
    re.compile(r"(?<![\w:])/work/"),
    re.compile(r"(?<![\w:])/home/\w"),
]
CITED_DOC = re.compile(r"\bdocs/([\w.-]+\.md)\b")

HISTORY_SCANNED = ["dbo_runtime", "tests", "graphs", "tools", "docs", "README.md"]
"""Code whose comments and docstrings, and docs whose lines, say why, never when or who."""
HISTORY = [
    re.compile(r"\bleases? \d+", re.IGNORECASE),
    re.compile(r"\blease\d+", re.IGNORECASE),
    re.compile(r"\b\w+(?:st|nd|rd|th) lease\b", re.IGNORECASE),
    re.compile(r"\bsessions? \d+", re.IGNORECASE),
    re.compile(r"\brun \d+\b", re.IGNORECASE),
    re.compile(r"\bruns \d+-\d+", re.IGNORECASE),
    re.compile(r"\bbefore item \d", re.IGNORECASE),
    re.compile(r"\bnew-user review\b", re.IGNORECASE),
    re.compile(r"\bmaintainer review\b", re.IGNORECASE),
    re.compile(r"\bre-review\b", re.IGNORECASE),
    re.compile(r"\breview item\b", re.IGNORECASE),
    re.compile(r"\breview (?:of )?\d{4}-\d{2}-\d{2}", re.IGNORECASE),
    # "X used to do": history; "is used to pick", "only used to check": purpose, allowed
    re.compile(r"(?<!\bis )(?<!\bare )(?<!\bbe )(?<!\bbeen )(?<!\bbeing )(?<!\bwas )(?<!\bwere )(?<!\bonly )"
               r"(?<!\balso )(?<!\bnot )\bused to\b", re.IGNORECASE),
]  # fmt: skip
SELF = Path(__file__).resolve()


def files_under(root: Path, entries: list[str]) -> Iterator[Path]:
    for entry in entries:
        path = root / entry
        if path.is_file():
            yield path
        elif path.is_dir():
            for p in sorted(path.rglob("*")):
                rel = p.relative_to(root).as_posix()
                if p.is_file() and "__pycache__" not in rel and p.suffix not in BINARY and not rel.startswith(RAW_RECORDS):
                    yield p


def lines_of(path: Path) -> list[str]:
    return path.read_text(errors="replace").splitlines()


def outside_and_citations(root: Path) -> Iterator[str]:
    for path in files_under(root, SCANNED):
        if path.resolve() == SELF:
            continue
        rel = path.relative_to(root).as_posix()
        for number, line in enumerate(lines_of(path), 1):
            for pattern in OUTSIDE:
                if pattern.search(line):
                    yield f"{rel}:{number}: points outside the repository ({pattern.pattern}): {line.strip()}"
                    break
            for name in CITED_DOC.findall(line):
                if not (root / "docs" / name).is_file():
                    yield f"{rel}:{number}: cites docs/{name}, which does not exist"


def prose_lines(path: Path) -> Iterator[tuple[int, str]]:
    """(line number, text) of the comments and docstrings of a Python file; every line of a .md; the
    comment lines of anything else."""
    lines = lines_of(path)
    if path.suffix == ".md":
        yield from enumerate(lines, 1)
        return
    if path.suffix != ".py":
        yield from ((n, line) for n, line in enumerate(lines, 1) if line.lstrip().startswith("#"))
        return
    source = "\n".join(lines) + "\n"
    try:
        tree = ast.parse(source)
        comments = [t for t in tokenize.generate_tokens(io.StringIO(source).readline) if t.type == tokenize.COMMENT]
    except (SyntaxError, tokenize.TokenError, ValueError):
        yield from enumerate(lines, 1)  # unparsable: judge every line
        return
    seen: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            for n in range(node.lineno, (node.end_lineno or node.lineno) + 1):
                if n not in seen:
                    seen.add(n)
                    yield n, lines[n - 1]
    for tok in comments:
        yield tok.start[0], tok.string


def history(root: Path) -> Iterator[str]:
    for path in files_under(root, HISTORY_SCANNED):
        if path.resolve() == SELF:
            continue
        rel = path.relative_to(root).as_posix()
        for number, text in sorted(prose_lines(path)):
            for pattern in HISTORY:
                m = pattern.search(text)
                if m:
                    yield f"{rel}:{number}: tells history ({m.group(0)!r}): say why, not when: {text.strip()}"
                    break


def violations(root: Path) -> list[str]:
    return [*outside_and_citations(root), *history(root)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", type=Path, default=Path(__file__).resolve().parents[1], help="the checkout (default: this one)")
    args = ap.parse_args(argv)
    found = violations(args.root.resolve())
    for line in found:
        print(line)
    if found:
        print(f"lint_repo: {len(found)} violation(s)", file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
