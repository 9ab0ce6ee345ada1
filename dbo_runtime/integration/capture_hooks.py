"""Count torch CUDA-graph captures (``CUDAGraph.capture_begin``/``end``) so the indexer call site can skip
the precise capture probe (``adapters.cuda_graph.CaptureCounter``); installed in the plugin's transaction."""

from __future__ import annotations

from dbo_runtime.adapters import cuda_graph
from dbo_runtime.integration.features import Feature
from dbo_runtime.integration.patching import Patch

FEATURES = [Feature("torch", "CUDA-graph capture counter")]

_COMMON = dict(
    reason=(
        "torch.cuda.is_current_stream_capturing() is a driver query on every indexer call; a process-wide "
        "capture counter lets the call site skip it when no capture is underway"
    ),
    upstream_pr="none (torch has no cheap capture-in-progress flag)",
    removal="torch exposes a cheap process-wide capture flag, or vLLM re-plans inside its own call site",
    anchors=(),
)


def patches() -> list[Patch]:
    return [
        Patch(
            name="torch.capture_begin",
            module="torch.cuda.graphs",
            attr="CUDAGraph.capture_begin",
            make=cuda_graph.counting_capture_begin,
            on_install=cuda_graph.counting_installed,
            on_uninstall=cuda_graph.counting_uninstalled,
            **_COMMON,  # type: ignore[arg-type]
        ),
        Patch(
            name="torch.capture_end",
            module="torch.cuda.graphs",
            attr="CUDAGraph.capture_end",
            make=cuda_graph.counting_capture_end,
            **_COMMON,  # type: ignore[arg-type]
        ),
    ]
