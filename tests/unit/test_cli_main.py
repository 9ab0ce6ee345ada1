"""``dbo-runtime``'s own parsing (``cli.main``): abbreviations, engine-argument look-alikes, parser errors under
``--json``. CPU only: nothing here reaches an engine (``check_with_vllm`` is replaced where a run would get that far)."""

from __future__ import annotations

import json
import sys

import pytest

from dbo_runtime.cli import main as cli_main
from dbo_runtime.cli import tune, verify
from dbo_runtime.cli.main import main

ENGINE = ["--model", "m", "-dp", "2", "--enable-expert-parallel", "--all2all-backend", "deepep_high_throughput"]


def _reached(*_: object) -> None:
    pytest.fail("an argument that looks like the command's own option reached the engine-argument check")


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["tune", "--rep", "8"], "--rep is not a tune option (did you mean --reps?)"),
        (["tune", "--rep=8"], "--rep is not a tune option (did you mean --reps?)"),
        (["tune", "--decode", "4"], "--decode is not a tune option (did you mean --decode-batch?)"),
        (["tune", "--prompt_lenght", "8"], "--prompt_lenght is not a tune option (did you mean --prompt-len?)"),
        (["verify", "--max-tok", "8"], "--max-tok is not a verify option (did you mean --max-tokens?)"),
        (["verify", "--noise-flor"], "--noise-flor is not a verify option (did you mean --noise-floor?)"),
    ],
)
def test_an_abbreviated_or_misspelt_own_option_never_becomes_an_engine_argument(
    argv: list[str], said: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """vLLM's parser takes abbreviations: ``tune --rep 8`` would start engines with ``--replayssm-buffer-len 8``."""
    monkeypatch.setattr(tune, "check_with_vllm", _reached)
    monkeypatch.setattr(verify, "check_with_vllm", _reached)
    assert main([*argv, *ENGINE]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.splitlines()) == 1
    assert err.startswith(f"dbo-runtime {argv[0]}: error: {said}; allowed values: {argv[0]}'s own options spelt in full")


def test_a_real_vllm_option_that_resembles_an_own_option_still_passes(monkeypatch: pytest.MonkeyPatch) -> None:
    """``--max-logprobs`` (vLLM) is close to verify's ``--max-dlogprob``, and it is vLLM's: handed on."""
    monkeypatch.setattr(cli_main, "vllm_option_names", lambda: {"--max-logprobs", "--seed"})
    assert cli_main._own_option_lookalike("verify", ["--max-logprobs", "3"]) is None
    cli_main.build_parser()
    for extra in (["--seed", "1"], ["--max-num-seqs", "8"], ["--enforce-eager"], ["--max-model-len=4096"]):
        assert cli_main._own_option_lookalike("tune", extra) is None, extra


@pytest.mark.parametrize("argv", [["sms", "--total", "132"], ["sms", "--json", "--total=132"], ["simulate", "--step", "1"], ["doctor", "--js"]])
def test_no_parser_takes_an_abbreviation(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    assert "unrecognized arguments" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "schema", "parameter"),
    [
        (["simulate", "--json", "--mode", "bogus"], "dbo-runtime/simulate/v1", "--mode"),
        (["simulate", "--json", "--steps"], "dbo-runtime/simulate/v1", None),
        (["sms", "--json", "--bogus"], "dbo-runtime/sms/v1", None),
        (["doctor", "--json", "extra"], "dbo-runtime/doctor/v2", None),
        (["tune", "--json", "--rep", "8", *ENGINE], "dbo-runtime/tune/v1", "--rep"),
    ],
)
def test_a_parser_error_under_json_is_a_json_error_document_too(
    argv: list[str], schema: str, parameter: str | None, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    out, err = capsys.readouterr()
    doc = json.loads(out)
    assert doc["schema"] == schema and doc["exit_code"] == 2 and doc["error"]["parameter"] == parameter
    assert doc["error"]["message"] in err and len(err.splitlines()) == 1


def test_a_json_error_for_a_refused_state_names_the_state_not_a_value(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["tune", "--json", "--rep", "8", *ENGINE]) == 2
    error = json.loads(capsys.readouterr().out)["error"]
    assert error["value"] is None and error["state"] == "not a tune option (did you mean --reps?)"
    assert main(["simulate", "--json", "--mode", "bogus"]) == 2
    error = json.loads(capsys.readouterr().out)["error"]
    assert error["state"] is None and error["value"] is not None


def test_a_parser_error_without_json_leaves_stdout_empty(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--mode", "bogus"]) == 2
    assert capsys.readouterr().out == ""


def test_ctrl_c_during_a_command_is_one_line_exit_130_and_a_json_document(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Ctrl-C inside a subcommand: one line naming it, exit 130 (the shell's 128 + SIGINT), and under --json the
    error document a script parsing stdout waits for; never Python's traceback."""
    from dbo_runtime.cli import simulate

    def interrupted(args: object) -> int:
        raise KeyboardInterrupt

    monkeypatch.setattr(simulate, "run", interrupted)
    assert main(["simulate"]) == 130
    out, err = capsys.readouterr()
    assert out == "" and err.splitlines() == ["dbo-runtime simulate: interrupted"]
    assert main(["simulate", "--json"]) == 130
    doc = json.loads(capsys.readouterr().out)
    assert doc["exit_code"] == 130 and "interrupted" in json.dumps(doc)


def test_a_real_sigint_ends_the_command_without_a_traceback(tmp_path: object) -> None:
    """The same with a real SIGINT to a running ``dbo-runtime simulate`` (sent once it reports its first step)."""
    import signal
    import subprocess
    import sys

    proc = subprocess.Popen(
        [sys.executable, "-m", "dbo_runtime", "simulate", "--preset", "small", "--steps", "64"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert proc.stderr is not None
    first = proc.stderr.readline()
    proc.send_signal(signal.SIGINT)
    rest = proc.stderr.read()
    assert proc.wait(timeout=60) == 130, (first, rest)
    assert "Traceback" not in rest and rest.splitlines()[-1] == "dbo-runtime simulate: interrupted"


@pytest.mark.parametrize("argv", [["simulate", "--steps", "1"], ["sms", "--total-sms", "132"]])
def test_a_reader_that_stops_early_ends_the_command_with_141_and_no_traceback(argv: list[str]) -> None:
    """``simulate | head -1``: Python raises BrokenPipeError where a C tool would die of SIGPIPE. The command ends
    with the shell's 128 + SIGPIPE (so ``pipefail`` sees the cut) and no traceback, never exit 1, which means a
    check failed."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # a small output waits in the buffer to the end
    proc = subprocess.Popen([sys.executable, "-m", "dbo_runtime", *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # before the import is done (seconds): every write to stdout then meets a closed pipe
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=300) == 141, err
    assert "Traceback" not in err and "BrokenPipeError" not in err


@pytest.mark.parametrize(
    ("argv", "stdout", "said"),
    [
        (["sms", "--total-sms", "132"], "closed", "dbo-runtime: error: stdout is closed; it needs an open stdout"),
        (["doctor", "--json"], "closed", "dbo-runtime: error: stdout is closed; it needs an open stdout"),
        (["sms", "--total-sms", "132"], "/dev/full", "dbo-runtime: error: stdout cannot be written (No space left on device); the output is lost"),
        (["doctor", "--json"], "/dev/full", "dbo-runtime: error: stdout cannot be written (No space left on device); the output is lost"),
    ],
)
def test_a_stdout_that_cannot_be_written_is_one_line_and_exit_3(argv: list[str], stdout: str, said: str) -> None:
    """``>&-`` or a full disk: the output cannot reach anyone, so the command says so in one line on stderr and
    ends with 3 ("cannot run here"), never a traceback and exit 1 ("a check failed")."""
    import os
    import subprocess
    import sys

    if stdout == "/dev/full" and not os.path.exists("/dev/full"):
        pytest.fail("/dev/full is part of every Linux machine this suite runs on")
    shell = f"exec {sys.executable} -m dbo_runtime {' '.join(argv)} " + (">&-" if stdout == "closed" else "> /dev/full")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # buffered, as on an operator's shell
    proc = subprocess.run(["/bin/sh", "-c", shell], stderr=subprocess.PIPE, text=True, timeout=300, env=env)
    assert proc.returncode == 3, proc.stderr
    assert proc.stderr.splitlines()[-1].startswith(said) and "Traceback" not in proc.stderr, proc.stderr


def test_another_files_os_error_is_not_taken_for_stdout(capsys: pytest.CaptureFixture[str]) -> None:
    """Only an error stdout itself raised becomes "stdout cannot be written": a command's own file error keeps its
    own handling (here: it propagates), and stdout is the original stream again afterwards."""
    from dbo_runtime.cli._common import interruptible

    before = sys.stdout

    def fails() -> int:
        print("some output")
        raise OSError(28, "No space left on device", "/tmp/x.json")

    with pytest.raises(OSError):
        interruptible(fails, "x")
    assert sys.stdout is before and capsys.readouterr().out == "some output\n"
