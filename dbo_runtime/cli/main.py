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
also an error document on stdout, parser-level errors included: a bad choice, an
unknown flag, a missing value); console scripts pass ``main()``'s return value to
``sys.exit``.
"""

from __future__ import annotations

import argparse
import ast
import difflib
import importlib
import pkgutil
import re
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any, NoReturn

from dbo_runtime import __version__
from dbo_runtime.cli._common import (
    EXIT_INTERRUPTED,
    EXIT_NO_DEVICE,
    EXIT_USAGE,
    CliError,
    OnceArgumentParser,
    interruptible,
)
from dbo_runtime.cli._engine import vllm_option_names
from dbo_runtime.core.errors import ConfigError, did_you_mean
from dbo_runtime.core.settings import StateError

PROG = "dbo-runtime"
PREFERRED_ORDER: tuple[str, ...] = ("sms", "doctor")
"""Order in ``--help``; other discovered subcommands follow alphabetically."""


_INVALID_CHOICE = re.compile(r"argument (?P<parameter>[^:]+): invalid choice: (?P<value>.*) \(choose from (?P<choices>.*)\)")


class UsageExit(SystemExit):
    """A parser-level refusal (unknown flag, bad choice, missing value), raised by ``OneLineArgumentParser.error``
    with what ``main`` needs to say it once more as a ``--json`` error document."""

    def __init__(self, prog: str, message: str, error: ConfigError | None) -> None:
        super().__init__(EXIT_USAGE)
        self.prog = prog
        self.message = message
        self.error = error


class OneLineArgumentParser(OnceArgumentParser):
    """argparse prints the whole usage block on a bad flag; operators asked for one line.

    A value outside a flag's choices is worded as every other refused value (``ConfigError``'s
    ``--mode='x' is not allowed; allowed values: ...``), not in argparse's own "invalid choice" words, so
    a refusal reads and greps the same whichever layer made it.

    Abbreviations are off for every parser (``allow_abbrev=False``): argparse would read ``--total 132`` as
    ``--total-sms 132``, so a typo could silently pick a flag, and a command that hands unknown arguments on
    (``verify``, ``tune``) must see an abbreviation of its own option as unknown to be able to refuse it.

    A single-value option given twice is refused (``OnceArgumentParser``), not read as its last value."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        choice = _INVALID_CHOICE.fullmatch(message)
        config = None
        if choice is not None:
            try:
                value = ast.literal_eval(choice["value"])
            except (ValueError, SyntaxError):
                value = choice["value"]
            config = ConfigError(choice["parameter"], value, choice["choices"])
            message = str(config) + _did_you_mean(str(value), choice["choices"])
            config.args = (message,)  # the --json document's message says the hint stderr says
        sys.stderr.write(f"{self.prog}: error: {message} (see {self.help_hint()})\n")
        raise UsageExit(self.prog, message, config)

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


def _did_you_mean(given: str, choices: str | list[str]) -> str:
    """`` (did you mean 'simulate'?)`` for the closest of ``choices`` (argparse's quoted list, or names), else empty."""
    return did_you_mean(given, re.findall(r"'([^']*)'", choices) if isinstance(choices, str) else choices)


def _own_options(command: str | None) -> list[str]:
    """``command``'s own ``--`` options, ``--help`` left out: the names a misspelt option is matched against."""
    sub = SUBPARSERS.get(command or "")
    return sorted(o for o in sub._option_string_actions if o.startswith("--") and o != "--help") if sub is not None else []


def _closest(name: str, own: list[str]) -> list[str]:
    """The one option of ``own`` close to ``name`` (0.8: ``--version`` is not offered ``--json``), or none."""
    return difflib.get_close_matches(name, own, n=1, cutoff=0.8)


def _unrecognized(command: str | None, extra: list[str]) -> str:
    """argparse's "unrecognized arguments" with the closest option of ``command`` for each unknown ``--`` one."""
    own = _own_options(command)
    hints = []
    for arg in extra:
        name = arg.split("=", 1)[0]
        if name.startswith("--") and (close := _closest(name.replace("_", "-"), own)):
            hints.append(f"{name}: did you mean {close[0]}?")
    hint = f" ({'; '.join(hints)})" if hints else ""
    return f"unrecognized arguments: {' '.join(extra)}{hint}"


SUBPARSERS: dict[str, argparse.ArgumentParser] = {}
"""Each subcommand's parser by name (``build_parser``): to tell an option given before its subcommand."""


