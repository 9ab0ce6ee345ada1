"""JIT-compiles DeepGEMM's paged-MQA planners at model load (a first compile in an eager DP step stalls the DP
group): outside any capture, what a decode step can present at the builder's SM count and each announced DBO count,
under ``VLLM_DEEP_GEMM_WARMUP``; variants first met in a step count as ``jit_in_step`` (goal 0)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dbo_runtime.adapters.deep_gemm import next_n_of
from dbo_runtime.core.errors import ConfigError
from dbo_runtime.core.log import get_logger
from dbo_runtime.core.planner_shapes import align_batch, aligned_buckets
from dbo_runtime.core.settings import WARM_MAX_BATCH_ENV, WarmPolicy, warm_policy

logger = get_logger(__name__)


@dataclass(frozen=True)
class PlannerProfile:
    """What an indexer builder will ask the planner for at the DBO count."""

    device: Any
    block_kv: int
    shapes: tuple[tuple[int, int], ...]
    """``(rows, width)`` of the planner's ``context_lens`` per microbatch."""
    varlen: bool = False
    max_rows: int = 0
    """Planner rows of the largest decode step."""
    width: int = 1

    def warm_shapes(self, policy: WarmPolicy, dbo: bool) -> list[tuple[int, int]]:
        """What to compile at load under ``policy``."""
        if policy.mode == "off":
            return []
        if policy.mode == "minimal":
            return list(self.shapes) if dbo else []
        cap = self.max_rows if policy.cap is None else _capped(policy.cap, self.max_rows)
        buckets = [(rows, self.width) for rows in aligned_buckets(cap)] if cap > 0 else []
        return (list(self.shapes) if dbo else []) + buckets


_said_capped: set[tuple[int, int]] = set()


def _capped(cap: int, max_rows: int) -> int:
    """The operator's warm-up cap, but no larger than the engine's largest decode step; said once."""
    if max_rows <= 0 or cap <= max_rows:
        return cap
    if (cap, max_rows) not in _said_capped:
        _said_capped.add((cap, max_rows))
        logger.warning(
            "dbo_runtime: %s=%d is above this engine's largest decode step (%d planner rows, from max_num_seqs and "
            "the speculative tokens): warming up to %d; allowed values: 0 to %d",
            WARM_MAX_BATCH_ENV, cap, max_rows, max_rows, max_rows,
        )  # fmt: skip
    return max_rows


