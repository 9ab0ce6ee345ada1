"""``dbo-runtime verify`` before any engine starts: what it refuses, what it leaves on disk, what it claims to
have checked, on CPU with the real vLLM 0.33.0 (its argument parser needs a GPU platform, so a run here stops
at that point at the latest). The verdict logic and the fake-engine runs are in tests/vllm/test_cli_verify.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from dbo_runtime.cli import verify
from dbo_runtime.cli._engine import misspelt
from dbo_runtime.cli.main import main

HT = ["--model", "m", "-dp", "2", "--enable-expert-parallel", "--all2all-backend", "deepep_high_throughput"]


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("VLLM_DBO_COMM_SMS", "NVSHMEM_QP_DEPTH", "DBO_RUNTIME_DISABLE"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def no_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fails the test if verify gets as far as vLLM's parser (the last step before engines start)."""

    def reached(args: list[str], command: str = "verify") -> None:
        raise AssertionError("verify reached vLLM's parser: the refusal came too late")

    monkeypatch.setattr(verify, "check_with_vllm", reached)


def _one_line(capsys: pytest.CaptureFixture[str]) -> str:
    err = [line for line in capsys.readouterr().err.splitlines() if not line.startswith("[verify]")]
    assert len(err) == 1 and "Traceback" not in err[0], err
    return err[0]


@pytest.mark.parametrize(
    ("env", "engine", "needle"),
    [
        ({"VLLM_DBO_COMM_SMS": "19"}, HT, "VLLM_DBO_COMM_SMS=19 is not allowed"),
        ({}, ["--model", "m", "-dp", "2", "--enable-expert-parallel", "--all2all-backend", "deepep_low_latency",
              "--max-num-batched-tokens", "2048"], "NVSHMEM_QP_DEPTH is unset (NVSHMEM default 1024); allowed values: an integer >= 4098"),
        ({"DBO_RUNTIME_TOPK_LAYOUT": "bad"}, HT, "DBO_RUNTIME_TOPK_LAYOUT='bad' is not allowed; allowed values: 'windows', 'copies'"),
        ({"DBO_RUNTIME_PLANNER_WARM_MAX_BATCH": "x"}, HT, "DBO_RUNTIME_PLANNER_WARM_MAX_BATCH='x' is not allowed"),
        ({"VLLM_DEEP_GEMM_WARMUP": "bogus"}, HT, "VLLM_DEEP_GEMM_WARMUP='bogus' is not allowed; allowed values: 'skip', 'full' or 'relax'"),
        ({"VLLM_DEEP_GEMM_WARMUP": "bogus", "DBO_RUNTIME_DISABLE": "1"}, HT, "VLLM_DEEP_GEMM_WARMUP='bogus' is not allowed"),
    ],
)  # fmt: skip
def test_a_refusal_creates_no_workdir(
    env: dict[str, str], engine: list[str], needle: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str], no_engine: None,
) -> None:  # fmt: skip
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    work = tmp_path / "new" / "sub"
    assert main(["verify", "--workdir", str(work), *engine]) == 2
    assert needle in _one_line(capsys) and not (tmp_path / "new").exists()


def test_no_gpu_creates_no_workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(verify, "check_with_vllm", lambda args, command="verify": None)  # vLLM's parser needs a GPU platform
    monkeypatch.setattr(verify, "visible_gpus", lambda: 0)
    assert main(["verify", "--workdir", str(tmp_path / "new" / "sub"), *HT]) == 3
    assert "needs 2 GPU(s)" in _one_line(capsys) and not (tmp_path / "new").exists()


@pytest.mark.parametrize(
    ("workdir", "why"),
    [
        ("/proc/x", "/proc is not writable: its file system takes no new files"),  # not "No such file or directory"
        ("/proc/self/x/y", "/proc/self is not writable: its file system takes no new files"),
        ("/dev/null/x", "/dev/null is not a folder"),
    ],
)
def test_a_system_path_workdir_says_why_it_cannot_be_written(
    workdir: str, why: str, capsys: pytest.CaptureFixture[str], no_engine: None
) -> None:
    assert main(["verify", "--workdir", workdir, *HT]) == 2
    assert _one_line(capsys) == (
        f"dbo-runtime verify: error: --workdir='{workdir}' is not allowed; allowed values: a folder verify can create "
        f"and write ({why})"
    )


