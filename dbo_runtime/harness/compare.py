"""Compare two greedy runs request by request, token by token (``verify``, the accuracy A/B). After the first
differing token the runs continue from different contexts: logprob differences count up to it only."""

from __future__ import annotations

import math
import statistics
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from dbo_runtime.core.errors import ConfigError


@dataclass(frozen=True)
class Request:
    index: int
    tokens: Sequence[int]
    logprobs: Sequence[Mapping[int, float]]
    """Per position: token id -> logprob of the returned top-k."""

    @staticmethod
    def from_json(obj: Mapping[str, Any]) -> Request:
        lps = [{int(k): float(v) for k, v in pos.items()} for pos in obj.get("logprobs") or []]
        return Request(int(obj["index"]), [int(t) for t in obj["tokens"]], lps)


@dataclass
class Comparison:
    requests: int = 0
    tokens: int = 0
    equal_tokens: int = 0
    agreement: float = 1.0
    prefix_agreement: float = 1.0
    exact_requests: int = 0
    agreement_se: float = 0.0
    max_abs_dlogprob: float = 0.0
    mean_abs_dlogprob: float = 0.0
    dlogprob_positions: int = 0
    dlogprob_missing: int = 0
    dlogprob_bounded: int = 0
    """Positions whose reference token left the other run's top-k (counted as a lower bound)."""
    nonfinite_logprobs: int = 0
    mean_abs_dlogprob_exact: float = 0.0
    """Mean over exact positions only: per-token noise, not how early a request diverged."""
    first_divergences: list[int | None] = field(default_factory=list)
    missing_requests: list[int] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _dlogprob(ref: Request, other: Request, position: int) -> tuple[str, float]:
    """(kind, |Δ logprob| of the reference token), kind ``exact``, ``bound``, ``nonfinite`` or ``missing``."""
    if position >= len(ref.logprobs) or position >= len(other.logprobs):
        return "missing", 0.0
    token = ref.tokens[position]
    a = ref.logprobs[position].get(token)
    if a is None or not other.logprobs[position]:
        return "missing", 0.0
    values = [a, *other.logprobs[position].values()]
    if not all(math.isfinite(v) for v in values):
        return "nonfinite", 0.0
    b = other.logprobs[position].get(token)
    if b is None:
        return "bound", max(0.0, a - min(other.logprobs[position].values()))
    return "exact", abs(a - b)


def compare(reference: Sequence[Request], other: Sequence[Request]) -> Comparison:
    """Compare ``other`` against ``reference`` (matched by ``index``)."""
    by_index = {r.index: r for r in other}
    out = Comparison()
    prefix_sum = 0.0
    per_request: list[float] = []
    marks: list[tuple[str, float]] = []  # _dlogprob of each position compared
    for ref in sorted(reference, key=lambda r: r.index):
        n = len(ref.tokens)
        out.tokens += n
        test = by_index.get(ref.index)
        if test is None:
            out.missing_requests.append(ref.index)
            out.first_divergences.append(0)
            per_request.append(0.0)
            continue
        out.requests += 1
        same = [i < len(test.tokens) and test.tokens[i] == ref.tokens[i] for i in range(n)]
        first = same.index(False) if False in same else None
        out.equal_tokens += sum(same)
        per_request.append(sum(same) / n if n else 1.0)
        out.first_divergences.append(first)
        out.exact_requests += first is None and len(test.tokens) == n
        prefix_sum += (n if first is None else first) / n if n else 1.0
        marks += [_dlogprob(ref, test, pos) for pos in range(n if first is None else first + 1)]
    n_of = Counter(kind for kind, _ in marks)
    out.dlogprob_missing, out.nonfinite_logprobs = n_of["missing"], n_of["nonfinite"]
    counted = [d for kind, d in marks if kind in ("exact", "bound")]
    exact = [d for kind, d in marks if kind == "exact"]
    out.dlogprob_positions, out.dlogprob_bounded = len(counted), n_of["bound"]
    out.max_abs_dlogprob = max(counted, default=0.0)
    total_requests = out.requests + len(out.missing_requests)
    out.agreement = out.equal_tokens / out.tokens if out.tokens else 1.0
    out.prefix_agreement = prefix_sum / total_requests if total_requests else 1.0
    out.mean_abs_dlogprob = math.fsum(counted) / len(counted) if counted else 0.0  # fsum: one result on every Python
    out.mean_abs_dlogprob_exact = math.fsum(exact) / len(exact) if exact else 0.0
    if len(per_request) > 1:
        out.agreement_se = statistics.stdev(per_request) / math.sqrt(len(per_request))
    return out


