"""The operator's vLLM engine arguments, as the real-engine commands (``verify``, ``tune``) take them.

Both run the operator's own ``vllm serve`` arguments offline, one process per data-parallel rank, and add the
DBO switches themselves; so the DP size is taken off the arguments, the DBO flags are dropped, and the options
that only make sense for a server or several nodes are refused before any engine starts.
"""

from __future__ import annotations

from typing import Any

from dbo_runtime.cli._common import CliError
from dbo_runtime.core.errors import ConfigError

EXIT_RUN_FAILED = 3
"""An engine run failed or cannot start here (no vLLM, too few GPUs)."""
EXIT_INCONCLUSIVE = 4
"""DBO never microbatched, so the runs prove nothing about it."""

DP_SIZE_FLAGS = ("--data-parallel-size", "-dp")
UNSUPPORTED_FLAGS = (
    "--data-parallel-size-local",
    "-dpl",
    "--data-parallel-address",
    "-dpa",
    "--data-parallel-rpc-port",
    "-dpp",
    "--data-parallel-start-rank",
    "-dpr",
    "--data-parallel-hybrid-lb",
    "--data-parallel-external-lb",
    "--headless",
    "--api-server-count",
)
"""Multi-node / server-only DP options: the commands run offline on one node."""
DBO_FLAGS = ("--enable-dbo", "--no-enable-dbo")


def split_engine_args(extra: list[str], command: str = "verify") -> tuple[list[str], int, list[str]]:
    """(engine args without DP size / DBO flags, DP size, notes). Pure: tested on CPU."""
    args = [a for a in extra if a != "--"]
    notes = []
    dp = 1
    out: list[str] = []
    i = 0
    while i < len(args):
        arg = args[i]
        name, eq, value = arg.partition("=")
        if name == "--config":
            raise ConfigError(
                "--config", value or "(set)", f"not supported by {command}: pass the engine arguments on the command "
                f"line (a config file could set enable_dbo or data_parallel_size behind {command}'s back)"
            )
        if name in UNSUPPORTED_FLAGS:
            raise ConfigError(name, value or "(set)", f"not supported by {command}: it runs offline on one node (leave it out)")
        if name in DBO_FLAGS:
            notes.append(f"{name} ignored: {command} sets DBO itself")
            i += 1
            continue
        if name in DP_SIZE_FLAGS:
            if not eq:
                if i + 1 >= len(args):
                    raise ConfigError(name, "(missing)", "a positive integer")
                value = args[i + 1]
                i += 1
            try:
                dp = int(value)
            except ValueError as exc:
                raise ConfigError(name, value, "a positive integer") from exc
            if dp < 1:
                raise ConfigError(name, value, "a positive integer")
            i += 1
            continue
        out.append(arg)
        i += 1
    what = f"the model to {command}, as for `vllm serve` (--model NAME_OR_PATH)"
    if not any(a == "--model" or a.startswith("--model=") for a in out) and not (out and not out[0].startswith("-")):
        raise ConfigError("--model", "(missing)", what)
    for i, arg in enumerate(out):
        if arg == "--model" and (i + 1 == len(out) or out[i + 1].startswith("-")):
            raise ConfigError("--model", "(no value)", what)
    if out and not out[0].startswith("-"):
        out = ["--model", *out]  # `vllm serve MODEL ...` style: the positional model
    if dp == 1:
        notes.append(
            "data-parallel size 1: vLLM never microbatches without data parallelism, so DBO cannot run; "
            "pass --data-parallel-size 2 or more"
        )
    return out, dp, notes


def flag_set(engine_args: list[str], on: str, off: str) -> bool:
    """vLLM's reading of a boolean flag pair: the last of ``on`` / ``off`` given wins (absent: off)."""
    last = None
    for arg in engine_args:
        name = arg.split("=", 1)[0].replace("_", "-")
        if name in (on, off):
            last = name
    return last == on


def require_dbo_parallelism(engine_args: list[str], dp: int, command: str, *, expert_parallel: bool = True) -> None:
    """DBO microbatches only with data parallelism, and its comm SMs serve the expert-parallel all2all: a run
    without them would prove nothing about DBO (vLLM never splits a step)."""
    if dp < 2:
        raise ConfigError("--data-parallel-size", dp, f"2 or more: vLLM microbatches only with data parallelism ({command} needs DBO to run)")
    if expert_parallel and not (flag_set(engine_args, "--enable-expert-parallel", "--no-enable-expert-parallel") or "-ep" in engine_args):
        raise ConfigError("--enable-expert-parallel", "(missing)", "set: DBO overlaps the expert-parallel all2all")


