"""The comm-side SM knob: vLLM's all2all manager.

vLLM 0.33.0's ``DeepEPHTAll2AllManager.set_num_sms`` clamps the request to the
20 SMs its buffers were sized for and calls DeepEP's static
``Buffer.set_num_sms``, which asserts an even count; the base manager's
``set_num_sms`` is a no-op. We call the manager, never DeepEP directly, so the
clamp stays vLLM's.
"""

from __future__ import annotations

from typing import Any


class All2AllKnob:
    """``SMKnob`` around ``all2all_manager.set_num_sms``."""

    def __init__(self, manager: Any) -> None:
        self.manager = manager
        self.name = f"{type(manager).__name__}.set_num_sms"

    def set(self, num_sms: int) -> None:
        self.manager.set_num_sms(num_sms)
