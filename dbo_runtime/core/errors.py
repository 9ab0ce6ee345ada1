"""Errors raised by dbo_runtime.

Every configuration error names the offending parameter, the value that was
given and the values that are allowed, because the operator sees it once, at
engine start, in a log that is usually far away from the flag they set.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Sequence


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


def did_you_mean(given: str, names: Iterable[str]) -> str:
    """`` (did you mean 'rocm'?)`` for the name of ``names`` that ``given`` differs from only in case, else the closest.

    The cutoff 0.8 keeps unrelated short names apart ('gpu' is not offered 'cpu'); a case-only difference is
    always offered, because a choice typed in capitals ('ROCM', 'ALL') is the commonest miss and scores low."""
    names = list(names)
    if given in names:
        return ""
    same_but_case = [n for n in names if n.lower() == given.lower()]
    close = same_but_case or difflib.get_close_matches(given, names, n=1, cutoff=0.8)
    return f" (did you mean {close[0]!r}?)" if close else ""


class ConfigError(DboRuntimeError, ValueError):
    """A parameter has a value dbo_runtime cannot run with: ``PARAMETER=VALUE is not allowed; allowed values: ...``."""

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


def ways_out(*, verified: Sequence[str] = (), also: str = "") -> str:
    """The ways out of every refusal, in one place. ``verified``: the vLLM releases dbo_runtime verifies, named
    where installing one of them would lift the refusal; ``also``: one more way, specific to the refusal."""
    ways = ["start without --enable-dbo or --ubatch-size (parallel_config.enable_dbo=False, ubatch_size=1)"]
    if also:
        ways.append(also)
    if verified:
        ways.append(f"install a vLLM release dbo_runtime verifies ({' or '.join(verified)}), or one that ships the upstream fix")
    ways.append("set DBO_RUNTIME_DISABLE=1 to accept vLLM's own DBO behaviour knowingly")
    return "Ways out: " + "; or ".join(ways) + "."
