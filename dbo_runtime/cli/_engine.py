"""The operator's vLLM engine arguments, as the real-engine commands (``verify``, ``tune``) take them.

Both run the operator's own ``vllm serve`` arguments offline, one process per data-parallel rank, and add the
DBO switches themselves; so the DP size is taken off the arguments, the DBO flags are dropped, and the options
that only make sense for a server or several nodes are refused before any engine starts.
"""

from __future__ import annotations

from typing import Any

from dbo_runtime.cli._common import CliError
from dbo_runtime.core.errors import ConfigError
from dbo_runtime.core.settings import StateError

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


def normal_arg(arg: str) -> str:
    """One command-line token as vLLM's ``FlexibleArgumentParser`` reads it: in a ``--`` option's name
    (up to the first ``.``, the nested-key separator) underscores are dashes, so ``--data_parallel_size``
    is ``--data-parallel-size``; values and short options are left alone. Every place the CLI inspects the
    engine arguments reads them through this, or an underscore spelling would slip past its checks."""
    if not arg.startswith("--"):
        return arg
    name, eq, value = arg.partition("=")
    head, dot, rest = name[2:].partition(".")
    return f"--{head.replace('_', '-')}{dot}{rest}{eq}{value}"


def engine_arg(args: list[str], flag: str) -> str | None:
    """The value vLLM takes for ``flag``: the last one given, ``--flag v`` or ``--flag=v``, in any spelling
    ``normal_arg`` accepts; None when absent."""
    found: str | None = None
    for i, arg in enumerate(args):
        name, eq, value = normal_arg(arg).partition("=")
        if name == flag:
            found = value if eq else (args[i + 1] if i + 1 < len(args) else "")
    return found


def has_flag(args: list[str], *names: str) -> bool:
    """Whether any of ``names`` is given, in any spelling ``normal_arg`` accepts."""
    return any(normal_arg(a).split("=", 1)[0] in names for a in args)


def split_engine_args(extra: list[str], command: str = "verify") -> tuple[list[str], int, list[str]]:
    """(engine args without DP size / DBO flags, DP size, notes). Pure: tested on CPU.

    The arguments come back in vLLM's own spelling (``normal_arg``), which vLLM parses exactly as the
    operator's, so every later check sees one spelling."""
    args = [normal_arg(a) for a in extra if a != "--"]
    notes = []
    dp = 1
    out: list[str] = []
    i = 0
    while i < len(args):
        arg = args[i]
        name, eq, value = arg.partition("=")
        if name == "--config":
            raise StateError(
                "--config", "given", f"left out ({command} takes the engine arguments on the command line only: "
                f"a config file could set enable_dbo or data_parallel_size behind {command}'s back)"
            )
        if name in UNSUPPORTED_FLAGS:
            raise StateError(name, "given", f"left out ({command} runs offline on one node)")
        if name in DBO_FLAGS:
            notes.append(f"{name} ignored: {command} sets DBO itself")
            i += 1
            continue
        if name in DP_SIZE_FLAGS:
            if not eq:
                if i + 1 >= len(args):
                    raise StateError(name, "given without a value", "a positive integer")
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
        raise StateError("--model", "missing", what)
    for i, arg in enumerate(out):
        if arg == "--model" and (i + 1 == len(out) or out[i + 1].startswith("-")):
            raise StateError("--model", "given without a value", what)
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
        name = normal_arg(arg).split("=", 1)[0]
        if name in (on, off):
            last = name
    return last == on


def vllm_option_names() -> set[str]:
    """vLLM's engine-argument names (``--field-name`` and ``--no-field-name`` per ``EngineArgs`` field); empty
    without vLLM. Read from the dataclass, which imports on a machine without a GPU, unlike vLLM's parser."""
    try:
        import dataclasses

        from vllm.engine.arg_utils import EngineArgs
    except Exception:
        return set()
    names = {"--" + f.name.replace("_", "-") for f in dataclasses.fields(EngineArgs)}
    return names | {"--no-" + n[2:] for n in names}


def misspelt(engine_args: list[str], flag: str) -> str | None:
    """The option in ``engine_args`` that is a near miss of ``flag`` and no vLLM option, else None. The real-engine
    commands check the DP size and expert parallelism before vLLM's own parser runs (that parser needs a GPU
    platform to be built at all), so without this a misspelt flag would be reported as a missing one."""
    import difflib

    names = {normal_arg(a).split("=", 1)[0] for a in engine_args if a.startswith("--")}
    near = difflib.get_close_matches(flag, sorted(names - {flag}), n=1, cutoff=0.85)
    return near[0] if near and near[0] not in vllm_option_names() else None


def _refuse_misspelt(engine_args: list[str], flag: str) -> None:
    near = misspelt(engine_args, flag)
    if near is not None:
        raise StateError(near, f"not a vLLM engine argument (did you mean {flag}?)", "vLLM's engine arguments spelt in full")


