"""Real-engine work that is not a single run: ``dbo-runtime verify`` invocations and a ``vllm serve``
session whose ``/metrics`` is scraped. They run inside the same pool as the plan's runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dbo_runtime.harness.launch import free_port
from tests.e2e import plan

VERIFY_CASES: dict[str, tuple[str, dict[str, str], str]] = {
    # label: (model, env, what the verdict must be)
    "verify-shared-topk-plugin": ("shared-topk", {"VLLM_USE_V2_MODEL_RUNNER": "0"}, "pass"),
    "verify-shared-topk-vanilla-comm0": (
        "shared-topk",
        {"VLLM_USE_V2_MODEL_RUNNER": "0", "DBO_RUNTIME_DISABLE": "1", "VLLM_DBO_COMM_SMS": "0"},
        "fail",
    ),
    "verify-deepseek-v32-vanilla-crash": ("deepseek-v32", {"VLLM_USE_V2_MODEL_RUNNER": "0", "DBO_RUNTIME_DISABLE": "1"}, "error"),
}


def verify_job(label: str, out: Path) -> Callable[[], dict[str, Any]]:
    model, env, _ = VERIFY_CASES[label]

    def work() -> dict[str, Any]:
        workdir = out / label
        argv = [
            sys.executable, "-m", "dbo_runtime", "verify", "--json", "--workdir", str(workdir),
            "--prompts", str(plan.TWO_GPU_PROMPTS.num), "--prompt-len", f"{plan.TWO_GPU_PROMPTS.min_len}-{plan.TWO_GPU_PROMPTS.max_len}",
            "--prompt-seed", str(plan.TWO_GPU_PROMPTS.seed), "--max-tokens", "32", "--timeout", "900", "--noise-floor",
            *plan.verify_args(model),
        ]  # fmt: skip
        started = time.monotonic()
        proc = subprocess.run(argv, env={**os.environ, **env}, capture_output=True, text=True, timeout=2400)
        try:
            doc = json.loads(proc.stdout)
        except json.JSONDecodeError:
            doc = None
        return {
            "label": label,
            "ok": doc is not None,
            "error": None if doc is not None else f"verify printed no JSON (exit {proc.returncode})",
            "exit_code": proc.returncode,
            "verify": doc,
            "argv": argv[3:],
            "env": env,
            "stderr_tail": proc.stderr[-4000:],
            "wall_s": time.monotonic() - started,
            "workdir": str(workdir),
        }

    return work


SERVE_LABEL = "serve-metrics-shared-topk"


def serve_job(out: Path, gpu: int | None) -> Callable[[], dict[str, Any]]:
    """``vllm serve`` with --enable-dbo (DP 1), Prometheus multiprocess mode; scrape /metrics."""

    def work() -> dict[str, Any]:
        root = out / SERVE_LABEL
        root.mkdir(parents=True, exist_ok=True)
        prom = root / "prometheus"
        prom.mkdir(exist_ok=True)
        for f in prom.iterdir():
            f.unlink()
        port = free_port()
        args = plan.tiny_args("shared-topk", eager=True, extra=["--enable-expert-parallel", "--all2all-backend", plan.HT, "--enable-dbo"])
        model = args[args.index("--model") + 1]
        rest = [a for i, a in enumerate(args) if a != "--model" and (i == 0 or args[i - 1] != "--model")]
        argv = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", model, "--port", str(port), *rest]
        env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(prom)}
        if gpu is not None:
            env["CUDA_VISIBLE_DEVICES"] = str(gpu)
        log_path = root / "serve.log"
        result: dict[str, Any] = {"label": SERVE_LABEL, "ok": False, "error": None, "argv": argv[3:]}
        started = time.monotonic()
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        base = f"http://127.0.0.1:{port}"
        try:
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"vllm serve exited with {proc.returncode} before it was healthy")
                if time.monotonic() - started > 600:
                    raise TimeoutError("vllm serve not healthy within 600 s")
                try:
                    with urllib.request.urlopen(base + "/health", timeout=2) as r:
                        if r.status == 200:
                            break
                except OSError:
                    time.sleep(1)
            result["start_s"] = time.monotonic() - started
            body = json.dumps({"model": model, "prompt": list(range(2, 602)), "max_tokens": 8, "temperature": 0}).encode()
            request = urllib.request.Request(base + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(request, timeout=120) as r:
                    result["completion_status"] = r.status
                    result["completion"] = json.loads(r.read())
            except Exception as exc:  # recorded; the metrics are what this job checks
                result["completion_status"] = repr(exc)
            with urllib.request.urlopen(base + "/metrics", timeout=10) as r:
                text = r.read().decode()
            result["metrics"] = [line for line in text.splitlines() if "dbo_runtime" in line]
            result["ok"] = True
        except Exception as exc:
            result["error"] = repr(exc)
        finally:
            import signal

            try:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(timeout=30)
            except Exception:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        log = log_path.read_text(errors="replace")
        result["plugin_log_lines"] = [line.strip() for line in log.splitlines() if "dbo_runtime:" in line][:40]
        result["log_tail"] = log[-3000:] if not result["ok"] else None
        result["wall_s"] = time.monotonic() - started
        return result

    return work


def all_jobs(out: Path, gpus: list[int]) -> dict[str, tuple[int, Callable[[], dict[str, Any]]]]:
    jobs: dict[str, tuple[int, Callable[[], dict[str, Any]]]] = {label: (2, verify_job(label, out)) for label in VERIFY_CASES}
    jobs[SERVE_LABEL] = (1, serve_job(out, gpus[-1] if gpus else None))
    return jobs
