"""``tools/gpu/session-*.sh`` on a machine where ``install.sh`` has not run: one line, exit 2, nothing run.

They are the commands a GPU lease runs one after another; a script that carried on without vLLM's environment,
or ended 0 after the benchmark inside it failed, would make a failed lease read as a finished one."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SESSIONS = {
    "session-e2e.sh": [],
    "session-bench.sh": [],
    "session-host-cost.sh": ["60"],
    "session-hook-calls.sh": [],
    "session-tune.sh": ["glm53-width"],
    "session-emulated.sh": ["540", "--rows", "a-eager"],
}


DEFAULT_ENV = {"session-e2e.sh": {"TWINS": "0"}}
"""The e2e script's arguments are checked here without the twins (their DeepGEMM choice has a test of its own)."""


def _run(script: str, args: list[str], tmp_path: Path, *, root: Path = ROOT, **env: str) -> subprocess.CompletedProcess[str]:
    """The script as the device runs it: ``OUT`` an existing empty folder (``_wrote`` says whether anything landed)."""
    (tmp_path / "out").mkdir(exist_ok=True)
    environ = {**os.environ, "OUT": str(tmp_path / "out"), "DBO_GPU_ENV": str(tmp_path / "no-such-env.sh"), **DEFAULT_ENV.get(script, {}), **env}
    return subprocess.run(["bash", str(root / "tools" / "gpu" / script), *args], capture_output=True, text=True,
                          timeout=60, env=environ, cwd=tmp_path)  # fmt: skip


def _wrote(tmp_path: Path) -> bool:
    out = tmp_path / "out"
    return out.exists() and any(out.iterdir())


@pytest.mark.parametrize("script", [*SESSIONS, "bundle.sh"])
def test_every_script_answers_help_with_its_header_and_runs_nothing(script: str, tmp_path: Path) -> None:
    """``--help`` is not a folder, a model or a limit: the header comment, exit 0, nothing installed or written."""
    for flag in ("-h", "--help"):
        proc = _run(script, [flag], tmp_path)
        assert proc.returncode == 0 and proc.stderr == "", proc.stderr
        assert proc.stdout.startswith(("On the ", "Build the real vLLM")) and "tools/gpu/" in proc.stdout and "#" not in proc.stdout[:2]
        assert not _wrote(tmp_path) and sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_every_session_script_is_listed() -> None:
    assert sorted(SESSIONS) == sorted(p.name for p in (ROOT / "tools" / "gpu").glob("session-*.sh"))


@pytest.mark.parametrize("script", sorted(SESSIONS))
def test_without_install_sh_one_line_and_exit_2(script: str, tmp_path: Path) -> None:
    proc = _run(script, SESSIONS[script], tmp_path)
    assert proc.returncode == 2, (proc.stdout[-1000:], proc.stderr[-1000:])
    [line] = proc.stderr.strip().splitlines()
    assert line == f"{script}: {tmp_path / 'no-such-env.sh'} is missing: send every bundle part (.gpu-vllm/p0..pN) and run /tmp/gpu-vllm/install.sh first (tools/gpu/README.md)"
    assert proc.stdout == "" and not _wrote(tmp_path)


