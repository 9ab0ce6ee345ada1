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
}


def _run(script: str, args: list[str], tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    environ = {**os.environ, "OUT": str(tmp_path / "out"), "DBO_GPU_ENV": str(tmp_path / "no-such-env.sh"), **env}
    return subprocess.run(["bash", str(ROOT / "tools" / "gpu" / script), *args], capture_output=True, text=True,
                          timeout=60, env=environ, cwd=tmp_path)  # fmt: skip


def test_every_session_script_is_listed() -> None:
    assert sorted(SESSIONS) == sorted(p.name for p in (ROOT / "tools" / "gpu").glob("session-*.sh"))


@pytest.mark.parametrize("script", sorted(SESSIONS))
def test_without_install_sh_one_line_and_exit_2(script: str, tmp_path: Path) -> None:
    proc = _run(script, SESSIONS[script], tmp_path)
    assert proc.returncode == 2, (proc.stdout[-1000:], proc.stderr[-1000:])
    [line] = proc.stderr.strip().splitlines()
    assert line == f"{script}: {tmp_path / 'no-such-env.sh'} is missing: send the seven bundle parts and run /tmp/gpu-vllm/install.sh first (tools/gpu/README.md)"
    assert proc.stdout == "" and not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("script", "args", "env", "named"),
    [
        ("session-tune.sh", ["nosuch"], {}, "MODEL 'nosuch' is not allowed; allowed values: glm53-width, v32-width"),
        ("session-tune.sh", ["v32-width", "30"], {}, "seconds '30' is not allowed; allowed values: an integer in [61, 3600]"),
        ("session-tune.sh", [], {}, "MODEL '' is not allowed; allowed values: glm53-width, v32-width"),
        ("session-tune.sh", ["v32-width", "540", "8,,12"], {}, "VALUES '8,,12' is not allowed"),
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
        ("session-tune.sh", ["v32-width", "0540"], {}, "seconds '0540' is not allowed"),  # bash reads it as octal
        ("session-host-cost.sh", ["12345678901234567890123"], {}, "seconds '12345678901234567890123' is not allowed"),
        ("session-hook-calls.sh", [".", "/nonexistent"], {}, "tree '/nonexistent' is not allowed"),
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
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("script", sorted(SESSIONS))
def test_without_out_one_line_and_exit_2(script: str, tmp_path: Path) -> None:
    proc = _run(script, SESSIONS[script], tmp_path, OUT="")
    assert proc.returncode == 2 and proc.stdout == "", proc.stderr
    [line] = proc.stderr.strip().splitlines()
    assert line == f"{script}: OUT is not set; allowed values: the folder that receives the results (the device machine sets it)"
