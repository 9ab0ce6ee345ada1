"""One rank of one real-engine run: ``python -m dbo_runtime.harness.runner SPEC OUT`` (spec from ``harness.launch``;
result: greedy tokens, top-k logprobs, the plugin's counters, timings). A child per rank: vLLM's offline DP wants
``VLLM_DP_*`` set before the engine exists, and a crash must not take the caller along. Ranks meet at file barriers."""

from __future__ import annotations

import gc
import json
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dbo_runtime.harness.prompts import PromptSpec, for_rank, load

BARRIER_ENV = "DBO_HARNESS_BARRIER_DIR"
BARRIER_TIMEOUT_S = 600.0
_KEEP: list[Any] = []
_PARTIAL: list[Path] = []
"""Where ``main`` writes the benchmark's reps so far."""
_VERSIONS: dict[str, Any] = {}
"""This engine's versions and GPU, kept with the partial reps."""
Stats = list[dict[str, Any]] | None
RowHook = Callable[[dict[str, Any], Stats, Stats, Stats, int], None]
"""``hook(row, s0, s1, s2, steps)``: a caller's columns for one rep, from the counter snapshots around its passes."""
RankRun = Callable[[dict[str, Any], int, int, dict[str, Any]], dict[str, Any]]


def _log(msg: str) -> None:
    sys.stderr.write(f"[dbo-harness rank {os.environ.get('VLLM_DP_RANK', '0')}] {msg}\n")
    sys.stderr.flush()


def partial_path(out: Path) -> Path:
    """``rank0.json`` -> ``rank0.partial.json``: the reps a benchmark finished before it was stopped."""
    return out.with_name(out.stem + ".partial.json")


class Superseded(TimeoutError):
    """A later run in the same directory took this run's turn folder over."""


def _superseded() -> bool:
    """Whether a later run removed this run's barrier folder (this engine is then an orphan)."""
    root = os.environ.get(BARRIER_ENV)
    return root is not None and not Path(root).is_dir()


def _save_partial(bench: dict[str, Any]) -> None:
    """Keep every finished rep on disk, for a run killed before its result file; never fails the run."""
    if _superseded():
        return
    for path in _PARTIAL:
        try:
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps({"bench": bench, **({"versions": _VERSIONS} if _VERSIONS else {})}))
            tmp.replace(path)
        except OSError as exc:
            _log(f"could not keep the reps so far in {path}: {exc}")


def _await(root: Path, done: Callable[[], bool], what: str, late: str, poll_s: float) -> None:
    deadline = time.monotonic() + BARRIER_TIMEOUT_S
    while not done():
        if not root.is_dir():
            raise Superseded(f"{what}: the run's folder {root} was removed by a later run")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: {late}")
        time.sleep(poll_s)


def barrier(name: str, rank: int, size: int) -> None:
    if size <= 1:
        return
    root = Path(os.environ[BARRIER_ENV])
    (root / f"{name}.{rank}").touch()
    late = f"the other DP ranks did not arrive within {BARRIER_TIMEOUT_S:.0f} s"
    _await(root, lambda: all((root / f"{name}.{r}").exists() for r in range(size)), f"barrier {name!r}", late, 0.05)


def wait_turn(name: str, rank: int) -> None:
    """Say ready, then wait for the coordinator to start this turn (``harness.turns``)."""
    root = Path(os.environ[BARRIER_ENV])
    (root / f"ready-{name}.{rank}").touch()
    _await(root, (root / f"go-{name}").exists, f"turn {name!r}", "never started by the coordinator", 0.02)


def _stats(llm: Any) -> Stats:
    """Per-worker dbo_runtime counters, or None where the plugin is not installed (vanilla)."""
    from dbo_runtime.integration.plugin import installed_patch_set

    if installed_patch_set() is None:
        return None
    try:
        return list(llm.collective_rpc("dbo_runtime_stats", timeout=60))
    except Exception as exc:
        _log(f"no plugin counters on the workers ({type(exc).__name__}: {exc})")
        return None


def _requests(indices: list[int], outputs: list[Any]) -> list[dict[str, Any]]:
    out = []
    for index, output in zip(indices, outputs, strict=True):
        done = output.outputs[0]
        logprobs = [{str(tid): float(lp.logprob) for tid, lp in position.items()} for position in done.logprobs or []]
        out.append({"index": index, "tokens": list(done.token_ids), "logprobs": logprobs})
    return out


