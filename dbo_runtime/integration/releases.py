"""Which recorded vLLM release this build is, judged by its code: release R when every patch in R's set has
R's fingerprint here; otherwise judged against the closest release, feature by feature, failing closed."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from importlib import metadata

from dbo_runtime.core.errors import PatchError
from dbo_runtime.integration import fingerprints
from dbo_runtime.integration.catalog import all_patches, all_reliances
from dbo_runtime.integration.features import Reliance
from dbo_runtime.integration.fingerprints import RELEASES
from dbo_runtime.integration.patching import Patch

SUPPORTED: tuple[str, ...] = tuple(RELEASES)
"""The recorded releases, oldest first."""


def installed_version() -> str | None:
    try:
        return metadata.version("vllm")
    except metadata.PackageNotFoundError:
        return None


def part_of(patch: Patch, recorded: Mapping[str, str]) -> bool:
    """Whether the patch is in a release's set (unbound, or recorded there)."""
    return not patch.fingerprint_anchors or recorded.get(patch.name) not in fingerprints.OUT_OF_SET


@dataclass(frozen=True)
class ReleaseMatch:
    installed: str | None
    release: str | None
    """The release whose every fingerprint matches, or None."""
    closest: str
    """The release with the fewest differing fingerprints (ties: the newest)."""
    differing: tuple[str, ...]
    """Patches that differ from ``closest``."""

    @property
    def recorded(self) -> Mapping[str, str]:
        return RELEASES[self.release or self.closest]

    @property
    def label(self) -> str:
        return f"vLLM {self.release or self.closest}"

    def describe(self) -> str:
        if self.release is not None:
            return f"vLLM {self.release} (verified by its code)"
        return (
            f"vLLM {self.installed or '(version unknown)'}: not a release dbo_runtime verifies (closest "
            f"{self.closest}, {len(self.differing)} fingerprint(s) differ; verified: {', '.join(SUPPORTED)})"
        )


def identify(patches: Sequence[Patch] | None = None) -> ReleaseMatch:
    """vLLM's code on disk (and what features rely on) against every recorded release."""
    chosen: list[Patch | Reliance] = [*(all_patches() if patches is None else patches), *all_reliances()]
    printed = {p.name: fingerprints.fingerprint(p.fingerprint_anchors) for p in chosen if p.fingerprint_anchors}
    best: tuple[int, str, tuple[str, ...]] | None = None
    for release, recorded in RELEASES.items():  # a later tie wins
        differing = tuple(
            name for name, want in recorded.items() if want != fingerprints.EXCLUDED and printed.get(name, want) != want
        )
        unrecorded = tuple(name for name in printed if name not in recorded)
        differing += unrecorded
        if best is None or len(differing) <= best[0]:
            best = (len(differing), release, differing)
    if best is None:
        raise PatchError(f"no recorded vLLM release: {fingerprints.RECORD_PROBLEM or 'RELEASES is empty'}")
    _, closest, differing = best
    return ReleaseMatch(installed_version(), closest if not differing else None, closest, differing)
