"""Start one real-engine run (all its DP ranks), wait for it, and turn it into a record. A rank whose peer died
blocks forever in a collective and vLLM's processes outlive a killed parent: each rank runs in a session of its
own, the others get a grace period once one fails, and every process group is killed at the end."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from dbo_runtime.core.switches import parse_switch
from dbo_runtime.harness.prompts import PromptSpec
from dbo_runtime.harness.runner import BARRIER_ENV, partial_path, summary_delta

RUNNER_MODULE_ENV = "DBO_HARNESS_RUNNER_MODULE"

FAIL_GRACE_S = 20.0
"""How long the other ranks may run on after one failed."""

SIGNATURES: dict[str, str] = {
    "deepgemm_schedule_assert": r"_schedule_meta_size == num_sms",
    "ubatch_thread_died": r"Exception in thread .*_ubatch_thread|in _ubatch_thread",
    "rpc_timeout": r"RPC call to \w+ timed out",
    "cuda_invalid_cluster_size": r"CUDA_ERROR_INVALID_CLUSTER_SIZE|invalid cluster size",
    "cuda_oom": r"CUDA out of memory|OutOfMemoryError",
    "engine_dead": r"EngineDeadError|EngineCore encountered an issue",
    "hang_killed": r"\[dbo-harness launcher\] timeout",
    "deepep_ll_qp_depth": r"nvshmem_qp_depth >= \(num_max_dispatch_tokens_per_rank",
    "misaligned_microbatch_view": r"Misaligned Tensor data",
    "dbo_runtime_refused": r"DboRefusal: dbo_runtime refuses",
}
"""Known failure texts in the logs, so a record says *what* happened, not only that it failed."""

SIGNATURE_HINTS: dict[str, str] = {
    "deepgemm_schedule_assert": "vLLM 0.33's DBO crash (indexer schedule planned for the whole GPU, DeepGEMM "
    "lowered to the compute SMs): dbo_runtime fixes it; is DBO_RUNTIME_DISABLE set?",
    "misaligned_microbatch_view": "vLLM's own DeepSeek-V4 crash under DBO (its CuTe compressor assumes aligned per-token "
    "inputs; a microbatch's are views at any token): serve DeepSeek-V4 without --enable-dbo",
    "deepep_ll_qp_depth": "DeepEP low-latency needs NVSHMEM_QP_DEPTH >= 2 x (max_num_batched_tokens + 1) "
    "(default 1024, i.e. at most 511 tokens): set NVSHMEM_QP_DEPTH=8192 or lower --max-num-batched-tokens",
}
"""What an operator can do about a known failure (``dbo-runtime verify`` prints it after the name)."""

FATAL_IN_LOG = ("deepgemm_schedule_assert", "ubatch_thread_died")
"""Failures after which vLLM hangs instead of exiting (a dead microbatch thread's partner waits
forever): seen in a log, the rank counts as failed."""


@dataclass
class RunSpec:
    label: str
    engine_args: list[str]
    dp: int = 1
    env: dict[str, str] = field(default_factory=dict)
    prompts: PromptSpec = field(default_factory=PromptSpec)
    max_tokens: int = 32
    logprobs: int = 5
    bench: dict[str, Any] | None = None
    cold_jit_cache: bool = False
    """Start with an empty ``DG_JIT_CACHE_DIR`` of the run's own, so nothing compiled before is found."""
    timeout_s: float = 900.0
    meta: dict[str, Any] = field(default_factory=dict)
    """Free-form facts for the record (model name, what the run demonstrates)."""
    module: str = "dbo_runtime.harness.runner"
    """The module each rank runs (``python -m``); ``$DBO_HARNESS_RUNNER_MODULE`` overrides it."""

    def record(self, ranks: list[dict[str, Any]], logs: list[str], wall_s: float) -> dict[str, Any]:
        """The run's record from its ranks' results and logs: what verify and tune read (pure: tested on CPU);
        a subclass adds what its own readers need."""
        text = "\n".join(logs)
        signatures = [name for name, pattern in SIGNATURES.items() if re.search(pattern, text)]
        if "hang_killed" in signatures and sum(1 for log in logs if "engine ready in" in log) < self.dp:
            # a run that timed out before every engine was up is slow, not the DBO hang
            signatures = [("start_timeout" if name == "hang_killed" else name) for name in signatures]
        ok = all(r.get("ok") for r in ranks) and len(ranks) == self.dp
        error = None
        if not ok:
            errors = [str(r.get("error")) for r in ranks if not r.get("ok")]
            detail = next((line.strip() for line in text.splitlines() if "_schedule_meta_size" in line), None)
            error = "; ".join(dict.fromkeys(errors))
            if detail and detail not in error:
                error += f" | {detail}"
        # from the counter snapshots around the generate, where a rank has them
        builds = [
            summary_delta(r["stats_start"], r["stats_end"], "microbatched_builds")
            if r.get("stats_start") and r.get("stats_end")
            else r.get("microbatched_builds")
            for r in ranks
        ]
        try:
            plugin = not parse_switch("DBO_RUNTIME_DISABLE", {**os.environ, **self.env})
        except Exception:
            plugin = False
        return {
            "label": self.label, "plugin": plugin, "ok": ok, "error": error, "failure_signatures": signatures,
            "start_s": [r.get("start_s") for r in ranks], "generate_s": [r.get("generate_s") for r in ranks],
            "wall_s": wall_s, "microbatched_steps": builds if self.dp > 1 else builds[0],
            "requests": sorted((req for r in ranks for req in r.get("requests") or []), key=lambda q: q["index"]),
            "bench": [r.get("bench") for r in ranks if r.get("bench")] or None,
        }  # fmt: skip


