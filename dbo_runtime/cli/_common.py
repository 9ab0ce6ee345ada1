"""Exit codes, the one-line error type, the argument parser's base and output helpers shared by subcommands.

The parser base (``OnceArgumentParser``) lives here, stdlib only, because every command line of the project
builds on it: ``dbo-runtime``'s parsers, the ``graphs/`` scripts and the ``tools/`` scripts, one of which
runs before anything is installed.

``rich`` renders the tables for people, but the GPU machine has no package
registry and may lack it, so a plain fixed-width table is the fallback; JSON
output never depends on either.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

EXIT_OK = 0
EXIT_PROBLEM = 1
"""A check failed (``doctor``: vLLM missing/unsupported, a required patch target missing)."""
EXIT_USAGE = 2
"""Bad flag or value (argparse errors and ``ConfigError``)."""
EXIT_NO_DEVICE = 3
"""The command cannot run on this machine: no GPU visible through NVML or CUDA (and no ``--total-sms``),
no CUDA or DeepGEMM where real kernels or CUDA graphs were asked for, too few GPUs, no vLLM or torch.
A bad argument is ``EXIT_USAGE`` even where the machine could not run it anyway, so a script can tell the
two apart: fix the command line, or move to another machine."""
EXIT_INTERRUPTED = 130
"""Ctrl-C (SIGINT): the shell's 128 + 2, after one line saying so instead of Python's traceback."""
EXIT_BROKEN_PIPE = 141
"""The reader of stdout went away (``| head``): the shell's 128 + SIGPIPE, as a tool killed by the signal reports,
so ``set -o pipefail`` still sees that the output was cut, without a traceback."""


def interruptible(main: Callable[[], int], prog: str) -> int:
    """Run a script's ``main``; Ctrl-C ends it with one line and ``EXIT_INTERRUPTED``. The ``finally`` blocks
    between (engines stopped, temporary folders removed) have run by the time it reaches here. stdout is flushed
    before it returns: a reader that left is ``EXIT_BROKEN_PIPE``, and a closed or unwritable stdout one line and
    ``EXIT_NO_DEVICE`` (the output cannot reach anyone), never Python's "Exception ignored" at exit."""
    if sys.stdout is None:  # started with stdout closed (``>&-``): every print would fail half-way
        print(f"{prog}: error: stdout is closed; it needs an open stdout (a terminal, a pipe, a file or > /dev/null)", file=sys.stderr)
        return EXIT_NO_DEVICE
    watch = _StdoutWatch(sys.stdout)
    sys.stdout = watch  # type: ignore[assignment]
    try:
        code = main()
        watch.flush()  # a buffered stdout's last write fails here, not at exit where no one could say it in one line
        return code
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError as exc:
        if exc is not watch.failed:
            raise  # another pipe's: not the reader of stdout going away
        # Python turns SIGPIPE into this exception; stdout is pointed at /dev/null so that the flush at exit
        # does not raise it again (the recipe of Python's signal documentation)
        _silence(watch.stream)
        return EXIT_BROKEN_PIPE
    except OSError as exc:
        if exc is not watch.failed:
            raise  # another file's error: the command's own handling (or a traceback) says it
        print(f"{prog}: error: stdout cannot be written ({exc.strerror or type(exc).__name__}); the output is lost", file=sys.stderr)
        _silence(watch.stream)
        return EXIT_NO_DEVICE
    finally:
        if sys.stdout is watch:
            sys.stdout = watch.stream


class _StdoutWatch:
    """stdout, noting the ``OSError`` a write or flush of it raised (a full disk, ``/dev/full``, an I/O error):
    the print that fails sits anywhere in a command, and only the stream can tell its error from another
    file's. Everything else is the stream's own."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream
        self.failed: OSError | None = None

    def write(self, text: str) -> Any:
        try:
            return self.stream.write(text)  # as the stream returns it (some wrappers return None)
        except OSError as exc:
            self.failed = exc
            raise

    def flush(self) -> None:
        try:
            self.stream.flush()
        except OSError as exc:
            self.failed = exc
            raise

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)


def _silence(stream: Any) -> None:
    """Point the failed stdout at /dev/null, so that the flush at exit does not raise (and print) again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, stream.fileno())
    except (OSError, ValueError, AttributeError, io.UnsupportedOperation):
        pass  # no descriptor to point (a captured stream): nothing is flushed at exit either


