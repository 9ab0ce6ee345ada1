"""The one-GPU DBO emulation's matrix: rows, the engines they need, and one JSON-lines record per row.

``python -m tests.e2e.emulated session --rows ROWS --out DIR`` (``tools/gpu/session-emulated.sh``) starts the
engines the chosen rows need (one child process each, ``python -m tests.e2e.emulated engine SPEC OUT``, a few at
once), then compares them and appends one record per row to ``DIR/emulated.jsonl``. Every engine runs with the
emulation (``dp_emulation``) on ``PYTHONPATH``; vanilla engines add ``DBO_RUNTIME_DISABLE=1``.

Rows (MODE is ``eager`` or ``graphs``, FULL_DECODE_ONLY):

- ``repro``: the upstream reproducer workload (exact repeats of 64k+1-token prompts, each a prefix-cache hit that
  leaves a 1-token extend, mixed with fresh long prompts), comm SMs 20, eager: vanilla must die on DeepGEMM's
  ``_schedule_meta_size`` assertion, dbo_runtime must serve every request;
- ``a-control-MODE``: the floor. Vanilla (comm SMs 0, so it cannot crash) against dbo_runtime (comm 0) on the
  control without followers, where bug B cannot act: what DBO's batch shapes and request timing alone move;
- ``a-MODE``: the same pair on a model with followers: outside the floor (bug B), within it on ``v32``;
- ``b-MODE``: dbo_runtime with comm SMs 20 against 0: within the floor (the re-plan is exact; the other GEMMs'
  SM count changes rounding, which a floor judges and bit-identity cannot);
- ``n-MODE`` and ``n-control-MODE``: two identical engines (dbo_runtime on the model with followers, vanilla on
  the control): how much of the floor is run-to-run;
- ``c``: eager, each follower's top-k read against its own microbatch's leader's: 0 wrong with dbo_runtime,
  more than 0 vanilla (the top-k buffer the layer reads; an index group's converted workspace is judged by the
  a rows' outputs, not here);
- ``mtp-kK`` (K 1, 2, 3: DeepGEMM's paged MQA ``next_n`` 2, 1 (K + 1 = 3 is flattened to single rows) and 4 on
  SM90), eager, the GLM-5.3 model with one MTP layer: dbo_runtime comm 20 against comm 0 within the eager floor
  (the b rule), vanilla comm 0 beside them; microbatched steps and draft acceptance recorded for all three;
- ``v4-mtp``: eager, DeepSeek-V4 with one MTP layer, vanilla against dbo_runtime at comm 0: the MTP hidden buffer
  after both microbatches joined holds each microbatch's rows at its own offset (0 wrong with dbo_runtime, more
  than 0 vanilla, which writes every microbatch from row 0); draft acceptance recorded with and without the fix;
- ``t-MODE``: DBO off, no emulation, on a tiny model (``--model`` glm53, v32, v4 or ml4: ``glm53-geometry``,
  ``deepseek-v32``, ``deepseek-v4``, ``mistral-large4``): dbo_runtime against vanilla token-identical in every
  sequence, and its logprobs bit-identical or within vanilla's own run-to-run drift (a second vanilla engine: past
  ``index_topk`` the indexer's top-k may come back in a varying order, so vanilla need not be bit-repeatable); recorded in
  ``transparency.jsonl`` with ``dp_emulated`` false.

``--model ml4`` (vLLM 0.34): the a/b/c/n rows on Mistral Large 4 (``ml4-emu``, followers from ``index_sharing``, 78
layers that ``--layers`` cuts) against its control ``ml4-emu-control``; row c checks ``MistralMLAAttention``.

Pairs are compared with ``dbo_runtime.harness.compare`` (logprobs up to each request's first differing token) and
judged by its ``FloorRule`` against the same session's ``a-control-MODE`` row, which a session adds when a row
needs it; ``python -m tests.e2e.emulated judge --out DIR`` re-judges a finished session's engine results. The
engines are not guaranteed identical batches (the engine core receives the requests while it steps), so a floor,
not bit-identity, is the judgement; ``same_microbatching`` is recorded beside it. DBO-on against DBO-off is no
verdict here: on random-weight models it diverges after a few tokens for vanilla and dbo_runtime alike.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from dbo_runtime.harness.compare import Comparison, FloorRule, Request, compare
from tests.e2e import dp_emulation
from tests.harness import selftime
from tests.harness.engine_runner import ROW_HOOK_ENV
from tests.harness.machine import gpu_gib, refuse_without_engine

HERE = Path(__file__).parent
ROOT = HERE.parent.parent
MODELS = HERE / "models"
FOLLOWERS = {"glm53": "glm53-emu", "glm53-pattern": "glm53-emu-pattern", "v32": "v32-emu", "ml4": "ml4-emu"}
"""The model under test by name; ``v32`` (DeepSeek-V3.2, every layer its own indexer) has no followers. ``ml4``
(Mistral Large 4, vLLM 0.34 only) is a Mistral ``params.json`` whose ``index_sharing`` makes followers."""
CONTROLS = {"glm53": "glm53-emu-control", "glm53-pattern": "glm53-emu-control", "v32": "glm53-emu-control", "ml4": "ml4-emu-control"}
"""Each model's control: its geometry with every layer its own indexer, so dbo_runtime must change nothing
(``v32`` has no followers itself, so its floor is GLM-5.3's control)."""
GIB_PER_ENGINE = {
    ("glm53", 8): 8, ("glm53-pattern", 8): 8, ("v32", 8): 9, ("ml4", 8): 8,
    ("glm53", 61): 21, ("glm53", 78): 26, ("glm53-pattern", 61): 21, ("glm53-pattern", 78): 26,
    ("v32", 61): 24, ("v32", 78): 30, ("ml4", 61): 20, ("ml4", 78): 25,
}  # fmt: skip
"""Estimated GPU memory of one engine (fp8 weights with 8 experts of 256, 1 GiB of KV, workspaces); 8 layers is a
quick smoke of the matrix's plumbing, 61 and 78 the production depths."""
ACCURACY_PROMPTS = {"num": 32, "min_len": 300, "max_len": 2500, "seed": 40}
ACCURACY_TOKENS = 16
FRESH_LONG = {"num": 16, "min_len": 2500, "max_len": 3500, "seed": 19}
MTP_MODEL = "glm53-emu-mtp"
"""``glm53-emu`` plus one MTP layer (``num_nextn_predict_layers`` 1)."""
V4_MTP_MODEL = "deepseek-v4-mtp"
TRANSPARENCY = {"glm53": "glm53-geometry", "v32": "deepseek-v32", "v4": "deepseek-v4", "ml4": "mistral-large4"}
"""DBO-off transparency's tiny models; ``mistral-large4`` is a Mistral-format ``params.json``."""
MTP_TOKENS = 48
MTP_ROWS = {"mtp-k1": 1, "mtp-k2": 2, "mtp-k3": 3}
"""Row -> speculative tokens K; DeepGEMM's SM90 paged MQA takes ``next_n`` K + 1 in {1, 2, 4}, others flattened."""
ROWS = (
    "repro", "a-eager", "a-control-eager", "b-eager", "b-control-eager", "c", "a-graphs", "a-control-graphs",
    "b-graphs", "b-control-graphs",
    "n-eager", "n-control-eager", "n-graphs", "n-control-graphs", *MTP_ROWS, "v4-mtp", "t-eager", "t-graphs",
)  # fmt: skip
MODELS_OF = {
    **{row: tuple(FOLLOWERS) for row in ROWS},
    "repro": ("glm53", "glm53-pattern", "v32"),
    **{row: ("glm53",) for row in MTP_ROWS},
    "v4-mtp": ("v4",),
    "t-eager": tuple(TRANSPARENCY),
    "t-graphs": tuple(TRANSPARENCY),
}
"""The ``--model`` values a row takes."""


def kernel_next_n(k: int) -> int:
    """The ``next_n`` DeepGEMM's SM90 paged MQA logits kernel runs with K speculative tokens (others flattened)."""
    return k + 1 if k + 1 in (1, 2, 4) else 1
IN_PROCESS = os.environ.get("DBO_EMU_IN_PROCESS", "1") == "1"
"""The engine core in the engine's own process: every request is added before the first step, so two engines
see identical batches (in its own process the core starts stepping while requests still arrive)."""
UPSTREAM_WORKSPACE_BUG = os.environ.get("DBO_EMU_KEEP_MQA_OVERLAP", "0") == "1"
"""Keep vLLM's default for ``ml4-emu-control`` in FULL graphs: every layer there prepares its MQA query beside the
indexer, so microbatch 1's workspace slot never grows before the lock and the first long microbatched prefill dies
on vLLM's locked workspace. By default those engines set ``VLLM_MULTI_STREAM_GEMM_TOKEN_THRESHOLD=0`` (the same
operations, the query prepared inside ``forward_mqa``) so the control can serve as a floor; records name it."""
WORKAROUND_ENV = "VLLM_MULTI_STREAM_GEMM_TOKEN_THRESHOLD"
KV_CACHE_DTYPE = os.environ.get("DBO_EMU_KV_CACHE_DTYPE", "fp8")
"""The reproducer's KV cache dtype (vllm#60732), kept for every row so one engine can serve several rows."""


@dataclasses.dataclass(frozen=True)
class Engine:
    model: str
    plugin: bool
    comm_sms: int
    mode: str
    layers: int
    runner: str
    dbo: bool = True
    spec_tokens: int = 0
    self_time: bool = False
    replica: int = 0
    """A second, otherwise identical engine (``n-*`` rows: the run-to-run floor)."""

    @property
    def label(self) -> str:
        depth = f"{self.layers}L" if self.layers else "asis"
        extra = ("" if self.dbo else "-dbooff") + (f"-mtp{self.spec_tokens}" if self.spec_tokens else "") + ("-selftime" if self.self_time else "") + (f"-r{self.replica}" if self.replica else "")
        return f"{self.model}-{depth}-{self.runner}-{self.mode}-{'plugin' if self.plugin else 'vanilla'}-comm{self.comm_sms}{extra}"

    @property
    def workaround(self) -> bool:
        """Whether this engine avoids vLLM's microbatch workspace lock (``UPSTREAM_WORKSPACE_BUG``)."""
        return self.model == "ml4-emu-control" and self.mode == "graphs" and self.dbo and not UPSTREAM_WORKSPACE_BUG

    def args(self) -> list[str]:
        """vLLM's CLI for this engine. ``layers`` 0 keeps the config's depth, which a Mistral ``params.json`` (its
        per-layer lists expanded at that depth) bounds: ``ml4-emu`` is 78 deep. DBO-off engines keep vLLM's defaults
        but the KV cache dtype (no EP), the same for plugin and vanilla. The KV cache is fp8 (FLASHMLA_SPARSE, the
        reproducer's) except on DeepSeek-V4, which picks its own."""
        compilation = {"cudagraph_mode": "FULL_DECODE_ONLY", "max_cudagraph_capture_size": 64}
        params = MODELS / self.model / "params.json"
        mistral = params.exists()
        depth = json.loads(params.read_text())["n_layers"] if mistral else None
        if depth is not None and self.layers > depth:
            # vLLM expands a Mistral config's per-layer patterns at its own depth: the override can only cut it
            raise ValueError(f"{self.model} has {depth} layers: --layers {self.layers} cannot deepen it")
        out = [
            "--model", str(MODELS / self.model),
            "--load-format", "dummy", "--skip-tokenizer-init",
            *(["--config-format", "mistral"] if mistral else []),
            *(["--hf-overrides", json.dumps({"num_hidden_layers": self.layers})] if self.layers else []),
            "--max-model-len", "4096", "--max-num-seqs", "64", "--max-num-batched-tokens", "8192",
            "--gpu-memory-utilization", "0.2", "--kv-cache-memory-bytes", str(1 << 30), "--seed", "0",
            *(["--enforce-eager"] if self.mode == "eager" else ["--compilation-config", json.dumps(compilation)]),
        ]  # fmt: skip
        if self.spec_tokens:
            out += ["--speculative-config", json.dumps({"method": "mtp", "num_speculative_tokens": self.spec_tokens})]
        if not self.model.startswith("deepseek-v4"):
            out += ["--kv-cache-dtype", KV_CACHE_DTYPE]
        if not self.dbo:
            return out
        return [
            *out,
            "--enable-prefix-caching",
            "--enable-expert-parallel", "--all2all-backend", "deepep_high_throughput", "--enable-dbo",
            "--dbo-decode-token-threshold", "4", "--dbo-prefill-token-threshold", "32",
        ]  # fmt: skip

    def env(self) -> dict[str, str]:
        env = {
            "PYTHONPATH": dp_emulation.pythonpath(),
            "VLLM_USE_V2_MODEL_RUNNER": "1" if self.runner == "v2" else "0",
            "VLLM_DEEP_GEMM_WARMUP": "skip",
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0" if IN_PROCESS else "1",
        }
        if self.self_time:
            env.update({"DBO_RUNTIME_SELF_TIME": "1", ROW_HOOK_ENV: selftime.ROW_HOOK})
        if self.workaround:
            env[WORKAROUND_ENV] = "0"
        if not self.plugin:
            env["DBO_RUNTIME_DISABLE"] = "1"
        if not self.dbo:
            return env
        env.update(dp_emulation.engine_env(self.comm_sms))
        if self.mode == "eager":
            # rows c and v4-mtp read the in-engine checks; plugin and vanilla get them alike (no numeric effect)
            env[dp_emulation.CHECK_ENV] = "1"
        return env


@dataclasses.dataclass(frozen=True)
class Settings:
    model: str = "glm53"
    layers: int = 61
    runner: str = "v2"


def needs(row: str, s: Settings) -> list[tuple[Engine, str]]:
    """The engines a row compares and the pass each must run (``accuracy``, ``repro`` or ``mtp``)."""
    if s.model not in MODELS_OF[row]:
        raise ValueError(f"row {row} takes --model {' or '.join(MODELS_OF[row])}, not {s.model}")
    mode = "graphs" if row.endswith("graphs") else "eager"
    if row in MTP_ROWS:
        k = MTP_ROWS[row]
        return [(Engine(MTP_MODEL, p, c, mode, s.layers, s.runner, spec_tokens=k), "mtp") for p, c in ((False, 0), (True, 0), (True, 20))]
    if row == "v4-mtp":
        return [(Engine(V4_MTP_MODEL, p, 0, mode, 0, s.runner, spec_tokens=1), "mtp") for p in (False, True)]
    if row.startswith("t-"):
        pairs = ((False, 0), (True, 0), (False, 1))  # vanilla, dbo_runtime, vanilla again (the run-to-run floor)
        return [(Engine(TRANSPARENCY[s.model], p, 0, mode, 0, s.runner, dbo=False, replica=r), "accuracy") for p, r in pairs]
    model, control = FOLLOWERS[s.model], CONTROLS[s.model]

    def e(m: str, plugin: bool, comm: int, replica: int = 0) -> Engine:
        return Engine(m, plugin, comm, mode, s.layers, s.runner, replica=replica)

    if row == "repro":
        return [(e(model, False, 20), "repro"), (e(model, True, 20), "repro")]
    if row in ("a-eager", "a-graphs", "c"):
        return [(e(model, False, 0), "accuracy"), (e(model, True, 0), "accuracy")]
    if row.startswith("a-control"):
        return [(e(control, False, 0), "accuracy"), (e(control, True, 0), "accuracy")]
    if row.startswith("b-control"):
        return [(e(control, True, 20), "accuracy"), (e(control, True, 0), "accuracy")]
    if row.startswith("b-"):
        return [(e(model, True, 20), "accuracy"), (e(model, True, 0), "accuracy")]
    if row.startswith("n-control"):
        return [(e(control, False, 0), "accuracy"), (e(control, False, 0, 1), "accuracy")]
    if row.startswith("n-"):
        return [(e(model, True, 0), "accuracy"), (e(model, True, 0, 1), "accuracy")]
    raise ValueError(row)


def plan(rows: Iterable[str], s: Settings) -> dict[Engine, list[str]]:
    """Each engine once, with every pass its rows need (``accuracy`` first)."""
    out: dict[Engine, list[str]] = {}
    for row in rows:
        for engine, what in needs(row, s):
            passes = out.setdefault(engine, [])
            if what not in passes:
                passes.append(what)
    for passes in out.values():
        passes.sort(key=lambda p: p != "accuracy")
    return out


# ---------------------------------------------------------------------------------------------- one engine


def _requests(outputs: list[Any]) -> list[dict[str, Any]]:
    out = []
    for o in outputs:
        c = o.outputs[0]
        lps = [{str(t): float(lp.logprob) for t, lp in pos.items()} for pos in (c.logprobs or [])]
        out.append({"tokens": list(c.token_ids), "logprobs": lps})
    return out


def _counters(llm: Any) -> list[dict[str, Any]]:
    """The emulation's counters per worker (none for an engine run without the emulation: DBO off)."""
    return list(llm.collective_rpc(dp_emulation.RPC, timeout=60)) if dp_emulation.enabled() else []


SPEC_METRICS = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens", "vllm:spec_decode_num_accepted_tokens")


def _spec_metrics(llm: Any) -> dict[str, int]:
    """vLLM's speculative-decoding counters (summed over labels), from its Prometheus snapshot."""
    out = dict.fromkeys(SPEC_METRICS, 0)
    for metric in llm.get_metrics():
        if metric.name in out:
            out[metric.name] += int(getattr(metric, "value", 0))
    return {k.removeprefix("vllm:spec_decode_"): v for k, v in out.items()}


def engine_main(spec_path: str, out_path: str) -> int:
    """One engine: every pass of its spec, the result rewritten after each (a crash keeps what ran)."""
    spec = json.loads(Path(spec_path).read_text())
    out = Path(out_path)
    result: dict[str, Any] = {"label": spec["label"], "passes": {}}

    def save() -> None:
        out.write_text(json.dumps(result))

    from vllm import LLM, SamplingParams
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from dbo_runtime.harness.prompts import PromptSpec, load
    from tests.e2e.reproducer import PROMPTS as REPRO

    parser = EngineArgs.add_cli_args(FlexibleArgumentParser(prog="vllm", allow_abbrev=False))
    t0 = time.perf_counter()
    llm = LLM.from_engine_args(EngineArgs.from_cli_args(parser.parse_args(spec["args"])))
    result["start_s"] = round(time.perf_counter() - t0, 1)
    import torch

    result["device"] = torch.cuda.get_device_name(0)
    from vllm import envs

    from dbo_runtime.integration.features import REGISTRY
    from dbo_runtime.integration.plugin import installed_patch_set

    patch_set = installed_patch_set()  # the engine core and its worker run in this process (uni executor, DP 1)
    states = [st.state for st in patch_set.status()] if patch_set is not None and patch_set.installed else []
    # in force: every feature this release takes verified in this process (the live registry, where a failed
    # install or a broken hook marks its feature) and no patch broken; an empty set leaves a "plugin" engine vanilla
    features = REGISTRY.all()
    short = [f"{name}: {st.describe()}" for name, st in features.items() if st.applies and not st.in_force]
    result["dbo_runtime"] = bool(features) and not short and "installed" in states and "broken" not in states
    result["dbo_runtime_shortfall"] = short
    result[WORKAROUND_ENV] = envs.VLLM_MULTI_STREAM_GEMM_TOKEN_THRESHOLD  # what vLLM used (the record's workaround)
    save()
    vocab = int(llm.llm_engine.model_config.get_vocab_size())
    greedy = {"temperature": 0.0, "ignore_eos": True, "detokenize": False}
    for what in spec["passes"]:
        result["passes"][what] = {"started": True}
        save()
        before = _counters(llm)
        spec_before = _spec_metrics(llm) if what == "mtp" else {}
        if what == "mtp":
            prompts = load(PromptSpec(**ACCURACY_PROMPTS), vocab)
            outputs = llm.generate(prompts, SamplingParams(max_tokens=MTP_TOKENS, logprobs=1, **greedy), use_tqdm=False)
            after = _spec_metrics(llm)
            done: dict[str, Any] = {"requests": _requests(outputs), "spec": {k: after[k] - spec_before[k] for k in after}}
        elif what == "accuracy":
            prompts = load(PromptSpec(**ACCURACY_PROMPTS), vocab)
            outputs = llm.generate(prompts, SamplingParams(max_tokens=ACCURACY_TOKENS, logprobs=1, **greedy), use_tqdm=False)
            done = {"requests": _requests(outputs)}
        else:
            first = load(PromptSpec(file=str(REPRO)), vocab)
            fresh = load(PromptSpec(**FRESH_LONG), vocab)
            params = SamplingParams(max_tokens=8, **greedy)
            llm.generate(first, params, use_tqdm=False)
            mixed = [p for i in range(max(len(first), len(fresh))) for p in (first[i : i + 1] + fresh[i : i + 1])]
            outputs = llm.generate(mixed, params, use_tqdm=False)
            done = {"requests": len(mixed), "completed": sum(1 for o in outputs if len(o.outputs[0].token_ids) == 8)}
        done["counters_before"], done["counters_after"] = before, _counters(llm)
        result["passes"][what] = done
        save()
    result["ok"] = True
    save()
    return 0


# ---------------------------------------------------------------------------------------------- the session


def _start(engine: Engine, passes: list[str], out: Path) -> tuple[subprocess.Popen[bytes], float]:
    spec = out / f"{engine.label}.spec.json"
    spec.write_text(json.dumps({"label": engine.label, "args": engine.args(), "passes": passes}))
    log = open(out / f"{engine.label}.log", "wb")  # noqa: SIM115 -- the child's, closed with the process
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.e2e.emulated", "engine", str(spec), str(out / f"{engine.label}.json")],
        cwd=ROOT, env={**os.environ, **engine.env()}, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    return proc, time.monotonic()


def run_engines(work: dict[Engine, list[str]], out: Path, at_once: int, deadline: float) -> None:
    """Start up to ``at_once`` engines, each stopped (its process group) when it outlives the session."""
    pending = list(work.items())
    running: list[tuple[Engine, subprocess.Popen[bytes]]] = []
    while pending or running:
        while pending and len(running) < at_once and time.monotonic() < deadline:
            engine, passes = pending.pop(0)
            running.append((engine, _start(engine, passes, out)[0]))
        if not running:
            break
        time.sleep(2)
        for engine, proc in list(running):
            late = time.monotonic() > deadline or (not engine.plugin and engine.comm_sms > 0 and _crashed(out, engine))
            if proc.poll() is not None or late:
                if late and proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                running.remove((engine, proc))


ASSERTION = "_schedule_meta_size == num_sms"


def _crashed(out: Path, engine: Engine) -> bool:
    """A vanilla engine that hit DeepGEMM's assertion: stopped at once (on V2 its step would hang until vLLM's
    RPC timeout, holding its GPU share)."""
    log = out / f"{engine.label}.log"
    return log.exists() and ASSERTION in log.read_text(errors="replace")


TRUST_LABELS = False
"""``judge --trust-labels``: a result without the ``dbo_runtime`` flag is taken to be what its label says."""


def _load(out: Path, engine: Engine) -> dict[str, Any]:
    path = out / f"{engine.label}.json"
    result = json.loads(path.read_text()) if path.exists() else {"passes": {}}
    log = out / f"{engine.label}.log"
    text = log.read_text(errors="replace") if log.exists() else ""
    result["assertion_seen"] = ASSERTION in text
    result["log_tail"] = text[-600:]
    flag = engine.plugin if TRUST_LABELS and "dbo_runtime" not in result else result.get("dbo_runtime")
    if result.get("ok") and flag is not engine.plugin:
        # a pair of engines that are both vanilla (or both patched) would pass every row without testing anything
        result["ok"] = False
        if flag is None:
            why = "its result does not say whether dbo_runtime was in force (written before engines recorded it; judge --trust-labels)"
        elif engine.plugin:
            why = "dbo_runtime's fixes were not in force: its entry point not installed, VLLM_PLUGINS leaving it out, or register failing (see its log)"
        else:
            why = "dbo_runtime was in force in a vanilla engine (DBO_RUNTIME_DISABLE=1 not honoured)"
        result["log_tail"] = f"{engine.label}: {why}"
    return result


def _recorded(out: Path, engine: Engine, key: str) -> Any:
    """What the engine recorded under ``key`` in its result (None: not recorded, or no result)."""
    path = out / f"{engine.label}.json"
    return json.loads(path.read_text()).get(key) if path.exists() else None


def _workarounds(out: Path, row: str, s: Settings) -> dict[str, str]:
    """Which of the row's engines, and of its floor's, ran with ``WORKAROUND_ENV`` 0, as each engine recorded it."""
    def used(r: str) -> list[str]:
        return [e.label for e, _ in needs(r, s) if _recorded(out, e, WORKAROUND_ENV) == 0]

    notes = {"workaround": used(row), "floor_workaround": used(floor) if (floor := floor_row(row)) else []}
    why = f"{WORKAROUND_ENV}=0 (vLLM's microbatch workspace lock) in "
    return {key: why + ", ".join(labels) for key, labels in notes.items() if labels}


def differing(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> int:
    """Sequences whose tokens or logprobs differ in any bit."""
    return sum(1 for x, y in zip(a, b, strict=True) if x != y)


def comparison(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> Comparison:
    """``b`` against ``a`` as ``dbo-runtime verify`` compares runs."""

    def requests(rs: list[dict[str, Any]]) -> list[Request]:
        return [Request.from_json({**r, "index": i}) for i, r in enumerate(rs)]

    return compare(requests(a), requests(b))


FACTS = (
    "requests", "agreement", "agreement_se", "exact_requests", "mean_abs_dlogprob_exact", "dlogprob_positions",
    "nonfinite_logprobs", "missing_requests",
)  # fmt: skip
"""The ``Comparison`` fields a record keeps: enough to rebuild it and re-judge the row from the record alone."""


def _facts(c: Comparison) -> dict[str, Any]:
    return {k: getattr(c, k) for k in FACTS}


def within_floor(comparison: dict[str, Any], floor: dict[str, Any]) -> tuple[bool, list[str]]:
    """``FloorRule`` on two recorded comparisons (``_facts``)."""
    return FloorRule().judge(Comparison(**comparison), Comparison(**floor))


FLOOR_OF = {"eager": "a-control-eager", "graphs": "a-control-graphs"}
"""The row whose pair is the floor for a mode's floor-judged rows (``mtp-kK`` are eager)."""
COMM_FLOOR_OF = {"eager": "b-control-eager", "graphs": "b-control-graphs"}
"""The floor of ``b-*``: dbo_runtime at comm 20 against comm 0 on the control, where no follower exists. Lowering
DeepGEMM's SM count changes every DeepGEMM GEMM's split, not only the indexer's schedule, so ``b-*`` compare with
that same change on a model bug B cannot touch."""
FLOORS = (*FLOOR_OF.values(), *COMM_FLOOR_OF.values())


def floor_row(row: str) -> str | None:
    """The floor row ``row`` is judged against, None for rows judged otherwise."""
    mode = "graphs" if row.endswith("graphs") else "eager"
    if row.startswith("b-") and row not in FLOORS:
        return COMM_FLOOR_OF[mode]
    if row.startswith(("a-eager", "a-graphs")):
        return FLOOR_OF[mode]
    return FLOOR_OF["eager"] if row in MTP_ROWS else None


def with_floors(rows: list[str]) -> list[str]:
    """``rows`` with each floor they need, floors first (a floor must be judged before its rows)."""
    floors = [f for f in FLOORS if f in rows or any(floor_row(r) == f for r in rows)]
    return floors + [r for r in rows if r not in floors]


def _judged(rec: dict[str, Any], floor: Comparison | None, want_outside: bool) -> dict[str, Any]:
    """``rec`` with the floor's verdict on its ``comparison``: within the floor, or outside it when ``want_outside``."""
    if floor is None:
        return {**rec, "error": "no floor: its row's engines did not both run", "pass": False}
    within, reasons = within_floor(rec["comparison"], _facts(floor))
    rec.update(floor=_facts(floor), within_floor=within, floor_reasons=reasons)
    rec["pass"] = rec["microbatched"] and (not within if want_outside else within)
    return rec


def _counted(result: dict[str, Any], what: str) -> dict[str, Any]:
    """This engine's emulation counters over one pass (summed over workers). A split step whose threads never
    switched (no yield inside an eager step, none at any capture for a replayed one) is ``unswitched``, not
    microbatched: its microbatches ran one after the other, so neither bug could act."""
    p = result["passes"].get(what, {})
    before, after = p.get("counters_before") or [], p.get("counters_after") or []
    keys = (
        "steps", "microbatched_steps", "microbatched_graph_steps", "yields_in_steps", "topk_reads", "topk_wrong_reads",
        "mtp_hidden_checks", "mtp_hidden_wrong",
    )  # fmt: skip
    if not after:  # the engine ran without the emulation (DBO off) or never reached this pass
        return {"yields_per_step": None, "runners": []}
    out: dict[str, Any] = {k: sum(w.get(k, 0) for w in after) - sum(w.get(k, 0) for w in before) for k in keys}
    eager = out["microbatched_steps"] - out["microbatched_graph_steps"]
    out["yields_per_step"] = round(out["yields_in_steps"] / eager, 2) if eager else None
    captured = sum(w.get("yields_outside_steps", 0) for w in after)
    out["unswitched_steps"] = (0 if out["yields_in_steps"] else eager) + (0 if captured else out["microbatched_graph_steps"])
    out["microbatched_steps"] -= out["unswitched_steps"]
    out["runners"] = sorted({w["runner"] for w in after if w.get("runner")})
    return out


def acceptance(spec: dict[str, int] | None) -> float | None:
    """Accepted draft tokens per draft token (None when no draft ran)."""
    if not spec or not spec.get("num_draft_tokens"):
        return None
    return round(spec["num_accepted_tokens"] / spec["num_draft_tokens"], 4)


LOGPROB_VERDICTS = ("bit-identical", "within run-to-run floor", "outside run-to-run floor", "no run-to-run floor ran")
"""How a t-row's logprobs compare; the last only for records made before the rows started a second vanilla."""


def transparency_pass(rec: dict[str, Any]) -> bool:
    """The t-row rule on a record's numbers: every sequence token-identical, and the logprobs bit-identical or
    within vanilla's own run-to-run drift (a record without that floor is judged on tokens alone, and says so)."""
    if rec.get("error") or not rec.get("sequences") or rec.get("logprobs") not in LOGPROB_VERDICTS:
        return False
    if (rec.get("differing") == 0) != (rec["logprobs"] == "bit-identical"):
        return False
    return rec.get("tokens_differing") == 0 and rec["logprobs"] != "outside run-to-run floor"


def transparency_floor(rec: dict[str, Any]) -> str:
    """``within``/``outside run-to-run floor`` from a record's ``comparison``, ``floor`` and ``floor_differing``: a
    vanilla replica bit-identical to vanilla measured no drift, so any difference is outside it (``FloorRule``'s
    minimum would otherwise let small differences through)."""
    if rec.get("floor_differing") == 0:
        return "outside run-to-run floor"
    within, _ = within_floor(rec["comparison"], rec["floor"])
    return "within run-to-run floor" if within else "outside run-to-run floor"


def _verdict_transparency(engines: list[tuple[Engine, str]], out: Path) -> dict[str, Any]:
    (vanilla, _), (plugin, _), (again, _) = engines
    r1, r2, r3 = (_load(out, e) for e in (vanilla, plugin, again))
    rec: dict[str, Any] = {"engines": [vanilla.label, plugin.label], "counters": [{}, {}]}  # DBO off: nothing to count
    if not (r1.get("ok") and r2.get("ok")):
        return {**rec, "error": [r.get("log_tail") or "no engine result" for r in (r1, r2) if not r.get("ok")], "pass": False}
    a, b = r1["passes"]["accuracy"]["requests"], r2["passes"]["accuracy"]["requests"]
    pairs = list(zip(a, b, strict=True))
    c = comparison(a, b)
    rec.update(
        sequences=len(a), differing_sequences=[i for i, (x, y) in enumerate(pairs) if x != y],
        tokens_differing=sum(1 for x, y in pairs if x["tokens"] != y["tokens"]),
        comparison=_facts(c), max_abs_dlogprob=c.max_abs_dlogprob,
    )  # fmt: skip
    rec["differing"] = len(rec["differing_sequences"])
    planned = out / "plan.json"
    replica_planned = planned.exists() and again.label in json.loads(planned.read_text())
    if rec["differing"] == 0:
        rec["logprobs"] = "bit-identical"
    elif r3.get("ok"):
        again_requests = r3["passes"]["accuracy"]["requests"]
        rec.update(floor=_facts(comparison(a, again_requests)), floor_differing=differing(a, again_requests))
        rec["floor_engine"] = again.label
        rec["logprobs"] = transparency_floor(rec)
    elif replica_planned:  # the floor engine failed or never started: no verdict on the logprobs
        return {**rec, "error": [r3.get("log_tail") or f"{again.label} did not run"], "pass": False}
    else:
        rec["logprobs"] = "no run-to-run floor ran"
    return {**rec, "pass": transparency_pass(rec)}


def verdict(row: str, s: Settings, out: Path, floors: dict[str, Comparison] | None = None) -> dict[str, Any]:
    """One row's record numbers and ``pass`` (bool) from its engines' results; a floor row adds its comparison
    to ``floors`` for the rows judged against it."""
    floors = {} if floors is None else floors
    engines = needs(row, s)
    if row in MTP_ROWS or row == "v4-mtp":
        return _verdict_mtp(row, engines, out, floors.get(FLOOR_OF["eager"]))
    if row.startswith("t-"):
        return _verdict_transparency(engines, out)
    (e1, what), (e2, _) = engines[:2]
    r1, r2 = _load(out, e1), _load(out, e2)
    c1, c2 = _counted(r1, what), _counted(r2, what)
    rec: dict[str, Any] = {"engines": [e1.label, e2.label], "counters": [c1, c2]}
    if row == "repro":
        served = r2["passes"].get("repro", {})
        rec.update(
            vanilla_assertion=r1["assertion_seen"],
            vanilla_served=bool(r1.get("ok")),
            plugin_requests=served.get("requests"),
            plugin_completed=served.get("completed"),
        )
        requests = served.get("requests")
        rec["pass"] = (
            rec["vanilla_assertion"] and not rec["vanilla_served"] and bool(r2.get("ok")) and requests is not None and served.get("completed") == requests
        )
        return rec
    if not (r1.get("ok") and r2.get("ok")):
        rec.update(error=[r.get("log_tail") for r in (r1, r2) if not r.get("ok")], **{"pass": False})
        return rec
    same = c1.get("microbatched_steps", 0) > 0 and c1.get("microbatched_steps") == c2.get("microbatched_steps")
    rec["same_microbatching"] = same
    if row == "c":
        rec.update(vanilla_reads=c1["topk_reads"], vanilla_wrong_reads=c1["topk_wrong_reads"], plugin_reads=c2["topk_reads"], plugin_wrong_reads=c2["topk_wrong_reads"])
        rec["pass"] = same and c1["topk_wrong_reads"] > 0 and c2["topk_reads"] > 0 and c2["topk_wrong_reads"] == 0
        return rec
    a, b = r1["passes"]["accuracy"]["requests"], r2["passes"]["accuracy"]["requests"]
    c = comparison(a, b)
    rec.update(sequences=len(a), differing=differing(a, b), comparison=_facts(c))
    rec["microbatched"] = c1.get("microbatched_steps", 0) > 0 and c2.get("microbatched_steps", 0) > 0
    if row.startswith("n-") or row in FLOORS:
        if row in FLOORS and rec["microbatched"]:
            floors[row] = c
        rec["pass"] = rec["microbatched"]
        return rec
    want_outside = row.startswith("a-") and s.model != "v32"
    return _judged(rec, floors.get(floor_row(row) or ""), want_outside)


def _verdict_mtp(row: str, engines: list[tuple[Engine, str]], out: Path, floor: Comparison | None) -> dict[str, Any]:
    """``mtp-kK``: engines vanilla comm 0, dbo_runtime comm 0, dbo_runtime comm 20; ``v4-mtp``: vanilla and
    dbo_runtime at comm 0."""
    results = [_load(out, e) for e, _ in engines]
    counters = [_counted(r, "mtp") for r in results]
    specs = [r["passes"].get("mtp", {}).get("spec") for r in results]
    rec: dict[str, Any] = {
        "engines": [e.label for e, _ in engines],
        "counters": counters,
        "spec_tokens": engines[0][0].spec_tokens,
        "kernel_next_n": kernel_next_n(engines[0][0].spec_tokens),
        "draft": specs,
        "acceptance": [acceptance(x) for x in specs],
    }
    if not all(r.get("ok") for r in results):
        return {**rec, "error": [r.get("log_tail") for r in results if not r.get("ok")], "pass": False}
    reqs = [r["passes"]["mtp"]["requests"] for r in results]
    steps = [c.get("microbatched_steps", 0) for c in counters]
    if row == "v4-mtp":
        (cv, cp), microbatched = counters, steps[0] > 0 and steps[0] == steps[1]
        rec.update(
            same_microbatching=microbatched, sequences=len(reqs[0]), differing=differing(reqs[0], reqs[1]),
            vanilla_hidden_checks=cv["mtp_hidden_checks"], vanilla_hidden_wrong=cv["mtp_hidden_wrong"],
            plugin_hidden_checks=cp["mtp_hidden_checks"], plugin_hidden_wrong=cp["mtp_hidden_wrong"],
        )  # fmt: skip
        rec["pass"] = microbatched and cv["mtp_hidden_wrong"] > 0 and cp["mtp_hidden_checks"] > 0 and cp["mtp_hidden_wrong"] == 0
        return rec
    rec.update(
        same_microbatching=steps[1] > 0 and steps[1] == steps[2],
        microbatched=all(n > 0 for n in steps),
        sequences=len(reqs[1]),
        differing=differing(reqs[1], reqs[2]),
        vanilla_differing=differing(reqs[0], reqs[1]),
        comparison=_facts(comparison(reqs[1], reqs[2])),
        vanilla_comparison=_facts(comparison(reqs[0], reqs[1])),
    )
    return _judged(rec, floor, want_outside=False)


def _versions() -> dict[str, Any]:
    from importlib import metadata

    info: dict[str, Any] = {"vllm": metadata.version("vllm")}
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True, timeout=30)
        info["device"] = out.stdout.strip().splitlines()[0] if out.stdout.strip() else None
    except (OSError, subprocess.SubprocessError):
        info["device"] = None
    return info


def _card_gib() -> tuple[int, bool]:
    """The GPU's memory in whole GiB, and whether NVML said so; 80 where it cannot, as on a CPU machine planning."""
    gib = gpu_gib()
    return (80, False) if gib is None else (int(gib), True)


def _gib(rows: list[str], s: Settings) -> int:
    """The largest engine's estimated GPU share: tiny models (DBO off, V4) fit vLLM's 0.2 of the GPU each."""
    if any(not (r.startswith("t-") or r == "v4-mtp") for r in rows):
        return GIB_PER_ENGINE[("glm53" if any(r in MTP_ROWS for r in rows) else s.model, s.layers)]
    return 16


def session(rows: list[str], s: Settings, out: Path, seconds: float, at_once: int | None, command: str) -> int:
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    work = plan(rows, s)
    (out / "plan.json").write_text(json.dumps([e.label for e in work]))
    at_once = at_once or max(1, 72 // _gib(rows, s))
    run_engines(work, out, at_once, t0 + seconds)
    return records(rows, s, out, {**_versions(), "command": command, "date": datetime.date.today().isoformat()})


def records(rows: list[str], s: Settings, out: Path, run: dict[str, Any], suffix: str = "") -> int:
    """Judge each row from the engine results in ``out``, append its record (to ``emulated{suffix}.jsonl`` or
    ``transparency{suffix}.jsonl``), print its line; 1 if any failed. ``run``: the session's device, vllm, date,
    command, and ``judged_by`` when a later ``judge`` re-reads them."""
    failed = 0
    floors: dict[str, Comparison] = {}
    for row in rows:
        rec = verdict(row, s, out, floors)
        counters = rec["counters"]
        transparency = row.startswith("t-")
        with (out / f"{'transparency' if transparency else 'emulated'}{suffix}.jsonl").open("a") as lines:
            record = {
                "family": "dbo-off-transparency" if transparency else "one-gpu-dbo-emulation",
                **({} if transparency else {"emulation": dp_emulation.NAME}),
                "dp_emulated": not transparency,
                "device": run["device"],
                "vllm": run["vllm"],
                "date": run["date"],
                "command": run["command"],
                **({"judged_by": run["judged_by"]} if "judged_by" in run else {}),
                "row": row,
                "runner": s.runner,
                "mode": "graphs" if row.endswith("graphs") else "eager",
                "comm_sms": [20, 0] if row.startswith("b-") else [0, 0, 20] if row in MTP_ROWS else (20 if row == "repro" else 0),
                "layers": s.layers if not (transparency or row == "v4-mtp") else None,
                "engine_core": "in-process" if IN_PROCESS else "own process",
                "model": s.model,
                "model_dir": needs(row, s)[0][0].model,
                "steps": [c.get("steps") for c in counters],
                "microbatched_steps": [c.get("microbatched_steps") for c in counters],
                "yields_per_step": [c.get("yields_per_step") for c in counters],
                **({"unswitched_steps": [c.get("unswitched_steps") for c in counters]} if any(c.get("unswitched_steps") for c in counters) else {}),
                "dbo_runtime_in_force": [_recorded(out, e, "dbo_runtime") for e, _ in needs(row, s)],
                **_workarounds(out, row, s),
                **{k: v for k, v in rec.items() if k != "counters"},
            }
            ran = sorted({r for c in counters for r in c.get("runners", [])} - {s.runner})
            if ran:  # vLLM chose another runner than the one asked for: the record would misname what ran
                record.update({"pass": False, "error": f"the engines ran the {', '.join(ran)} runner, not {s.runner}"})
            lines.write(json.dumps(record) + "\n")
            print(json.dumps({k: record[k] for k in ("row", "pass", "microbatched_steps", "yields_per_step")}), flush=True)
            failed += not record["pass"]
    return 1 if failed else 0


def judge(rows: list[str], s: Settings, out: Path, command: str) -> int:
    """Re-judge a finished session from its engine results, without a GPU: records to ``*-judged.jsonl`` beside
    the session's own, with the session's device, vLLM, date and command and this ``judged_by``."""
    if not out.is_dir():
        print(f"judge: {out} is not a folder: pass the one the session's emulated-runs.tgz unpacks to", file=sys.stderr)
        return 2
    found = [out / n for n in ("emulated.jsonl", "transparency.jsonl") if (out / n).exists()]
    lines = [line for f in found for line in f.read_text().splitlines() if line.strip()]
    if not lines:
        print(
            f"judge: {out} holds no session records (emulated.jsonl or transparency.jsonl): pass the folder that "
            "the session's emulated-runs.tgz unpacks to",
            file=sys.stderr,
        )
        return 2
    labels = [e.label for e in plan(rows, s)]
    planned = json.loads((out / "plan.json").read_text()) if (out / "plan.json").exists() else labels
    unplanned = [label for label in labels if label not in planned]
    if unplanned:
        print(
            f"judge: the session in {out} ran no engine {', '.join(unplanned)}: pass the session's own --rows, "
            f"--model and --layers (its engines: {', '.join(planned)})",
            file=sys.stderr,
        )
        return 2
    if not any((out / f"{label}.json").exists() for label in labels):
        print(
            f"judge: {out} holds no result of the engines these rows need ({labels[0]}.json, ...): pass the folder "
            "that the session's emulated-runs.tgz unpacks to, with the session's --rows, --model and --layers",
            file=sys.stderr,
        )
        return 2
    first: dict[str, Any] = json.loads(lines[0])
    run = {k: first[k] for k in ("device", "vllm", "date", "command")}
    for earlier in out.glob("*-judged.jsonl"):  # these rows' records are replaced, never appended to; others kept
        kept = [line for line in earlier.read_text().splitlines() if line.strip() and json.loads(line).get("row") not in rows]
        earlier.write_text("".join(f"{line}\n" for line in kept))
    status = records(rows, s, out, {**run, "judged_by": command}, suffix="-judged")
    print(f"judge: records in {out}/*-judged.jsonl", file=sys.stderr)
    return status


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["engine"]:
        return engine_main(*argv[1:3])
    p = argparse.ArgumentParser(prog="python -m tests.e2e.emulated", description="The one-GPU DBO emulation matrix.")
    p.add_argument("cmd", choices=["session", "plan", "judge"], help="session: run the engines (GPU); plan: list them; judge: re-judge a session's folder")
    p.add_argument("--rows", default="repro,a-eager,a-control-eager,b-eager,c", help=f"comma-separated, from {','.join(ROWS)} (default %(default)s)")
    p.add_argument("--model", default="glm53", choices=sorted(set(FOLLOWERS) | set(TRANSPARENCY)))
    p.add_argument("--layers", type=int, default=None, choices=[8, 61, 78], help="depth of the DSA rows (default 61)")
    p.add_argument("--runner", default="v2", choices=["v1", "v2"])
    p.add_argument("--out", type=Path, default=Path("emulated-out"), help="session: where results go; judge: the folder a session's emulated-runs.tgz unpacks to")
    p.add_argument("--seconds", type=float, default=540.0, help="session: stop the engines after this long (records are still written)")
    p.add_argument("--at-once", type=int, default=None, help="session: engines alive together (default: as many as fit 72 GiB; refused above the GPU's memory less 4 GiB)")
    p.add_argument("--trust-labels", action="store_true", help="judge: results written before engines recorded dbo_runtime's state")
    a = p.parse_args(argv)
    if a.at_once is not None and a.at_once < 1:
        p.error(f"argument --at-once: {a.at_once} is not allowed; allowed values: an integer >= 1")
    if not a.seconds > 0:
        p.error(f"argument --seconds: {a.seconds} is not allowed; allowed values: a number > 0")
    asked = [r for r in a.rows.split(",") if r]
    if not asked:
        p.error(f"argument --rows: {a.rows!r} is not allowed; allowed values: one or more of {','.join(ROWS)}")
    bad = [r for r in asked if r not in ROWS]
    if bad:
        p.error(f"unknown row(s) {','.join(bad)}; rows are {','.join(ROWS)}")
    rows = with_floors(asked)
    if a.layers is not None and all(r.startswith("t-") or r == "v4-mtp" for r in asked):
        print(f"{p.prog}: note: --layers {a.layers} does not apply to rows {','.join(asked)}: they run the model at its own depth", file=sys.stderr)
    s = Settings(a.model, a.layers or 61, a.runner)
    wrong = [r for r in asked if a.model not in MODELS_OF[r]]
    if wrong:
        p.error(f"row(s) {','.join(wrong)} do not take --model {a.model} (" + "; ".join(f"{r}: {','.join(MODELS_OF[r])}" for r in wrong) + ")")
    card, seen = _card_gib()
    if a.at_once is not None and a.at_once * (gib := _gib(rows, s)) > card - 4:  # the twins and CUDA contexts beside
        assumed = "" if seen else " (no GPU visible here: an 80 GiB card assumed)"
        p.error(f"argument --at-once: {a.at_once} engines of about {gib} GiB do not fit {card - 4} of the GPU's {card} GiB{assumed}; at most {max(1, (card - 4) // gib)}")
    if a.cmd == "plan":
        for engine, passes in plan(rows, s).items():
            print(engine.label, ",".join(passes))
        return 0
    if a.cmd == "judge":
        global TRUST_LABELS
        TRUST_LABELS = a.trust_labels
        return judge(rows, s, a.out, "python -m tests.e2e.emulated " + " ".join(argv))
    from importlib import metadata

    release = dp_emulation.release_of(metadata.version("vllm"))
    if release is None or a.runner not in dp_emulation.RUNNERS[release]:
        p.error(f"--runner {a.runner} is not emulated on vLLM {metadata.version('vllm')} (tables: {dp_emulation.RUNNERS})")
    refused = refuse_without_engine("python -m tests.e2e.emulated session", 1, "no engine started, no record written")
    if refused is not None:
        return refused
    return session(rows, s, a.out, a.seconds, a.at_once, "python -m tests.e2e.emulated " + " ".join(argv))


if __name__ == "__main__":
    sys.exit(main())
