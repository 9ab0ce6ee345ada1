"""Emulated vLLM builds: the vLLM 0.33.0 sources dbo_runtime fingerprints, with edits.

Not a fake of vLLM's behaviour: the real vLLM 0.33.0 stays imported and patched. Only the text that
``dbo_runtime.integration.fingerprints`` reads from vLLM's files is edited, which is exactly what another
build (a development build with an upstream fix, a moved target) looks like to the plugin's verification.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from dbo_runtime.integration import fingerprints


@contextmanager
def edited_sources(edits: dict[str, Callable[[str], str]]) -> Iterator[None]:
    """Within the block, ``read_source(module)`` returns ``edits[module](real text)`` for the edited modules."""
    real = fingerprints.read_source.__wrapped__  # the uncached reader of the installed files

    @functools.lru_cache(maxsize=64)
    def read(module: str) -> str | None:
        text = real(module)
        edit = edits.get(module)
        return edit(text) if edit is not None and text is not None else text

    original = fingerprints.read_source
    fingerprints.clear_caches()
    fingerprints.read_source = read  # type: ignore[assignment]
    try:
        yield
    finally:
        fingerprints.read_source = original  # type: ignore[assignment]
        fingerprints.clear_caches()


def replace_once(old: str, new: str) -> Callable[[str], str]:
    def edit(text: str) -> str:
        assert old in text, f"{old!r} is not in the vLLM 0.33.0 source: the emulation is stale"
        return text.replace(old, new, 1)

    return edit


def in_turn(*edits: Callable[[str], str]) -> Callable[[str], str]:
    """Several edits of one module, applied in order."""

    def edit(text: str) -> str:
        for one in edits:
            text = one(text)
        return text

    return edit


UPSTREAM_60732: dict[str, Callable[[str], str]] = {
    "vllm.v1.attention.backends.mla.indexer": replace_once(
        "    indices: torch.Tensor | None = None\n\n\n@dataclass\nclass DeepseekV32IndexerMetadata:",
        "    indices: torch.Tensor | None = None\n    schedule_num_sms: int = 0\n\n"
        "    def get_schedule_metadata(self) -> torch.Tensor:\n        return self.schedule_metadata\n\n\n"
        "@dataclass\nclass DeepseekV32IndexerMetadata:",
    ),
    "vllm.model_executor.layers.sparse_attn_indexer": replace_once(
        "                decode_metadata.block_table,\n                decode_metadata.schedule_metadata,\n"
        "                max_model_len=max_model_len,",
        "                decode_metadata.block_table,\n                decode_metadata.get_schedule_metadata(),\n"
        "                max_model_len=max_model_len,",
    ),
}
"""vllm#60732 as it lands: the decode metadata re-plans (``get_schedule_metadata``) and the call site asks it."""

TOPK_60734_PARTS = (
    replace_once(
        "self, logical_topk_indices: torch.Tensor, max_decode_rows: int | None = None\n",
        "self, logical_topk_indices: torch.Tensor, max_decode_rows: int | None = None, num_ubatches: int = 1\n",
    ),
    replace_once("    def _convert_once(", "    def _topk_state(self):\n        return self\n\n    def _convert_once("),
    replace_once(
        "    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:\n        num_tokens = logical_topk_indices.shape[0]\n",
        "    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:\n        self._topk_state()\n"
        "        num_tokens = logical_topk_indices.shape[0]\n",
    ),
)
"""vllm#60734's three parts: the builder takes ``num_ubatches``, the group defines ``_topk_state``, and calls it."""

UPSTREAM_60734: dict[str, Callable[[str], str]] = {"vllm.v1.attention.backends.mla.index_group": in_turn(*TOPK_60734_PARTS)}
