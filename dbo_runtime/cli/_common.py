"""Exit codes, the expected-failure type and the output helpers the subcommands share.

Stdlib and ``dbo_runtime.core`` only: ``sms`` must run on a GPU machine that has no vLLM.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import sys
import textwrap
import threading
import time
import warnings
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

EXIT_OK = 0
EXIT_PROBLEM = 1
"""A check failed (doctor), a verdict is FAIL, or the installed vLLM is not protected (simulate)."""
EXIT_USAGE = 2
"""A bad argument or environment value."""
EXIT_NO_DEVICE = 3
"""Cannot run on this machine: no GPU, too few GPUs, no vLLM or torch, or an engine run failed."""
EXIT_INCONCLUSIVE = 4
"""verify / tune: DBO never microbatched, so the runs prove nothing about it."""
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
    """A plain fixed-width table: greppable in logs, the same on every machine."""
    widths = [max([len(c), *(len(r[i]) for r in rows)]) for i, c in enumerate(columns)]
    lines = [title, "  ".join(c.ljust(w) for c, w in zip(columns, widths)).rstrip(), "  ".join("-" * w for w in widths)]
    lines += ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    sys.stdout.write("\n".join([*lines, *caption]) + "\n")


def wrapped(text: str, indent: str = "  ") -> str:
    """``text`` folded to ``WIDTH`` columns, continuation lines indented."""
    return textwrap.fill(text, WIDTH, subsequent_indent=indent, break_on_hyphens=False)


def release_line() -> str:
    """Which vLLM release dbo_runtime verified here (``releases.identify().describe()``); works without vLLM."""
    try:
        from dbo_runtime.integration.releases import identify

        return identify().describe()
    except Exception as exc:  # sms runs where vLLM or its files are missing: said, never a crash
        return f"vLLM release not identified ({type(exc).__name__}: {exc})"


def disabled_warning(environ: Mapping[str, str] | None = None) -> str | None:
    """What ``DBO_RUNTIME_DISABLE`` in force means, in the one wording every command shows; None when enabled.
    A warning, never a failure: vanilla vLLM is a deliberate choice (the A/B runs)."""
    from dbo_runtime.core.switches import read_switch

    switch = read_switch("DBO_RUNTIME_DISABLE", environ)
    if not switch.on:
        return None
    return (
        f"DBO_RUNTIME_DISABLE={switch.raw}: nothing patched, nothing refused; --enable-dbo runs vLLM's own DBO "
        "(the DeepGEMM schedule crash / wrong top-k on DSA models)"
    )


def settings_a_server_refuses(environ: Mapping[str, str] | None = None) -> list[Exception]:
    """The settings an engine start would refuse: the plugin's own (only while it is enabled) and vLLM's it follows."""
    from dbo_runtime.core.settings import setting_problems, vllm_setting_problems
    from dbo_runtime.core.switches import read_switch

    plugin = [] if read_switch("DBO_RUNTIME_DISABLE", environ).on else setting_problems(environ)
    return [*plugin, *vllm_setting_problems(environ)]


class Progress:
    """Progress lines on stderr, so stdout stays the result; inside ``with``, a line every ``tick_s`` seconds
    says how long the current phase has run (a long engine start otherwise looks hung)."""

    def __init__(self, prefix: str, tick_s: float = 30.0) -> None:
        self.prefix, self.tick_s, self.phase = prefix, tick_s, ""
        self.started = time.monotonic()
        self._stop = threading.Event()

    def say(self, text: str) -> None:
        print(f"{self.prefix} {text}", file=sys.stderr, flush=True)

    def set(self, phase: str) -> None:
        self.phase, self.started = phase, time.monotonic()
        self.say(f"{phase} ...")

    def __enter__(self) -> Progress:
        def tick() -> None:
            while not self._stop.wait(self.tick_s):
                self.say(f"{self.phase}: {time.monotonic() - self.started:.0f} s")

        threading.Thread(target=tick, daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()


def int_in(low: int, high: int) -> Any:
    """An argparse ``type``: an integer in ``[low, high]``; argparse names the option in its error line."""

    def parse(text: str) -> int:
        try:
            value = int(text, 10)
        except ValueError:
            value = low - 1
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"invalid value {text!r}: allowed integers in [{low}, {high}]")
        return value

    return parse


class _Capture(logging.Handler):
    """Collects log records as lines; as a filter on another handler it keeps the record from that handler."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= self.level:
            self.emit(record)
        return False


@contextlib.contextmanager
def import_noise() -> Iterator[list[str]]:
    """Keep what vLLM and torch log on import ("Failed to import from vllm._C", "Triton not available": expected
    on a CPU box) off stderr, where it would read as the command's findings; the lines are collected instead."""
    with contextlib.suppress(ImportError):
        import torch  # noqa: F401  (torch installs its own stderr handler on import; filtered below)
    capture = _Capture()
    torch_handlers = list(logging.getLogger("torch").handlers)
    logging.getLogger().addHandler(capture)
    for handler in torch_handlers:
        handler.addFilter(capture)
    try:
        with warnings.catch_warnings(record=True) as caught:
            yield capture.lines
        capture.lines.extend(f"{w.category.__name__}: {w.message}" for w in caught)
    finally:
        logging.getLogger().removeHandler(capture)
        for handler in torch_handlers:
            handler.removeFilter(capture)


def protection() -> dict[str, Any]:
    """Whether dbo_runtime's fixes are in force on the vLLM installed here: ``installed`` (vLLM's version),
    ``verified`` (``identify().describe()``), ``in_force`` and ``detail`` (why not)."""
    from dbo_runtime.integration import plugin, releases

    out: dict[str, Any] = {"installed": releases.installed_version(), "verified": release_line(), "in_force": False}
    if out["installed"] is None:
        return {**out, "detail": "vLLM is not installed here"}
    try:
        with import_noise():
            states = plugin.feature_states()
    except Exception as exc:  # a vLLM that does not import
        return {**out, "detail": f"vLLM does not import here ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"}
    missing = [f"{name}: {s.describe()}" for name, s in states.items() if not s.in_force]
    return {**out, "in_force": not missing, "detail": "; ".join(missing) or "every fix in force"}
