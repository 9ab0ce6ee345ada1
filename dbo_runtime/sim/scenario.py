"""A DSA stack run the way vLLM runs DBO (eager, or captured as MRV1/MRV2 capture), checked bit for bit against an
unsplit run: microbatches yield after every layer, so one's indexer leader runs between the other's leader and its
followers (what corrupts shared top-k state), under ``SMControl.partition`` (what trips DeepGEMM's assertion)."""

from __future__ import annotations

import time
import types
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Literal

import torch

from dbo_runtime.core.budget import SMBudget, compute_budget, deep_gemm_compute_multiple
from dbo_runtime.core.topk_memory import index_leaders
from dbo_runtime.services.planner_warmup import PlannerProfile
from dbo_runtime.services.schedule_cache import IndexerScheduleCache
from dbo_runtime.services.topk_state import TopkLayout, UbatchTopkState
from dbo_runtime.sim.backends import KernelBackend, ScheduleAssertion
from dbo_runtime.sim.microbatch import MicrobatchContext, current_ubatch, start_microbatches
from dbo_runtime.sim.sm_scope import FunctionKnob, SMControl

Mode = Literal["eager", "mrv1", "mrv2"]
MODES: tuple[Mode, ...] = ("eager", "mrv1", "mrv2")


@dataclass(frozen=True)
class ScenarioConfig:
    num_layers: int = 78
    index_topk_freq: int = 4
    index_skip_topk_offset: int = 3
    num_requests: int = 16
    next_n: int = 1
    max_context: int = 2048
    heads: int = 8
    head_dim: int = 32
    block_kv: int = 64
    index_topk: int = 64
    comm_sms: int = 20
    steps: int = 4
    seed: int = 0
    fix_schedule: bool = True
    """dbo_runtime's schedule cache at the call site (False: vLLM's behaviour)."""
    isolate_topk: bool = True
    """Per-microbatch top-k state (False: vLLM's shared buffer)."""
    plan_ahead: bool = True
    defer_plan_ahead: bool = True
    """Plan-ahead builds launch no planner; the first eager call site plans (False: plan at build)."""
    topk_layout: str = "windows"


SMALL = ScenarioConfig()
"""CPU default: the GLM-5.3 layer pattern at toy widths (runs in seconds)."""

DEEPGEMM_INDEXER_SHAPES: tuple[tuple[int, int], ...] = ((32, 128), (64, 128))
"""(heads, head_dim) of the DSA indexers DeepGEMM's logits kernel is built for."""


def for_backend(config: ScenarioConfig, backend: KernelBackend) -> ScenarioConfig:
    """Real DeepGEMM only runs real indexer shapes: widen toy heads to GLM-5.3's 32 x 128."""
    if backend.simulated or (config.heads, config.head_dim) in DEEPGEMM_INDEXER_SHAPES:
        return config
    return replace(config, heads=32, head_dim=128)
GLM53 = ScenarioConfig(num_requests=32, max_context=16384, heads=32, head_dim=128, index_topk=2048, steps=20)
"""GPU default: GLM-5.3 indexer shapes (32 heads x 128, block 64, top-k 2048)."""


@dataclass
class StepCheck:
    step: int
    phase: str
    ok: bool
    logits_mismatch_rows: int = 0
    topk_mismatch_rows: int = 0
    follower_mismatch: int = 0
    replans: int = 0
    error: str = ""


@dataclass
class ScenarioResult:
    mode: str
    backend: str
    simulated: bool
    config: dict[str, Any]
    budget: str
    leaders: int
    followers: int
    checks: list[StepCheck] = field(default_factory=list)
    replans_total: int = 0
    captured_replans: int = 0
    planned_ahead: int = 0
    deferred_plans: int = 0
    warmups: int = 0
    jit_in_capture: list[Any] = field(default_factory=list)
    topk_extra_bytes: int = 0
    step_ms: list[float] = field(default_factory=list)
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error and all(c.ok for c in self.checks) and not self.jit_in_capture

    @property
    def steady_state_replans(self) -> int:
        """Call-site re-plans after the first step (plan-ahead makes this 0)."""
        return sum(c.replans for c in self.checks[1:] if c.phase != "reference")

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "ok": self.ok, "steady_state_replans": self.steady_state_replans}


