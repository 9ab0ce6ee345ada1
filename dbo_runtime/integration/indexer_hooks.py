"""Indexer schedule-cache hooks (issue 3). Filled in by the indexer work."""

from __future__ import annotations

from dbo_runtime.integration.patching import Patch


def patches() -> list[Patch]:
    return []