class PlannerWarmup:
    """Registered profiles, compiled variants, and the warm-up itself."""

    def __init__(self, planner: Callable[[], Any], stats: Any, dbo_sms: Callable[[int], int | None]) -> None:
        self._planner = planner
        self.stats = stats
        self._dbo_sms = dbo_sms
        self._lock = threading.RLock()
        self._profiles: dict[int, list[PlannerProfile]] = {}
        self._warmed: set[tuple[Any, ...]] = set()
        self._failed: set[tuple[Any, ...]] = set()
        """Variants whose warm-up raised: not retried."""
        self._warm_done: set[tuple[Any, ...]] = set()
        self._noted: set[tuple[Any, ...]] = set()
        """``note_plan``'s raw arguments already checked (a known shape costs one set lookup)."""
        self._sweep_warned = False
        self.serving = False
        """vLLM's start-up is over: later first launches are in-step."""

    def variant(self, device: Any, block_kv: int, num_sms: int, rows: int, width: int, varlen: bool) -> tuple[Any, ...]:
        """What DeepGEMM compiles one planner for, on a device."""
        where = f"{getattr(device, 'type', device)}:{getattr(device, 'index', None) or 0}"
        return (where, int(block_kv), self._planner().slots(int(num_sms), 1 if varlen else int(width)), align_batch(rows), varlen)

    def note_plan(self, context_lens: Any, block_kv: int, num_sms: int, indices: Any | None) -> None:
        """A planner launched by a step: count a variant the warm-up did not cover. Never raises."""
        try:
            raw = (context_lens.shape, context_lens.device, block_kv, num_sms, indices is not None)
            if raw in self._noted:
                return
            key = self.variant(raw[1], block_kv, num_sms, int(raw[0][0]), next_n_of(context_lens), indices is not None)
        except Exception:
            return
        self._noted.add(raw)
        if key in self._warmed:
            return
        with self._lock:
            if key in self._warmed:
                return
            self._warmed.add(key)
            if self.serving:
                self.stats.jit_in_step += 1
            else:
                self.stats.jit_at_start += 1

    def start_serving(self) -> None:
        """vLLM's start-up is over: first launches count in-step."""
        self.serving = True

    def register_profile(
        self, device_index: int, profile: PlannerProfile, *, full_sms: int | None = None, microbatches: bool = True
    ) -> None:
        """An indexer builder exists: warm it for its own SM count (``full_sms``, None: not at all) and, if its
        engine ``microbatches``, for every announced DBO count."""
        with self._lock:
            profiles = self._profiles.setdefault(device_index, [])
            if profile not in profiles:
                profiles.append(profile)
        if full_sms is not None:
            self.warm(device_index, int(full_sms), dbo=False)
        if not microbatches:
            return
        sms = self._dbo_sms(device_index)
        if sms is not None:
            self.warm(device_index, sms)

    def _policy(self) -> WarmPolicy:
        """``warm_policy()``, a bad value logged once and read as unset (a raise would repeat every DBO step)."""
        try:
            return warm_policy()
        except ConfigError as exc:
            if not self._sweep_warned:
                self._sweep_warned = True
                logger.warning("dbo_runtime: %s; read as unset", exc)
            import os

            return warm_policy({k: v for k, v in os.environ.items() if k != WARM_MAX_BATCH_ENV})

    def warm(self, device_index: int, num_sms: int, *, dbo: bool = True) -> int:
        """Launch the planner once per distinct variant of every registered profile at ``num_sms``; never inside
        a capture (a JIT compile there would be fatal)."""
        profiles = self._profiles.get(device_index, [])
        if not profiles:
            return 0
        # once warm for the current profiles, return before any probe
        done = (device_index, num_sms, dbo, len(profiles))
        if done in self._warm_done:
            return 0
        planner = self._planner()
        if planner.capturing():
            self.stats.warm_skipped_in_capture += 1
            return 0
        import time

        import torch

        started = time.perf_counter_ns()
        launched = 0
        policy = self._policy()
        todo: dict[tuple[Any, ...], tuple[PlannerProfile, int, int]] = {}
        for profile in profiles:
            for rows, shape_width in profile.warm_shapes(policy, dbo):
                # varlen (SM100): one row per token, next_n 1
                width = 1 if profile.varlen else shape_width
                batch = align_batch(rows)
                key = self.variant(profile.device, profile.block_kv, num_sms, batch, width, profile.varlen)
                if key not in self._warmed and key not in self._failed:
                    todo.setdefault(key, (profile, batch, width))
        if todo:
            logger.info(
                "dbo_runtime: compiling %d paged-MQA planner variants for %d SMs on device %d (%s; about 1-2 s each "
                "on a cold DG_JIT_CACHE_DIR, milliseconds when cached)",
                len(todo), num_sms, device_index, policy.source,
            )
        for key, (profile, batch, width) in todo.items():
            try:
                lens = torch.ones((batch, width), dtype=torch.int32, device=profile.device)
                indices = torch.arange(batch, dtype=torch.int32, device=profile.device) if profile.varlen else None
                planner.plan(lens, profile.block_kv, num_sms, indices)
            except Exception as exc:
                # an optimisation: the call site compiles it on first use
                self._failed.add(key)
                self.stats.warm_failures += 1
                if self.stats.warm_failures == 1:
                    logger.warning(
                        "dbo_runtime: planner warm-up for %d SMs failed (%r); the variant compiles on first use",
                        num_sms, exc,
                    )
                continue
            self._warmed.add(key)
            launched += 1
        self._warm_done.add(done)
        self.stats.warmups += launched
        elapsed = time.perf_counter_ns() - started
        self.stats.warm_ns += elapsed
        if launched:
            logger.info(
                "dbo_runtime: warmed %d paged-MQA planners for %d SMs on device %d in %.1f s (%s; %s)",
                launched, num_sms, device_index, elapsed / 1e9, "DBO count" if dbo else "full GPU", policy.source,
            )
        return launched
