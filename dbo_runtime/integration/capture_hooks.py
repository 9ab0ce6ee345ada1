"""Count torch CUDA-graph captures so the indexer call site can skip a 300-650 ns capture probe.

Upstream target: ``torch.cuda.graphs.CUDAGraph.capture_begin`` / ``capture_end``
(the Python layer every ``torch.cuda.graph(...)`` capture goes through; vLLM
0.33.0 captures FULL DBO graphs with it in ``UBatchWrapper._capture_ubatches``
and MRV2's ``CudaGraphManager``). See ``dbo_runtime.adapters.cuda_graph.CaptureCounter``.
Not a vLLM patch, but installed and removed in the same transaction.
"""

from __future__ import annotations

from dbo_runtime.adapters.cuda_graph import (
    counting_capture_begin,
    counting_capture_end,
    counting_installed,
    counting_uninstalled,
)
from dbo_runtime.integration.features import Feature
from dbo_runtime.integration.patching import Patch

FEATURES = [Feature("torch", "CUDA-graph capture counter")]

_COMMON = dict(
    reason=(
        "torch.cuda.is_current_stream_capturing() costs 300-650 ns on an H200 host; a process-wide capture "
        "counter lets the indexer call site skip it when no capture is underway"
    ),
    upstream_pr="none (torch has no cheap capture-in-progress flag)",
    removal="torch exposes a cheap process-wide capture flag, or vLLM re-plans inside its own call site",
    anchors=(),  # torch's capture_begin/end are wrapped through unchanged: no vLLM code relied on
)


def patches() -> list[Patch]:
    return [
        Patch(
            name="torch.capture_begin",
            module="torch.cuda.graphs",
            attr="CUDAGraph.capture_begin",
            make=counting_capture_begin,
            on_install=counting_installed,
            on_uninstall=counting_uninstalled,
            **_COMMON,  # type: ignore[arg-type]
        ),
        Patch(
            name="torch.capture_end",
            module="torch.cuda.graphs",
            attr="CUDAGraph.capture_end",
            make=counting_capture_end,
            **_COMMON,  # type: ignore[arg-type]
        ),
    ]
