"""The comm SM knob: vLLM's all2all manager, so that its clamp applies."""

from __future__ import annotations

from typing import Any


class All2AllKnob:

    def __init__(self, manager: Any) -> None:
        self.manager = manager
        self.name = f"{type(manager).__name__}.set_num_sms"

    def set(self, num_sms: int) -> None:
        self.manager.set_num_sms(num_sms)
