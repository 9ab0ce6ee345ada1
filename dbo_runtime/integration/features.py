"""Which of dbo_runtime's fixes (features: patches sharing a name prefix) are in force here, and why not: before
install each is *provided by vLLM* (an upstream probe hits; none of its patches install), *unverified* (a fingerprint
differs), *needs X* or *verified*; a lazy failure marks it *broken*. The guard refuses DBO without a needed fix."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from dbo_runtime.integration import fingerprints
from dbo_runtime.integration.patching import Patch

Verdict = Literal[
    "verified", "provided by vLLM", "unverified", "dependency", "not installed", "broken", "disabled", "not in release"
]


_PROBES = {
    "param": fingerprints.has_param, "member": fingerprints.has_member, "call": fingerprints.calls,
    "uses": fingerprints.uses,
}


@dataclass(frozen=True)
class Probe:
    """One piece of an upstream fix, read from vLLM's syntax tree (never from comments or strings)."""

    kind: Literal["param", "member", "call", "uses"]
    """``param``: the function takes ``name``; ``member``: the class (module for ``""``) defines it; ``call``:
    code there calls it; ``uses``: code there reads it."""
    module: str
    qualname: str
    name: str

    def __post_init__(self) -> None:
        if self.kind not in _PROBES:
            raise ValueError(f"Probe.kind must be one of {sorted(_PROBES)}, not {self.kind!r}")

    def present(self) -> bool:
        return _PROBES[self.kind](self.module, self.qualname, self.name)


@dataclass(frozen=True)
class Upstream:
    """The upstream fix that retires a feature; every probe must hold. A missed fix errs towards refusing: the
    fix changes fingerprinted code, so the feature becomes *unverified*."""

    pr: str
    probes: tuple[Probe, ...]

    def present(self) -> bool:
        return bool(self.probes) and all(probe.present() for probe in self.probes)


@dataclass(frozen=True)
class Reliance:
    """vLLM code a feature is correct only with, though it patches none of it: fingerprinted and judged like a
    required patch's anchors."""

    name: str
    anchors: tuple[str, ...]
    reason: str
    optional = False

    @property
    def feature(self) -> str:
        return self.name.partition(".")[0]

    @property
    def fingerprint_anchors(self) -> tuple[str, ...]:
        return self.anchors


@dataclass(frozen=True)
class Feature:
    name: str
    summary: str
    requires: tuple[str, ...] = ()
    upstream: Upstream | None = None
    on_optional_skipped: Callable[[Mapping[str, str]], None] | None = None
    """Told the skipped optional patches (name -> why) before install."""
    relies_on: tuple[Reliance, ...] = ()

    def __post_init__(self) -> None:
        strays = [r.name for r in self.relies_on if r.feature != self.name or not r.anchors]
        if strays:
            raise ValueError(f"feature {self.name!r}: a Reliance needs anchors and a {self.name}. name, not {strays}")


@dataclass
class FeatureState:
    feature: Feature
    verdict: Verdict
    detail: str = ""
    patches: list[str] = field(default_factory=list)
    left_out: dict[str, tuple[str, ...]] = field(default_factory=dict)
    """Patches left out of the release on purpose -> their architectures: the guard refuses those."""

    @property
    def installs(self) -> bool:
        return self.verdict == "verified"

    @property
    def applies(self) -> bool:
        """False where the release leaves the feature out: never in force, yet no shortfall of this install."""
        return self.verdict != "not in release"

    @property
    def in_force(self) -> bool:
        """Ours installed and intact, or vLLM's own."""
        return self.verdict in ("verified", "provided by vLLM")

    def describe(self) -> str:
        head = "in force" if self.verdict == "verified" else self.verdict
        return head + (f" ({self.detail})" if self.detail else "")