@pytest.mark.parametrize(
    ("script", "args", "env", "named"),
    [
        ("session-tune.sh", ["nosuch"], {}, "MODEL 'nosuch' is not allowed; allowed values: glm53-width, v32-width"),
        ("session-tune.sh", ["v32-width", "30"], {}, "seconds '30' is not allowed; allowed values: an integer in [61, 3600]"),
        ("session-tune.sh", [], {}, "MODEL '' is not allowed; allowed values: glm53-width, v32-width"),
        ("session-tune.sh", ["v32-width", "540", "8,,12"], {}, "VALUES: --values='8,,12' is not allowed; allowed values: 'all', or "),
        ("session-tune.sh", ["v32-width", "540", "7"], {}, "VALUES: --values=7 is not allowed; allowed values: 'all', or "),  # tune's rule
        ("session-tune.sh", ["v32-width", "540", "8", "extra"], {}, "arguments 'v32-width 540 8 extra' are not allowed"),
        ("session-host-cost.sh", ["abc"], {}, "seconds 'abc' is not allowed; allowed values: an integer in [1, 3600]"),
        ("session-host-cost.sh", [""], {}, "seconds '' is not allowed; allowed values: an integer in [1, 3600]"),
        ("session-hook-calls.sh", [], {"COLD": "abc"}, "COLD 'abc' is not allowed; allowed values: an integer in [1, 1000000]"),
        ("session-hook-calls.sh", [], {"COLD": ""}, "COLD '' is not allowed; allowed values: an integer in [1, 1000000]"),
        ("session-e2e.sh", ["e2e", "abc"], {}, "seconds 'abc' is not allowed; allowed values: an integer in [1, 3600]"),
        ("session-e2e.sh", ["e2e", "-5"], {}, "seconds '-5' is not allowed"),
        ("session-e2e.sh", [""], {}, "MARK '' is not allowed"),
        ("session-e2e.sh", ["e2e", "60"], {"TWIN_LIMIT": "x"}, "TWIN_LIMIT 'x' is not allowed"),
        ("session-bench.sh", ["abc", "0"], {}, "seconds S1 'abc' is not allowed; allowed values: an integer in [0, 3600]"),
        ("session-bench.sh", ["0", "-1"], {}, "seconds S2 '-1' is not allowed"),
        ("session-bench.sh", ["0", "10", "foo"], {}, "GROUPS 'foo' is not allowed; allowed values: ht, ll, ht,ll"),
        ("session-bench.sh", ["00", "0"], {}, "seconds S1 '00' is not allowed"),  # `timeout 00` would have no limit
        ("session-tune.sh", ["v32-width", "0540"], {}, "seconds '0540' is not allowed; allowed values: an integer in [61, 3600] (digits only, no leading zero)"),  # bash reads it as octal
        ("session-host-cost.sh", ["12345678901234567890123"], {}, "seconds '12345678901234567890123' is not allowed"),
        ("session-hook-calls.sh", [".", "/nonexistent"], {}, "tree '/nonexistent' is not allowed"),
        ("session-e2e.sh", [], {"E2E": "yes"}, "E2E 'yes' is not allowed; allowed values: 0 (off), 1 (on)"),
        ("session-e2e.sh", [], {"TWINS": "true"}, "TWINS 'true' is not allowed; allowed values: 0 (off), 1 (on)"),
        ("session-e2e.sh", [], {"E2E": "0", "TWINS": "0"}, "E2E=0 with TWINS=0 is not allowed"),
        ("session-bench.sh", ["0", "0"], {}, "seconds '0 0' are not allowed"),
        ("session-e2e.sh", [], {"TWIN_BENCHES": "bench_nope.py"}, "TWIN_BENCHES 'bench_nope.py' is not allowed"),
        ("session-e2e.sh", [], {"DBO_E2E_MAX_ENGINES": "abc"}, "DBO_E2E_MAX_ENGINES='abc' is not allowed; allowed values: an integer >= 1"),
        ("session-e2e.sh", [], {"DBO_E2E_LOAD_FORMAT": "foo"}, "DBO_E2E_LOAD_FORMAT='foo' is not allowed; allowed values: 'dummy', 'dbo_runtime_random'"),
        ("session-e2e.sh", ["e2e and (", "60"], {}, "MARK 'e2e and (' is not allowed; allowed values: a pytest -m expression"),
        ("session-e2e.sh", ["e2e_dp", "60"], {}, "MARK 'e2e_dp' is not allowed; allowed values: a pytest -m expression of the markers in pyproject.toml (unknown: e2e_dp)"),
        ("session-host-cost.sh", ["300", "--out", "/tmp/y"], {}, "--out is not allowed"),  # the results would miss $OUT
        ("session-emulated.sh", ["300", "--rows", "c"], {"EMU_WORK": "/"}, "EMU_WORK '/' is not allowed"),  # it is emptied first
        ("session-emulated.sh", ["300", "--rows", "t-eager"], {"EMU_INSTALLED": "yes"}, "EMU_INSTALLED 'yes' is not allowed"),
        ("session-emulated.sh", ["300", "--rows", "t-eager", "--out", "/tmp/y"], {}, "--out is set by this script"),
        ("session-emulated.sh", ["300", "--seconds=9"], {}, "--seconds=9 is set by this script"),
        # the benchmark's own parser, before env.sh, the install and the clean-up of /tmp/host-cost
        ("session-host-cost.sh", ["300", "--bogus"], {}, "bench_host_cost: error: unrecognized arguments: --bogus"),
        ("session-host-cost.sh", ["--bogus"], {}, "bench_host_cost: error: unrecognized arguments: --bogus"),  # SECONDS left out
        ("session-emulated.sh", ["--rows", "nope"], {}, "python -m tests.e2e.emulated: error: unknown row(s) nope"),
        ("session-host-cost.sh", ["300", "--only", "glm53-7L-eager-dbo-off"], {}, "bench_host_cost: error: argument --only: invalid value 'glm53-7L-eager-dbo-off'"),
    ],
)
def test_a_bad_argument_is_one_line_before_anything_runs(
    script: str, args: list[str], env: dict[str, str], named: str, tmp_path: Path
) -> None:
    if script == "session-hook-calls.sh":
        args = [str(ROOT) if a == "." else a for a in args]
    proc = _run(script, args, tmp_path, **env)
    assert proc.returncode == 2 and proc.stdout == "", proc.stderr
    [line] = proc.stderr.strip().splitlines()
    assert line.startswith(f"{script}: {named}")
    assert not _wrote(tmp_path)


