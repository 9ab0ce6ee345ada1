"""Which recorded vLLM release this build is, judged by its code.

Why: the version string says what a build claims, the fingerprints say what its code is. A build is
release R when every patch R records has the same fingerprint here; then R's set is the one that
installs. A patch R records as ``missing`` (its target does not exist there, such as the V1 model
runner's in 0.34.0) is not part of R's set and never makes a feature unverified; one recorded ``excluded`` is left
out on purpose, and a feature left with none of its patches is not in force there. A build that matches
no release is judged against the closest one, feature by feature, and every difference fails closed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from importlib import metadata

from dbo_runtime.integration import fingerprints
from dbo_runtime.integration.catalog import all_patches
from dbo_runtime.integration.patching import Patch
from dbo_runtime.integration.recorded_fingerprints import RELEASES

SUPPORTED: tuple[str, ...] = tuple(RELEASES)
"""The releases whose fingerprints are recorded, oldest first (``guard.VERIFIED`` reads the same record)."""


def installed_version() -> str | None:
    try:
        return metadata.version("vllm")
    except metadata.PackageNotFoundError:
        return None


def part_of(patch: Patch, recorded: Mapping[str, str]) -> bool:
    """Whether the patch belongs to a release's set: bound to no vLLM code, or recorded there (not ``missing``
    because its target does not exist, not ``excluded`` on purpose)."""
    return not patch.fingerprint_anchors or recorded.get(patch.name) not in fingerprints.OUT_OF_SET


@dataclass(frozen=True)
class ReleaseMatch:
    installed: str | None
    """vLLM's own version string (informational only)."""
    release: str | None
    """The recorded release whose every fingerprint this build's code has, or None."""
    closest: str
    """The recorded release with the fewest differing fingerprints (ties: the newest)."""
    differing: tuple[str, ...]
    """Patches whose fingerprint differs from ``closest``'s record."""

    @property
    def recorded(self) -> Mapping[str, str]:
        return RELEASES[self.release or self.closest]

    @property
    def label(self) -> str:
        """How verdicts name the code they were checked against."""
        return f"vLLM {self.release or self.closest}"

    def describe(self) -> str:
        if self.release is not None:
            return f"vLLM {self.release} (verified by its code)"
        return (
            f"vLLM {self.installed or '(version unknown)'}: not a release dbo_runtime verifies (closest "
            f"{self.closest}, {len(self.differing)} fingerprint(s) differ; verified: {', '.join(SUPPORTED)})"
        )


def identify(patches: Sequence[Patch] | None = None) -> ReleaseMatch:
    """Compare the build on disk with every recorded release (reads vLLM's files, imports nothing of it)."""
    chosen = all_patches() if patches is None else patches
    printed = {p.name: fingerprints.fingerprint(p.fingerprint_anchors) for p in chosen if p.fingerprint_anchors}
    best: tuple[int, str, tuple[str, ...]] | None = None
    for release, recorded in RELEASES.items():  # oldest first: a later tie replaces an earlier one
        differing = tuple(
            name for name, want in recorded.items() if want != fingerprints.EXCLUDED and printed.get(name, want) != want
        )
        unrecorded = tuple(name for name in printed if name not in recorded)
        differing += unrecorded
        if best is None or len(differing) <= best[0]:
            best = (len(differing), release, differing)
    assert best is not None, "recorded_fingerprints.RELEASES is empty"
    _, closest, differing = best
    return ReleaseMatch(installed_version(), closest if not differing else None, closest, differing)


__all__ = ["SUPPORTED", "ReleaseMatch", "identify", "installed_version", "part_of"]
