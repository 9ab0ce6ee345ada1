"""The operator's ``vllm serve`` arguments as ``verify`` and ``tune`` run them: offline, one process per DP rank,
DBO switched by the command; what an engine would refuse is refused before any starts."""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path
from typing import Any

from dbo_runtime.cli._common import EXIT_NO_DEVICE, CliError, say
from dbo_runtime.core.cli_support import StateError
from dbo_runtime.core.errors import ConfigError
from dbo_runtime.harness.launch import engine_arg, normal_arg

DP_SIZE_FLAGS = ("--data-parallel-size", "-dp")
UNSUPPORTED_FLAGS = (
    "--data-parallel-size-local", "-dpl", "--data-parallel-address", "-dpa", "--data-parallel-rpc-port", "-dpp",
    "--data-parallel-start-rank", "-dpr", "--data-parallel-hybrid-lb", "--data-parallel-external-lb", "--headless",
    "--api-server-count",
)  # fmt: skip
"""Multi-node / server-only options: the commands run offline on one node."""
DBO_FLAGS = ("--enable-dbo", "--no-enable-dbo")
DP_RULE = "an integer >= 2 (vLLM microbatches only with data parallelism; {command} needs DBO to run)"


def add_engine_command(subparsers: Any, name: str, doc: str, help_: str, timeout: float, timeout_help: str) -> argparse.ArgumentParser:
    """A subcommand that runs engines: its own options first, then the operator's ``vllm serve`` arguments."""
    p = subparsers.add_parser(name, help=help_, usage="%(prog)s [options] MODEL [vllm serve engine arguments]", description=doc.split("\n\n")[1].replace("``", "") + f" Put {name}'s own options first, then your `vllm serve` engine arguments.", allow_abbrev=False)
    p.add_argument("--timeout", type=float, default=timeout, metavar="S", help=f"{timeout_help} (default {timeout:.0f})")
    p.add_argument("--workdir", metavar="DIR", help="keep logs and records here (default: a temporary folder)")
    p.add_argument("--json", action="store_true", help="print the result as JSON on stdout (progress stays on stderr)")
    return p


def has_flag(args: list[str], *names: str) -> bool:
    return any(normal_arg(a).split("=", 1)[0] in names for a in args)


def split_engine_args(extra: list[str], command: str) -> tuple[list[str], int | None, list[str]]:
    """(engine arguments without the DP size and DBO flags, in vLLM's spelling; the DP size, None if not given; notes)."""
    notes: list[str] = []
    out: list[str] = []
    dp: int | None = None
    tokens = (normal_arg(a) for a in extra if a != "--")
    for arg in tokens:
        name, eq, value = arg.partition("=")
        if name == "--config":
            raise StateError("--config", "given", f"left out ({command} takes engine arguments on the command line only)")
        if name in UNSUPPORTED_FLAGS:
            raise StateError(name, "given", f"left out ({command} runs offline on one node)")
        if name in DBO_FLAGS:
            notes.append(f"{name} ignored: {command} sets DBO itself")
        elif name in DP_SIZE_FLAGS:
            if not eq:
                value = next(tokens, "")
            if not value.isdigit():
                raise ConfigError(name, value, DP_RULE.format(command=command))
            dp = int(value)
        else:
            out.append(arg)
    if out and not out[0].startswith("-"):
        out = ["--model", *out]  # `vllm serve MODEL ...`: the positional model
    model = engine_arg(out, "--model")
    if not model or model.startswith("-"):
        first = f" ({out[0]} came first)" if out else ""
        raise StateError("MODEL", "missing", f"the model to {command}, right after {command}'s own options{first}, as in `vllm serve MODEL ...` (or --model NAME_OR_PATH)")
    return out, dp, notes


def prepare(extra: list[str], command: str, *, expert_parallel: bool) -> tuple[list[str], int, list[str]]:
    """(engine arguments, DP size, notes) after every check an engine would fail, before any starts."""
    from dbo_runtime.cli._split import comm_sms_problem
    from dbo_runtime.core.cli_support import vllm_setting_problems
    from dbo_runtime.core.settings import setting_problems

    engine_args, given_dp, notes = split_engine_args(extra, command)
    dp = require_dbo_parallelism(engine_args, given_dp, command, expert_parallel=expert_parallel)
    backend = engine_arg(engine_args, "--all2all-backend")
    for problem in (qp_depth_problem(engine_args, os.environ), comm_sms_problem(os.environ, backend), *setting_problems(), *vllm_setting_problems()):
        if problem is not None:
            raise problem
    return engine_args, dp, [*switch_notes(), *notes]


def qp_depth_problem(engine_args: list[str], environ: Any) -> ConfigError | None:
    """DeepEP low-latency asserts ``nvshmem_qp_depth >= 2 * (dispatch tokens per rank + 1)`` at its first dispatch
    (tokens: ``--max-num-batched-tokens``, 256 unset, doubled in throughput mode): said before any engine starts."""
    if engine_arg(engine_args, "--all2all-backend") != "deepep_low_latency" or not has_flag(engine_args, "--enable-expert-parallel", "-ep"):
        return None
    given, raw = engine_arg(engine_args, "--max-num-batched-tokens"), environ.get("NVSHMEM_QP_DEPTH")
    tokens = int(given) if given and given.isdigit() else 256 * (2 if engine_arg(engine_args, "--performance-mode") == "throughput" else 1)
    need = 2 * (tokens + 1)
    if (1024 if raw is None else int(raw) if raw.isdigit() else -1) >= need:
        return None
    allowed = f"an integer >= {need} for DeepEP low-latency with --max-num-batched-tokens {tokens}, e.g. NVSHMEM_QP_DEPTH={max(8192, need)}"
    return StateError("NVSHMEM_QP_DEPTH", "unset (NVSHMEM default 1024)", allowed) if raw is None else ConfigError("NVSHMEM_QP_DEPTH", raw, allowed)