def test_a_read_only_workdir_is_refused_with_the_reason_and_nothing_made(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], no_engine: None
) -> None:
    """Root passes every permission test, so the check writes a file and reads the answer; a read-only mount is
    stood in for by the write's own error (``EROFS``)."""
    import errno
    import tempfile

    def read_only(*args: object, **kwargs: object) -> None:
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(tempfile, "TemporaryFile", read_only)
    assert main(["verify", "--workdir", str(tmp_path / "new" / "sub"), *HT]) == 2
    assert _one_line(capsys).endswith(f"a folder verify can create and write ({tmp_path} is not writable: Read-only file system)")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("content", "why"),
    [(b"one\n\xff two\n", "(byte 4 is not UTF-8)"), (None, "(cannot be read: Input/output error)")],
    ids=["not-utf8", "unreadable"],
)
def test_a_prompt_file_that_cannot_be_read_says_why(
    content: bytes | None, why: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], no_engine: None
) -> None:
    """The reason, not the exception's class name ("(OSError)"): /proc/self/mem is a file every read of which fails."""
    path = tmp_path / "p.txt" if content is not None else Path("/proc/self/mem")
    if content is not None:
        path.write_bytes(content)
    assert main(["verify", "--prompt-file", str(path), *HT]) == 2
    assert _one_line(capsys) == (
        f"dbo-runtime verify: error: --prompt-file='{path}' is not allowed; allowed values: a readable UTF-8 text file {why}"
    )


def test_a_workdir_under_a_file_is_refused_early(tmp_path: Path, capsys: pytest.CaptureFixture[str], no_engine: None) -> None:
    afile = tmp_path / "afile"
    afile.write_text("")
    assert main(["verify", "--workdir", str(afile / "sub"), *HT]) == 2
    assert f"({afile} is a file, not a folder)" in _one_line(capsys)


@pytest.mark.parametrize("command", ["verify", "tune"])
def test_an_empty_workdir_is_refused_not_read_as_a_temporary_one(
    command: str, capsys: pytest.CaptureFixture[str], no_engine: None
) -> None:
    """``--workdir ''`` is what an unset shell variable gives; verify would delete a temporary folder on a pass."""
    assert main([command, "--workdir", "", *HT]) == 2
    assert f"--workdir='' is not allowed; allowed values: a non-empty path of a folder {command} can create and write" in _one_line(capsys)


def test_underscore_spellings_read_as_dashes(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, no_engine: None) -> None:
    """--data_parallel_size 2 is DP 2 for vLLM, so for verify too (not "--data-parallel-size=1 is not allowed")."""
    monkeypatch.setenv("VLLM_DBO_COMM_SMS", "19")  # a refusal that comes after the DP check and before vLLM's parser
    assert main(["verify", "--model", "m", "--data_parallel_size", "2", "--enable_expert_parallel", "--all2all_backend",
                 "deepep_high_throughput"]) == 2  # fmt: skip
    assert "VLLM_DBO_COMM_SMS=19" in _one_line(capsys)
    monkeypatch.delenv("VLLM_DBO_COMM_SMS")
    assert main(["verify", "--model", "m", "--data_parallel_size", "2", "--enable_dbo", "--all2all_backend", "deepep_low_latency",
                 "--enable_expert_parallel", "--max_num_batched_tokens", "2048"]) == 2  # fmt: skip
    assert "NVSHMEM_QP_DEPTH" in _one_line(capsys)


def test_a_missing_model_reads_as_missing(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["verify", "-dp", "2"]) == 2
    assert _one_line(capsys).startswith("dbo-runtime verify: error: --model is missing; allowed values: the model to verify")


def test_checks_that_need_no_vllm_come_before_the_gpu_check(capsys: pytest.CaptureFixture[str], no_engine: None) -> None:
    """--noise-floor with one sequence per rank cannot halve it: a usage error on any machine, not "needs a GPU"."""
    assert main(["verify", "--noise-floor", "--prompts", "2", *HT, "--max-num-seqs", "1"]) == 2
    assert "--noise-floor is given with 1 sequence" in _one_line(capsys)