def comm_sms_problem(engine_args: list[str], environ: Any) -> ConfigError | None:
    """``VLLM_DBO_COMM_SMS`` as the engines will read it, checked before any starts (vLLM would fail in the
    middle of the DBO run, after the DBO-off one): vLLM 0.33.0's policy on this GPU, or an H200 without one."""
    raw = environ.get("VLLM_DBO_COMM_SMS")
    if raw is None:
        return None
    from dbo_runtime.core.budget import ALL2ALL_BACKENDS, H200_SMS, compute_budget
    from dbo_runtime.harness.launch import engine_arg

    backend = engine_arg(engine_args, "--all2all-backend")
    total = H200_SMS
    try:
        import torch

        if torch.cuda.is_available():
            total = int(torch.cuda.get_device_properties(0).multi_processor_count)
    except Exception:
        pass
    try:
        compute_budget(
            total_sms=total,
            platform="cuda",
            enable_dbo=True,
            expert_parallel=True,
            all2all_backend=backend if backend in ALL2ALL_BACKENDS else None,
            env_comm_sms=raw,
            compute_multiple=2,
        )
    except ConfigError as exc:
        return exc
    return None


def switch_notes() -> list[str]:
    """The plugin's own switches as the engines will read them (a typo warns; ``DISABLE=1`` runs vanilla)."""
    from dbo_runtime.core.switches import parse_switch, switch_problems

    notes = list(switch_problems())
    try:
        if parse_switch("DBO_RUNTIME_DISABLE"):
            notes.append("DBO_RUNTIME_DISABLE is set: the engines run vLLM's own DBO, without dbo_runtime")
    except Exception:
        pass
    return notes


def same_runner_env(environ: Any) -> dict[str, str]:
    """vLLM 0.33 falls back to the V1 runner for DBO unless ``VLLM_USE_V2_MODEL_RUNNER`` is set
    (``VllmConfig`` lists "dual batch overlap" as unsupported by V2 then), while a run without DBO takes
    its default. Pin V1 for every run in that case, or a comparison would compare runners, not DBO."""
    return {} if environ.get("VLLM_USE_V2_MODEL_RUNNER") is not None else {"VLLM_USE_V2_MODEL_RUNNER": "0"}


def check_with_vllm(engine_args: list[str], command: str = "verify") -> None:
    """Parse the engine arguments with vLLM's own parser; one line on error, before any GPU work."""
    try:
        from vllm.engine.arg_utils import EngineArgs
        from vllm.utils.argparse_utils import FlexibleArgumentParser
    except ImportError as exc:
        raise CliError(f"vLLM is not importable here ({exc}); {command} runs the real engine", EXIT_RUN_FAILED) from exc

    class _Parser(FlexibleArgumentParser):
        def error(self, message: str) -> Any:  # argparse would print usage and exit 2
            raise ConfigError("VLLM_ENGINE_ARGS", " ".join(engine_args), f"arguments vLLM accepts ({message})")

    try:
        parser = EngineArgs.add_cli_args(_Parser(prog="vllm"))
    except Exception as exc:  # e.g. no GPU platform: vLLM's DeviceConfig cannot infer a device
        why = "no GPU platform: vLLM cannot infer a device type" if "infer device type" in str(exc) else f"{type(exc).__name__}: {exc}"
        raise CliError(f"vLLM cannot run on this machine ({why}); {command} needs a GPU machine", EXIT_RUN_FAILED) from exc
    parser.parse_args(engine_args)


def visible_gpus() -> int:
    try:
        import torch

        return int(torch.cuda.device_count()) if torch.cuda.is_available() else 0
    except Exception:
        return 0


__all__ = [
    "EXIT_INCONCLUSIVE",
    "EXIT_RUN_FAILED",
    "check_with_vllm",
    "comm_sms_problem",
    "flag_set",
    "require_dbo_parallelism",
    "same_runner_env",
    "split_engine_args",
    "switch_notes",
    "visible_gpus",
]