def _versions() -> dict[str, Any]:
    from importlib import metadata

    import torch

    info: dict[str, Any] = {"torch": torch.__version__, "python": sys.version.split()[0]}
    for dist in ("vllm", "tokenspeed-deepgemm", "tokenspeed-deepep", "dbo-runtime"):
        try:
            info[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            info[dist] = None
    if torch.cuda.is_available():
        info["device"] = torch.cuda.get_device_name(0)
        info["visible_gpus"] = torch.cuda.device_count()
    return info


def summary_delta(before: Stats, after: Stats, key: str) -> Any:
    """The change of one summary counter over this rank's workers (an int for counts, a float for seconds)."""
    if not before or not after:
        return None
    pairs = [(early["summary"].get(key), late["summary"].get(key)) for early, late in zip(before, after, strict=False)]
    if any(a is None or b is None for a, b in pairs):
        return None  # a counter this plugin build does not report
    return sum(b - a for a, b in pairs)


def _per_partition_ms(seconds: Any, partitions: Any) -> float | None:
    """Host ms per microbatched forward (SMControl's partitions); None where none ran or no counters."""
    ok = isinstance(partitions, int) and partitions > 0 and isinstance(seconds, (int, float))
    return float(seconds) / partitions * 1e3 if ok else None


def start(spec: dict[str, Any], rank: int, size: int, result: dict[str, Any]) -> tuple[Any, ...]:
    """(engine, greedy sampling parameters, this rank's prompts, their indices, vocabulary size)."""
    t0 = time.perf_counter()
    from vllm import LLM, SamplingParams
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    result["import_s"] = time.perf_counter() - t0
    # no abbreviations: checks read the engine arguments by their full names
    parser = EngineArgs.add_cli_args(FlexibleArgumentParser(prog="vllm", allow_abbrev=False))
    engine_args = EngineArgs.from_cli_args(parser.parse_args(spec["engine_args"]))
    t1 = time.perf_counter()
    llm = LLM.from_engine_args(engine_args)
    _KEEP.append(llm)  # shut down only after the result is on disk (a DP shutdown can hang)
    result["start_s"] = time.perf_counter() - t1
    _log(f"engine ready in {result['start_s']:.1f} s")
    result["versions"] = _versions()
    _VERSIONS.update(result["versions"])
    vocab = int(llm.llm_engine.model_config.get_vocab_size())
    prompts = load(PromptSpec(**spec["prompts"]), vocab)
    mine = for_rank(prompts, rank, size)
    if not mine:
        raise ValueError(f"DP rank {rank} has no prompt: give at least {size} prompts")
    params = SamplingParams(temperature=0.0, max_tokens=int(spec["max_tokens"]), ignore_eos=True,
                            logprobs=int(spec.get("logprobs", 5)), detokenize=False)  # fmt: skip
    return llm, params, [prompts[i] for i in mine], mine, vocab


def generate(
    llm: Any, params: Any, batch: list[Any], mine: list[int], rank: int, size: int, result: dict[str, Any]
) -> None:
    """The greedy pass, started together on every rank, between two counter snapshots."""
    result["stats_start"] = _stats(llm)
    barrier("generate", rank, size)
    t2 = time.perf_counter()
    outputs = llm.generate(batch, params, use_tqdm=False)
    result["generate_s"] = time.perf_counter() - t2
    result["requests"] = _requests(mine, outputs)
    result["stats_end"] = _stats(llm)
    result["microbatched_builds"] = summary_delta(result["stats_start"], result["stats_end"], "microbatched_builds")
    _log(f"generated {len(batch)} requests in {result['generate_s']:.2f} s")


def run(spec: dict[str, Any], rank: int, size: int, result: dict[str, Any]) -> dict[str, Any]:
    """Fill ``result`` as the run goes, so a failure still reports what happened before it."""
    llm, params, batch, mine, _ = start(spec, rank, size, result)
    generate(llm, params, batch, mine, rank, size, result)
    if spec.get("bench"):
        result["bench"] = bench_reps(llm, type(params), batch, spec["bench"], rank, size)
    result["ok"] = True
    return result


def bench_reps(
    llm: Any, sampling: Any, batch: list[Any], bench: dict[str, Any], rank: int, size: int, hook: RowHook | None = None
) -> dict[str, Any]:
    """Per rep a 1-token and a T-token pass, timed, with SMControl's partitions over each; ``prefill_twice``: one
    more 1-token pass, ``prefill_s`` the faster (a compile may stall one). ``hook`` adds a caller's columns."""
    steps = int(bench["max_tokens"])
    one = sampling(temperature=0.0, max_tokens=1, ignore_eos=True, detokenize=False)
    full = sampling(temperature=0.0, max_tokens=steps, ignore_eos=True, detokenize=False)
    reps = []
    coordinated = bool(bench.get("coordinated"))

    def timed(params: Any, barrier_name: str) -> float:
        barrier(barrier_name, rank, size)
        t = time.perf_counter()
        llm.generate(batch, params, use_tqdm=False)
        return time.perf_counter() - t

    for rep in range(int(bench.get("warmup", 1)) + int(bench["reps"])):
        if coordinated:
            wait_turn(f"rep{rep}", rank)
        s0 = _stats(llm)
        prefill = timed(one, f"bench{rep}a")
        s1 = _stats(llm)
        total = timed(full, f"bench{rep}b")
        s2 = _stats(llm)
        passes = [prefill, timed(one, f"bench{rep}c")] if bench.get("prefill_twice") else [prefill]
        row: dict[str, Any] = {"rep": rep, "warmup": rep < int(bench.get("warmup", 1)), "prefill_s": min(passes), "total_s": total}
        row["prefill_passes_s"] = passes
        # per microbatched forward: free of the DP ranks' start skew
        n01, n12 = summary_delta(s0, s1, "partitions"), summary_delta(s1, s2, "partitions")
        t01, t12 = summary_delta(s0, s1, "partition_s"), summary_delta(s1, s2, "partition_s")
        row.update(prefill_partitions=n01, prefill_partition_ms=_per_partition_ms(t01, n01))
        if isinstance(n01, int) and isinstance(n12, int) and t01 is not None and t12 is not None:
            row.update(decode_partitions=n12 - n01, decode_partition_ms=_per_partition_ms(t12 - t01, n12 - n01))
        if hook is not None:
            hook(row, s0, s1, s2, steps)
        reps.append(row)
        _save_partial({"max_tokens": steps, "requests": len(batch), "reps": reps})
        if coordinated:
            (Path(os.environ[BARRIER_ENV]) / f"done-rep{rep}.{rank}").touch()
    return {"max_tokens": steps, "requests": len(batch), "reps": reps}


EXIT_WATCHDOG_S = 90.0
"""From the result written to the process gone: past it the runner exits hard (it runs as its own process)."""


def _exit_hard() -> None:
    """vLLM's DP shutdown can hang after the result is written; never let that block the caller."""
    _log(f"shutdown took over {EXIT_WATCHDOG_S:.0f} s; exiting hard")
    os._exit(3)


def main(argv: list[str] | None = None, run_rank: RankRun = run) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        sys.stderr.write("usage: python -m dbo_runtime.harness.runner SPEC.json OUT.json\n")
        return 2
    spec = json.loads(Path(args[0]).read_text())
    rank, size = int(os.environ.get("VLLM_DP_RANK", "0")), int(os.environ.get("VLLM_DP_SIZE", "1"))
    out = Path(args[1])
    _PARTIAL[:] = [partial_path(out)]
    result: dict[str, Any] = {"label": spec.get("label"), "rank": rank, "dp": size, "ok": False, "error": None}
    try:
        run_rank(spec, rank, size, result)
    except BaseException as exc:  # the run's failure is the result (e.g. vLLM's DeepGEMM assertion)
        result.update(ok=False, error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc()[-6000:])
        _log(f"failed: {result['error']}")
    if _superseded():  # an orphan: the later run's rank files are its own
        _log("this run's folder was taken over by a later run: no result written")
        return 1
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(result))
    tmp.replace(out)  # before the exit barrier: a peer's failure must not cost this rank's result
    watchdog = threading.Timer(EXIT_WATCHDOG_S, _exit_hard)
    watchdog.daemon = True
    watchdog.start()
    if result.get("ok"):
        # Only a rank that succeeded waits for the others; the launcher kills a failed peer.
        try:
            barrier("exit", rank, size)
        except TimeoutError as exc:
            _log(str(exc))
    _KEEP.clear()
    gc.collect()
    return 0 if result.get("ok") else 1


def cli(run_rank: RankRun = run) -> None:
    """``main``, then exit (hard under ``DBO_HARNESS_HARD_EXIT=1``)."""
    code = main(run_rank=run_rank)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code) if os.environ.get("DBO_HARNESS_HARD_EXIT") == "1" else sys.exit(code)


if __name__ == "__main__":
    cli()
