"""``dbo-runtime simulate`` refusals: a machine that cannot run what was asked is exit 3, as in every command
(README's exit-code table), and a bad environment value says that the environment is where to fix it."""

from __future__ import annotations

import pytest
import torch

from dbo_runtime.cli.main import main

FAST = ["--backend", "cpu", "--steps", "1", "--requests", "4", "--no-contrast"]


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("VLLM_DBO_COMM_SMS", "DBO_RUNTIME_DISABLE", "DBO_RUNTIME_TOPK_LAYOUT", "VLLM_DEEP_GEMM_WARMUP"):
        monkeypatch.delenv(name, raising=False)


def _one_line(capsys: pytest.CaptureFixture[str]) -> str:
    out, err = capsys.readouterr()
    [line] = err.strip().splitlines()
    assert "Traceback" not in err and out == ""
    return line


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        (["--mode", "mrv1"], "dbo-runtime simulate: --mode mrv1 needs a CUDA GPU (FULL CUDA-graph capture): no CUDA device"),
        (["--mode", "mrv2", "--backend", "auto"], "dbo-runtime simulate: --mode mrv2 needs a CUDA GPU"),
        (["--backend", "deep_gemm"], "dbo-runtime simulate: --backend deep_gemm needs a CUDA GPU and DeepGEMM: no CUDA device"),
    ],
)
def test_what_needs_a_gpu_exits_3_on_a_machine_without_one(argv: list[str], line: str, capsys: pytest.CaptureFixture[str]) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA; the no-CUDA path is exercised on the CPU box")
    assert main(["simulate", *argv]) == 3
    assert _one_line(capsys).startswith(line)


