"""Exit codes, the expected-failure type and output helpers the subcommands share (no vLLM import)."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import sys
import textwrap
import warnings
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

EXIT_PROBLEM = 1
"""A check failed, a verdict is FAIL, or the installed vLLM is not protected."""
EXIT_USAGE = 2
"""A bad argument or environment value."""
EXIT_NO_DEVICE = 3
"""Cannot run on this machine (no GPU, vLLM or torch), or an engine run failed."""
EXIT_INCONCLUSIVE = 4
"""DBO never microbatched, so the runs prove nothing about it."""
WIDTH = 100


class CliError(Exception):
    """An expected failure: one line on stderr and ``exit_code``, no traceback."""

    def __init__(self, message: str, exit_code: int = EXIT_PROBLEM) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def warn(command: str, line: str) -> None:
    print(f"dbo-runtime {command}: warning: {line}", file=sys.stderr)


def print_json(document: Any) -> None:
    sys.stdout.write(json.dumps(document, indent=2) + "\n")


def print_table(title: str, columns: Sequence[str], rows: Sequence[Sequence[str]], caption: Sequence[str] = ()) -> None:
    """A plain fixed-width table."""
    widths = [max([len(c), *(len(r[i]) for r in rows)]) for i, c in enumerate(columns)]
    lines = [title, "  ".join(c.ljust(w) for c, w in zip(columns, widths)).rstrip(), "  ".join("-" * w for w in widths)]
    lines += ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    sys.stdout.write("\n".join([*lines, *caption]) + "\n")


def wrapped(text: str, indent: str = "  ") -> str:
    """``text`` folded to ``WIDTH`` columns."""
    return textwrap.fill(text, WIDTH, subsequent_indent=indent, break_on_hyphens=False)


def release_line() -> str:
    """Which vLLM release dbo_runtime verified here; works without vLLM."""
    try:
        from dbo_runtime.integration.releases import identify

        return identify().describe()
    except Exception as exc:
        return f"vLLM release not identified ({type(exc).__name__}: {exc})"


def disabled_warning(environ: Mapping[str, str] | None = None) -> str | None:
    """What ``DBO_RUNTIME_DISABLE`` in force means; None when enabled."""
    from dbo_runtime.core.switches import read_switch

    switch = read_switch("DBO_RUNTIME_DISABLE", environ)
    if not switch.on:
        return None
    return (f"DBO_RUNTIME_DISABLE={switch.raw}: nothing patched, nothing refused; --enable-dbo runs vLLM's own DBO "
            "(the DeepGEMM schedule crash / wrong top-k on DSA models)")  # fmt: skip


def settings_a_server_refuses(environ: Mapping[str, str] | None = None) -> list[Exception]:
    """The settings an engine start would refuse (the plugin's only while enabled, and vLLM's)."""
    from dbo_runtime.core.cli_support import vllm_setting_problems
    from dbo_runtime.core.settings import setting_problems
    from dbo_runtime.core.switches import read_switch

    plugin = [] if read_switch("DBO_RUNTIME_DISABLE", environ).on else setting_problems(environ)
    return [*plugin, *vllm_setting_problems(environ)]


def say(prefix: str, text: str) -> None:
    """A progress line on stderr."""
    print(f"{prefix} {text}", file=sys.stderr, flush=True)


def int_in(low: int, high: int) -> Any:
    """An argparse ``type``: an integer in ``[low, high]``."""

    def parse(text: str) -> int:
        with contextlib.suppress(ValueError):
            if low <= (value := int(text, 10)) <= high:
                return value
        raise argparse.ArgumentTypeError(f"invalid value {text!r}: allowed integers in [{low}, {high}]")

    return parse


@contextlib.contextmanager
def import_noise() -> Iterator[list[str]]:
    """What vLLM and torch log or warn on import (a filter takes every record), so it does not read as findings."""
    with contextlib.suppress(ImportError):
        import torch  # noqa: F401  (installs its own stderr handler)
    lines: list[str] = []

    def take(record: logging.LogRecord) -> bool:
        if record.levelno >= logging.WARNING:
            lines.append(record.getMessage())
        return False

    capture = logging.Handler()
    handlers = [capture, *logging.getLogger("torch").handlers]
    logging.getLogger().addHandler(capture)
    for handler in handlers:
        handler.addFilter(take)
    try:
        with warnings.catch_warnings(record=True) as caught:
            yield lines
        lines.extend(f"{w.category.__name__}: {w.message}" for w in caught)
    finally:
        logging.getLogger().removeHandler(capture)
        for handler in handlers:
            handler.removeFilter(take)


def protection() -> dict[str, Any]:
    """Whether the fixes are in force on the installed vLLM, with ``detail``."""
    from dbo_runtime.integration import plugin, releases

    out: dict[str, Any] = {"installed": releases.installed_version(), "verified": release_line(), "in_force": False}
    if out["installed"] is None:
        return {**out, "detail": "vLLM is not installed here"}
    try:
        with import_noise():
            states = plugin.feature_states()
    except Exception as exc:  # a vLLM that does not import
        return {**out, "detail": f"vLLM does not import here ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"}
    missing = [f"{name}: {s.describe()}" for name, s in states.items() if not s.in_force and s.applies]
    return {**out, "in_force": not missing, "detail": "; ".join(missing) or "every fix in force"}
