"""``DBO_REQUIRE_GPU`` for the GPU and e2e suites: set, a test that cannot run here fails instead of
skipping. Read like every project switch, except that an unrecognised value is refused: a CI job that
misspells it would otherwise skip every GPU test and pass, the outcome the switch exists to prevent."""

from __future__ import annotations

from collections.abc import Mapping

from dbo_runtime.core.errors import ConfigError
from dbo_runtime.core.switches import ALLOWED, read_switch


def require_gpu(environ: Mapping[str, str] | None = None) -> bool:
    switch = read_switch("DBO_REQUIRE_GPU", environ)
    if not switch.recognised:
        raise ConfigError("DBO_REQUIRE_GPU", switch.raw, ALLOWED)
    return switch.on