@dataclass(frozen=True)
class Thresholds:
    """The pass line of ``dbo-runtime verify``. DBO changes batch shapes, so a near-tie may flip a few
    requests; a wrong top-k moves logprobs far, which ``max_dlogprob`` judges. Assumes a trained model,
    whose margins exceed DBO's numerical noise."""

    min_agreement: float = 0.95
    max_dlogprob: float = 0.25

    def validate(self) -> None:
        if not 0.0 <= self.min_agreement <= 1.0:
            raise ConfigError("--min-agreement", self.min_agreement, "a number in [0, 1]")
        if not (self.max_dlogprob >= 0.0 and math.isfinite(self.max_dlogprob)):
            raise ConfigError("--max-dlogprob", self.max_dlogprob, "a finite number >= 0")


@dataclass(frozen=True)
class FloorRule:
    """How far a DBO-on comparison may sit from a noise floor (a run that changes only batch shapes)
    and still count as noise: DBO may move the model as much as batch shapes do, not more."""

    agreement_slack: float = 0.02
    """Agreement may sit this far below the floor's, or three standard errors, whichever is larger."""
    dlogprob_factor: float = 3.0
    """Mean |dlogprob| on the shared prefix may be at most this many times the floor's..."""
    dlogprob_min: float = 1e-6
    """...taking the floor's as at least this (a batch-invariant floor would otherwise allow nothing)."""

    def degenerate(self, floor: Comparison) -> bool:
        """A floor identical to the reference measured no noise: nothing to judge against."""
        return floor.exact_requests == floor.requests and floor.max_abs_dlogprob == 0.0 and not floor.missing_requests

    def judge(self, result: Comparison, floor: Comparison) -> tuple[bool, list[str]]:
        """(within the floor, reasons it is not); per-token noise compares exact positions only."""
        reasons = []
        slack = max(self.agreement_slack, 3.0 * math.sqrt(2.0) * floor.agreement_se)
        if result.agreement < floor.agreement - slack:
            reasons.append(f"token agreement {result.agreement:.4f} < noise floor {floor.agreement:.4f} - {slack:.3f}")
        limit = self.dlogprob_factor * max(floor.mean_abs_dlogprob_exact, self.dlogprob_min)
        if result.mean_abs_dlogprob_exact > limit:
            reasons.append(
                f"mean |dlogprob| {result.mean_abs_dlogprob_exact:.3g} > {self.dlogprob_factor:g} x noise floor "
                f"{floor.mean_abs_dlogprob_exact:.3g} (positions where the reference token was in the top-k)"
            )
        if result.missing_requests:
            reasons.append(f"{len(result.missing_requests)} requests missing from the DBO run")
        if result.nonfinite_logprobs:
            reasons.append(f"{result.nonfinite_logprobs} positions with a non-finite logprob")
        return (not reasons), reasons


def verdict(result: Comparison, thresholds: Thresholds) -> tuple[bool, list[str]]:
    """(passed, reasons it failed)."""
    reasons = []
    if result.missing_requests:
        reasons.append(f"{len(result.missing_requests)} requests missing from the DBO run")
    if result.agreement < thresholds.min_agreement:
        reasons.append(f"token agreement {result.agreement:.4f} < {thresholds.min_agreement}")
    if result.max_abs_dlogprob > thresholds.max_dlogprob:
        reasons.append(f"max |dlogprob| {result.max_abs_dlogprob:.4g} > {thresholds.max_dlogprob}")
    if result.nonfinite_logprobs:
        reasons.append(f"{result.nonfinite_logprobs} positions with a non-finite logprob")
    return (not reasons), reasons
