"""The windows layout's one bound: vLLM's padded decode path writes ``B x next_n`` top-k rows per microbatch,
which can pass a window's end. ``window_end_reachable`` is checked here against vLLM 0.33.0's own microbatch
slicing (``maybe_create_ubatch_slices``): whenever a microbatch after the first needs more rows than its window
holds, the rule must have said so."""

from __future__ import annotations

import random
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from dbo_runtime.integration import topk_hooks
from dbo_runtime.services.topk_state import UbatchTopkState, window_end_reachable


def test_the_rule_covers_every_short_window_of_vllms_slicing() -> None:
    from vllm.v1.worker.ubatch_utils import maybe_create_ubatch_slices

    rng = random.Random(7)
    short = 0
    for _ in range(20000):
        m, q = rng.randint(16, 1024), rng.randint(2, 4)
        seqs = rng.randint(2, m)
        graph = rng.randint(2, m) if rng.random() < 0.5 else 0  # the largest FULL-graph capture size, or eager
        n_req = rng.randint(2, seqs)
        lens = [q if rng.random() < 0.9 else rng.randint(1, q) for _ in range(n_req)]  # short: a prefill tail
        total = sum(lens)
        if total > (graph or m):
            continue
        padded = rng.randint(total, graph or m)
        reqs = rng.randint(n_req, max(n_req, padded // q)) if graph else n_req  # graphs pad whole requests
        _, slices = maybe_create_ubatch_slices(True, np.array(lens), padded, reqs, 2)
        assert slices is not None
        second = slices[1]
        need = (second.request_slice.stop - second.request_slice.start) * q
        if need > m - second.token_slice.start:
            short += 1
            assert window_end_reachable(max(seqs * q, graph), m, q, 2), (m, q, seqs, graph, lens, padded, reqs)
    assert short > 50  # the sweep does reach short windows: the rule was tested where it matters


@pytest.mark.parametrize(
    ("seqs", "tokens", "spec", "graphs", "moe_freq", "reachable"),
    [
        (255, 1020, 3, None, 1, True),  # the reviewer's case: 1020 rows of decode, 510 after the split
        (256, 8192, 1, None, 1, False),  # DeepSeek MTP-1 at vLLM's defaults
        (256, 8192, 1, [512, 1024, 8192], 1, True),  # a FULL-graph capture size past half the step
        (1024, 1024, 0, None, 2, False),  # no speculative tokens: one row per token
        (256, 8192, 1, None, 2, True),  # dense layers between MoE layers: padding can land on live rows
    ],
)
def test_the_hook_reads_the_engine_config(
    seqs: int, tokens: int, spec: int, graphs: list[int] | None, moe_freq: int, reachable: bool
) -> None:
    class Mode:
        def has_full_cudagraphs(self) -> bool:
            return graphs is not None

    config: Any = SimpleNamespace(
        scheduler_config=SimpleNamespace(max_num_seqs=seqs, max_num_batched_tokens=tokens),
        speculative_config=SimpleNamespace(num_speculative_tokens=spec) if spec else None,
        compilation_config=SimpleNamespace(cudagraph_mode=Mode(), cudagraph_capture_sizes=graphs or [8]),
        model_config=SimpleNamespace(hf_text_config=SimpleNamespace(n_routed_experts=256, moe_layer_freq=moe_freq)),
    )
    state = UbatchTopkState(lambda: (0, 0))
    topk_hooks._check_window_end(state, config, 2)
    assert (state.windows_too_short is not None) == reachable
    unreadable = UbatchTopkState(lambda: (0, 0))
    topk_hooks._check_window_end(unreadable, SimpleNamespace(), 2)
    assert unreadable.windows_too_short is not None and "could not be read" in unreadable.windows_too_short


def test_padded_decode_rows_counts_graph_padding_and_caps_at_the_step() -> None:
    from dbo_runtime.integration.engine_config import padded_decode_rows

    assert padded_decode_rows(256, 2, 8192) == 512  # eager: next_n rows per request
    assert padded_decode_rows(256, 2, 8192, largest_full_graph=1024) == 1024  # graphs pad whole requests up to it
    assert padded_decode_rows(4096, 4, 8192) == 8192  # never more than a step holds
