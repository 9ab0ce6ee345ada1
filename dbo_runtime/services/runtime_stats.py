"""dbo_runtime's counters of one process as one dict: the services' counters (no vLLM import) and the
microbatched metadata builds, the only count that includes FULL-graph replays."""

from __future__ import annotations

import dataclasses
import os
import threading
from typing import Any


@dataclasses.dataclass
class StepCounters:
    microbatched_builds: int = 0
    """Microbatched metadata builds, start-up dummy runs included."""
    microbatched_capture_builds: int = 0
    """Metadata builds for capturing a microbatched graph."""


_STEPS = StepCounters()
_STEPS_LOCK = threading.Lock()


def count_microbatched_build(for_capture: bool = False) -> None:
    with _STEPS_LOCK:
        if for_capture:
            _STEPS.microbatched_capture_builds += 1
        else:
            _STEPS.microbatched_builds += 1


def collect() -> dict[str, Any]:
    """This process's counters (unused services report zeros)."""
    from dbo_runtime.services.schedule_cache import schedule_cache
    from dbo_runtime.services.sm_control import existing_controls

    controls = {}
    for device, control in sorted(existing_controls().items()):
        stats = control.stats
        controls[str(device)] = {
            "total_sms": control.total_sms,
            "announced": [b.describe() for b in control.announced],
            "announced_compute_sms": [b.compute for b in control.announced],
            "announced_comm_sms": [b.comm for b in control.announced],
            "partitions_entered": stats.partitions_entered,
            "partition_seconds": stats.partition_seconds,
            "knob_switches": stats.switches,
            "subscriber_errors": stats.subscriber_errors,
        }
    with _STEPS_LOCK:
        steps = dataclasses.asdict(_STEPS)
    return {
        "pid": os.getpid(),
        "sm_control": controls,
        "schedule_cache": dataclasses.asdict(schedule_cache().stats),
        "steps": steps,
    }