@pytest.mark.parametrize("script", sorted(SESSIONS))
def test_without_out_one_line_and_exit_2(script: str, tmp_path: Path) -> None:
    proc = _run(script, SESSIONS[script], tmp_path, OUT="")
    assert proc.returncode == 2 and proc.stdout == "", proc.stderr
    [line] = proc.stderr.strip().splitlines()
    assert line == f"{script}: OUT is not set; allowed values: the folder that receives the results (the device machine sets it)"


@pytest.mark.parametrize("script", sorted(SESSIONS))
def test_an_out_that_cannot_take_results_is_one_line(script: str, tmp_path: Path) -> None:
    """A tarball that could not be written would leave the lease with nothing, after the whole run."""
    proc = _run(script, SESSIONS[script], tmp_path, OUT=str(tmp_path / "absent"))
    assert proc.returncode == 2 and proc.stdout == "", proc.stderr
    [line] = proc.stderr.strip().splitlines()
    assert line == f"{script}: OUT '{tmp_path / 'absent'}' is not allowed; allowed values: an existing writable folder (the device machine makes one)"


def test_the_twins_without_their_wheel_use_vllms_vendored_deep_gemm(tmp_path: Path) -> None:
    """Without ``.whl`` carried the twins run on the DeepGEMM vLLM vendors, so the wheel is no precondition: the
    script goes on to the bundle's environment, whose absence is the one line and exit 2."""
    import shutil

    tree = tmp_path / "checkout"
    shutil.copytree(ROOT / "tools" / "gpu", tree / "tools" / "gpu")
    proc = _run("session-e2e.sh", [], tmp_path, root=tree, E2E="0", TWINS="1")
    assert proc.returncode == 2 and proc.stdout == "", proc.stderr
    [line] = proc.stderr.strip().splitlines()
    assert "tokenspeed_deepgemm" not in line and "env.sh is missing" in line, line
    assert "vllm.third_party.deep_gemm" in (ROOT / "tools" / "gpu" / "session-e2e.sh").read_text()
    assert not _wrote(tmp_path)