class _SimIndexGroup(types.SimpleNamespace):
    """The fields of vLLM's ``SparseMLAIndexGroup`` that ``UbatchTopkState`` reads (a class: weakly referenced)."""


class Scenario:
    """Persistent buffers, services and the layer stack of one scenario run."""

    def __init__(self, config: ScenarioConfig, backend: KernelBackend) -> None:
        self.cfg = config
        self.be = backend
        self.dev = backend.device
        self.leaders = index_leaders(config.num_layers, config.index_topk_freq, config.index_skip_topk_offset)
        self.leader_ids = [i for i, lead in enumerate(self.leaders) if lead]
        self.gen = torch.Generator(device="cpu").manual_seed(config.seed)
        b, n = config.num_requests, config.next_n
        self.split = [b // 2, b - b // 2]
        self.max_blocks = config.max_context // config.block_kv
        self.num_blocks = b * self.max_blocks + 1
        kv = torch.randn((self.num_blocks * config.block_kv, config.head_dim), generator=self.gen)
        q0 = torch.randn((1, 1, 1, config.head_dim), generator=self.gen)
        _, self.kv_cache = backend.make_inputs(q=q0.to(self.dev), k=kv.to(self.dev), block_kv=config.block_kv)
        # Persistent inputs (address-stable: CUDA graphs read them at replay).
        self.context_lens = torch.zeros((b, n), dtype=torch.int32, device=self.dev)
        self.block_table = torch.zeros((b, self.max_blocks), dtype=torch.int32, device=self.dev)
        q_shape = (len(self.leader_ids), b, n, config.heads, config.head_dim)
        self.q = backend.make_inputs(q=torch.zeros(q_shape, device=self.dev), k=kv[: config.block_kv].to(self.dev), block_kv=config.block_kv)[0]
        self.weights = torch.zeros((len(self.leader_ids), b * n, config.heads), device=self.dev)
        # Persistent outputs.
        self.out_logits = torch.zeros((len(self.leader_ids), b * n, config.max_context), device=self.dev)
        self.out_topk = torch.zeros((len(self.leader_ids), b * n, config.index_topk), dtype=torch.int32, device=self.dev)
        self.out_follow = torch.zeros((config.num_layers, b * n), dtype=torch.int64, device=self.dev)
        self.cols = torch.arange(config.max_context, device=self.dev)
        # The model-wide logical top-k buffer (max_num_batched_tokens rows) and the services.
        self.logical = torch.zeros((b * n, config.index_topk), dtype=torch.int32, device=self.dev)
        self.comm_buf = torch.zeros(1024, device=self.dev)
        locate = current_ubatch if config.isolate_topk else (lambda: (0, 0))
        self.topk = UbatchTopkState(locate, layout=TopkLayout(config.topk_layout))
        self.topk.mark_model_buffer(self.logical)
        # Held for the scenario's lifetime: the per-microbatch state is anchored to the group.
        self.topk_group = _SimIndexGroup(
            logical_topk_indices=self.logical, physical_topk_indices=self.logical, side_stream=None, has_indexer=True,
            num_layers=2, valid_topk_counts=torch.zeros(b * n, dtype=torch.int32, device=self.dev),
        )  # fmt: skip
        if config.isolate_topk:
            self.topk.attach(self.topk_group, 2, lambda: torch.cuda.Event() if self.dev.type == "cuda" else None)
        self.cache = IndexerScheduleCache(planner=backend, defer_plan_ahead=config.defer_plan_ahead)  # type: ignore[arg-type]
        device_index = self.dev.index if self.dev.index is not None else 0
        self.control = SMControl(device_index, backend.total_sms)
        # the worker's SM90 rule (even DeepGEMM counts), so simulate and sms agree with it
        multiple = deep_gemm_compute_multiple(backend.sm_major)
        self.budget: SMBudget = compute_budget(
            total_sms=backend.total_sms, platform="cuda", enable_dbo=True, expert_parallel=True, device=device_index,
            all2all_backend="deepep_high_throughput", env_comm_sms=config.comm_sms, compute_multiple=multiple,
        )  # fmt: skip
        self.knob = FunctionKnob("deep_gemm.set_num_sms", backend.set_num_sms)
        shapes = tuple((rows, config.next_n) for rows in self.split)  # exactly this scenario's microbatches
        self.cache.warmup.register_profile(device_index, PlannerProfile(self.dev, config.block_kv, shapes))
        self.cache.attach(self.control)
        self.control.announce(self.budget)
        # Per-microbatch persistent schedule buffers (vLLM: one builder, one buffer per microbatch).
        self.sched_buf = [torch.zeros((backend.total_sms + 1, 2), dtype=torch.int32, device=self.dev) for _ in range(2)]
        self.sched_full = torch.zeros((backend.total_sms + 1, 2), dtype=torch.int32, device=self.dev)
        self.schedules: list[torch.Tensor] = []
        streams = [torch.cuda.Stream(device=self.dev) for _ in range(2)] if self.dev.type == "cuda" else [None, None]
        self.compute_stream, self.comm_stream = streams

    def new_inputs(self) -> None:
        """Fresh contexts, block tables, queries and weights, copied in place."""
        c, g = self.cfg, self.gen
        b, n = c.num_requests, c.next_n
        last = torch.randint(n, c.max_context + 1, (b,), generator=g)
        last[0] = c.max_context  # one request at the full context every step
        lens = torch.stack([last - (n - 1 - j) for j in range(n)], dim=1).to(torch.int32)
        perm = torch.randperm(self.num_blocks - 1, generator=g)[: b * self.max_blocks] + 1
        self.context_lens.copy_(lens)
        self.block_table.copy_(perm.view(b, self.max_blocks).to(torch.int32))
        q = torch.randn(self.q.shape, generator=g)
        self.q.copy_(q.to(self.q.dtype) if self.dev.type == "cpu" else q.to(self.dev).to(self.q.dtype))
        self.weights.copy_(torch.rand(self.weights.shape, generator=g))

    def rows(self, ub: int | None) -> slice:
        reqs = self.reqs(ub)
        return slice(reqs.start * self.cfg.next_n, reqs.stop * self.cfg.next_n)

    def reqs(self, ub: int | None) -> slice:
        if ub is None:
            return slice(0, self.cfg.num_requests)
        start = 0 if ub == 0 else self.split[0]
        return slice(start, start + self.split[ub])

    def build(self, microbatched: bool) -> None:
        """Plan each microbatch's schedule, like ``DeepseekV32IndexerMetadataBuilder.build``."""
        builder_sms = self.be.total_sms  # vLLM: num_compute_units(), fixed for the builder's lifetime
        ubs: list[int | None] = [0, 1] if microbatched else [None]
        self.schedules = []
        for ub in ubs:
            sms = builder_sms
            if self.cfg.fix_schedule and self.cfg.plan_ahead and microbatched:
                with self.cache.microbatched_build():
                    sms = self.cache.plan_ahead_sms(self.control.device) or builder_sms
            lens = self.context_lens[self.reqs(ub)]
            buf = self.sched_full if ub is None else self.sched_buf[ub]
            if self.cfg.fix_schedule and sms != builder_sms and self.cache.defer_plan_ahead:
                # As the patched builder: record the rows and inputs; the first eager call site plans.
                view = buf[: self.be.slots(sms, self.cfg.next_n) + 1]
                self.cache.track_deferred(view, planned_sms=sms, block_kv=self.cfg.block_kv, next_n=self.cfg.next_n,
                                          context_lens=lens, indices=None)  # fmt: skip
                self.cache.stats.planned_ahead += 1
            else:
                planned = self.be.plan(lens, self.cfg.block_kv, sms)
                view = buf[: planned.shape[0]]
                view.copy_(planned)
                if self.cfg.fix_schedule:
                    self.cache.track(view, planned_sms=sms, block_kv=self.cfg.block_kv, next_n=self.cfg.next_n,
                                     ahead=sms != builder_sms)  # fmt: skip
                    if ub is not None:
                        self.cache.stats.planned_ahead += int(sms != builder_sms)
            self.schedules.append(view)

    def forward(self, ub: int | None, ctx: MicrobatchContext | None) -> None:
        c = self.cfg
        rows, reqs = self.rows(ub), self.reqs(ub)
        nrows = rows.stop - rows.start
        lens = self.context_lens[reqs]
        table = self.block_table[reqs]
        schedule = self.schedules[0 if ub is None else ub]
        valid = self.cols.view(1, -1) < lens.reshape(-1, 1)
        leader_pos = 0
        for layer in range(c.num_layers):
            buf = self.topk.logical(self.logical)
            if self.leaders[layer]:
                sched = self.cache.resolve(schedule, lens, None, c.block_kv) if c.fix_schedule else schedule
                logits = self.be.logits(self.q[leader_pos, reqs], self.kv_cache, self.weights[leader_pos, rows], lens,
                                        table, sched, c.max_context)  # fmt: skip
                masked = logits.masked_fill(~valid, float("-inf"))
                order = torch.sort(masked, dim=-1, descending=True, stable=True).indices[:, : c.index_topk].to(torch.int32)
                buf[:nrows].copy_(order)
                self.out_logits[leader_pos, rows].copy_(masked)
                self.out_topk[leader_pos, rows].copy_(order)
                leader_pos += 1
            else:
                self.out_follow[layer, rows].copy_((buf[:nrows].long() * (layer + 1)).sum(dim=-1))
            if ctx is not None:
                ctx.comm(lambda: self.comm_buf.add_(1.0))

    def run_reference(self) -> dict[str, torch.Tensor]:
        """Unsplit, full SMs, no DBO: the ground truth for the same inputs."""
        self.build(microbatched=False)
        self.forward(None, None)
        return self.snapshot()

    def snapshot(self) -> dict[str, torch.Tensor]:
        return {"logits": self.out_logits.clone(), "topk": self.out_topk.clone(), "follow": self.out_follow.clone()}

    def clear_outputs(self) -> None:
        for out in (self.out_logits, self.out_topk, self.out_follow):
            out.zero_()

    def join(self, run: Any) -> None:
        """Release and join the threads; outside a capture the caller's stream waits for them."""
        run.finish()
        if self.compute_stream is not None and not torch.cuda.is_current_stream_capturing():
            torch.cuda.current_stream().wait_stream(self.compute_stream)

    def start(self) -> Any:
        """Park the two microbatch threads; the compute stream first waits for the inputs."""
        if self.compute_stream is not None and not torch.cuda.is_current_stream_capturing():
            self.compute_stream.wait_stream(torch.cuda.current_stream())
        bodies = [lambda ctx: self.forward(0, ctx), lambda ctx: self.forward(1, ctx)]
        return start_microbatches(
            bodies, token_offsets=[0, self.split[0] * self.cfg.next_n], compute_stream=self.compute_stream,
            comm_stream=self.comm_stream, device=self.dev.index if self.dev.type == "cuda" else None,
        )

    def compare(self, ref: dict[str, torch.Tensor], step: int, phase: str, replans: int) -> StepCheck:
        out = self.snapshot()
        logits_bad = (out["logits"] != ref["logits"]).any(dim=-1).any(dim=0)
        # -inf == -inf is True; NaN never appears (masked columns are -inf, valid ones are finite).
        topk_bad = (out["topk"] != ref["topk"]).any(dim=-1).any(dim=0)
        bad = int(logits_bad.sum()), int(topk_bad.sum()), int((out["follow"] != ref["follow"]).sum())
        return StepCheck(step, phase, not any(bad), *bad, replans=replans)


@dataclass(frozen=True)
class Contrast:
    """A run of the same scenario with part of dbo_runtime switched off, and how it must fail."""

    name: str
    expect: Literal["pass", "assertion", "topk-mismatch"]
    overrides: dict[str, Any]

    def as_expected(self, res: ScenarioResult) -> bool:
        if self.expect == "pass":
            return res.ok
        if self.expect == "assertion":
            return res.error.startswith("DeepGEMM assertion")
        return not res.error and any(c.follower_mismatch > 0 for c in res.checks)


CONTRASTS: tuple[Contrast, ...] = (
    Contrast("vLLM (no dbo_runtime)", "assertion", {"fix_schedule": False, "isolate_topk": False}),
    Contrast("schedule fix only (vllm#60732)", "topk-mismatch", {"isolate_topk": False}),
    Contrast("upstream re-plan at call site", "pass", {"plan_ahead": False}),
)
"""What vLLM does, what the upstream schedule fix alone does, and its re-plan cost."""


def run_scenario(
    config: ScenarioConfig, backend: KernelBackend, mode: Mode = "eager", *,
    progress: Callable[[int, int], None] | None = None,
) -> ScenarioResult:  # fmt: skip
    """Reference + DBO steps in ``mode`` (graph modes on a CUDA backend); never raises for a scenario failure
    (it is in the result)."""
    sc = Scenario(config, backend)
    n = len(sc.leader_ids)
    result = ScenarioResult(mode, backend.name, backend.simulated, asdict(config), sc.budget.describe(), n,
                            config.num_layers - n)  # fmt: skip
    result.topk_extra_bytes = sc.topk.extra_bytes()
    graph: Any = None
    try:
        for step in range(config.steps):
            sc.new_inputs()
            ref = sc.run_reference()
            sc.clear_outputs()
            before = sc.cache.stats.replans
            t0 = time.perf_counter()
            if mode == "eager" or (graph is None and step == 0):
                # Eager DBO step (in graph modes this is vLLM's warm-up run under SM control).
                sc.build(microbatched=True)
                with sc.control.partition(sc.budget, compute_knob=sc.knob):
                    sc.join(sc.start())
                phase = "eager" if mode == "eager" else "warmup"
            elif graph is None:
                graph = capture_dbo_graph(sc, mode)
                phase = "capture"
            else:
                sc.build(microbatched=True)  # vLLM rebuilds metadata every step, also before a replay
                graph.replay()
                phase = "replay"
            if sc.dev.type == "cuda":
                torch.cuda.synchronize(sc.dev)
            result.step_ms.append((time.perf_counter() - t0) * 1e3)
            result.checks.append(sc.compare(ref, step, phase, sc.cache.stats.replans - before))
            if progress is not None:
                progress(step + 1, config.steps)
    except ScheduleAssertion as exc:
        result.error = f"DeepGEMM assertion: {exc}"
    except Exception as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    finally:
        sc.be.set_num_sms(sc.be.total_sms)
    st = sc.cache.stats
    result.replans_total, result.captured_replans, result.warmups = st.replans, st.captured_replans, st.warmups
    result.planned_ahead, result.deferred_plans = st.planned_ahead, st.deferred_plans
    jit = getattr(sc.be, "jit", None)
    result.jit_in_capture = list(jit.compiled_in_capture) if jit is not None else []
    return result


def capture_dbo_graph(sc: Scenario, mode: Mode) -> Any:
    """Capture one FULL DBO graph the way MRV1 or MRV2 does; the first replay is the capture run."""
    graph = torch.cuda.CUDAGraph()
    sc.build(microbatched=True)
    if mode == "mrv1":
        # UBatchWrapper: `with self.sm_control: self._capture_ubatches(...)`; threads released in the graph.
        with sc.control.partition(sc.budget, compute_knob=sc.knob):
            run = sc.start()
            with torch.cuda.graph(graph, stream=sc.compute_stream):
                run.finish()
    else:
        # UBatchRunner: SM control entered before torch.cuda.graph opens, exited by finish() inside it.
        token = sc.control.enter(sc.budget, compute_knob=sc.knob)
        run = sc.start()
        try:
            with torch.cuda.graph(graph, stream=sc.compute_stream):
                try:
                    run.finish()
                finally:
                    sc.control.exit(token)
        except BaseException:
            if sc.control.depth:
                sc.control.exit(token)
            raise
    graph.replay()
    return graph