def verify(
    features: Sequence[Feature], patches: Sequence[Patch], recorded: Mapping[str, str], against: str
) -> dict[str, FeatureState]:
    """A verdict per feature, from vLLM's source against release ``against``'s fingerprints ``recorded``. A patch
    recorded ``missing`` that this build has fails its feature; ``excluded`` ones become ``left_out``."""
    by_feature: dict[str, list[Patch]] = {}
    excluded: dict[str, dict[str, tuple[str, ...]]] = {}
    reappeared: dict[str, list[str]] = {}
    for patch in patches:
        want = recorded.get(patch.name)
        if not patch.fingerprint_anchors or want not in fingerprints.OUT_OF_SET:
            by_feature.setdefault(patch.feature, []).append(patch)
        elif want == fingerprints.EXCLUDED:
            excluded.setdefault(patch.feature, {})[patch.name] = patch.architectures
        elif not patch.optional and _present(patch):
            reappeared.setdefault(patch.feature, []).append(patch.name)
    for feature in features:
        for reliance in feature.relies_on:
            if recorded.get(reliance.name) == fingerprints.MISSING and _present(reliance):
                reappeared.setdefault(feature.name, []).append(reliance.name)
    states: dict[str, FeatureState] = {}
    for feature in features:
        own = by_feature.get(feature.name, [])
        names = [p.name for p in own]
        if feature.upstream is not None and feature.upstream.present():
            states[feature.name] = FeatureState(feature, "provided by vLLM", feature.upstream.pr, names)
            continue
        if not own and feature.name in excluded:
            states[feature.name] = FeatureState(
                feature, "not in release", f"{against} leaves its {len(excluded[feature.name])} patches out on purpose", [],
                excluded[feature.name],
            )
            continue
        bound: list[Patch | Reliance] = [*own, *(r for r in feature.relies_on if recorded.get(r.name) not in fingerprints.OUT_OF_SET)]
        mismatched = [p.name for p in bound if not p.optional and _mismatch(p, recorded)] + reappeared.get(feature.name, [])
        if mismatched:
            states[feature.name] = FeatureState(
                feature, "unverified", f"code differs from {against} at " + ", ".join(mismatched), names
            )
            continue
        degraded = excluded_optional(own, recorded, against)
        detail = f"without optional {', '.join(degraded)}: code differs from {against}" if degraded else ""
        states[feature.name] = FeatureState(feature, "verified", detail, names, excluded.get(feature.name, {}))
    for feature in features:
        state = states[feature.name]
        missing = [r for r in feature.requires if r in states and not states[r].installs]
        if state.installs and missing:
            states[feature.name] = FeatureState(feature, "dependency", "needs " + ", ".join(missing), state.patches, state.left_out)
    return states


def _present(bound: Patch | Reliance) -> bool:
    return fingerprints.fingerprint(bound.fingerprint_anchors) != fingerprints.MISSING


def _mismatch(patch: Patch | Reliance, recorded: Mapping[str, str]) -> bool:
    anchors = patch.fingerprint_anchors
    if not anchors:
        return False
    want = recorded.get(patch.name)
    return want is None or fingerprints.fingerprint(anchors) != want


def excluded_optional(patches: Iterable[Patch], recorded: Mapping[str, str], against: str) -> dict[str, str]:
    return {p.name: f"code differs from {against}" for p in patches if p.optional and _mismatch(p, recorded)}


class FeatureRegistry:
    """The process's feature states (filled at ``register()``)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._states: dict[str, FeatureState] = {}

    def set_all(self, states: dict[str, FeatureState]) -> None:
        with self._lock:
            self._states = dict(states)

    def mark(self, feature: str, verdict: Verdict, detail: str) -> None:
        with self._lock:
            state = self._states.get(feature)
            if state is not None and state.verdict != "provided by vLLM":
                self._states[feature] = FeatureState(state.feature, verdict, detail, state.patches, state.left_out)

    def get(self, feature: str) -> FeatureState | None:
        return self._states.get(feature)

    def all(self) -> dict[str, FeatureState]:
        with self._lock:
            return dict(self._states)

    def clear(self) -> None:
        with self._lock:
            self._states = {}


REGISTRY = FeatureRegistry()
