"""dbo_runtime's counters on vLLM's Prometheus endpoint: ``prometheus_client`` metrics in the worker, which vLLM's
API server exports in multiprocess mode like its own. The exporter subscribes to SMControl and moves the counters
once per DBO step (``exited``), never per layer."""

from __future__ import annotations

import threading
from typing import Any

from dbo_runtime.core.log import get_logger
from dbo_runtime.services.sm_control import BudgetEvent, SMControl

logger = get_logger(__name__)

PREFIX = "dbo_runtime_"
REPLAN_KINDS = ("call_site", "captured", "untracked")


class MetricsExporter:
    """Prometheus metrics for one process (``registry`` defaults to prometheus_client's global one)."""

    def __init__(self, registry: Any | None = None, cache: Any | None = None) -> None:
        from prometheus_client import REGISTRY, Counter, Gauge

        reg = REGISTRY if registry is None else registry
        labels = ("device",)
        self.partitions = Counter(PREFIX + "sm_partitions", "DBO steps run under an SM partition", labels, registry=reg)
        self.knob_switches = Counter(PREFIX + "sm_knob_switches", "SM knob applications (enter and restore)", labels, registry=reg)
        self.compute_sms = Gauge(
            PREFIX + "dbo_compute_sms", "Compute SMs of the announced DBO budget", labels, registry=reg, multiprocess_mode="mostrecent"
        )
        self.comm_sms = Gauge(
            PREFIX + "dbo_comm_sms", "Comm SMs of the announced DBO budget", labels, registry=reg, multiprocess_mode="mostrecent"
        )
        self.replans = Counter(
            PREFIX + "indexer_replans", "Paged-MQA schedule re-plans by where they ran", ("kind",), registry=reg
        )
        self.planned_ahead = Counter(PREFIX + "indexer_planned_ahead", "Schedules planned for the DBO count at build", registry=reg)
        self.warmups = Counter(PREFIX + "planner_warmups", "Planner kernels launched by warm-up (JIT outside steps)", registry=reg)
        self.jit_in_step = Counter(
            PREFIX + "planner_jit_in_step", "Planner variants first launched inside a step (compiled there unless cached)", registry=reg
        )
        self.jit_at_start = Counter(
            PREFIX + "planner_jit_at_start", "Planner variants first launched by vLLM's start-up runs (profile, warm-up, capture)", registry=reg
        )
        self._cache = cache
        self._last: dict[tuple[int, str | None], int] = {}
        self._children: dict[tuple[int, str | None], Any] = {}
        self._lock = threading.Lock()
        self._attached: set[int] = set()

    def attach(self, control: SMControl) -> None:
        """Subscribe to ``control`` once (replays the budgets announced so far)."""
        with self._lock:
            if id(control) in self._attached:
                return
            self._attached.add(id(control))
            # Create the labelled children now, so /metrics lists every series from model load on.
            device = str(control.device)
            self.partitions.labels(device)
            self.knob_switches.labels(device)
            for kind in REPLAN_KINDS:
                self.replans.labels(kind)
        control.subscribe(self.on_budget, name="prometheus_metrics")

    def _add(self, counter: Any, label: str | None, value: int) -> None:
        """Move ``counter`` (its ``label`` child) up to the running total ``value``; a zero delta touches nothing."""
        key = (id(counter), label)
        previous = self._last.get(key, 0)
        self._last[key] = value
        if value <= previous:
            return
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = counter if label is None else counter.labels(label)
        child.inc(value - previous)

    def on_budget(self, event: BudgetEvent) -> None:
        device = str(event.budget.device)
        if event.kind == "announced":
            self.compute_sms.labels(device).set(event.budget.compute)
            self.comm_sms.labels(device).set(event.budget.comm)
            return
        if event.kind != "exited":
            return
        with self._lock:
            stats = event.control.stats
            self._add(self.partitions, device, stats.partitions_entered)
            self._add(self.knob_switches, device, stats.switches)
            if self._cache is None:
                from dbo_runtime.services.schedule_cache import schedule_cache

                self._cache = schedule_cache()
            cache = self._cache.stats
            self._add(self.replans, "call_site", cache.replans)
            self._add(self.replans, "captured", cache.captured_replans)
            self._add(self.replans, "untracked", cache.untracked_replans)
            self._add(self.planned_ahead, None, cache.planned_ahead)
            self._add(self.warmups, None, cache.warmups)
            self._add(self.jit_in_step, None, cache.jit_in_step)
            self._add(self.jit_at_start, None, cache.jit_at_start)


_EXPORTER: MetricsExporter | None = None
_EXPORTER_LOCK = threading.Lock()


def export_to_prometheus(control: SMControl) -> MetricsExporter | None:
    """Attach the process's exporter to ``control`` (created on first use); None without prometheus_client."""
    global _EXPORTER
    with _EXPORTER_LOCK:
        if _EXPORTER is None:
            try:
                _EXPORTER = MetricsExporter()
            except ImportError:
                logger.info("dbo_runtime: prometheus_client not installed; metrics not exported")
                return None
        exporter = _EXPORTER
    exporter.attach(control)
    return exporter
