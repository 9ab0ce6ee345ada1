"""Per-microbatch top-k hooks (issue 4). Filled in by the top-k work."""

from __future__ import annotations

from dbo_runtime.integration.patching import Patch


def patches() -> list[Patch]:
    return []