def _misplaced(top: argparse.ArgumentParser, given: list[str]) -> tuple[str | None, str] | None:
    """A subcommand's option typed before the subcommand, or with none (``dbo-runtime --json sms``,
    ``dbo-runtime --total-sms 3``): (the subcommand named, if any; the one line that says where it goes).

    Read from the arguments as typed, before argparse: argparse takes such an option as the top level's and says
    only "unrecognized", and with no subcommand it takes the option's value for COMMAND (``COMMAND=3 is not
    allowed``). Options no subcommand knows are left to argparse, except that the line names them too."""
    if "--" in given:
        given = given[: given.index("--")]  # what follows is positional, never an option to move
    if any(a in ("-h", "--help", "--version") for a in given):
        return None  # help and the version win, as argparse gives them
    at = next((i for i, a in enumerate(given) if a in SUBPARSERS), None)
    command = None if at is None else given[at]
    head = given if at is None else given[:at]
    found: tuple[str, str, list[str]] | None = None  # (its name, as typed with its value, the subcommands that take it)
    unknown: list[str] = []
    i = 0
    while i < len(head):
        token = head[i]
        name = token.split("=", 1)[0]
        i += 1
        if not token.startswith("-") and command is None and found is None:
            return None  # a word where COMMAND goes: argparse's "COMMAND='simulat' is not allowed" says more
        if not token.startswith("-") or name in top._option_string_actions:
            continue
        owners = [c for c, sub in SUBPARSERS.items() if name in sub._option_string_actions]
        if not owners and command is not None and SUBPARSERS[command].get_default("_accepts_extra"):
            lookalike = _own_option_lookalike(command, [token])
            if lookalike is not None:  # moved after the subcommand it would be refused there: say it now
                return command, str(lookalike)
            owners = [command]  # verify / tune hand it to vLLM's parser, which reads it after the subcommand only
        if not owners:
            unknown.append(token)
            continue
        action = SUBPARSERS[owners[0]]._option_string_actions.get(name)
        takes_value = action.nargs != 0 if action is not None else i < len(head) and not head[i].startswith("-")
        typed = token
        if "=" not in token and takes_value and i < len(head):
            typed, i = f"{token} {head[i]}", i + 1
        found = found or (name, typed, owners)
    if found is None:
        return None
    name, typed, owners = found
    also = f"; also unrecognized: {' '.join(unknown)}" if unknown else ""
    if command is None:
        return None, f"argument {name} belongs to a subcommand ({', '.join(owners)}): give one first ({PROG} {owners[0]} {typed}){also}"
    if command not in owners:  # argparse would take its value for COMMAND
        return command, f"argument {name} is not an option of '{command}': it belongs to {', '.join(owners)}{also}"
    if name not in SUBPARSERS[command]._option_string_actions:
        return command, (
            f"argument {name} is no {PROG} option: {command} takes vLLM's engine arguments after the subcommand "
            f"({PROG} {command} {typed}){also}"
        )
    return command, f"argument {name} belongs to '{command}': give it after the subcommand ({PROG} {command} {typed}){also}"


def _own_option_lookalike(command: str, extra: list[str]) -> ConfigError | None:
    """An unknown argument of a command that hands unknown arguments on as vLLM engine arguments (``verify``,
    ``tune``) that looks like one of the command's own options: a prefix of one (``--rep`` for ``--reps``) or a
    close misspelling (``--prompt-lenght``).

    Why refused here: vLLM's parser takes abbreviations, so ``tune --rep 8`` would reach the engines as vLLM's
    ``--replayssm-buffer-len 8`` and ``--decode 4`` as ``--decode-context-parallel-size 4``, changing the
    engine while the command's own option stays at its default. A real vLLM option that only resembles one
    (``--max-logprobs``, close to verify's ``--max-dlogprob``) is not refused: vLLM's option names are looked up
    only when a close match is found, so the usual path imports no vLLM."""
    own = _own_options(command)
    for arg in extra:
        if not arg.startswith("--") or arg == "--":
            continue
        name = arg.split("=", 1)[0].split(".", 1)[0].replace("_", "-")
        prefixed = [o for o in own if o.startswith(name)]
        close = prefixed or _closest(name, own)
        if not close or (not prefixed and name in vllm_option_names()):
            continue
        return StateError(
            arg.split("=", 1)[0],
            f"not a {command} option (did you mean {' or '.join(close)}?)",
            f"{command}'s own options spelt in full, then vLLM's engine arguments (vLLM would read an abbreviation "
            f"as one of its own options; see {PROG} {command} --help)",
        )
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
    """Parse ``argv`` (default ``sys.argv[1:]``), run the subcommand, return its exit code (130 after Ctrl-C)."""
    return interruptible(lambda: _main(argv), PROG)


