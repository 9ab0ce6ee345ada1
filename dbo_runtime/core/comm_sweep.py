"""Which ``VLLM_DBO_COMM_SMS`` values ``dbo-runtime tune`` tries (DeepEP HT: even, at most its manager's share), and
which one the measurements support: a value replaces today's only when it beats it in every paired round by at
least ``min_gain``, over enough rounds that noise alone does so in at most 5 % of sweeps."""

from __future__ import annotations

import math
import re
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from dbo_runtime.core.budget import DEEPEP_HT_MANAGER_NUM_SMS, DEFAULT_COMM_SMS, compute_budget, parse_comm_sms
from dbo_runtime.core.cli_support import H200_SMS, StateError
from dbo_runtime.core.errors import ConfigError, did_you_mean

TUNABLE_BACKEND = "deepep_high_throughput"
DEFAULT_VALUES = (4, 8, 12, 16, 20)
ALPHA = 0.05
"""Family-wise error of moving off today's value: at most 5 % of sweeps where no value is faster do so."""


@dataclass(frozen=True)
class Sweep:
    values: tuple[int, ...]
    default: int
    """The value the operator runs today: ``VLLM_DBO_COMM_SMS`` if set, else vLLM's default."""
    total_sms: int
    notes: tuple[str, ...] = ()


def plan_sweep(
    raw_values: str, *, backend: str | None, platform: str, environ: Mapping[str, str], total_sms: int = H200_SMS
) -> Sweep:
    """The values to measure, the operator's current one included (so every ratio is side by side)."""
    if platform == "rocm":
        raise ConfigError("platform", platform, "cuda: on ROCm vLLM forces 0 comm SMs for DBO with DeepEP HT")
    if backend != TUNABLE_BACKEND:
        why = ("deepep_high_throughput: vLLM allows DBO with deepep_high_throughput, deepep_low_latency and nixl_ep, "
               "and the last two reserve no comm SMs (max_sms_used() is 0)")  # fmt: skip
        if backend is None:
            raise StateError("--all2all-backend", "not given", why)
        raise ConfigError("--all2all-backend", backend, why + did_you_mean(backend, (TUNABLE_BACKEND,)))
    ceiling = DEEPEP_HT_MANAGER_NUM_SMS
    env_raw = environ.get("VLLM_DBO_COMM_SMS")
    default = parse_comm_sms(env_raw) if env_raw is not None else DEFAULT_COMM_SMS["cuda"]
    allowed = f"'all', or a comma-separated list of 0 (no partition) and even integers in [2, {ceiling}], each once"
    parts = [part.strip() for part in raw_values.split(",")]
    if raw_values.strip() == "all":
        values = list(range(2, ceiling + 1, 2))
    elif not all(re.fullmatch(r"[0-9]{1,6}", part) for part in parts):  # int() also reads '1_0' and other digits
        raise ConfigError("--values", raw_values, allowed + did_you_mean(raw_values.strip(), ["all"]))
    else:
        values = [int(part) for part in parts]
    if len(set(values)) < len(values) or any(v != 0 and (v % 2 or not 2 <= v <= ceiling) for v in values):
        raise ConfigError("--values", raw_values, allowed)
    notes = []
    if default not in values:
        values.append(default)
        notes.append(f"added {default}, the value in force today, so every ratio is measured side by side")
    values = sorted(set(values))
    if len(values) < 2:
        raise ConfigError("--values", raw_values, "at least one value besides the one in force today")
    for value in values:  # vLLM's policy must accept each, as the engine will see it
        compute_budget(total_sms=total_sms, platform="cuda", enable_dbo=True, expert_parallel=True,
                       all2all_backend=backend, env_comm_sms=str(value), compute_multiple=2)  # fmt: skip
    return Sweep(tuple(values), default, total_sms, tuple(notes))


@dataclass
class Measurement:
    """One value's time per microbatched step (ms) per measured round, the slowest rank counting (a DP step
    waits for it); a round counts only where every rank microbatched."""

    value: int
    by_rep: dict[int, float] = field(default_factory=dict)
    microbatched: int = 0
    error: str | None = None

    @property
    def reps_ms(self) -> list[float]:
        return [self.by_rep[r] for r in sorted(self.by_rep)]

    @property
    def median_ms(self) -> float | None:
        return statistics.median(self.by_rep.values()) if self.by_rep else None


def measurement(value: int, record: Mapping[str, Any], metric: str, microbatch_key: str) -> Measurement:
    """From a harness record: per measured round, the max of ``metric`` over the ranks (``bench`` rows)."""
    if not record.get("ok"):
        return Measurement(value, error=str(record.get("error") or "the engine run failed"))
    ranks = [b.get("reps") or [] for b in (record.get("bench") or [])]
    if not ranks:
        return Measurement(value, error="no timings in the record")
    out = Measurement(value)
    by_rep: dict[int, list[float]] = {}
    for row in (row for rows in ranks for row in rows if not row.get("warmup")):
        value_ms, built = row.get(metric), row.get(microbatch_key)
        if isinstance(built, int):
            out.microbatched += built
            if isinstance(value_ms, (int, float)) and built > 0:
                by_rep.setdefault(int(row["rep"]), []).append(float(value_ms))
    out.by_rep = {rep: max(times) for rep, times in by_rep.items() if len(times) == len(ranks)}
    if not out.by_rep:
        out.error = "no round where every rank microbatched" if out.microbatched else "DBO never microbatched"
    return out


