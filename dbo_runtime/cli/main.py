"""``dbo-runtime``: one argparse parser, one module per subcommand (``add_parser``, ``run``). A bad argument or a
``ConfigError``: one line, exit 2 (``verify``/``tune`` hand unknown ones to vLLM); a ``CliError``: one line, its code."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from dbo_runtime import __version__
from dbo_runtime.cli import doctor, simulate, sms, tune, verify
from dbo_runtime.cli._common import EXIT_NO_DEVICE, EXIT_USAGE, CliError
from dbo_runtime.core.errors import ConfigError

PROG = "dbo-runtime"
COMMANDS = (sms, doctor, simulate, verify, tune)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description="DBO SM-budget introspection and vLLM integration checks.")
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module in COMMANDS:
        module.add_parser(subparsers).set_defaults(run=module.run, takes_engine_args=hasattr(module, "ENGINE_ARGS"))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and not (args.command and args.takes_engine_args):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if args.command is None:  # as vLLM's own CLI: no subcommand prints the help
        parser.print_help()
        return 0
    args.extra_args = extra
    where = f"{PROG} {args.command}"
    try:
        return int(args.run(args))
    except ConfigError as exc:
        print(f"{where}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except CliError as exc:
        print(f"{where}: {exc}", file=sys.stderr)
        return exc.exit_code
    except ModuleNotFoundError as exc:
        if exc.name != "torch":
            raise
        print(f"{where}: torch is not installed: this command needs torch (install vLLM with its torch)", file=sys.stderr)
        return EXIT_NO_DEVICE


if __name__ == "__main__":
    raise SystemExit(main())