PORT_BLOCK = 16
"""vLLM's offline DP derives more ports from ``VLLM_DP_MASTER_PORT``: runs get whole free blocks."""


def free_port(block: int = 1) -> int:
    """A port whose next ``block - 1`` ports were free too when checked (races stay possible)."""
    import random

    for _ in range(200):
        base = random.randrange(20000, 60000 - block)
        with contextlib.ExitStack() as sockets, contextlib.suppress(OSError):  # closed once checked
            for port in range(base, base + block):
                sockets.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM)).bind(("127.0.0.1", port))
            return base
    raise RuntimeError(f"no block of {block} free ports found")


def normal_arg(arg: str) -> str:
    """A token as vLLM's parser reads it (underscores in an option's name are dashes): one spelling to check."""
    if not arg.startswith("--"):
        return arg
    name, eq, value = arg.partition("=")
    head, dot, rest = name[2:].partition(".")
    return f"--{head.replace('_', '-')}{dot}{rest}{eq}{value}"


def engine_arg(args: list[str], *flags: str) -> str | None:
    """The value vLLM takes for the first of ``flags`` given: the last one, ``--flag v`` or ``--flag=v``."""
    for flag in flags:
        found: str | None = None
        for i, arg in enumerate(args):
            name, eq, value = normal_arg(arg).partition("=")
            if name == flag:
                found = value if eq else (args[i + 1] if i + 1 < len(args) else "")
        if found is not None:
            return found
    return None


def _fatal_in_logs(logs: list[Path]) -> bool:
    for path in logs:
        with contextlib.suppress(OSError):
            text = path.read_text(errors="replace")
            if any(re.search(SIGNATURES[name], text) for name in FATAL_IN_LOG):
                return True
    return False


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


_LIVE: set[subprocess.Popen[bytes]] = set()
"""Engine process groups started and not reaped, killed when this process is terminated."""


def kill_all() -> None:
    """Kill every engine process group this process launched and has not reaped."""
    for proc in list(_LIVE):
        _kill_group(proc)


def clear_dir(path: Path) -> None:
    """Empty ``path`` (files and folders), creating it when missing."""
    path.mkdir(parents=True, exist_ok=True)
    for stale in path.iterdir():
        if stale.is_dir() and not stale.is_symlink():
            shutil.rmtree(stale, ignore_errors=True)
        else:
            stale.unlink(missing_ok=True)