def _main(argv: Sequence[str] | None) -> int:
    parser = build_parser()
    given = list(sys.argv[1:] if argv is None else argv)
    try:
        # A subcommand that wraps another program (verify: vLLM's engine arguments) takes the
        # arguments it does not know; every other subcommand rejects them as argparse would.
        misplaced = _misplaced(parser, given)
        if misplaced is not None:
            command, message = misplaced
            print(f"{PROG}: error: {message}", file=sys.stderr)
            schema = SUBPARSERS[command].get_default("_schema") if command else None
            _json_error(_json_args(argparse.Namespace(_schema=schema), given), CliError(message, EXIT_USAGE), EXIT_USAGE)
            return EXIT_USAGE
        args, extra = parser.parse_known_args(given)
        if extra and not getattr(args, "_accepts_extra", False):
            where = f"{PROG} {args.command}" if args.command else PROG
            message = _unrecognized(args.command, extra)
            print(f"{where}: error: {message} (see {where} --help)", file=sys.stderr)
            _json_error(_json_args(args, given), CliError(message, EXIT_USAGE), EXIT_USAGE)
            return EXIT_USAGE
        lookalike = _own_option_lookalike(args.command, extra) if extra else None
        if lookalike is not None:
            print(f"{PROG} {args.command}: error: {lookalike}", file=sys.stderr)
            _json_error(args, lookalike, EXIT_USAGE)
            return EXIT_USAGE
        args.extra_args = extra
    except UsageExit as exc:  # already said on stderr; under --json also on stdout
        command = exc.prog.rsplit(" ", 1)[-1]
        schema = SUBPARSERS[command].get_default("_schema") if command in SUBPARSERS else None  # a misspelt COMMAND: none
        _json_error(_json_args(argparse.Namespace(_schema=schema), given), exc.error or CliError(exc.message, EXIT_USAGE), EXIT_USAGE)
        return EXIT_USAGE
    except SystemExit as exc:  # --help, --version
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    run = getattr(args, "_run", None)
    if run is None:
        commands = ", ".join(m.__name__.rsplit(".", 1)[-1] for m in subcommand_modules())
        message = f"a COMMAND is required: one of {commands}"
        print(f"{PROG}: error: {message} (see {PROG} --help)", file=sys.stderr)
        _json_error(_json_args(args, given), StateError("COMMAND", "missing", commands), EXIT_USAGE)
        return EXIT_USAGE
    where = f"{PROG} {args.command}"
    try:
        return int(run(args))
    except KeyboardInterrupt:
        interrupted = CliError("interrupted", EXIT_INTERRUPTED)
        print(f"{where}: {interrupted}", file=sys.stderr)
        _json_error(args, interrupted, EXIT_INTERRUPTED)
        return EXIT_INTERRUPTED
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


def _json_args(args: argparse.Namespace, given: list[str]) -> argparse.Namespace:
    """``args`` as ``_json_error`` reads them: a ``--json`` typed where no subcommand took it (``dbo-runtime --json``,
    ``dbo-runtime --json --bogus``) still asks for an error document, with no schema to name."""
    if getattr(args, "json", False) or "--json" not in given:
        return args
    return argparse.Namespace(json=True, _schema=getattr(args, "_schema", None))


def _json_error(args: argparse.Namespace, exc: Exception, exit_code: int) -> None:
    """Under ``--json`` a failure is a JSON document on stdout too: a script parsing stdout gets an answer.

    ``{"schema": <the command's schema>, "error": {"message", "parameter", "value", "state", "allowed"}, "exit_code"}``
    (``parameter``/``allowed`` are null unless a parameter was refused; ``value`` is the value refused, null when
    the parameter was refused for its state -- missing, given without a value, not an option -- which ``state``
    then names).
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
                "value": None if config is None or isinstance(config, StateError) else str(config.value),
                "state": config.state if isinstance(config, StateError) else None,
                "allowed": config.allowed if config else None,
            },
            "exit_code": exit_code,
        }
    )


if __name__ == "__main__":
    raise SystemExit(main())
