"""Which ``VLLM_DBO_COMM_SMS`` values to try, and which one the measurements support (``dbo-runtime tune``).

vLLM's default comm share (20 SMs on CUDA) is not derived from anything the operator runs, and DeepEP only
accepts some values: high-throughput buffers are sized for the manager's 20 SMs (vLLM clamps larger requests to
them) and ``Buffer.set_num_sms`` asserts an even count. Low-latency and NIXL reserve no comm SM at all
(``max_sms_used() == 0``), and ROCm with DeepEP HT forces 0, so there is nothing to tune there. The choice is
conservative: a value replaces the default only when it is faster by ``min_gain`` *and* its slowest measured rep
beats the default's fastest, so noise between interleaved reps never moves an operator off vLLM's default.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from dbo_runtime.core.budget import (
    DEEPEP_HT_MANAGER_NUM_SMS,
    DEFAULT_COMM_SMS,
    H200_SMS,
    compute_budget,
    parse_comm_sms,
)
from dbo_runtime.core.errors import ConfigError

TUNABLE_BACKEND = "deepep_high_throughput"
DEFAULT_VALUES = (4, 8, 12, 16, 20)
MAX_VALUES = 8
"""Every value is one live DP engine on the same GPUs for the whole sweep (interleaved turns)."""


@dataclass(frozen=True)
class Sweep:
    values: tuple[int, ...]
    default: int
    """The value the operator runs today: ``VLLM_DBO_COMM_SMS`` if set, else vLLM's default."""
    ceiling: int
    total_sms: int
    notes: tuple[str, ...] = ()


def _allowed(ceiling: int) -> str:
    return f"'all', or a comma-separated list of 0 (no partition) and even integers in [2, {ceiling}]"


def plan_sweep(
    raw_values: str,
    *,
    backend: str | None,
    platform: str,
    environ: Mapping[str, str],
    total_sms: int = H200_SMS,
) -> Sweep:
    """The values to measure, the operator's current one included (so every ratio is side by side)."""
    if platform == "rocm":
        raise ConfigError("platform", platform, "cuda: on ROCm vLLM forces 0 comm SMs for DBO with DeepEP HT")
    if backend != TUNABLE_BACKEND:
        why = (
            "deepep_high_throughput: low-latency and NIXL reserve no comm SMs (max_sms_used() is 0), and vLLM "
            "allows DBO only with these three"
        )
        raise ConfigError("--all2all-backend", backend or "(unset)", why)
    ceiling = DEEPEP_HT_MANAGER_NUM_SMS
    env_raw = environ.get("VLLM_DBO_COMM_SMS")
    default = parse_comm_sms(env_raw) if env_raw is not None else DEFAULT_COMM_SMS["cuda"]
    text = raw_values.strip().lower()
    if text == "all":
        values = list(range(2, ceiling + 1, 2))
    else:
        values = []
        for part in (p.strip() for p in text.split(",")):
            try:
                values.append(int(part))
            except ValueError:
                raise ConfigError("--values", raw_values, _allowed(ceiling)) from None
    for value in values:
        if value != 0 and (value % 2 or not 2 <= value <= ceiling):
            raise ConfigError("--values", raw_values, _allowed(ceiling))
    notes = []
    if default not in values:
        values.append(default)
        notes.append(f"added {default}, the value in force today, so every ratio is measured side by side")
    values = sorted(set(values))
    if len(values) > MAX_VALUES:
        raise ConfigError("--values", raw_values, f"at most {MAX_VALUES} values (each is one engine kept alive on the same GPUs)")
    if len(values) < 2:
        raise ConfigError("--values", raw_values, "at least one value besides the one in force today")
    for value in values:  # vLLM's policy must accept each, as the engine will see it
        compute_budget(
            total_sms=total_sms,
            platform="cuda",
            enable_dbo=True,
            expert_parallel=True,
            all2all_backend=backend,
            env_comm_sms=str(value),
            compute_multiple=2,
        )
    return Sweep(tuple(values), default, ceiling, total_sms, tuple(notes))