def require_dbo_parallelism(
    engine_args: list[str], dp: int, command: str, *, expert_parallel: bool = True, dp_given: bool = True
) -> None:
    """DBO microbatches only with data parallelism, and its comm SMs serve the expert-parallel all2all: a run
    without them would prove nothing about DBO (vLLM never splits a step). ``dp_given``: whether the operator
    passed a DP size at all (the refusal then says the 1 is vLLM's default, or names the near miss typed)."""
    if dp < 2:
        if not dp_given:
            _refuse_misspelt(engine_args, DP_SIZE_FLAGS[0])
        unset = "" if dp_given else " (none given; vLLM's default is 1)"
        raise ConfigError(
            "--data-parallel-size", dp, f"2 or more{unset}: vLLM microbatches only with data parallelism ({command} needs DBO to run)"
        )
    if expert_parallel and not (flag_set(engine_args, "--enable-expert-parallel", "--no-enable-expert-parallel") or "-ep" in engine_args):
        _refuse_misspelt(engine_args, "--enable-expert-parallel")
        off = has_flag(engine_args, "--no-enable-expert-parallel")
        state = "turned off (--no-enable-expert-parallel given last)" if off else "missing"
        raise StateError("--enable-expert-parallel", state, "given (DBO overlaps the expert-parallel all2all)")


def comm_sms_problem(engine_args: list[str], environ: Any, *, backend: str | None = None) -> ConfigError | None:
    """``VLLM_DBO_COMM_SMS`` as the engines will read it, checked before any starts (vLLM would fail in the
    middle of the DBO run, after the DBO-off one): the split ``sms`` computes (``_inputs.budget_for``, so the
    same value gets the same words everywhere) on this GPU, or on the H200 profile where none is visible.
    ``backend``: the all2all backend when the engine arguments name none (``doctor``: the default HT)."""
    from dbo_runtime.cli._inputs import COMM_ENV, Input, budget_for, comm_input
    from dbo_runtime.core.budget import ALL2ALL_BACKENDS, BACKEND_MAX_SMS_USED, H200_SMS

    if environ.get(COMM_ENV) is None:
        return None
    chosen = engine_arg(engine_args, "--all2all-backend") or backend
    total = Input(H200_SMS, "default", "the H200 profile: no GPU visible here")
    major = 9
    try:
        import torch

        if torch.cuda.is_available():
            props = torch.cuda.get_device_properties(0)
            total, major = Input(int(props.multi_processor_count), "hardware", "CUDA"), int(props.major)
    except Exception:
        pass
    try:
        budget_for(
            total=total,
            comm=comm_input(None, "cuda", environ),
            max_sms_used=Input(BACKEND_MAX_SMS_USED.get(chosen or ""), "vllm-0.33.0-manager"),
            platform="cuda",
            all2all_backend=chosen if chosen in ALL2ALL_BACKENDS else None,
            where="the engines' GPU",
            sm_major=major,
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
    """Parse the engine arguments with vLLM's own parser; one line on error, before any GPU work.

    Without a GPU platform vLLM cannot build the parser at all: that is said as what it is (nothing was
    checked, exit 3), so the caller reports a check only after this returns.

    Abbreviations are refused (the engine runner parses the same way, ``harness.runner``): vLLM's own parser
    would take ``--max-num-batched 4096`` for ``--max-num-batched-tokens``, past every check here that reads
    the engine arguments by their full names."""
    try:
        from vllm.engine.arg_utils import EngineArgs
        from vllm.utils.argparse_utils import FlexibleArgumentParser
    except ImportError as exc:
        raise CliError(f"vLLM is not importable here ({exc}); {command} runs the real engine", EXIT_RUN_FAILED) from exc

    class _Parser(FlexibleArgumentParser):
        def error(self, message: str) -> Any:  # argparse would print usage and exit 2
            raise ConfigError("VLLM_ENGINE_ARGS", " ".join(engine_args), f"arguments vLLM accepts ({message})")

    try:
        parser = EngineArgs.add_cli_args(_Parser(prog="vllm", allow_abbrev=False))
    except Exception as exc:  # e.g. no GPU platform: vLLM's DeviceConfig cannot infer a device
        why = "no GPU platform: vLLM cannot infer a device type" if "infer device type" in str(exc) else f"{type(exc).__name__}: {exc}"
        raise CliError(
            f"engine arguments not checked: vLLM cannot build its parser here ({why}); {command} needs a GPU machine",
            EXIT_RUN_FAILED,
        ) from exc
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
    "engine_arg",
    "flag_set",
    "has_flag",
    "misspelt",
    "normal_arg",
    "require_dbo_parallelism",
    "same_runner_env",
    "split_engine_args",
    "switch_notes",
    "visible_gpus",
    "vllm_option_names",
]
