"""The on/off switches, read one way everywhere. vLLM calls ``register()`` without a ``try``, so an
unrecognised value never raises; it reads as the choice that keeps the protection, reported in one line."""

from __future__ import annotations

import difflib
import os
from collections.abc import Mapping
from dataclasses import dataclass

from dbo_runtime.core.errors import ConfigError
from dbo_runtime.core.settings import LAYOUT_ENV, WARM_MAX_BATCH_ENV

ON = ("1", "true", "yes", "on")
OFF = ("0", "false", "no", "off", "")
SWITCHES = ("DBO_RUNTIME_DISABLE", "DBO_RUNTIME_STRICT", "DBO_RUNTIME_SELF_TIME")

UNRECOGNISED_READS_AS: dict[str, bool] = {
    "DBO_RUNTIME_DISABLE": False,
    "DBO_RUNTIME_STRICT": False,
    "DBO_RUNTIME_SELF_TIME": False,
}
"""How a value outside ``ON``/``OFF`` is read."""

ALLOWED = "'1', 'true', 'yes', 'on' (on); '0', 'false', 'no', 'off', '' (off); or not set (off); any case"

_EFFECT = {
    ("DBO_RUNTIME_DISABLE", True): "the plugin patches nothing and vLLM runs as without dbo_runtime",
    ("DBO_RUNTIME_DISABLE", False): "the plugin stays active: its fixes where verified, and its guard",
    ("DBO_RUNTIME_STRICT", True): "a fix that is not in force on this vLLM, or a failed install, raises at plugin load",
    ("DBO_RUNTIME_STRICT", False): "a fix that is not in force is logged; the guard refuses a DBO model that needs it",
    ("DBO_RUNTIME_SELF_TIME", True): "a bench harness that loads the self-timer times every patched call",
    ("DBO_RUNTIME_SELF_TIME", False): "the plugin's own time is not measured",
}


@dataclass(frozen=True)
class Switch:

    name: str
    raw: str | None
    on: bool
    recognised: bool

    @property
    def effect(self) -> str:
        return _EFFECT.get((self.name, self.on), "on" if self.on else "off")

    def problem(self) -> str:
        """The line shown for an unrecognised value ("" when recognised)."""
        if self.recognised:
            return ""
        return f"{ConfigError(self.name, self.raw, ALLOWED)}; read as {'on' if self.on else 'off'}: {self.effect}"


def read_switch(name: str, environ: Mapping[str, str] | None = None) -> Switch:
    """Read ``name``; never raises."""
    raw = (os.environ if environ is None else environ).get(name)
    value = "" if raw is None else raw.strip().lower()
    if value in ON:
        return Switch(name, raw, True, True)
    if value in OFF:
        return Switch(name, raw, False, True)
    return Switch(name, raw, UNRECOGNISED_READS_AS.get(name, False), False)


def parse_switch(name: str, environ: Mapping[str, str] | None = None) -> bool:
    """Whether the switch is in force."""
    return read_switch(name, environ).on


PREFIX = "DBO_RUNTIME_"
NAMES = (*SWITCHES, LAYOUT_ENV, WARM_MAX_BATCH_ENV)
"""Every environment variable the plugin reads under its prefix."""


VLLM_PREFIX = "VLLM_DBO_"
VLLM_NAMES = ("VLLM_DBO_COMM_SMS",)
"""vLLM's DBO variables."""


def unknown_names(environ: Mapping[str, str] | None = None) -> list[str]:
    """One line per ``DBO_RUNTIME_*`` / ``VLLM_DBO_*`` name (any case) nobody reads: a misspelt DISABLE
    would leave every patch installed."""
    env = os.environ if environ is None else environ
    lines = []
    for name in sorted(env):
        upper = name.upper()
        for prefix, known, owner in ((PREFIX, NAMES, "a dbo_runtime setting"), (VLLM_PREFIX, VLLM_NAMES, "a vLLM setting")):
            if not upper.startswith(prefix) or name in known:
                continue
            # without the shared prefix, which makes every name look close
            close = difflib.get_close_matches(upper[len(prefix) :], [n[len(prefix) :] for n in known], n=1, cutoff=0.75)
            hint = f"did you mean {prefix}{close[0]}? " if close else ""
            lines.append(f"{name} is not {owner} and is ignored ({hint}allowed names: {', '.join(known)})")
    return lines


def switch_problems(environ: Mapping[str, str] | None = None) -> list[str]:
    """One line per unrecognised switch value or unread name."""
    values = [s.problem() for s in (read_switch(name, environ) for name in SWITCHES) if not s.recognised]
    return values + unknown_names(environ)
