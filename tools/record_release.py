"""Record a vLLM release's fingerprints, and print the review list a maintainer works through.

    python tools/record_release.py VERSION [--source DIR] [--against RELEASE] [--write]

Reads the release's source (``pip download --no-deps vllm==VERSION``, unpacked; or ``--source``, a
``vllm`` package directory), fingerprints every patch's anchors and every feature's ``relies_on`` (vLLM code a
fix relies on without patching it) there and prints one line per patch or reliance:

* ``unchanged``  the code the patch relies on is the same as in ``--against`` (default: the newest recorded);
* ``changed``    it differs: review the hook against the new code before recording;
* ``moved``      an anchor is gone from its module but a block of that name exists elsewhere (where);
* ``missing``    an anchor exists nowhere: the patch is not part of this release's set;
* ``new``        the patch has no record in ``--against`` (or its target was missing there);
* ``excluded``   ``--against`` left the patch out of its set on purpose (``--exclude``).

Then every module that reaches DeepGEMM's paged-MQA logits function (``hooked`` by a logits patch, or ``REVIEW``):
a deferred plan-ahead schedule is fitted only at a hooked call site, so an unhooked one that can run under DBO
needs a patch before the release is recorded.

``--write`` records this release in ``dbo_runtime/integration/recorded_fingerprints.json`` (other releases
kept); ``--exclude PATCH ...`` records those patches as left out of its set on purpose. Recording is the maintainer's sign-off: a recorded fingerprint makes the patch install there.
The procedure: ``docs/new-release.md``.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import functools
import json
import pathlib
import re
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dbo_runtime.integration import fingerprints  # noqa: E402
from dbo_runtime.integration.catalog import all_patches, all_reliances  # noqa: E402
from dbo_runtime.integration.features import Reliance  # noqa: E402
from dbo_runtime.integration.fingerprints import RECORD, RELEASES  # noqa: E402
from dbo_runtime.integration.patching import Patch  # noqa: E402


@contextlib.contextmanager
def use_source_root(root: pathlib.Path) -> Iterator[None]:
    """Read every anchor from the ``vllm`` package directory ``root``; caches are cleared on entry and exit."""
    importable = fingerprints._vllm_root
    fingerprints._vllm_root = functools.lru_cache(maxsize=1)(lambda: root)  # type: ignore[assignment]
    fingerprints.clear_caches()
    try:
        yield
    finally:
        fingerprints._vllm_root = importable  # type: ignore[assignment]
        fingerprints.clear_caches()


def fetch_source(version: str, into: pathlib.Path) -> pathlib.Path:
    """The ``vllm`` package directory of the official wheel (Python files only)."""
    done = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", f"vllm=={version}", "-d", str(into)])
    if done.returncode != 0:
        raise SystemExit(f"record_release.py: vllm=={version} could not be downloaded (pip said why above); use --source DIR")
    wheel = next(into.glob(f"vllm-{version}-*.whl"))
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(into, [n for n in archive.namelist() if n.startswith("vllm/") and n.endswith(".py")])
    return into / "vllm"


def source_version(root: pathlib.Path) -> str | None:
    """The release a vllm package directory says it is (``_version.py``, written by the wheel build); None if absent."""
    path = root / "_version.py"
    found = re.search(r"^__version__\s*=\s*(?:version\s*=\s*)?['\"]([^'\"]+)['\"]", path.read_text() if path.is_file() else "", re.M)
    return found.group(1) if found else None


def _relocated(root: pathlib.Path, anchor: str) -> list[str]:
    """Other ``module:qualname`` places in ``root`` that define the anchor's last name at the same nesting."""
    module, _, qualname = anchor.partition(":")
    leaf = qualname.split(".")[-1]
    pattern = re.compile(rf"^\s*(?:async def|def|class) {re.escape(leaf)}\b", re.MULTILINE)
    found = []
    for path in sorted(root.rglob("*.py")):
        text = path.read_text(encoding="utf-8", errors="replace")
        if not pattern.search(text):
            continue
        candidate = "vllm." + ".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__")
        if candidate != module and fingerprints.source_block(candidate, qualname) is not None:
            found.append(f"{candidate}:{qualname}")
    return found


def review(patch: Patch | Reliance, printed: str, previous: dict[str, str], root: pathlib.Path) -> tuple[str, str]:
    anchors = patch.fingerprint_anchors
    if printed == fingerprints.MISSING:
        gone = [a for a in anchors if fingerprints.anchor_fingerprint(a) == fingerprints.MISSING]
        places = {a: _relocated(root, a) for a in gone}
        moved = {a: p for a, p in places.items() if p}
        if moved:
            return "moved", "; ".join(f"{a} -> {', '.join(p)}" for a, p in moved.items())
        return "missing", ", ".join(gone)
    want = previous.get(patch.name)
    if want == fingerprints.EXCLUDED:
        return "excluded", f"left out of {patch.name.partition('.')[0]} on purpose in the record compared with ({printed})"
    if want is None or want in fingerprints.OUT_OF_SET:
        return "new", printed + (f" (was {want})" if want else "")
    if want == printed:
        return "unchanged", printed
    return "changed", f"{want} -> {printed}"


