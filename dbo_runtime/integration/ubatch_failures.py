"""Failures of dbo_runtime code on a DBO microbatch thread: recorded there, raised on the main thread later.
vLLM does not wake the partner when one microbatch thread dies, so patches that run there are shielded: a failure
is recorded, the call falls back, and ``ubatch_guard``'s join points raise it."""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from dbo_runtime.core.errors import MicrobatchFailure
from dbo_runtime.core.log import get_logger
from dbo_runtime.integration import ubatch_ids
from dbo_runtime.integration.ubatch_ids import THREAD_TABLE

logger = get_logger(__name__)


@dataclass
class UbatchFailures:
    """Failures recorded on microbatch threads since the last join check."""

    pending: list[tuple[str, int, BaseException]] = field(default_factory=list)
    recorded_total: int = 0
    by_where: dict[str, int] = field(default_factory=dict)
    _logged: set[str] = field(default_factory=set)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def record(self, where: str, exc: BaseException) -> bool:
        """Record ``exc`` on a microbatch thread; False means "re-raise it"."""
        ubatch = ubatch_ids.ubatch_thread_id()
        if ubatch is None:
            return False
        with self._lock:
            self.pending.append((where, ubatch, exc))
            self.recorded_total += 1
            self.by_where[where] = self.by_where.get(where, 0) + 1
            first = where not in self._logged
            self._logged.add(where)
        try:
            if first:
                logger.error(
                    "dbo_runtime: %s failed on DBO microbatch %d (%r); continuing the microbatch with a "
                    "placeholder so no thread is left waiting, and raising on the main thread after the join",
                    where, ubatch, exc, exc_info=exc,
                )
            else:
                logger.debug("dbo_runtime: %s failed again on DBO microbatch %d: %r", where, ubatch, exc)
        except Exception:
            pass
        return True

    def take(self) -> list[tuple[str, int, BaseException]]:
        with self._lock:
            taken, self.pending = self.pending, []
        return taken

    def raise_pending(self, also: BaseException | None = None) -> None:
        """After the join: raise what the microbatches recorded."""
        if self.pending:
            taken = self.take()
            if taken:
                raise MicrobatchFailure(taken, also)


FAILURES = UbatchFailures()


def record(where: str, exc: BaseException) -> bool:
    """``FAILURES.record``."""
    try:
        return FAILURES.record(where, exc)
    except Exception:
        return False


SHIELDS_ITSELF = "__dbo_runtime_shields_itself__"


def shields_itself(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Mark ``fn`` as shielding itself: it catches ``Exception``, calls ``record`` and falls back."""
    setattr(fn, SHIELDS_ITSELF, True)
    return fn


def shield(fn: Callable[..., Any], fallback: Callable[..., Any], where: str) -> Callable[..., Any]:
    """``fn`` that records a failure on a microbatch thread and returns ``fallback(*args, **kwargs)``."""

    @functools.wraps(fn)
    def shielded(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except Exception as exc:
            if not record(where, exc):
                raise
            return fallback(*args, **kwargs)

    return shielded


class MicrobatchAttr:
    """An instance attribute as a class data descriptor that resolves the calling microbatch's value; it shields
    its own ``__get__`` (a wrapper would cost a call per access)."""

    where = "microbatch attribute"

    def __init__(self, name: str) -> None:
        self.name = name

    def resolve(self, obj: Any, value: Any) -> Any:
        return value

    def __get__(self, obj: Any, objtype: type | None = None) -> Any:
        if obj is None:
            return self
        try:
            value = obj.__dict__[self.name]
        except KeyError:
            raise AttributeError(self.name) from None
        table = THREAD_TABLE
        if table and not table[0]:
            return value
        try:
            return self.resolve(obj, value)
        except Exception as exc:
            if not record(self.where, exc):
                raise
            return value

    def __set__(self, obj: Any, value: Any) -> None:
        obj.__dict__[self.name] = value

    def __delete__(self, obj: Any) -> None:
        try:
            del obj.__dict__[self.name]
        except KeyError:
            raise AttributeError(self.name) from None
