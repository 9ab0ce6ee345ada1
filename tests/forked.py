"""Several fresh-process checks for the price of one interpreter start.

A prelude pays the shared imports once (torch, vLLM's config); each scenario then runs in a forked child with
everything else still unimported, and comes back with its own exit code and output. A scenario is Python source
run in the prelude's globals; ``run_script(path, *args)`` there runs a script as ``python path args`` would
(``__main__``, its folder first on ``sys.path``, ``SystemExit`` as the exit code).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

DRIVER = r"""
import json, os, runpy, sys, traceback
spec = json.loads(sys.argv[1])

def run_script(path, *args):
    sys.argv = [path, *args]
    sys.path[0] = os.path.dirname(path)
    runpy.run_path(path, run_name="__main__")

g = {"__name__": "__forked__", "run_script": run_script}
exec(spec["prelude"], g)
for name, body in spec["scenarios"].items():
    sys.stdout.flush(); sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        files = spec["files"][name]
        os.dup2(os.open(files[0], os.O_WRONLY | os.O_CREAT | os.O_TRUNC), 1)
        os.dup2(1 if files[1] == files[0] else os.open(files[1], os.O_WRONLY | os.O_CREAT | os.O_TRUNC), 2)
        try:
            exec(body, g)
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        except BaseException:
            traceback.print_exc()
            code = 1
        sys.stdout.flush(); sys.stderr.flush()
        os._exit(code)
    print(json.dumps([name, os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])]), flush=True)
"""


@dataclass(frozen=True)
class Scenario:
    code: int
    """The child's exit status; -1 where it never reported (the prelude failed: ``stderr`` says why)."""
    stdout: str
    stderr: str
    """Empty where ``merged``: the child's stderr then went into ``stdout``, in the order it was written."""


def run_forked(prelude: str, scenarios: dict[str, str], *, merged: bool = False, timeout: float = 600, cwd: Path | None = None) -> dict[str, Scenario]:
    with tempfile.TemporaryDirectory(prefix="forked-") as tmp:
        files = {
            name: [str(Path(tmp) / f"{i}.out"), str(Path(tmp) / (f"{i}.out" if merged else f"{i}.err"))]
            for i, name in enumerate(scenarios)
        }
        spec = json.dumps({"prelude": prelude, "scenarios": scenarios, "files": files})
        proc = subprocess.run([sys.executable, "-c", DRIVER, spec], capture_output=True, text=True, timeout=timeout, cwd=cwd)
        codes = dict(json.loads(line) for line in proc.stdout.splitlines() if line.startswith("["))
        out = {}
        for name, (stdout, stderr) in files.items():
            if name not in codes:
                out[name] = Scenario(-1, proc.stdout, proc.stderr[-3000:])
                continue
            text = [Path(f).read_text() if Path(f).exists() else "" for f in (stdout, stderr)]
            out[name] = Scenario(codes[name], text[0], "" if merged else text[1])
        return out
