"""Argument parsing for the ``graphs/`` scripts: a bad value is one line, refused before any GPU check.

argparse prints its usage block before an error, and a range only checked after the "needs a GPU"
refusal is only caught on the GPU machine (new-user review 2026-12-01). The project's rule for bad
input: one line naming the parameter and the allowed values, exit 2, nothing run."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import NoReturn


class Parser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` whose errors are one line (``prog: error: ... (see --help)``)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


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
            raise argparse.ArgumentTypeError(f"{text!r} is not allowed; allowed values: {allowed}")
        return value

    parse.__name__ = allowed  # argparse names the type in some messages
    return parse


def positive_seconds(text: str) -> float:
    """An argparse ``type``: a finite number of seconds > 0."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"{text!r} is not allowed; allowed values: a finite number of seconds > 0")
    return value
