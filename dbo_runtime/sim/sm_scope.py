"""SMControl's ``with`` form, for the simulator, graphs and tests; the plugin enters and exits in separate calls."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from dbo_runtime.core.budget import SMBudget
from dbo_runtime.services import sm_control
from dbo_runtime.services.sm_control import SMKnob


@dataclass(frozen=True)
class FunctionKnob:
    """An ``SMKnob`` around a plain setter."""

    name: str
    setter: Callable[[int], None]

    def set(self, num_sms: int) -> None:
        self.setter(num_sms)


class SMControl(sm_control.SMControl):
    @property
    def depth(self) -> int:
        return len(self._stack)

    @contextmanager
    def partition(
        self, budget: SMBudget, *, comm_knob: SMKnob | None = None, compute_knob: SMKnob | None = None
    ) -> Iterator[SMBudget]:
        token = self.enter(budget, comm_knob=comm_knob, compute_knob=compute_knob)
        try:
            yield budget
        finally:
            self.exit(token)
