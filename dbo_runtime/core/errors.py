"""Errors raised by dbo_runtime; a configuration error names the parameter, value and allowed values."""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Sequence


class DboRuntimeError(RuntimeError):
    """Raised on purpose."""


def shown(value: object) -> str:
    """A number bare, text quoted (an empty value stays visible)."""
    if isinstance(value, str) and value == value.strip() and value:
        try:
            float(value)
        except ValueError:
            return repr(value)
        return value
    return repr(value)


def did_you_mean(given: str, names: Iterable[str]) -> str:
    """`` (did you mean 'rocm'?)``: a case-only match, else the closest."""
    names = list(names)
    if given in names:
        return ""
    same_but_case = [n for n in names if n.lower() == given.lower()]
    close = same_but_case or difflib.get_close_matches(given, names, n=1, cutoff=0.8)
    return f" (did you mean {close[0]!r}?)" if close else ""


class ConfigError(DboRuntimeError, ValueError):
    """``PARAMETER=VALUE is not allowed; allowed values: ...``."""

    def __init__(self, parameter: str, value: object, allowed: str | Iterable[object]) -> None:
        hint = ""
        if not isinstance(allowed, str):
            allowed = list(allowed)
            if isinstance(value, str) and all(isinstance(a, str) for a in allowed):
                hint = did_you_mean(value, [str(a) for a in allowed])
            allowed = ", ".join(repr(a) for a in allowed)
        self.parameter = parameter
        self.value = value
        self.allowed = allowed
        super().__init__(f"{parameter}={shown(value)} is not allowed; allowed values: {allowed}{hint}")


class PatchError(DboRuntimeError):
    """Nothing was left applied."""


class UnsupportedConfiguration(DboRuntimeError):
    """A configuration refused rather than run silently wrong."""


class DboRefusal(UnsupportedConfiguration):
    """A needed fix is not in force."""


class MicrobatchFailure(DboRuntimeError):
    """Failures on microbatch threads, raised after the join."""

    def __init__(self, failures: list[tuple[str, int, BaseException]], also: BaseException | None = None) -> None:
        self.failures = failures
        self.also = also
        where, ubatch, first = failures[0]
        more = f" (+{len(failures) - 1} more failure(s) in this step)" if len(failures) > 1 else ""
        then = f" vLLM then raised: {also!r}." if also is not None else ""
        super().__init__(
            f"dbo_runtime: {where} failed on DBO microbatch {ubatch}: {first!r}{more}. The microbatch finished "
            "the step with a placeholder so that its partner thread and the other DP ranks were not left "
            f"waiting; the step then raises this error, which stops vLLM's engine core.{then}"
        )
        # __cause__ hides __context__: name vLLM's error here.
        self.__cause__ = first


def ways_out(*, verified: Sequence[str] = (), also: str = "") -> str:
    """The ways out of every refusal; ``verified`` names releases that lift it, ``also`` adds one more way."""
    ways = ["start without --enable-dbo or --ubatch-size (parallel_config.enable_dbo=False, ubatch_size=1)"]
    if also:
        ways.append(also)
    if verified:
        ways.append(f"install a vLLM release dbo_runtime verifies ({' or '.join(verified)}), or one that ships the upstream fix")
    ways.append("set DBO_RUNTIME_DISABLE=1 to accept vLLM's own DBO behaviour knowingly")
    return "Ways out: " + "; or ".join(ways) + "."
