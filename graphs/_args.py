"""Argument helpers of the ``graphs/`` scripts: plain argparse (a bad value is exit 2), exit 3 where the machine
cannot run a script, and output to the git-ignored ``graphs/results/local/`` unless ``--out`` names a folder."""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable
from pathlib import Path

EXIT_NO_DEVICE = 3
RESULTS = Path(__file__).resolve().parent / "results"
SCRATCH = RESULTS / "local"


def integer(low: int, high: int | None = None, *, multiple: int = 1) -> Callable[[str], int]:
    """An argparse ``type``: an integer in ``[low, high]`` (``high`` None: no bound), a multiple of ``multiple``."""
    allowed = (f"an integer >= {low}" if high is None else f"integers in [{low}, {high}]") + (f", a multiple of {multiple}" if multiple > 1 else "")

    def parse(text: str) -> int:
        value = int(text) if text.strip().lstrip("-").isdigit() else None
        if value is None or value < low or (high is not None and value > high) or value % multiple:
            raise argparse.ArgumentTypeError(f"invalid value {text!r}: allowed {allowed}")
        return value

    return parse


def positive_seconds(text: str) -> float:
    """An argparse ``type``: a finite number of seconds > 0."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"invalid value {text!r}: allowed a finite number of seconds > 0")
    return value


def add_out(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, default=SCRATCH, help="output folder (default graphs/results/local/, git-ignored)")


def progress(line: str) -> None:
    """The harness's progress lines, on stderr: stdout is the measurement."""
    print(line, file=sys.stderr, flush=True)


def say_written(prog: str, *paths: Path) -> None:
    """One line on stderr naming the files written: stdout is the measurement."""
    written = [str(p) for p in paths if p.is_file()]
    print(f"{prog}: wrote {', '.join(written) if written else 'nothing'}", file=sys.stderr)