def launch(
    spec: RunSpec, workdir: Path, progress: Callable[[str], None] | None = None, *, barrier: Path | None = None
) -> dict[str, Any]:
    """Run ``spec`` to completion (or failure/timeout) and return its record; ``barrier`` is the folder
    of this run's turn and rank files (default ``<workdir>/<label>/barrier``)."""
    if spec.dp < 1:
        raise ValueError("dp must be >= 1")
    root = workdir / spec.label
    root.mkdir(parents=True, exist_ok=True)
    if barrier is None:
        barrier = root / "barrier"
        clear_dir(barrier)
    else:
        barrier.mkdir(parents=True, exist_ok=True)
    # a reused directory (verify --workdir) must not lend an old run's result, record or logs to this one
    for stale in [*root.glob("rank*.json"), *root.glob("rank*.log"), root / "record.json"]:
        stale.unlink(missing_ok=True)
    if spec.cold_jit_cache:
        shutil.rmtree(root / "dg-jit-cold", ignore_errors=True)
    spec_path = root / "spec.json"
    spec_path.write_text(json.dumps(asdict(spec), indent=1))
    port = free_port(PORT_BLOCK)
    runner_module = os.environ.get(RUNNER_MODULE_ENV, spec.module)
    procs: list[subprocess.Popen[bytes]] = []
    logs = []
    started = time.monotonic()
    for rank in range(spec.dp):
        env = {**os.environ, **spec.env, BARRIER_ENV: str(barrier), "PYTHONUNBUFFERED": "1"}
        if spec.dp > 1:
            dp_env = {"RANK": rank, "RANK_LOCAL": rank, "SIZE": spec.dp, "MASTER_IP": "127.0.0.1", "MASTER_PORT": port}
            env.update({f"VLLM_DP_{key}": str(value) for key, value in dp_env.items()})
        if spec.cold_jit_cache:
            env["DG_JIT_CACHE_DIR"] = str(root / "dg-jit-cold")
        log_path = root / f"rank{rank}.log"
        logs.append(log_path)
        command = [sys.executable, "-m", runner_module, str(spec_path), str(root / f"rank{rank}.json")]
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        procs.append(proc)
        _LIVE.add(proc)
    failed_at: float | None = None
    last_scan = 0.0
    timed_out = False
    try:
        while True:
            codes = [p.poll() for p in procs]  # poll every rank: any() would stop at the first live one
            if all(c is not None for c in codes):
                break
            now = time.monotonic()
            if failed_at is None and any(c not in (None, 0) for c in codes):
                failed_at = now
            if failed_at is None and now - last_scan > 2.0:
                last_scan = now
                if _fatal_in_logs(logs):
                    failed_at = now
            if failed_at is not None and now - failed_at > FAIL_GRACE_S:
                break
            if timed_out := now - started > spec.timeout_s:
                break
            time.sleep(0.5)
    finally:
        for p in procs:
            _kill_group(p)
        for p in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=30)
            _LIVE.discard(p)
    wall = time.monotonic() - started
    if timed_out:
        with open(logs[0], "a") as log:
            log.write(f"\n[dbo-harness launcher] timeout after {spec.timeout_s:.0f} s: killed every rank\n")
    ranks = load_ranks(root, spec.dp, lambda rank: f"wrote no result (exit code {procs[rank].returncode})")
    record = spec.record(ranks, [p.read_text(errors="replace") for p in logs], wall)
    (root / "record.json").write_text(json.dumps(record, indent=1))
    if progress is not None:
        progress(f"{spec.label}: {'ok' if record['ok'] else 'FAILED: ' + str(record['error'])} ({wall:.0f} s)")
    return record


def load_ranks(root: Path, dp: int, why_missing: Callable[[int], str]) -> list[dict[str, Any]]:
    """Each rank's result, or a failed placeholder saying why it is missing (with any reps it finished)."""
    ranks = []
    for rank in range(dp):
        path = root / f"rank{rank}.json"
        if path.exists():
            result = json.loads(path.read_text())
        else:
            result = {"rank": rank, "ok": False, "error": f"rank {rank} {why_missing(rank)}"}
        if not result.get("bench"):  # killed, or failed mid-benchmark (a turn or barrier timeout): keep its reps
            try:
                kept = json.loads(partial_path(path).read_text())
                bench, versions = kept["bench"], kept.get("versions")
            except (OSError, ValueError, KeyError, TypeError, AttributeError):  # none kept, or unreadable
                bench, versions = None, None
            if isinstance(bench, dict):
                result.update(bench=bench, bench_partial=True)
                if isinstance(versions, dict) and not result.get("versions"):
                    result["versions"] = versions  # the GPU that measured the reps kept
        ranks.append(result)
    return ranks
