"""dbo_runtime's counters of one process, as one plain dict.

Why one snapshot: an operator (and the real-engine tests) must see, per worker,
that microbatched steps really happened and what the plugin did in them --
partitions, re-plans by kind, plan-ahead, warm-ups, top-k attachments, planners
recorded into CUDA graphs. Those counters live in three services; this module
only reads them (no vLLM import) and adds the one counter no service owns: the
microbatched metadata builds the runner hooks see, which is the only place that
also counts FULL-graph replays (a replay skips vLLM's SM-control context).
"""

from __future__ import annotations

import dataclasses
import os
import threading
from typing import Any


@dataclasses.dataclass
class StepCounters:
    microbatched_builds: int = 0
    """Metadata builds for a microbatched step (MRV1 ``ubatch_slices``; MRV2 ``UBatchRunner.prepare``).
    Includes vLLM's own dummy runs at start-up; compare two snapshots around a workload."""
    microbatched_capture_builds: int = 0
    """MRV2 ``prepare(for_capture=True)``: metadata for capturing a microbatched graph."""


_STEPS = StepCounters()
_STEPS_LOCK = threading.Lock()


def step_counters() -> StepCounters:
    return _STEPS


def count_microbatched_build(for_capture: bool = False) -> None:
    # Runs on the runner's main thread once per step; a lock keeps the count exact if a
    # runner ever builds from two threads.
    with _STEPS_LOCK:
        if for_capture:
            _STEPS.microbatched_capture_builds += 1
        else:
            _STEPS.microbatched_builds += 1


def collect() -> dict[str, Any]:
    """The services' counters of this process (services never used report zeros)."""
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


__all__ = ["StepCounters", "collect", "count_microbatched_build", "step_counters"]
