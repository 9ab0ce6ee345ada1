"""Boolean environment switches, parsed strictly.

``DBO_RUNTIME_DISABLE=ture`` silently meaning "off" would patch vLLM while the
operator believes it untouched; every switch therefore accepts only the usual
spellings and anything else is one ``ConfigError`` naming the variable.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from dbo_runtime.core.errors import ConfigError

TRUE = ("1", "true", "yes", "on")
FALSE = ("", "0", "false", "no", "off")
SWITCHES = ("DBO_RUNTIME_DISABLE", "DBO_RUNTIME_STRICT")


def parse_switch(name: str, environ: Mapping[str, str] | None = None) -> bool:
    raw = (os.environ if environ is None else environ).get(name, "")
    value = raw.strip().lower()
    if value in TRUE:
        return True
    if value in FALSE:
        return False
    raise ConfigError(name, raw, [*TRUE, *FALSE[1:], "unset"])