LOGITS = "fp8_fp4_paged_mqa_logits"
NOT_CALL_SITES = ("vllm/utils/deep_gemm.py", "vllm/third_party/")
"""DeepGEMM's wrapper and vendored copy define the function; every other module naming it in code calls it."""


def logits_call_sites(root: pathlib.Path) -> list[tuple[str, str]]:
    """(module, the logits patch hooking it or "") for each module whose code names DeepGEMM's paged-MQA logits."""
    hooked = {p.module: p.name for p in all_patches() if p.attr == LOGITS}
    out = []
    for path in sorted(root.rglob("*.py")):
        where = path.relative_to(root.parent).as_posix()
        if where.startswith(NOT_CALL_SITES) or LOGITS not in (text := path.read_text(errors="replace")):
            continue
        try:
            tree = ast.parse(text)
        except SyntaxError:
            continue
        if any(
            (isinstance(n, ast.ImportFrom) and any(a.name == LOGITS for a in n.names))
            or (isinstance(n, ast.Attribute) and n.attr == LOGITS)
            or (isinstance(n, ast.Name) and n.id == LOGITS)
            for n in ast.walk(tree)
        ):
            module = where.removesuffix(".py").removesuffix("/__init__").replace("/", ".")
            out.append((module, hooked.get(module, "")))
    return out


def render(releases: dict[str, dict[str, str]]) -> str:
    return json.dumps(releases, indent=2) + "\n"


def _key(version: str) -> tuple[int, ...]:
    return tuple(int(part) if part.isdigit() else -1 for part in re.split(r"[.+]", version))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="record_release.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("version", help="the vLLM release, e.g. 0.34.0")
    parser.add_argument("--source", type=pathlib.Path, help="an unpacked vllm package directory (skips the download)")
    parser.add_argument("--against", choices=sorted(RELEASES), help="compare with this recorded release")
    parser.add_argument("--write", action="store_true", help="record this release's fingerprints")
    parser.add_argument(
        "--exclude", nargs="+", default=[], metavar="PATCH",
        help="with --write: leave these patches out of the release's set on purpose (their fix is unreachable there)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if not re.fullmatch(r"\d+\.\d+\.\d+(\.\d+)?(\.post\d+)?(\+[\w.]+)?", args.version):
        parser.error(f"version '{args.version}' is not allowed; allowed values: a vLLM release such as 0.34.0")
    against = args.against or max(RELEASES, key=_key)
    with tempfile.TemporaryDirectory() as tmp:
        root = args.source or fetch_source(args.version, pathlib.Path(tmp))
        if not (root / "__init__.py").is_file():
            parser.error(f"--source {root} is not a vllm package directory (no __init__.py)")
        found = source_version(root)
        if found is not None and found.split("+")[0] != args.version.split("+")[0]:  # a local build tag aside
            parser.error(f"--source {root} holds vLLM {found}, not {args.version}: its fingerprints would be recorded "
                         "under the wrong release; pass the version it holds, or another --source")
        with use_source_root(root.resolve()):
            # anchors may depend on what exists there
            patches: list[Patch | Reliance] = [*(p for p in all_patches() if p.fingerprint_anchors), *all_reliances()]
            printed = {p.name: fingerprints.fingerprint(p.fingerprint_anchors) for p in patches}
            rows = [(p.name, *review(p, printed[p.name], RELEASES[against], root)) for p in patches]
        sites = logits_call_sites(root.resolve())
    unknown = sorted(set(args.exclude) - set(printed))
    if unknown:  # before the review list, so the refusal is the one line a user sees
        parser.error(f"--exclude: no patch bound to vLLM code is named {', '.join(unknown)}")
    width = max(len(name) for name, _, _ in rows)
    print(f"vLLM {args.version} against the record of {against}:")
    for name, status, detail in rows:
        print(f"  {status:<9} {name:<{width}}  {detail}")
    counts = {s: sum(1 for _, st, _ in rows if st == s) for s in ("unchanged", "changed", "moved", "missing", "new", "excluded")}
    print("  " + ", ".join(f"{n} {s}" for s, n in counts.items() if n))
    print(f"modules calling DeepGEMM's {LOGITS} (a deferred plan-ahead schedule is fitted only where hooked):")
    for module, patch in sites:
        print(f"  {'hooked' if patch else 'REVIEW':<9} {module}  " + (patch or "not hooked: may it run under DBO?"))
    if args.write:
        printed.update({name: fingerprints.EXCLUDED for name in args.exclude})
        releases = {**RELEASES, args.version: printed}
        RECORD.write_text(render(dict(sorted(releases.items(), key=lambda kv: _key(kv[0])))))
        print(f"recorded vLLM {args.version} ({len(printed)} fingerprints) in {RECORD.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