@dataclass
class Measurement:
    """One value's step times (ms) per measured rep, the slowest rank counting (a DP step waits for it)."""

    value: int
    reps_ms: list[float] = field(default_factory=list)
    microbatched: int = 0
    error: str | None = None

    @property
    def median_ms(self) -> float | None:
        return statistics.median(self.reps_ms) if self.reps_ms else None


def measurement(value: int, record: Mapping[str, Any], metric: str, microbatch_key: str) -> Measurement:
    """From a harness record: per measured rep, the max of ``metric`` over the ranks (``bench`` rows)."""
    out = Measurement(value)
    if not record.get("ok"):
        out.error = str(record.get("error") or "the engine run failed")
        return out
    ranks = [b.get("reps") or [] for b in (record.get("bench") or [])]
    if not ranks:
        out.error = "no timings in the record"
        return out
    by_rep: dict[int, list[float]] = {}
    for rows in ranks:
        for row in rows:
            if row.get("warmup"):
                continue
            value_ms = row.get(metric)
            if isinstance(value_ms, (int, float)):
                by_rep.setdefault(int(row["rep"]), []).append(float(value_ms))
            built = row.get(microbatch_key)
            if isinstance(built, int):
                out.microbatched += built
    out.reps_ms = [max(times) for _, times in sorted(by_rep.items()) if len(times) == len(ranks)]
    if not out.reps_ms:
        out.error = "no rep measured on every rank"
    return out


def choose(measurements: Sequence[Measurement], default: int, *, min_gain: float) -> dict[str, Any]:
    """The verdict document: the curve, the fastest value, and the setting to use."""
    usable = [m for m in measurements if m.median_ms is not None and m.microbatched > 0]
    curve = [
        {
            "comm_sms": m.value,
            "median_ms": m.median_ms,
            "min_ms": min(m.reps_ms) if m.reps_ms else None,
            "max_ms": max(m.reps_ms) if m.reps_ms else None,
            "reps_ms": m.reps_ms,
            "microbatched_steps": m.microbatched,
            "error": m.error or (None if m.microbatched > 0 or m.median_ms is None else "DBO never microbatched"),
        }
        for m in measurements
    ]
    doc: dict[str, Any] = {"default": default, "min_gain": min_gain, "curve": curve}
    base = next((m for m in usable if m.value == default), None)
    if not usable:
        never = any(m.median_ms is not None for m in measurements)
        doc.update(verdict="inconclusive" if never else "error", best=None, setting=None)
        return doc
    if base is None:
        doc.update(verdict="error", best=None, setting=None, reason=f"the value in force today ({default}) was not measured")
        return doc
    for row in curve:
        row["speedup_vs_default"] = base.median_ms / row["median_ms"] if row["median_ms"] else None  # type: ignore[operator]
    best = min(usable, key=lambda m: (m.median_ms, abs(m.value - default)))
    assert best.median_ms is not None and base.median_ms is not None
    gain = base.median_ms / best.median_ms - 1.0
    separated = max(best.reps_ms) < min(base.reps_ms)
    if best.value != default and gain >= min_gain and separated:
        chosen, reason = best, f"{gain:.1%} faster than {default}, every rep faster than the default's fastest"
    elif best.value != default:
        chosen = base
        reason = (
            f"{best.value} measured {gain:.1%} faster, within the noise between reps or below --min-gain "
            f"{min_gain:.0%}: keep {default}"
        )
    else:
        chosen, reason = base, f"{default} is the fastest value measured"
    doc.update(
        verdict="measured",
        best=best.value,
        best_speedup=base.median_ms / best.median_ms,
        chosen=chosen.value,
        reason=reason,
        setting=f"VLLM_DBO_COMM_SMS={chosen.value}",
    )
    return doc


__all__ = ["DEFAULT_VALUES", "Measurement", "Sweep", "choose", "measurement", "plan_sweep"]