@pytest.mark.parametrize("mode", ["mrv1", "mrv2"])
def test_a_capture_mode_with_the_cpu_backend_is_a_conflict_on_every_machine(mode: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Not "this machine has no GPU" (exit 3): with ``--backend cpu`` a GPU would refuse it too."""
    assert main(["simulate", "--mode", mode, "--backend", "cpu"]) == 2
    assert _one_line(capsys).startswith(
        f"dbo-runtime simulate: error: --mode={mode!r} is not allowed; allowed values: eager with --backend cpu"
    )


def test_a_bad_layout_in_the_environment_says_the_flag_does_not_override_it(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DBO_RUNTIME_TOPK_LAYOUT", "bad")
    assert main(["simulate", *FAST, "--topk-layout", "windows"]) == 2
    line = _one_line(capsys)
    assert line.startswith("dbo-runtime simulate: error: DBO_RUNTIME_TOPK_LAYOUT='bad' is not allowed; allowed values: 'windows', 'copies'")
    assert "set in the environment: a server would read it and stop; unset it, --topk-layout does not override it" in line


@pytest.mark.parametrize(("raw", "disabled"), [("bogus", None), ("", None), ("Skip", None), ("bogus", "1")])
def test_a_warmup_mode_vllm_refuses_is_one_line_not_a_pass(
    raw: str, disabled: str | None, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A server with this VLLM_DEEP_GEMM_WARMUP would not start (vLLM raises on any value outside its exact
    choices), plugin or not: simulate refuses it instead of printing PASS for that server."""
    monkeypatch.setenv("VLLM_DEEP_GEMM_WARMUP", raw)
    if disabled is not None:
        monkeypatch.setenv("DBO_RUNTIME_DISABLE", disabled)
    assert main(["simulate", *FAST]) == 2
    assert _one_line(capsys) == (
        f"dbo-runtime simulate: error: VLLM_DEEP_GEMM_WARMUP={raw!r} is not allowed; allowed values: 'skip', 'full' or "
        "'relax' (exact, lower case), or not set (relax): vLLM refuses any other value at engine start"
    )


@pytest.mark.parametrize("mode", ["skip", "full", "relax"])
def test_every_warmup_mode_vllm_takes_runs(mode: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_DEEP_GEMM_WARMUP", mode)
    assert main(["simulate", *FAST]) == 0
    assert "VLLM_DEEP_GEMM_WARMUP" not in capsys.readouterr().err


def test_a_simulation_the_machine_cannot_hold_is_refused_before_it_starts(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--requests 1024 --preset glm53`` peaks near 23 GiB of host memory on the CPU simulation: where that is
    more than the machine has, one line and exit 3 before any tensor exists, not the kernel's OOM killer later."""
    from dbo_runtime.cli import simulate

    monkeypatch.setattr(simulate, "available_bytes", lambda: 8 << 30)
    assert main(["simulate", "--backend", "cpu", "--preset", "glm53", "--requests", "1024", "--steps", "1"]) == 3
    out, err = capsys.readouterr()
    [line] = err.splitlines()
    assert out == "" and line.startswith("dbo-runtime simulate: --requests 1024 with --preset glm53 needs about 23.")
    assert line.endswith("GiB of memory on the CPU simulation; this machine has 8.0 GiB available (lower --requests, or use --preset small)")


def test_the_memory_estimate_grows_with_the_requests_and_stays_above_the_measured_peaks() -> None:
    """The estimate against the peak RSS measured on the development CPU (``--steps 1 --no-contrast``):
    glm53 647 / 1683 MiB at 16 / 64 requests, small 385 / 1234 MiB at 64 / 1024; above each, by at most 15 %."""
    import dataclasses

    from dbo_runtime.cli.simulate import estimated_bytes
    from dbo_runtime.sim.scenario import GLM53, SMALL

    measured = {(GLM53, 16): 647, (GLM53, 64): 1683, (SMALL, 64): 385, (SMALL, 1024): 1234}
    for (base, requests), mib in measured.items():
        estimate = estimated_bytes(dataclasses.replace(base, num_requests=requests), 21) / 2**20
        assert mib < estimate < 1.15 * mib, (base.heads, requests, estimate)


def test_available_memory_is_the_lower_of_the_machine_and_its_cgroup_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    """Inside a container the OOM killer acts at the cgroup's ``memory.max``, which ``MemAvailable`` does not show."""
    import builtins
    import io

    from dbo_runtime.cli import simulate

    files = {"/proc/meminfo": "MemTotal: 25165824 kB\nMemAvailable: 20971520 kB\n"}
    real_open = builtins.open

    def fake_open(path: object, *args: object, **kwargs: object) -> object:
        if str(path) in ("/proc/meminfo", "/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"):
            if str(path) not in files:
                raise FileNotFoundError(path)
            return io.StringIO(files[str(path)])
        return real_open(path, *args, **kwargs)  # type: ignore[call-overload]

    monkeypatch.setattr(builtins, "open", fake_open)
    assert simulate.available_bytes() == 20 << 30  # no cgroup files: the machine's figure
    files.update({"/sys/fs/cgroup/memory.max": "max\n", "/sys/fs/cgroup/memory.current": "1073741824\n"})
    assert simulate.available_bytes() == 20 << 30  # no limit
    files["/sys/fs/cgroup/memory.max"] = str(8 << 30)
    assert simulate.available_bytes() == 7 << 30  # 8 GiB limit, 1 GiB in use
    del files["/proc/meminfo"]
    assert simulate.available_bytes() == 7 << 30


def test_the_memory_refusal_names_what_was_given(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    from dbo_runtime.cli import simulate

    monkeypatch.setattr(simulate, "available_bytes", lambda: 1 << 20)
    assert main(["simulate", "--backend", "cpu"]) == 3
    [line] = capsys.readouterr().err.splitlines()
    assert "simulate: 16 requests with --preset small needs about " in line and line.endswith("available (lower --requests)")


def test_a_bad_comm_env_hidden_by_the_flag_is_warned(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """``--comm-sms`` runs the what-if, and the ``VLLM_DBO_COMM_SMS`` a server would fail on is still said, on
    stderr and in the JSON's warnings, as ``sms`` says it."""
    import json

    monkeypatch.setenv("VLLM_DBO_COMM_SMS", "abc")
    assert main(["simulate", *FAST, "--comm-sms", "10", "--json"]) == 0
    out, err = capsys.readouterr()
    [said] = [w for w in json.loads(out)["warnings"] if "VLLM_DBO_COMM_SMS" in w]
    assert said.startswith("VLLM_DBO_COMM_SMS='abc' in this environment is not an integer >= 0") and said in err


def test_the_layout_variable_says_it_takes_any_case() -> None:
    """The variable is read in any case (``Copies`` works) while ``--topk-layout`` takes the lower-case choice:
    the variable's refusal says so, and offers the near miss."""
    from dbo_runtime.core.errors import ConfigError
    from dbo_runtime.core.settings import TopkLayout, parse_layout

    assert parse_layout("Copies") is TopkLayout.COPIES and parse_layout(" ") is TopkLayout.WINDOWS
    with pytest.raises(ConfigError) as err:
        parse_layout("Copis")
    assert str(err.value) == (
        "DBO_RUNTIME_TOPK_LAYOUT='Copis' is not allowed; allowed values: 'windows', 'copies' in any case, or unset (windows) (did you mean 'copies'?)"
    )
