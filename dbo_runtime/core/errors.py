"""Errors raised by dbo_runtime.

Every configuration error names the offending parameter, the value that was
given and the values that are allowed, because the operator sees it once, at
engine start, in a log that is usually far away from the flag they set.
"""

from __future__ import annotations

from collections.abc import Iterable


class DboRuntimeError(RuntimeError):
    """Base class for every error dbo_runtime raises on purpose."""


def shown(value: object) -> str:
    """A refused value as an error line shows it: a number bare, anything else in Python's quotes.

    Why one rule: a flag or a variable arrives as text, and a check made after parsing holds a number, so
    ``repr`` alone would quote one flag two ways (``--total-sms='0'`` refused while parsing, ``--total-sms=10``
    refused by the split). A number reads the same typed or parsed and is shown bare, as most refusals already
    showed it; text keeps its quotes, so an empty value, a stray space or a word is still visible as typed."""
    if isinstance(value, str) and value == value.strip() and value:
        try:
            float(value)
        except ValueError:
            return repr(value)
        return value
    return repr(value)


class ConfigError(DboRuntimeError, ValueError):
    """A parameter has a value dbo_runtime cannot run with: ``PARAMETER=VALUE is not allowed; allowed values: ...``."""

    def __init__(self, parameter: str, value: object, allowed: str | Iterable[object]) -> None:
        if not isinstance(allowed, str):
            allowed = ", ".join(repr(a) for a in allowed)
        self.parameter = parameter
        self.value = value
        self.allowed = allowed
        super().__init__(f"{parameter}={shown(value)} is not allowed; allowed values: {allowed}")


class PatchError(DboRuntimeError):
    """The vLLM patch set could not be installed; nothing was left applied."""


class UnsupportedConfiguration(DboRuntimeError):
    """A vLLM configuration that dbo_runtime refuses rather than run silently wrong."""


class DboRefusal(UnsupportedConfiguration):
    """A DBO configuration that needs a dbo_runtime fix which is not in force: engine start stops.

    The message is one line: the architecture, the cause and the ways out.
    """


class MicrobatchFailure(DboRuntimeError):
    """dbo_runtime code failed on a DBO microbatch thread; raised on the main thread after the join.

    ``failures`` lists ``(where, microbatch id, exception)`` in the order they
    were recorded; ``__cause__`` is the first exception (its traceback is the
    failing microbatch's).
    """

    def __init__(self, failures: list[tuple[str, int, BaseException]], also: BaseException | None = None) -> None:
        self.failures = failures
        self.also = also
        where, ubatch, first = failures[0]
        more = f" (+{len(failures) - 1} more failure(s) in this step)" if len(failures) > 1 else ""
        then = f" vLLM then raised: {also!r}." if also is not None else ""
        super().__init__(
            f"dbo_runtime: {where} failed on DBO microbatch {ubatch}: {first!r}{more}. The microbatch finished "
            "the step with a placeholder so that its partner thread and the other DP ranks were not left "
            f"waiting; this step's output is discarded.{then}"
        )
        # __cause__ makes Python's traceback printer skip __context__: vLLM's own error (``also``)
        # is therefore named in the message, not only chained.
        self.__cause__ = first
