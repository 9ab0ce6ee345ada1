"""Argument parsing for the ``graphs/`` scripts: a bad value is one line, refused before any GPU check.

argparse prints its usage block before an error, and a range only checked after the "needs a GPU"
refusal is only caught on the GPU machine. The project's rule for bad
input: one line naming the parameter and the allowed values, exit 2, nothing run; an option that takes one
value given twice is such input too (``cli._common.OnceArgumentParser``), not its last value. A machine that cannot
run a script (no CUDA, no DeepGEMM, no vLLM, too few GPUs) is exit 3, as for every ``dbo-runtime`` command.

Output goes to ``graphs/results/local/`` unless ``--out`` says otherwise: that folder is git-ignored, so
trying a script never rewrites the committed results in ``graphs/results/`` that ``docs/performance.md``
cites; updating those takes an explicit ``--out graphs/results``."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from pathlib import Path

from dbo_runtime.cli._common import EXIT_NO_DEVICE, interruptible
from dbo_runtime.cli.main import OneLineArgumentParser
from dbo_runtime.core.errors import shown

RESULTS = Path(__file__).resolve().parent / "results"
"""The committed results (``docs/performance.md`` cites them)."""
SCRATCH = RESULTS / "local"
"""The default output folder: git-ignored."""

__all__ = ["EXIT_NO_DEVICE", "RESULTS", "SCRATCH", "Parser", "add_out", "integer", "interruptible", "out_folder", "positive_seconds", "refuse_repeats", "say_written"]


class Parser(OneLineArgumentParser):
    """The CLI's one-line parser; a script is run by path, so its hint is plain ``--help``."""

    def help_hint(self) -> str:
        return "--help"


def integer(low: int, high: int | None = None, *, multiple: int = 1) -> Callable[[str], int]:
    """An argparse ``type``: an integer in ``[low, high]`` (``high`` None: no bound), a multiple of ``multiple``."""
    allowed = f"an integer >= {low}" if high is None else f"integers in [{low}, {high}]"
    if multiple > 1:
        allowed += f", a multiple of {multiple}"

    def parse(text: str) -> int:
        try:
            value = int(text, 10)
        except ValueError:
            value = None
        if value is None or value < low or (high is not None and value > high) or value % multiple:
            raise argparse.ArgumentTypeError(f"{shown(text)} is not allowed; allowed values: {allowed}")
        return value

    return parse


def positive_seconds(text: str) -> float:
    """An argparse ``type``: a finite number of seconds > 0."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"{shown(text)} is not allowed; allowed values: a finite number of seconds > 0")
    return value


def out_folder(prog: str) -> Callable[[str], Path]:
    """An argparse ``type`` for ``--out``: a folder ``prog`` can create (with its parents) and write.

    Checked as the arguments are parsed, so a bad ``--out`` (a file, a folder that cannot be written) is one
    line and exit 2 on any machine, ahead of the GPU check and of minutes of measuring. The probe is the one the
    real-engine commands use for ``--workdir`` (``cli._paths.check_dir``): it creates nothing, and the folder is
    made only when the results are written."""
    from dbo_runtime.cli._paths import check_dir
    from dbo_runtime.core.errors import ConfigError

    def parse(text: str) -> Path:
        try:
            return check_dir(text, "--out", prog)
        except ConfigError as exc:
            raise argparse.ArgumentTypeError(f"{text!r} is not allowed; allowed values: {exc.allowed}") from None

    return parse


def add_out(parser: argparse.ArgumentParser) -> None:
    """``--out``: the output folder, ``graphs/results/local/`` (git-ignored) unless given; checked by ``out_folder``
    (the default too: argparse passes a string default through ``type``)."""
    parser.add_argument(
        "--out",
        type=out_folder(parser.prog),
        default=str(SCRATCH),
        help="output folder (default graphs/results/local/, git-ignored; --out graphs/results updates the committed results)",
    )


def say_written(prog: str, *paths: Path) -> None:
    """One line on stderr naming the files a benchmark wrote (a PNG only where matplotlib made it): its stdout is
    the measurement, and the default folder (``graphs/results/local/``) is not where a reader looks first."""
    import sys

    written = [str(p) for p in paths if p.is_file()]
    print(f"{prog}: wrote {', '.join(written) if written else 'nothing'}", file=sys.stderr)


def refuse_repeats(parser: argparse.ArgumentParser, option: str, items: list, allowed: str) -> None:
    """A comma-separated list with a value in it twice, refused in one line: each value is one axis or group of a
    benchmark and runs once, so a repeat is more likely a typo for another value than a wish (``tune --values``
    refuses it the same way). ``allowed`` ends the line, as in every refused value."""
    twice = [v for v in dict.fromkeys(items) if items.count(v) > 1]
    if twice:
        listed = ", ".join(repr(v) if isinstance(v, str) else str(v) for v in twice)
        parser.error(f"argument {option}: {listed} listed twice; allowed values: {allowed}")
