"""``dbo-runtime``: the command-line entry point and its subcommand registry.

Subcommands are discovered, not listed: every module of ``dbo_runtime.cli``
whose name does not start with ``_`` (and is not ``main``) and that defines

* ``add_parser(subparsers) -> argparse.ArgumentParser`` -- add its parser, and
* ``run(args: argparse.Namespace) -> int`` -- do the work, return the exit code,

becomes a subcommand; so a new one (``simulate``) is one new file and no edit
here. Such modules must stay cheap to import (stdlib and ``dbo_runtime.core``
at module level): building the parser imports all of them, and ``sms`` must run
on the GPU machine, which has no vLLM.

Exit codes (``dbo_runtime.cli._common``): 0 ok, 1 a check failed, 2 bad flag
or value (one line naming the parameter and the allowed values), 3 cannot run here (no GPU, too few
GPUs, no torch).
Expected failures print one line on stderr and never a traceback (with ``--json``
also an error document on stdout); console scripts pass ``main()``'s return
value to ``sys.exit``.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import pkgutil
import re
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import NoReturn

from dbo_runtime import __version__
from dbo_runtime.cli._common import EXIT_NO_DEVICE, EXIT_USAGE, CliError
from dbo_runtime.core.errors import ConfigError

PROG = "dbo-runtime"
PREFERRED_ORDER: tuple[str, ...] = ("sms", "doctor")
"""Order in ``--help``; other discovered subcommands follow alphabetically."""


_INVALID_CHOICE = re.compile(r"argument (?P<parameter>[^:]+): invalid choice: (?P<value>.*) \(choose from (?P<choices>.*)\)")


class OneLineArgumentParser(argparse.ArgumentParser):
    """argparse prints the whole usage block on a bad flag; operators asked for one line.

    A value outside a flag's choices is worded as every other refused value (``ConfigError``'s
    ``--mode='x' is not allowed; allowed values: ...``), not in argparse's own "invalid choice" words, so
    a refusal reads and greps the same whichever layer made it."""

    def error(self, message: str) -> NoReturn:
        choice = _INVALID_CHOICE.fullmatch(message)
        if choice is not None:
            try:
                value = ast.literal_eval(choice["value"])
            except (ValueError, SyntaxError):
                value = choice["value"]
            message = str(ConfigError(choice["parameter"], value, choice["choices"]))
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.help_hint()})\n")

    def help_hint(self) -> str:
        return f"{self.prog} --help"


def subcommand_modules() -> list[ModuleType]:
    """The modules of ``dbo_runtime.cli`` that define ``add_parser`` and ``run``."""
    import dbo_runtime.cli as package

    names = [m.name for m in pkgutil.iter_modules(package.__path__) if not m.name.startswith("_") and m.name != "main"]
    names.sort(key=lambda n: (PREFERRED_ORDER.index(n) if n in PREFERRED_ORDER else len(PREFERRED_ORDER), n))
    modules = []
    for name in names:
        module = importlib.import_module(f"{package.__name__}.{name}")
        if callable(getattr(module, "add_parser", None)) and callable(getattr(module, "run", None)):
            modules.append(module)
    return modules


SUBPARSERS: dict[str, argparse.ArgumentParser] = {}
"""Each subcommand's parser by name (``build_parser``): to tell an option given before its subcommand."""


def _misplaced(command: str | None, extra: list[str]) -> str | None:
    """An unknown argument that is an option of ``command`` was given before it (``dbo-runtime --json sms``):
    argparse reads it as the top level's and says only "unrecognized"."""
    sub = SUBPARSERS.get(command or "")
    if sub is None:
        return None
    for arg in extra:
        if arg.split("=", 1)[0] in sub._option_string_actions:
            return f"{PROG}: error: argument {arg.split('=', 1)[0]} belongs to '{command}': give it after the subcommand ({PROG} {command} {arg})"
    return None


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineArgumentParser(prog=PROG, description="DBO SM-budget introspection and vLLM integration checks.")
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module in subcommand_modules():
        sub = module.add_parser(subparsers)
        SUBPARSERS[sub.prog.rsplit(" ", 1)[-1]] = sub
        sub.set_defaults(
            _run=module.run,
            _schema=getattr(module, "SCHEMA", None),
            _accepts_extra=bool(getattr(module, "ACCEPTS_EXTRA_ARGS", False)),
        )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` (default ``sys.argv[1:]``), run the subcommand, return its exit code."""
    parser = build_parser()
    try:
        # A subcommand that wraps another program (verify: vLLM's engine arguments) takes the
        # arguments it does not know; every other subcommand rejects them as argparse would.
        args, extra = parser.parse_known_args(None if argv is None else list(argv))
        if extra and not getattr(args, "_accepts_extra", False):
            given = list(sys.argv[1:] if argv is None else argv)
            before = given[: given.index(args.command)] if args.command in given else []
            misplaced = _misplaced(args.command, [a for a in extra if a in before])
            if misplaced is not None:
                print(misplaced, file=sys.stderr)
                return EXIT_USAGE
            where = f"{PROG} {args.command}" if args.command else PROG
            print(f"{where}: error: unrecognized arguments: {' '.join(extra)} (see {where} --help)", file=sys.stderr)
            return EXIT_USAGE
        args.extra_args = extra
    except SystemExit as exc:  # --help, --version, usage errors
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    run = getattr(args, "_run", None)
    if run is None:
        commands = ", ".join(m.__name__.rsplit(".", 1)[-1] for m in subcommand_modules())
        print(f"{PROG}: error: a COMMAND is required: one of {commands} (see {PROG} --help)", file=sys.stderr)
        return EXIT_USAGE
    where = f"{PROG} {args.command}"
    try:
        return int(run(args))
    except ConfigError as exc:
        print(f"{where}: error: {exc}", file=sys.stderr)
        _json_error(args, exc, EXIT_USAGE)
        return EXIT_USAGE
    except CliError as exc:
        print(f"{where}: {exc}", file=sys.stderr)
        _json_error(args, exc, exc.exit_code)
        return exc.exit_code
    except ModuleNotFoundError as exc:
        if exc.name != "torch":
            raise
        # pip install --no-deps dbo-runtime (the README's path next to vLLM) brings no torch of its own
        missing = CliError("torch is not installed: this command needs torch (install vLLM 0.33.0 with its torch first)", EXIT_NO_DEVICE)
        print(f"{where}: {missing}", file=sys.stderr)
        _json_error(args, missing, EXIT_NO_DEVICE)
        return EXIT_NO_DEVICE


def _json_error(args: argparse.Namespace, exc: Exception, exit_code: int) -> None:
    """Under ``--json`` a failure is a JSON document on stdout too: a script parsing stdout gets an answer.

    ``{"schema": <the command's schema>, "error": {"message", "parameter", "value", "allowed"}, "exit_code"}``
    (``parameter``/``value``/``allowed`` are null unless a value was refused).
    """
    if not getattr(args, "json", False):
        return
    from dbo_runtime.cli._common import print_json

    config = exc if isinstance(exc, ConfigError) else None
    print_json(
        {
            "schema": getattr(args, "_schema", None),
            "error": {
                "message": str(exc),
                "parameter": config.parameter if config else None,
                "value": None if config is None else str(config.value),
                "allowed": config.allowed if config else None,
            },
            "exit_code": exit_code,
        }
    )


if __name__ == "__main__":
    raise SystemExit(main())