def rounds_needed(alternatives: int, alpha: float) -> int:
    """Paired rounds for a sign test to move off the default at family-wise error ``alpha``: all ``n`` rounds
    faster has probability ``0.5 ** n`` under no difference, times the alternatives (Bonferroni)."""
    return max(1, math.ceil(math.log2(max(alternatives, 1) / alpha)))


def sign_test_p(faster: int, rounds: int, alternatives: int) -> float:
    """One-sided sign test, Bonferroni over ``alternatives``."""
    tail = sum(math.comb(rounds, i) for i in range(faster, rounds + 1)) / 2**rounds
    return min(1.0, max(alternatives, 1) * tail)


def choose(measurements: Sequence[Measurement], default: int, *, min_gain: float, alpha: float = ALPHA) -> dict[str, Any]:
    """The verdict: the curve, ``best`` (the fastest value measured) and ``chosen`` (the one to set: not ``best``
    where that is not confirmed). Values are compared with the default within each round, so drift cancels."""
    usable = [m for m in measurements if m.by_rep]
    base = next((m for m in usable if m.value == default), None)
    curve: list[dict[str, Any]] = []
    for m in measurements:
        low, high = (min(m.reps_ms), max(m.reps_ms)) if m.reps_ms else (None, None)
        row: dict[str, Any] = {"comm_sms": m.value, "median_ms": m.median_ms, "min_ms": low, "max_ms": high}
        row.update(reps_ms=m.reps_ms, microbatched_steps=m.microbatched, error=m.error)
        if base is not None and m.by_rep:
            common = sorted(set(m.by_rep) & set(base.by_rep))
            ratios = [base.by_rep[r] / m.by_rep[r] for r in common]
            speedup = statistics.median(ratios) if ratios else None
            row.update(rounds=len(common), paired_speedup=speedup, faster_rounds=sum(1 for x in ratios if x > 1))
        curve.append(row)
    doc: dict[str, Any] = {"default": default, "min_gain": min_gain, "alpha": alpha, "curve": curve}
    if not usable:
        never = all(m.error == "DBO never microbatched" for m in measurements)
        doc.update(verdict="inconclusive" if never else "error", best=None, setting=None)
        return doc
    if base is None:
        doc.update(verdict="error", best=None, setting=None, reason=f"the value in force today ({default}) was not measured")
        return doc
    alternatives = [r for r in curve if r["comm_sms"] != default and r.get("paired_speedup")]
    need = rounds_needed(len(alternatives), alpha)
    for r in alternatives:
        r["p_value"] = sign_test_p(r["faster_rounds"], r["rounds"], len(alternatives))
    best = max(alternatives, key=lambda r: r["paired_speedup"], default=None)
    confirmed = [r for r in alternatives
                 if r["paired_speedup"] - 1 >= min_gain and r["faster_rounds"] == r["rounds"] >= need]  # fmt: skip
    if confirmed:
        chosen = max(confirmed, key=lambda r: r["paired_speedup"])
        value, chosen_speedup, p_value = chosen["comm_sms"], chosen["paired_speedup"], chosen["p_value"]
        reason = (f"{chosen_speedup - 1:.1%} faster than {default} (median of {chosen['rounds']} paired rounds, "
                  f"faster in every one; p = {p_value:.3g})")  # fmt: skip
    elif best is not None and best["paired_speedup"] > 1:
        value, chosen_speedup, p_value = default, 1.0, best["p_value"]
        gain = best["paired_speedup"] - 1
        if gain < min_gain:
            reason = f"{best['comm_sms']} measured {gain:.1%} faster, below --min-gain {min_gain:.0%}: keep {default}"
        else:
            reason = (f"{best['comm_sms']} measured {gain:.1%} faster but in {best['faster_rounds']} of "
                      f"{best['rounds']} paired rounds (confirming needs all of at least {need}, --reps {need}): "
                      f"keep {default}")  # fmt: skip
    else:
        value, reason, chosen_speedup, p_value = default, f"{default} is the fastest value measured", 1.0, None
    doc.update(
        verdict="measured", best=best["comm_sms"] if best is not None and best["paired_speedup"] > 1 else default,
        best_paired_speedup=max(best["paired_speedup"], 1.0) if best is not None else 1.0, chosen=value,
        chosen_speedup=chosen_speedup, p_value=p_value, rounds_needed=need, reason=reason,
        setting=f"VLLM_DBO_COMM_SMS={value}",
    )  # fmt: skip
    return doc