def require_dbo_parallelism(engine_args: list[str], dp: int | None, command: str, *, expert_parallel: bool = True) -> int:
    """The DP size: vLLM microbatches only with DP >= 2, and DBO's comm SMs serve the expert-parallel all2all."""
    if dp is None:
        raise StateError("--data-parallel-size", "not given (vLLM's default is 1)", DP_RULE.format(command=command))
    if dp < 2:
        raise ConfigError("--data-parallel-size", dp, DP_RULE.format(command=command))
    last = [normal_arg(a) for a in engine_args if normal_arg(a) in ("--enable-expert-parallel", "--no-enable-expert-parallel", "-ep")]
    if expert_parallel and (not last or last[-1] == "--no-enable-expert-parallel"):
        raise StateError("--enable-expert-parallel", "missing", "given (DBO overlaps the expert-parallel all2all)")
    return dp


def switch_notes() -> list[str]:
    """The plugin's switches as the engines will read them (a typo warns; ``DISABLE=1`` runs vanilla)."""
    from dbo_runtime.core.switches import parse_switch, switch_problems

    notes = list(switch_problems())
    if parse_switch("DBO_RUNTIME_DISABLE"):
        notes.append("DBO_RUNTIME_DISABLE is set: the engines run vLLM's own DBO, without dbo_runtime")
    return notes


def same_runner_env(environ: Any) -> dict[str, str]:
    """Pin the runner unless the operator did: vLLM may pick another for DBO, and a comparison must compare DBO only."""
    return {} if environ.get("VLLM_USE_V2_MODEL_RUNNER") is not None else {"VLLM_USE_V2_MODEL_RUNNER": "0"}


def check_with_vllm(engine_args: list[str], command: str) -> None:
    """Parse the engine arguments with vLLM's own parser before any GPU work (exit 3 where it cannot be built)."""
    try:
        from vllm.engine.arg_utils import EngineArgs
        from vllm.utils.argparse_utils import FlexibleArgumentParser
    except ImportError as exc:
        raise CliError(f"vLLM is not importable here ({exc}); {command} runs the real engine", EXIT_NO_DEVICE) from exc

    class _Parser(FlexibleArgumentParser):
        def error(self, message: str) -> Any:
            raise refused_engine_arg(message, command)

    try:
        parser = EngineArgs.add_cli_args(_Parser(prog="vllm", allow_abbrev=False))
    except Exception as exc:  # no GPU platform: vLLM's DeviceConfig cannot infer a device
        why = "no GPU platform" if "infer device type" in str(exc) else f"{type(exc).__name__}: {exc}"
        raise CliError(f"engine arguments not checked: vLLM cannot build its parser here ({why}); {command} needs a GPU machine", EXIT_NO_DEVICE) from exc
    parser.parse_args(engine_args)


def refused_engine_arg(message: str, command: str) -> StateError:
    """vLLM's parser refusal, naming the first unknown option and whether it is a ``vllm serve`` server option."""
    unknown = message.partition("unrecognized arguments:")[2].split()
    if not unknown:
        return StateError("an engine argument", f"refused by vLLM's parser ({message})", "vLLM engine arguments")
    name = next((u for u in unknown if u.startswith("-")), unknown[0]).split("=")[0]
    try:
        from vllm.entrypoints.common.cli_args import make_arg_parser
        from vllm.utils.argparse_utils import FlexibleArgumentParser

        server = name in make_arg_parser(FlexibleArgumentParser())._option_string_actions
    except Exception:  # another vLLM layout: the option is named all the same
        server = False
    why = f"it is a vllm serve server option; {command} runs the engine offline" if server else "vLLM has no such engine argument"
    return StateError(f"engine argument {name!r}", f"not allowed: {why}", "vLLM engine arguments")


def visible_gpus() -> int:
    try:
        import torch

        return int(torch.cuda.device_count()) if torch.cuda.is_available() else 0
    except Exception:
        return 0


def start(command: str, engine_args: list[str], gpus: int, why: str, notes: list[str], raw_workdir: str | None) -> Path:
    """The last checks before the engines start (vLLM's parser, the GPU count), the notes said, the work folder."""
    check_with_vllm(engine_args, command)
    if (visible := visible_gpus()) < gpus:
        raise CliError(f"needs {gpus} GPU(s) ({why}); {visible} visible", EXIT_NO_DEVICE)
    for note in notes:
        say(f"[{command}]", f"note: {note}")
    return workdir(raw_workdir, command)


def workdir(raw: str | None, command: str) -> Path:
    """``--workdir``, created right before the engines start; else a new temporary folder."""
    if raw is None:
        return Path(tempfile.mkdtemp(prefix=f"dbo-{command}-"))
    try:
        Path(raw).mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError("--workdir", raw, f"a folder {command} can create ({exc.strerror or exc})") from None
    return Path(raw)