def test_the_two_gpu_benchmark_on_one_gpu_is_exit_3(tmp_path: Path) -> None:
    """bench_dbo_engine needs DP 2: on a one-GPU machine it cannot run, and a lease command must not end 0 there."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H200 (UUID: GPU-x)'\n")
    (bin_dir / "nvidia-smi").chmod(0o755)
    env_sh = tmp_path / "env.sh"  # a stand-in for install.sh's environment (no vLLM is needed to refuse)
    env_sh.write_text(f"export PATH={bin_dir}:$PATH\n")
    proc = _run("session-bench.sh", ["0", "60", "ht"], tmp_path, DBO_GPU_ENV=str(env_sh))
    assert proc.returncode == 3 and proc.stdout == "", proc.stderr
    [line] = proc.stderr.strip().splitlines()
    assert line == "session-bench.sh: bench_dbo_engine needs 2 GPUs (DBO needs DP >= 2), 1 visible: run it on nvidia-h200-x2, or give it 0 seconds"
    assert not _wrote(tmp_path)


def _bundle(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if k != "DRY_RUN"}
    return subprocess.run(["bash", str(ROOT / "tools" / "gpu" / "bundle.sh"), *args], capture_output=True, text=True,
                          timeout=60, cwd=tmp_path, env={**clean, "PATH": "/usr/bin:/bin", **env})  # fmt: skip


@pytest.mark.parametrize("dry_run", [{}, {"DRY_RUN": "1"}])
@pytest.mark.parametrize("folder", [".", "..", "/tmp/x", "a/b", ".git", "docs", "-x"])
def test_bundle_refuses_a_folder_it_would_delete(folder: str, dry_run: dict[str, str], tmp_path: Path) -> None:
    """bundle.sh replaces its output folder (rm -rf) after minutes of downloads: the checkout, a system path or a
    folder holding anything but an earlier bundle's parts is refused first, with nothing downloaded or written;
    a dry run refuses it too, so it previews a run that would start."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "notes.md").write_text("keep me")
    proc = _bundle(tmp_path, folder, **dry_run)
    assert proc.returncode == 2 and proc.stdout == "", proc.stderr
    [line] = proc.stderr.strip().splitlines()
    assert line.startswith(f"bundle.sh: folder '{folder}' is not allowed; allowed values: ")
    assert (tmp_path / "docs" / "notes.md").read_text() == "keep me" and sorted(p.name for p in tmp_path.iterdir()) == ["docs"]


@pytest.mark.parametrize("value", ["yes", "", "true"])
def test_bundle_refuses_a_dry_run_switch_that_is_not_0_or_1(value: str, tmp_path: Path) -> None:
    """A mistyped DRY_RUN would otherwise read as off and start minutes of downloads."""
    proc = _bundle(tmp_path, DRY_RUN=value)
    assert proc.returncode == 2 and proc.stdout == "" and list(tmp_path.iterdir()) == []
    assert proc.stderr.strip().splitlines() == [f"bundle.sh: DRY_RUN '{value}' is not allowed; allowed values: 0 (off), 1 (on)"]
    dry = _bundle(tmp_path, DRY_RUN="1")
    assert dry.returncode == 0 and "into .gpu-vllm/p0..pN" in dry.stdout and list(tmp_path.iterdir()) == [], dry.stderr


def test_bundle_refuses_a_release_without_its_lock(tmp_path: Path) -> None:
    """A release the GPU image's wheel set was never worked out for would download for minutes, then fail in pip."""
    proc = _bundle(tmp_path, DRY_RUN="1", VLLM_VERSION="9.9.9")
    assert proc.returncode == 2 and proc.stdout == "" and list(tmp_path.iterdir()) == []
    assert proc.stderr.strip().splitlines() == [
        "bundle.sh: VLLM_VERSION '9.9.9' is not allowed; allowed values: 0.33.0 0.34.0 (another release: add "
        "tools/gpu/gpu-extra-lock-9.9.9.txt)"
    ]
    assert _bundle(tmp_path, DRY_RUN="1", VLLM_VERSION="0.33.0").returncode == 0


