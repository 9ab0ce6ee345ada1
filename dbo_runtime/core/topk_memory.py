"""Which layers of a DSA model run the indexer (the leaders) and which read a leader's top-k (the followers)."""

from __future__ import annotations

from dbo_runtime.core.coverage import v32_followers
from dbo_runtime.core.errors import ConfigError


def index_leaders(
    num_layers: int,
    index_topk_freq: int = 1,
    index_skip_topk_offset: int = 2,
    index_topk_pattern: str | None = None,
) -> list[bool]:
    """Which layers run the indexer."""
    if index_topk_freq < 1:
        raise ConfigError("index_topk_freq", index_topk_freq, "an integer >= 1")
    config = {
        "num_hidden_layers": num_layers,
        "index_topk_freq": index_topk_freq,
        "index_skip_topk_offset": index_skip_topk_offset,
        "index_topk_pattern": index_topk_pattern,
    }
    followers = set(v32_followers(config))
    return [layer not in followers for layer in range(num_layers)]