def test_without_a_gpu_it_says_the_arguments_were_not_checked() -> None:
    """vLLM cannot build its parser without a GPU platform: verify must not claim it checked the arguments."""
    # a fresh interpreter: vLLM caches its parser's defaults, so an in-process fake platform would leak in
    proc = subprocess.run([sys.executable, "-m", "dbo_runtime", "verify", *HT, "--bogus-engine-arg", "3"],
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    if "needs 2 GPU(s)" in proc.stderr:
        pytest.skip("this machine has a GPU platform: vLLM's parser builds here")
    assert proc.returncode == 3, proc.stderr[-2000:]
    assert "checking the engine arguments" not in proc.stderr and "checked with vLLM's parser" not in proc.stderr
    [line] = [x for x in proc.stderr.splitlines() if x.startswith("dbo-runtime verify")]
    assert line.startswith("dbo-runtime verify: engine arguments not checked: vLLM cannot build its parser here (no GPU platform")
    assert line.endswith("verify needs a GPU machine")


@pytest.mark.parametrize(
    ("own", "needle"),
    [
        (["--prompts", "0"], "--prompts=0 is not allowed; allowed values: an integer in [1, "),
        (["--max-tokens", "x"], "--max-tokens='x' is not allowed; allowed values: an integer in [1, 4096]"),
        (["--prompt-len", "5-1"], "--prompt-len='5-1' is not allowed; allowed values: MIN-MAX with 1 <= MIN <= MAX"),
        (["--prompt-len", "256-10240000"], "--prompt-len='256-10240000' is not allowed; allowed values: MIN-MAX with 1 <= MIN <= MAX <= 1048576"),
        (["--timeout", "-1"], "--timeout=-1 is not allowed; allowed values: a positive number of seconds"),
        (["--timeout", "0.0e0"], "--timeout=0.0e0 is not allowed; allowed values: a positive number of seconds"),
        (["--min-agreement", "2"], "--min-agreement=2 is not allowed; allowed values: a number in [0, 1]"),
        (["--max-dlogprob", "nan"], "--max-dlogprob=nan is not allowed; allowed values: a finite number >= 0"),
        (["--workdir", "/proc/x/y"], "--workdir='/proc/x/y' is not allowed; allowed values: a folder verify can create and write"),
        (["--prompt-file", "p.txt", "--prompts", "5"], "--prompts=5 is not allowed; allowed values: not given with --prompt-file"),
        (["--prompt-seed", "3", "--prompt-file", "p.txt"], "--prompt-seed=3 is not allowed; allowed values: not given with --prompt-file"),
    ],
)
@pytest.mark.parametrize(
    "engine",
    [["--model", "m"], ["--model", "m", "-dp", "1"], ["-dp", "2"], [*HT, "--headless"]],
    ids=["no-dp", "dp-1", "no-model", "headless"],
)
def test_its_own_options_are_checked_before_the_engine_arguments(
    own: list[str], needle: str, engine: list[str], capsys: pytest.CaptureFixture[str], no_engine: None
) -> None:
    """A bad verify option is named as itself, whatever the engine arguments lack (the DP size, the model)."""
    assert main(["verify", *own, *engine]) == 2
    line = _one_line(capsys)
    assert line.startswith("dbo-runtime verify: error: ") and needle in line, line


@pytest.mark.parametrize("command", ["verify", "tune"])
def test_a_missing_dp_size_is_named_as_vllms_default(command: str, capsys: pytest.CaptureFixture[str], no_engine: None) -> None:
    """``--model m`` alone: the refusal names the 1 it rejects as vLLM's default, not as something the user passed."""
    assert main([command, "--model", "m", "--enable-expert-parallel"]) == 2
    assert "--data-parallel-size=1 is not allowed; allowed values: 2 or more (none given; vLLM's default is 1)" in _one_line(capsys)
    assert main([command, "--model", "m", "-dp", "1", "--enable-expert-parallel"]) == 2
    assert "--data-parallel-size=1 is not allowed; allowed values: 2 or more: vLLM" in _one_line(capsys)


@pytest.mark.parametrize("command", ["verify", "tune"])
def test_a_misspelt_dp_or_ep_flag_is_named(command: str, capsys: pytest.CaptureFixture[str], no_engine: None) -> None:
    """vLLM's parser runs only after these checks (it needs a GPU platform), so a typo in the DP size flag is
    refused as itself, not reported as a missing DP size of 1 the operator never typed; the same for expert
    parallelism."""
    assert main([command, "--model", "m", "--data-paralel-size", "2", "--enable-expert-parallel"]) == 2
    line = _one_line(capsys)
    assert line.endswith(
        "error: --data-paralel-size is not a vLLM engine argument (did you mean --data-parallel-size?); "
        "allowed values: vLLM's engine arguments spelt in full"
    ), line
    assert misspelt(["--data_parallel_size=2"], "--data-parallel-size") is None  # vLLM's own spelling, not a miss
    assert misspelt(["--max-model-len", "8"], "--data-parallel-size") is None
    assert misspelt(["--data-parallel-size-local", "1"], "--data-parallel-size") is None  # a real vLLM option
    if command == "tune":
        assert main([command, "--model", "m", "-dp", "2", "--enable-expert-paralel"]) == 2
        line = _one_line(capsys)
        assert "error: --enable-expert-paralel is not a vLLM engine argument (did you mean --enable-expert-parallel?)" in line, line
        assert main([command, "--model", "m", "-dp", "2", "--enable-expert-parallel", "--no-enable-expert-parallel"]) == 2
        line = _one_line(capsys)  # vLLM's own off switch is no typo: it is named as what turned the flag off
        assert "--enable-expert-parallel is turned off (--no-enable-expert-parallel given last)" in line and "did you mean" not in line, line
    assert main([command, "--model", "m", "--enable-expert-parallel"]) == 2
    assert "did you mean" not in _one_line(capsys)


def test_fewer_prompts_than_ranks_is_echoed_as_typed(capsys: pytest.CaptureFixture[str], no_engine: None) -> None:
    """The prompt count is checked against the DP size after the engine arguments are read; the refusal shows
    ``--prompts`` as it was typed, like every other refusal of a number (``+1``, not ``1``)."""
    assert main(["verify", "--prompts", "+1", "--model", "m", "-dp", "2"]) == 2
    line = _one_line(capsys)
    assert "--prompts=+1 is not allowed; allowed values: at least the data-parallel size (2)" in line, line
    assert main(["verify", "--json", "--timeout", "0", "--model", "m", "-dp", "2"]) == 2
    error = json.loads(capsys.readouterr().out)["error"]
    assert (error["parameter"], error["value"]) == ("--timeout", "0")  # as typed, not 0.0
