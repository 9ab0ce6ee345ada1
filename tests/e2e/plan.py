"""Every real-engine run the e2e tests need, by label (the tests ask for labels; the
session runs exactly the labels of the selected tests, in parallel).

Sizes: the issue's bar -- at least 48 prompts of 300-2500 tokens and 24+ tokens each on one
GPU; at least 64 requests x 32 tokens for the two-GPU A/B. Every engine gets a fixed KV-cache
size, so engines sharing a GPU never mislead each other's memory profiling.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from dbo_runtime.harness.launch import RunSpec
from dbo_runtime.harness.prompts import PromptSpec
from tests.harness import selftime
from tests.harness.engine_runner import ROW_HOOK_ENV, E2ESpec

MODELS = Path(__file__).parent / "models"
KV_CACHE_BYTES = 2 << 30
ONE_GPU_PROMPTS = PromptSpec(num=48, min_len=300, max_len=2500, seed=1)
TWO_GPU_PROMPTS = PromptSpec(num=64, min_len=300, max_len=2500, seed=2)
"""The prompts under which the shared-top-k corruption showed as 11x dbo_runtime's mean |dlogprob| on two
H200s. Prompts longer than index_topk (2048) exercise the indexer's selection, but its prefill top-k claims
output slots with atomicAdd, so with random weights at a trained scale such prompts gave a different first
token from run to run; with ``dummy`` weights vLLM repeated itself to 1.9e-6."""
DBO_THRESHOLDS = ["--dbo-decode-token-threshold", "4"]
"""Microbatch every decode step of 4+ tokens per rank (vLLM's default is 32)."""
HT = "deepep_high_throughput"
LL = "deepep_low_latency"
FULL_DECODE = ["--compilation-config", json.dumps({"cudagraph_mode": "FULL_DECODE_ONLY"})]
LL_BATCHED_TOKENS = ["--max-num-batched-tokens", "2048"]
"""With DeepEP LL, vLLM 0.33 defaults ``max_num_batched_tokens`` to 256 (``engine/arg_utils.py``,
``DEFAULT_MAX_NUM_BATCHED_TOKENS_FOR_BATCHED_DP``): prefill then runs in ~140 chunks that share steps
with early decodes, no step reaches the prefill threshold (512), and by the time every prefill is done
most requests have finished. On 2x H200 (2026-11-30) MRV1 microbatched 0 steps and MRV2 2 under LL."""
LL_ENV = {"NVSHMEM_QP_DEPTH": "8192"}
"""DeepEP LL asserts ``NVSHMEM_QP_DEPTH >= (num_max_dispatch_tokens_per_rank + 1) * 2``
(``deep_ep/buffer.py``, default depth 1024, i.e. at most 511 tokens per rank); vLLM 0.33 sizes
the dispatch by ``max_num_batched_tokens``, so 2048 tokens need a depth of at least 4098
(2x H200, 2026-11-30: every LL engine failed its first dummy dispatch without it)."""

LOAD_FORMAT = os.environ.get("DBO_E2E_LOAD_FORMAT", "dummy")  # LOAD_FORMATS[0], defined below
"""vLLM's ``dummy`` weights by default. ``DBO_E2E_LOAD_FORMAT=dbo_runtime_random`` loads random weights at
a trained model's scale (``tests/load_format``), which make greedy tokens sensitive -- and on
2x H200 (2026-11-30) showed that the tiny models are then too sensitive to prove anything by tokens:
vanilla vLLM against itself (DBO off, one GPU) agreed on 67-79 % of tokens, every prompt longer than
index_topk diverging at its first token, and DBO on vs off with DeepEP HT agreed on 5-11 % whether or
not the model had followers or dbo_runtime was installed. With ``dummy`` weights vLLM repeats itself to
1.9e-6 in logprob and the top-k corruption shows in logprobs only (11x dbo_runtime's, 2026-11-30)."""
WEIGHT_GAINS = os.environ.get("DBO_E2E_WEIGHT_GAINS", json.dumps({"qk_gain": 2.0, "mlp_gain": 0.1}))
"""Gains for ``dbo_runtime_random`` (see ``tests/load_format``); gains 1 and these gave the same picture."""
VANILLA_CRASH_TIMEOUT_S = 300.0
"""Vanilla DBO + DeepEP HT on MRV2 hangs silently until vLLM's 5-minute RPC timeout (2026-11-30);
the launcher stops it earlier (``hang_killed``). A healthy run here starts in <= 120 s under load."""


LOAD_FORMATS = ("dummy", "dbo_runtime_random")
MAX_ENGINES_DEFAULT = 12
SELF_TIME_SITE = Path(__file__).resolve().parents[1] / "harness" / "selftime_site"
"""The sitecustomize that loads the self-timer (``tests/harness/selftime.py``) into a run's processes."""


def bench_env(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` for an engine; one that sets ``DBO_RUNTIME_SELF_TIME`` gets the self-timer's site on ``PYTHONPATH``
    and its columns in the bench rows."""
    if "DBO_RUNTIME_SELF_TIME" not in env:
        return dict(env)
    path = os.pathsep.join([str(SELF_TIME_SITE), *filter(None, [os.environ.get("PYTHONPATH")])])
    return {**env, "PYTHONPATH": path, ROW_HOOK_ENV: selftime.ROW_HOOK}


def max_engines(environ: Mapping[str, str] | None = None) -> int:
    """``DBO_E2E_MAX_ENGINES``: engine processes started at once (default 12)."""
    from dbo_runtime.core.errors import ConfigError

    raw = (os.environ if environ is None else environ).get("DBO_E2E_MAX_ENGINES")
    if raw is None:
        return MAX_ENGINES_DEFAULT
    try:
        value = int(raw.strip(), 10)
    except ValueError:
        value = 0
    if value < 1:
        raise ConfigError("DBO_E2E_MAX_ENGINES", raw, f"an integer >= 1 (engines started at once; default {MAX_ENGINES_DEFAULT})")
    return value


def env_problems(environ: Mapping[str, str] | None = None) -> list[str]:
    """The e2e suites' own settings, checked at collection: each is read only when the engines start,
    on the GPU machine, where a typo would cost a traceback after the engines began to start. One line
    each, naming the variable and the allowed values."""
    from dbo_runtime.core.errors import ConfigError
    from tests.load_format.dbo_runtime_random import parse_gains

    env = os.environ if environ is None else environ
    problems = []
    try:
        max_engines(env)
    except ConfigError as exc:
        problems.append(str(exc))
    load_format = env.get("DBO_E2E_LOAD_FORMAT", LOAD_FORMATS[0])
    if load_format not in LOAD_FORMATS:
        problems.append(str(ConfigError("DBO_E2E_LOAD_FORMAT", load_format, LOAD_FORMATS)))
    gains = env.get("DBO_E2E_WEIGHT_GAINS")
    if gains is not None:
        try:
            parse_gains(json.loads(gains))
        except ValueError as exc:  # json.JSONDecodeError is a ValueError
            problems.append(str(ConfigError("DBO_E2E_WEIGHT_GAINS", gains, f"a JSON object of qk_gain / mlp_gain > 0 ({exc})")))
    return problems


def tiny_args(model: str, *, eager: bool, extra: list[str] | None = None) -> list[str]:
    return [
        "--model",
        str(MODELS / model),
        "--load-format",
        LOAD_FORMAT,
        *(["--model-loader-extra-config", WEIGHT_GAINS] if LOAD_FORMAT == "dbo_runtime_random" else []),
        "--skip-tokenizer-init",
        "--max-model-len",
        "4096",
        "--max-num-seqs",
        "64",
        "--gpu-memory-utilization",
        "0.06",
        "--kv-cache-memory-bytes",
        str(KV_CACHE_BYTES),
        "--seed",
        "0",
        *(["--enforce-eager"] if eager else []),
        *(extra or []),
    ]


def _env(runner: str | None, plugin: bool, **extra: str) -> dict[str, str]:
    env = bench_env(extra)
    if runner is not None:
        env["VLLM_USE_V2_MODEL_RUNNER"] = "1" if runner == "v2" else "0"
    if not plugin:
        env["DBO_RUNTIME_DISABLE"] = "1"
    return env


def one_gpu() -> dict[str, RunSpec]:
    out: dict[str, RunSpec] = {}
    # Run-to-run control: the same vanilla engine twice. vLLM's own results differ between runs
    # in the last bits (plugin vs vanilla differed by <= 2.5e-4 in logprob, tokens identical, on
    # 2026-11-30); the control says whether that is vLLM's noise or the plugin.
    for mode in ("eager", "graphs"):
        label = f"1gpu-deepseek-v32-{mode}-v2-vanilla2"
        out[label] = E2ESpec(
            label=label,
            engine_args=tiny_args("deepseek-v32", eager=mode == "eager"),
            env=_env("v2", False),
            prompts=ONE_GPU_PROMPTS,
            max_tokens=24,
            meta={"model": "deepseek-v32", "issue": 8, "what": "run-to-run control (vanilla twice)"},
        )
    for model in ("deepseek-v32", "shared-topk"):
        for mode in ("eager", "graphs"):
            for runner in ("v1", "v2"):
                for plugin in (True, False):
                    label = f"1gpu-{model}-{mode}-{runner}-{'plugin' if plugin else 'vanilla'}"
                    out[label] = E2ESpec(
                        label=label,
                        engine_args=tiny_args(model, eager=mode == "eager"),
                        env=_env(runner, plugin),
                        prompts=ONE_GPU_PROMPTS,
                        max_tokens=24,
                        meta={"model": model, "issue": 8, "what": "transparency, DBO off"},
                    )
    for k in (1, 3):
        for plugin in (True, False):
            label = f"1gpu-mtp{k}-{'plugin' if plugin else 'vanilla'}"
            spec = json.dumps({"method": "mtp", "num_speculative_tokens": k})
            out[label] = E2ESpec(
                label=label,
                engine_args=tiny_args("deepseek-v32-mtp", eager=True, extra=["--speculative-config", spec]),
                env=_env(None, plugin),
                prompts=ONE_GPU_PROMPTS,
                max_tokens=24,
                meta={"model": "deepseek-v32-mtp", "issue": 8, "what": f"MTP k={k} (indexer next_n {k + 1}), DBO off"},
            )
    label = "1gpu-shared-topk-dbo-dp1-plugin"
    out[label] = E2ESpec(
        label=label,
        engine_args=tiny_args("shared-topk", eager=True, extra=["--enable-expert-parallel", "--all2all-backend", HT, "--enable-dbo"]),
        env=_env(None, True),
        prompts=PromptSpec(num=8, min_len=300, max_len=2500, seed=3),
        max_tokens=8,
        meta={"model": "shared-topk", "issue": 8, "what": "--enable-dbo with DP 1: budget, warm-up, top-k attach; no microbatch"},
    )
    return out


EMULATE = Path(__file__).parent / "emulate"
FAMILY_PROMPTS = PromptSpec(num=16, min_len=300, max_len=1500, seed=4)
DBO_DP1 = ["--enable-expert-parallel", "--all2all-backend", HT, "--enable-dbo"]
FAMILY: dict[str, dict[str, Any]] = {
    "glm53-geometry": {"gpu_memory_utilization": "0.2", "architecture": "GlmMoeDsaForCausalLM"},
    "deepseek-v4": {"gpu_memory_utilization": "0.1", "architecture": "DeepseekV4ForCausalLM"},
    "deepseek-v41": {
        "gpu_memory_utilization": "0.1",
        "architecture": "DeepseekV41ForCausalLM",
        # its registered class is multimodal, whose processor refuses to start without a tokenizer
        "extra": ["--limit-mm-per-prompt", '{"image": 0}'],
    },
    "glm5next": {"gpu_memory_utilization": "0.1", "architecture": "Glm5NextForCausalLM"},
}
"""The DSA-family tiny models (``models/README.md``) and what each needs of a shared GPU."""


def _with_memory(args: list[str], fraction: str) -> list[str]:
    i = args.index("--gpu-memory-utilization")
    return [*args[: i + 1], fraction, *args[i + 2 :]]


def family() -> dict[str, RunSpec]:
    """One GPU: the fail-closed guard on an emulated unverified build, and every DSA-family architecture with
    the plugin against vanilla (DBO off, eager and graphs) and with DBO at DP 1 (the hooks armed)."""
    out: dict[str, RunSpec] = {}
    emulated = f"{EMULATE / 'unverified_topk'}:{os.environ.get('PYTHONPATH', '')}"
    for label, disable in (("1gpu-guard-unverified-dbo-refused", False), ("1gpu-guard-unverified-dbo-disabled", True)):
        env = {"PYTHONPATH": emulated, **({"DBO_RUNTIME_DISABLE": "1"} if disable else {})}
        out[label] = E2ESpec(
            label=label,
            engine_args=tiny_args("shared-topk", eager=True, extra=DBO_DP1),
            env=env,
            prompts=PromptSpec(num=4, min_len=300, max_len=600, seed=5),
            max_tokens=4,
            timeout_s=300,
            meta={"model": "shared-topk", "issue": 16, "what": "guard: emulated unverified top-k code, --enable-dbo"},
        )
    for model, facts in FAMILY.items():
        for mode in ("eager", "graphs"):
            for plugin in (True, False):
                label = f"1gpu-{model}-{mode}-{'plugin' if plugin else 'vanilla'}"
                out[label] = E2ESpec(
                    label=label,
                    engine_args=_with_memory(
                        tiny_args(model, eager=mode == "eager", extra=list(facts.get("extra", []))), facts["gpu_memory_utilization"]
                    ),
                    env=_env(None, plugin),
                    prompts=FAMILY_PROMPTS,
                    max_tokens=16,
                    timeout_s=600,
                    meta={"model": model, "issue": 17, "what": f"{facts['architecture']}: transparency, DBO off"},
                )
        label = f"1gpu-{model}-dbo-dp1-plugin"
        out[label] = E2ESpec(
            label=label,
            engine_args=_with_memory(
                tiny_args(model, eager=True, extra=[*DBO_DP1, *facts.get("extra", [])]), facts["gpu_memory_utilization"]
            ),
            env=_env(None, True),
            prompts=PromptSpec(num=8, min_len=300, max_len=1500, seed=6),
            max_tokens=8,
            timeout_s=600,
            meta={"model": model, "issue": 17, "what": f"{facts['architecture']}: --enable-dbo at DP 1 (hooks armed)"},
        )
    out.update(jit_sweep())
    return out


JIT_SWEEP_PROMPTS = PromptSpec(num=64, min_len=300, max_len=600, seed=21)
"""As many prompts as ``--max-num-seqs``: with staggered lengths the decode batch takes every size 64..1."""


JIT_SWEEP_WARMUP = {"DBO_RUNTIME_PLANNER_WARM_MAX_BATCH": "64"}
"""The planner set vLLM's default (``relax``) gives at ``--max-num-seqs 64`` (``core.settings.warm_policy``: every
32-row bucket up to the largest decode step), asked for by its cap because the session keeps
``VLLM_DEEP_GEMM_WARMUP=skip``: under ``relax`` vLLM's own DeepGEMM warm-up runs in eager engines too (its
``kernel_warmup`` ignores ``--enforce-eager`` for DeepGEMM) and compiles about 3400 GEMM kernels on a cold cache,
far past a 10-minute command. The cold cache still holds no planner, so the sweep proves what it claims: no planner
compiles inside a step under that set. MTP-1 on SM90 plans 64 rows of width 2 (next_n 2 is native there, not one
row per token), so the same cap is its exact set."""


def jit_sweep() -> dict[str, RunSpec]:
    """Issue 20: no planner compiles inside a step. ``--enable-dbo`` at DP 1 announces the DBO budget (vLLM never
    microbatches there, so steps plan at the full SM count: the DBO count in steps needs DP 2, ``dp2-jit-sweep``),
    HT eager gives ``register_builder`` no capture sizes, graphs give it vLLM's; MTP-1 adds next_n 2. Each starts
    on an empty DeepGEMM JIT cache, prefills all 64 prompts, then decodes while they finish one by one."""
    out: dict[str, RunSpec] = {}
    mtp = ["--speculative-config", json.dumps({"method": "mtp", "num_speculative_tokens": 1})]
    for name, model, eager, extra, env in (
        ("eager", "shared-topk", True, [], JIT_SWEEP_WARMUP),
        ("graphs", "shared-topk", False, [], JIT_SWEEP_WARMUP),
        ("mtp1-eager", "deepseek-v32-mtp", True, mtp, JIT_SWEEP_WARMUP),
    ):
        label = f"1gpu-jit-sweep-{name}-dbo-dp1"
        out[label] = E2ESpec(
            label=label,
            engine_args=tiny_args(model, eager=eager, extra=[*DBO_DP1, *extra]),
            env=_env(None, True, **env),
            prompts=JIT_SWEEP_PROMPTS,
            max_tokens=8,
            logprobs=0,
            stagger_max_tokens=True,
            cold_jit_cache=True,
            timeout_s=600,
            meta={"model": model, "issue": 20, "what": f"planner JIT in steps, cold DG_JIT_CACHE_DIR, decode batch 64..1: {name}"},
        )
    return out


def dp_spec(label: str, model: str, backend: str, *, dbo: bool, runner: str, plugin: bool, graphs: bool, what: str, **env: str) -> RunSpec:
    """One DP-2 + EP run of the plan (also the benchmark's: ``graphs/bench_dbo_engine.py``)."""
    extra = ["--enable-expert-parallel", "--all2all-backend", backend, *DBO_THRESHOLDS]
    if graphs:
        extra += FULL_DECODE
    if backend == LL:
        extra += LL_BATCHED_TOKENS
        env = {**LL_ENV, **env}
    if dbo:
        extra.append("--enable-dbo")
    return E2ESpec(
        label=label,
        engine_args=tiny_args(model, eager=not graphs, extra=extra),
        dp=2,
        env=_env(runner, plugin, **env),
        prompts=TWO_GPU_PROMPTS,
        max_tokens=32,
        meta={"model": model, "issue": 9, "what": what},
    )


def two_gpu() -> dict[str, RunSpec]:
    specs = [
        # HT eager: the crash, the fix, the A/B (the shared-topk HT V1 A/B comes from the verify tests)
        dp_spec("dp2-ht-ref-deepseek-v32-v1", "deepseek-v32", HT, dbo=False, runner="v1", plugin=True, graphs=False, what="reference (DBO off)"),
        dp_spec("dp2-ht-dbo-deepseek-v32-v1-plugin", "deepseek-v32", HT, dbo=True, runner="v1", plugin=True, graphs=False, what="DBO, dbo_runtime (noise floor)"),
        dp_spec("dp2-ht-dbo-deepseek-v32-v1-vanilla-comm0", "deepseek-v32", HT, dbo=True, runner="v1", plugin=False, graphs=False,
            what="DBO vanilla, VLLM_DBO_COMM_SMS=0", VLLM_DBO_COMM_SMS="0"),
        dp_spec("dp2-ht-dbo-deepseek-v32-v2-plugin", "deepseek-v32", HT, dbo=True, runner="v2", plugin=True, graphs=False, what="DBO, dbo_runtime, MRV2"),
        dp_spec("dp2-ht-ref-shared-topk-v2", "shared-topk", HT, dbo=False, runner="v2", plugin=True, graphs=False, what="reference (DBO off), MRV2"),
        dp_spec("dp2-ht-dbo-shared-topk-v2-plugin", "shared-topk", HT, dbo=True, runner="v2", plugin=True, graphs=False, what="DBO, dbo_runtime, MRV2"),
        dp_spec("dp2-ht-dbo-shared-topk-v1-vanilla", "shared-topk", HT, dbo=True, runner="v1", plugin=False, graphs=False, what="the crash, MRV1"),
        dp_spec("dp2-ht-dbo-shared-topk-v2-vanilla", "shared-topk", HT, dbo=True, runner="v2", plugin=False, graphs=False, what="the crash, MRV2"),
        # MTP (one speculative token) under DBO, HT eager
        dp_spec("dp2-ht-ref-mtp1-v1", "deepseek-v32-mtp", HT, dbo=False, runner="v1", plugin=True, graphs=False, what="MTP k=1 reference (DBO off)"),
        dp_spec("dp2-ht-dbo-mtp1-v1-plugin", "deepseek-v32-mtp", HT, dbo=True, runner="v1", plugin=True, graphs=False, what="MTP k=1, DBO, dbo_runtime"),
    ]
    for spec in specs:
        if spec.label.endswith("-vanilla") and spec.label.startswith("dp2-ht-dbo-"):
            spec.timeout_s = VANILLA_CRASH_TIMEOUT_S
        if spec.meta["model"] == "deepseek-v32-mtp":
            spec.engine_args += ["--speculative-config", json.dumps({"method": "mtp", "num_speculative_tokens": 1})]
    # LL + FULL_DECODE_ONLY graphs: top-k isolation inside graph replays (no SM partition under LL).
    # Hidden 2048: DeepEP LL's smallest hidden size (see models/README.md).
    for model, runners in (("deepseek-v32-h2048", ("v1",)), ("shared-topk-h2048", ("v1", "v2"))):
        for runner in runners:
            specs += [
                dp_spec(f"dp2-ll-ref-{model}-{runner}", model, LL, dbo=False, runner=runner, plugin=True, graphs=True, what="reference (DBO off)"),
                dp_spec(f"dp2-ll-dbo-{model}-{runner}-plugin", model, LL, dbo=True, runner=runner, plugin=True, graphs=True, what="DBO, dbo_runtime"),
                dp_spec(f"dp2-ll-dbo-{model}-{runner}-vanilla", model, LL, dbo=True, runner=runner, plugin=False, graphs=True, what="DBO vanilla"),
            ]
    sweep = E2ESpec(
        label="dp2-jit-sweep-ht-dbo-shared-topk",
        engine_args=tiny_args(
            "shared-topk", eager=True, extra=["--enable-expert-parallel", "--all2all-backend", HT, "--enable-dbo", "--dbo-decode-token-threshold", "2"]
        ),
        dp=2,
        env=_env("v1", True, **JIT_SWEEP_WARMUP),
        prompts=PromptSpec(num=128, min_len=300, max_len=600, seed=22),
        max_tokens=8,
        logprobs=0,
        stagger_max_tokens=True,
        cold_jit_cache=True,
        meta={"model": "shared-topk", "issue": 20, "what": "planner JIT in microbatched steps (DBO count), cold cache, decode 64..1 per rank"},
    )
    specs.append(sweep)
    return {s.label: s for s in specs}


WIDTH_MODELS = ("glm53-width", "v32-width")
"""Real attention/indexer/MoE width, few layers (``models/README.md``): 16.4 / 19.6 GB of weights per GPU at EP 2."""
WIDTH_MEMORY = {"ht": "0.3", "ll": "0.45"}
"""Per-GPU shares (the pool admits runs by them): 16.4 / 19.6 GB of weights, 2 GiB of KV, DeepEP's buffers (HT
about 1 GiB; LL's RDMA buffer 24-28 GiB at hidden 6144 / 7168 for 2048 batched tokens) and activations."""
WIDTH_PROMPTS = PromptSpec(num=64, min_len=300, max_len=3500, seed=18)
FRESH_LONG = PromptSpec(num=16, min_len=2500, max_len=3500, seed=19)
"""The fresh long prompts the reproducer's repeats are mixed with."""
REPRODUCER_ARGS = [
    "--enable-expert-parallel", "--all2all-backend", HT, "--enable-dbo",
    "--dbo-prefill-token-threshold", "32", "--dbo-decode-token-threshold", "32",
    "--kv-cache-dtype", "fp8", "--enable-prefix-caching",
    "--hf-overrides", json.dumps({"num_hidden_layers": 4}),
]  # fmt: skip
"""vllm#60732's reproducer: a 4-layer GLM-5.3, DP 2 / EP 2, HT eager, DBO thresholds 32, fp8 KV, prefix caching."""


def _width_args(model: str, *, eager: bool, extra: list[str], memory: str = WIDTH_MEMORY["ht"]) -> list[str]:
    """Width runs always load ``dbo_runtime_random`` weights: greedy tokens must vary for agreement to mean
    anything (``tests/load_format``), and vLLM's ``dummy`` weights make every token a near-tie."""
    args = _with_memory(tiny_args(model, eager=eager, extra=extra), memory)
    i = args.index("--load-format")
    args[i + 1] = "dbo_runtime_random"
    if "--model-loader-extra-config" not in args:
        args[i + 2 : i + 2] = ["--model-loader-extra-config", WEIGHT_GAINS]
    return args


def production_width() -> dict[str, RunSpec]:
    """Two GPUs at production width (issue 18): the upstream reproducer, the accuracy A/B of both runners under
    HT eager and LL + FULL decode graphs, the top-k memory of both layouts, and the DSA family under DBO."""
    from tests.e2e.reproducer import PROMPTS as REPRODUCER_PROMPTS

    out: dict[str, RunSpec] = {}
    for plugin in (False, True):
        label = f"dp2w-repro-glm53-{'plugin' if plugin else 'vanilla'}"
        out[label] = E2ESpec(
            label=label,
            engine_args=_width_args("glm53-width", eager=True, extra=REPRODUCER_ARGS),
            dp=2,
            env=_env("v1", plugin),
            prompts=PromptSpec(file=str(REPRODUCER_PROMPTS)),
            repeat_mixed=FRESH_LONG,
            max_tokens=8,
            timeout_s=900 if plugin else VANILLA_CRASH_TIMEOUT_S,
            meta={"model": "glm53-width", "issue": 18, "what": "vllm#60732 reproducer: 64k+1 prompts, exact repeats mixed with fresh long prompts"},
        )
    modes = {
        "ht": (HT, True, [*DBO_THRESHOLDS], {}),
        "ll": (LL, False, [*FULL_DECODE, *LL_BATCHED_TOKENS, *DBO_THRESHOLDS], LL_ENV),
    }
    for model in WIDTH_MODELS:
        for mode, (backend, eager, extra, env) in modes.items():
            base = ["--enable-expert-parallel", "--all2all-backend", backend, *extra]
            for runner in ("v1", "v2"):
                variants = [("ref", False, True, {}), ("dbo-plugin", True, True, {})]
                if runner == "v1":
                    vanilla_env = {"VLLM_DBO_COMM_SMS": "0"} if backend == HT else {}  # HT vanilla crashes at any other value
                    variants.append(("dbo-vanilla", True, False, vanilla_env))
                for name, dbo, plugin, more in variants:
                    label = f"dp2w-{mode}-{name}-{model}-{runner}"
                    out[label] = E2ESpec(
                        label=label,
                        engine_args=_width_args(
                            model, eager=eager, extra=[*base, *(["--enable-dbo"] if dbo else [])], memory=WIDTH_MEMORY[mode]
                        ),
                        dp=2,
                        env=_env(runner, plugin, **env, **more),
                        prompts=WIDTH_PROMPTS,
                        max_tokens=32,
                        meta={"model": model, "issue": 18, "what": f"accuracy A/B at production width: {mode} {name} {runner}"},
                    )
    for layout in ("windows", "copies"):
        label = f"dp2w-memory-glm53-{layout}"
        out[label] = E2ESpec(
            label=label,
            engine_args=_width_args(
                "glm53-width",
                eager=True,
                extra=["--enable-expert-parallel", "--all2all-backend", HT, "--enable-dbo", *DBO_THRESHOLDS, "--max-num-batched-tokens", "8192"],
            ),
            dp=2,
            env=_env("v1", True, DBO_RUNTIME_TOPK_LAYOUT=layout),
            prompts=PromptSpec(num=16, min_len=300, max_len=1000, seed=20),
            max_tokens=4,
            meta={"model": "glm53-width", "issue": 18, "what": f"top-k state bytes, {layout} layout"},
        )
    for model, facts in FAMILY.items():
        if model == "glm53-geometry":
            continue  # its width twin is glm53-width above
        extra = ["--enable-expert-parallel", "--all2all-backend", HT, *DBO_THRESHOLDS, *facts.get("extra", [])]
        for name, dbo, plugin in (("ref", False, True), ("dbo-plugin", True, True), ("dbo-vanilla", True, False)):
            label = f"dp2-family-{model}-{name}"
            out[label] = E2ESpec(
                label=label,
                engine_args=_with_memory(tiny_args(model, eager=True, extra=[*extra, *(["--enable-dbo"] if dbo else [])]), facts["gpu_memory_utilization"]),
                dp=2,
                env=_env("v1", plugin),
                prompts=TWO_GPU_PROMPTS,
                max_tokens=32,
                timeout_s=VANILLA_CRASH_TIMEOUT_S if not plugin else 900,
                meta={"model": model, "issue": 18, "what": f"{facts['architecture']} under DBO, DP 2, HT eager: {name}"},
            )
    return out


def tune_args(model: str) -> list[str]:
    """The engine arguments ``dbo-runtime tune`` gets on two GPUs (HT eager, DP 2): tune splits the memory."""
    args = _width_args(model, eager=True, extra=["--data-parallel-size", "2", "--enable-expert-parallel", "--all2all-backend", HT])
    i = args.index("--gpu-memory-utilization")
    return args[:i] + args[i + 2 :]


def all_specs() -> dict[str, RunSpec]:
    return {**one_gpu(), **family(), **two_gpu(), **production_width()}


def verify_args(model: str) -> list[str]:
    """The engine arguments ``dbo-runtime verify`` gets in the two-GPU tests (HT eager, DP 2)."""
    return tiny_args(model, eager=True, extra=["--data-parallel-size", "2", "--enable-expert-parallel", "--all2all-backend", HT, *DBO_THRESHOLDS])