def test_install_without_the_bundle_parts_is_one_line_and_exit_2(tmp_path: Path) -> None:
    """install.sh before the parts were copied: one line naming the folder and what to do, nothing written."""
    proc = subprocess.run(
        ["bash", str(ROOT / "tools" / "gpu" / "install.sh")], env={**os.environ, "DBO_BUNDLE_PARTS": str(tmp_path)},
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.splitlines() == [
        f"tools/gpu/install.sh: no bundle parts in {tmp_path}: copy every part of .gpu-vllm/p0..pN there first (tools/gpu/README.md)"
    ]
    assert list(tmp_path.iterdir()) == []


def test_host_cost_summarizes_a_stopped_run_with_the_row_filters_only(tmp_path: Path) -> None:
    """When the limit stops the benchmark, the script summarizes the finished reps with ``--from-runs``, which
    refuses the options that start engines: it passes the row filters on and drops ``--reps``/``--at-once``/...
    (a ``python3`` stand-in records the calls; the real benchmark's refusal has its own test)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "calls.txt"
    (bin_dir / "python3").write_text(
        "#!/bin/bash\n"
        f'echo "$*" >> {calls}\n'
        'case "$*" in *--from-runs*) exit 0 ;; *graphs/bench_host_cost.py*) mkdir -p /tmp/host-cost/bench_host_cost_runs; exit 124 ;; esac\n'
        "exit 0\n"
    )
    (bin_dir / "python3").chmod(0o755)
    env_sh = tmp_path / "env.sh"
    env_sh.write_text(f"export PATH={bin_dir}:$PATH\n")
    argv = ["60", "--only", "v32-78L-eager-dbo-off", "--reps", "4", "--at-once=2", "--steps", "8", "--graphs-steps", "64"]
    proc = _run("session-host-cost.sh", argv, tmp_path, DBO_GPU_ENV=str(env_sh))
    assert proc.returncode == 124, proc.stderr
    runs = [line for line in calls.read_text().splitlines() if "graphs/bench_host_cost.py" in line]
    assert runs == [
        "graphs/bench_host_cost.py --out /tmp/host-cost --only v32-78L-eager-dbo-off --reps 4 --at-once=2 --steps 8 --graphs-steps 64",
        "graphs/bench_host_cost.py --from-runs /tmp/host-cost/bench_host_cost_runs --out /tmp/host-cost --only v32-78L-eager-dbo-off",
    ]


def test_tune_values_all_passes_the_early_check(tmp_path: Path) -> None:
    """``all`` is tune's own value: the early check lets it through (to the missing install here), and the script
    then asks tune for the rounds its sign test needs for ten values rather than a fixed 6 it would refuse."""
    proc = _run("session-tune.sh", ["v32-width", "540", "all"], tmp_path)
    assert proc.returncode == 2 and "is missing: send every bundle part (.gpu-vllm/p0..pN)" in proc.stderr, proc.stderr
    assert '--reps "$REPS"' in (ROOT / "tools" / "gpu" / "session-tune.sh").read_text()


def test_bundle_refuses_a_folder_named_for_another_release(tmp_path: Path) -> None:
    """``bundle.sh .gpu-vllm-0.33`` without ``VLLM_VERSION=0.33.0`` would fill that folder with 0.34.0."""
    proc = _bundle(tmp_path, ".gpu-vllm-0.33", DRY_RUN="1")
    assert proc.returncode == 2 and proc.stdout == "" and list(tmp_path.iterdir()) == []
    [line] = proc.stderr.strip().splitlines()
    assert "names vLLM 0.33 but VLLM_VERSION is 0.34.0" in line
    ok = _bundle(tmp_path, ".gpu-vllm-0.33", DRY_RUN="1", VLLM_VERSION="0.33.0")
    assert ok.returncode == 0 and ok.stdout.startswith("vllm==0.33.0"), ok.stderr


@pytest.mark.parametrize("script", ["install.sh", "_checks.sh"])
def test_the_helpers_answer_help_with_their_header_only(script: str, tmp_path: Path) -> None:
    """install.sh travels alone and installs on any argument; _checks.sh has no ``set`` line to stop at."""
    proc = _run(script, ["--help"], tmp_path, DBO_BUNDLE_PARTS=str(tmp_path))
    assert proc.returncode == 0 and proc.stdout.startswith(("On the GPU machine", "Sourced by bundle.sh")), proc.stderr
    assert "{" not in proc.stdout and not (tmp_path / "bundle.tar").exists()


def test_a_work_folder_holding_other_files_is_never_emptied(tmp_path: Path) -> None:
    work = tmp_path / "mine"
    work.mkdir()
    (work / "keep.txt").write_text("precious")
    proc = _run("session-emulated.sh", ["300", "--rows", "c"], tmp_path, EMU_WORK=str(work))
    assert proc.returncode == 2 and "EMU_WORK" in proc.stderr and (work / "keep.txt").exists()