class CliError(Exception):
    """An expected failure: printed as one line on stderr, no traceback."""

    def __init__(self, message: str, exit_code: int = EXIT_PROBLEM) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def _shown_value(value: Any) -> str:
    """A stored option value as the error line shows it, in ``ConfigError``'s way (``core.errors.shown``: a
    number bare, text quoted); a parsed value (a path) as the text it was parsed from."""
    from dbo_runtime.core.errors import shown

    if isinstance(value, (list, tuple)):
        return " ".join(_shown_value(v) for v in value)
    return shown(value if isinstance(value, (str, int, float)) else str(value))


class StoreOnce(argparse._StoreAction):
    """argparse's ``store`` that refuses a second value: argparse keeps the last one without a word, so
    ``--preset glm53 --preset small`` would run ``small`` while the command line also says ``glm53``.

    Tracked per destination, so two spellings of one setting (``-o``/``--out``, an abbreviation where a parser
    allows them, ``--flag=value`` and ``--flag value``) count as the same option. Only ``store``: ``append`` and
    ``count`` exist to be repeated, and a repeated switch (``store_true``) asks for the same thing twice."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any, option_string: str | None = None) -> None:
        given: dict[str, tuple[str, Any]] | None = getattr(parser, "given_options", None)
        if option_string is not None and given is not None:
            if self.dest in given:
                first, before = given[self.dest]
                then, now = _shown_value(before), _shown_value(values)
                if first != option_string:  # two spellings of one setting: say which came with which value
                    then, now = f"{first} {then}", f"{option_string} {now}"
                raise argparse.ArgumentError(self, f"given twice ({then}, then {now}); give it once")
            given[self.dest] = (option_string, values)
        super().__call__(parser, namespace, values, option_string)


class OnceArgumentParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose single-value options refuse a second value (``StoreOnce``), with
    ``given_options``: the destinations the last parse set from the command line (dest -> (the option's name,
    its value)), so a caller can tell an option typed at its default value from one left out."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.register("action", None, StoreOnce)
        self.register("action", "store", StoreOnce)
        self.given_options: dict[str, tuple[str, Any]] = {}

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:  # type: ignore[override]
        self.given_options = {}
        return super().parse_known_args(args, namespace)


DISABLED_WARNING = (
    "DBO_RUNTIME_DISABLE={value}: nothing patched, nothing refused; --enable-dbo runs vLLM's own DBO "
    "(the DeepGEMM schedule crash / wrong top-k on DSA models)"
)


def disabled_warning(environ: Mapping[str, str] | None = None) -> str | None:
    """The finding for ``DBO_RUNTIME_DISABLE`` in force, in the one wording ``doctor`` and ``simulate`` both show;
    None while the plugin is enabled.

    A warning, never a failure: vanilla vLLM is the operator's deliberate choice (the A/B runs, ``verify``), and
    what the disabled plugin would have fixed is the information they need, not a verdict on this machine.
    """
    from dbo_runtime.core.switches import read_switch

    switch = read_switch("DBO_RUNTIME_DISABLE", environ)
    return DISABLED_WARNING.format(value=switch.raw) if switch.on else None


def warn_switch_problems(command: str) -> list[str]:
    """Print each unrecognised ``DBO_RUNTIME_*`` switch on stderr, in the plugin's words; return them.

    ``sms`` and ``simulate`` do not install the plugin, but an operator runs them to learn what
    a server with this environment will do, so they read the switches exactly as the plugin does
    (``core.switches``) and show the same line the worker log would.
    """
    from dbo_runtime.core.switches import switch_problems

    problems = switch_problems()
    for problem in problems:
        print(f"dbo-runtime {command}: warning: {problem}", file=sys.stderr)
    return problems


def settings_a_server_refuses(environ: Mapping[str, str] | None = None) -> list[Exception]:
    """The settings an engine start would refuse with this environment: the plugin's own (``core.settings``; only
    while the plugin is enabled, as ``DBO_RUNTIME_DISABLE=1`` never reads them) and vLLM's that it follows. One
    list for ``doctor`` (problems) and ``sms`` (warnings), so both name the same settings in the same words."""
    from dbo_runtime.core.settings import setting_problems, vllm_setting_problems
    from dbo_runtime.core.switches import read_switch

    plugin = [] if read_switch("DBO_RUNTIME_DISABLE", environ).on else setting_problems(environ)
    return [*plugin, *vllm_setting_problems(environ)]


def warn_refused_settings(command: str) -> list[str]:
    """Print, as a warning, each setting a server would refuse (``settings_a_server_refuses``); return the lines.

    For a command that only shows what a server would do (``sms``: the SM split, which these settings do not
    change): refusing would stop it from showing the split, and silence would let the operator start a server
    that then stops."""
    lines = [f"{problem} (a server refuses it at engine start; {command} does not read it)" for problem in settings_a_server_refuses()]
    for line in lines:
        print(f"dbo-runtime {command}: warning: {line}", file=sys.stderr)
    return lines


def print_json(document: Any) -> None:
    sys.stdout.write(json.dumps(document, indent=2, sort_keys=False) + "\n")


def _plain_table(title: str, columns: Sequence[str], rows: Sequence[Sequence[str]], caption: Sequence[str]) -> str:
    widths = [len(c) for c in columns]
    for row in rows:
        for i, cell in enumerate(row):
            widths[i] = max(widths[i], len(cell))
    lines = [title]
    lines.append("  ".join(c.ljust(w) for c, w in zip(columns, widths)).rstrip())
    lines.append("  ".join("-" * w for w in widths))
    lines.extend("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows)
    lines.extend(caption)
    return "\n".join(lines) + "\n"


def print_table(
    title: str,
    columns: Sequence[str],
    rows: Sequence[Sequence[str]],
    caption: Sequence[str] = (),
    *,
    compact: bool = False,
    width: int | None = None,
    styles: Sequence[str | None] | None = None,
) -> None:
    """A table on stdout: rich when importable, plain text otherwise.

    Cells are passed as ``rich.text.Text`` so GPU names or notes containing
    ``[...]`` are never parsed as rich markup. Off a terminal (and without ``$COLUMNS``) the
    width is fixed -- ``width``, else wide (220) so captured output (tests, logs) is not wrapped
    mid-number -- and the table is rendered to text first so no line carries rich's trailing
    padding into a log or a diff. ``compact``: no borders and one space between columns (``simulate``
    keeps its table within 100 columns that way); a narrower terminal folds cells instead of cutting them. ``styles``: a rich style
    per row, shown on a terminal only.
    """
    try:
        from rich import box
        from rich.console import Console
        from rich.table import Table
        from rich.text import Text
    except ImportError:
        sys.stdout.write(_plain_table(title, columns, rows, caption))
        return
    terminal = sys.stdout.isatty() or bool(os.environ.get("COLUMNS"))
    if width is None:
        width_used = None if terminal else 220
    else:
        width_used = min(width, shutil.get_terminal_size((width, 24)).columns) if terminal else width
    buffer = None if sys.stdout.isatty() else io.StringIO()
    console = Console(file=buffer or sys.stdout, width=width_used, highlight=False, color_system="auto" if buffer is None else None)
    if compact:
        table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, padding=(0, 1, 0, 0))
    else:
        table = Table(title=title, title_justify="left")
    key_width = max([len(columns[0]), *(len(row[0]) for row in rows)]) if columns else 0
    for i, column in enumerate(columns):
        if compact:
            # folded, not cut: on an 80-column terminal no_wrap would end cells in "…"
            table.add_column(column, overflow="fold")
        else:
            # the first column is the row's key (GPU label, patch name): never folded, so it stays greppable
            table.add_column(column, overflow="fold", min_width=key_width if i == 0 else None)
    for i, row in enumerate(rows):
        table.add_row(*(Text(cell) for cell in row), style=styles[i] if styles else None)
    console.print(table)
    for line in caption:
        console.print(Text(line), soft_wrap=True)  # one line each, however long: greppable in logs
    if buffer is not None:
        sys.stdout.write("".join(line.rstrip() + "\n" for line in buffer.getvalue().splitlines()))
