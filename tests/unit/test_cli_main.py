"""``dbo-runtime``'s conventions: argparse's error line and exit 2 for a bad argument, a refused value in one
line, the engine arguments ``verify`` / ``tune`` hand on, and the two entry points."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from dbo_runtime.cli.main import main

ROOT = Path(__file__).resolve().parents[2]


def usage_error(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    out, err = capsys.readouterr()
    assert out == ""
    return err.strip().splitlines()[-1]


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        (["sms", "--platform", "cpu"], "dbo-runtime sms: error: argument --platform: invalid choice: 'cpu' (choose from 'cuda', 'rocm')"),
        (["sms", "--total-sms", "0"], "dbo-runtime sms: error: argument --total-sms: invalid value '0': allowed integers in [2, 1024]"),
        (["simulate", "--steps", "x"], "dbo-runtime simulate: error: argument --steps: invalid value 'x': allowed integers in [1, 1000]"),
        (["simulate", "--mode", "graphs"], "dbo-runtime simulate: error: argument --mode: invalid choice: 'graphs'"),
        (["tune", "--shape", "train"], "dbo-runtime tune: error: argument --shape: invalid choice: 'train'"),
        (["verify", "--max-tokens", "0"], "dbo-runtime verify: error: argument --max-tokens: invalid value '0': allowed integers in [1, 4096]"),
    ],
)
def test_a_bad_argument_is_argparses_line_naming_it_and_exit_2(argv: list[str], line: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert usage_error(capsys, argv).startswith(line)


@pytest.mark.parametrize("argv", [["sms", "--bogus"], ["--json", "sms", "--total-sms", "132"], ["doctor", "extra"]])
def test_arguments_a_command_does_not_take_are_refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert "error: unrecognized arguments:" in usage_error(capsys, argv)


def test_no_command_prints_the_help_as_vllm_does(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: dbo-runtime") and all(c in out for c in ("sms", "doctor", "simulate", "verify", "tune"))


def test_a_stray_option_without_a_command_is_an_error_not_the_help(capsys: pytest.CaptureFixture[str]) -> None:
    """``dbo-runtime --verison`` is a typo: one argparse line and exit 2, as vLLM's CLI answers it."""
    for argv in (["--verison"], ["-V"]):
        with pytest.raises(SystemExit) as stop:
            main(argv)
        assert stop.value.code == 2 and capsys.readouterr().err.splitlines()[-1] == f"dbo-runtime: error: unrecognized arguments: {argv[0]}"


def test_verify_and_tune_hand_unknown_arguments_on_as_engine_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    """The engine arguments reach the commands' own checks (no GPU needed): a DP size of 1 cannot microbatch."""
    for command in ("verify", "tune"):
        assert main([command, "--model", "m", "--enable-expert-parallel"]) == 2
        [line] = capsys.readouterr().err.splitlines()
        assert line.startswith(f"dbo-runtime {command}: error: --data-parallel-size is not given (vLLM's default is 1); allowed values: an integer >= 2")
        assert main([command, "--bogus", "m", "-dp", "2"]) == 2  # an unknown option before MODEL: said, not "no model"
        [line] = capsys.readouterr().err.splitlines()
        assert line.startswith(f"dbo-runtime {command}: error: MODEL is missing; allowed values: the model to {command}, right after {command}'s own options (--bogus came first)")


@pytest.mark.parametrize(("command", "defaults"), [("verify", ["(default 0.95)", "(default 0.25)"]), ("tune", ["(default 4,8,12,16,20)"])])
def test_verify_and_tune_usage_shows_the_model_and_engine_arguments(command: str, defaults: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    """Where the copied ``vllm serve`` line goes, in the usage an argparse error prints and in ``--help``."""
    usage = f"usage: dbo-runtime {command} [options] MODEL [vllm serve engine arguments]"
    with pytest.raises(SystemExit):
        main([command, "--timeout", "x"])
    assert capsys.readouterr().err.startswith(usage)
    with pytest.raises(SystemExit):
        main([command, "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert out.startswith(usage) and all(d in out for d in defaults), out


def test_a_value_refused_after_parsing_is_one_line_and_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["sms", "--total-sms", "132", "--comm-sms", "200"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.splitlines()) == 1 and err.startswith("dbo-runtime sms: error: --comm-sms=200 is not allowed")


def test_console_script_and_module_entry() -> None:
    """The two ways in: ``python -m dbo_runtime`` and ``main`` as the console script calls it."""
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}
    module = subprocess.run([sys.executable, "-m", "dbo_runtime", "sms", "--total-sms", "132"], capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert module.returncode == 0 and "132/20/112" in module.stdout, module.stderr
    script = subprocess.run(
        [sys.executable, "-c", "import sys; from dbo_runtime.cli.main import main; sys.exit(main())", "--version"],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=120,
    )  # fmt: skip
    assert script.returncode == 0 and script.stdout.startswith("dbo-runtime ")
