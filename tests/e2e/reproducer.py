"""The upstream reproducer's prompts (vllm#60732's validation): random tokens of 64*k+1, repeated in full.

A prompt of 64*k+1 tokens whose exact repeat arrives later hits the prefix cache for 64*k tokens (whole blocks)
and leaves a one-token extend, scheduled at the head of a batch beside fresh long prefills: the mixed prefill +
short-extend step that decode-only runs never reach, where vanilla vLLM 0.33.0 crashed under DBO + DeepEP HT.
The file is generated (``python -m tests.e2e.reproducer``) and checked against this generator by a unit test.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

PROMPTS = Path(__file__).parent / "prompts" / "seed-reproducer.jsonl"
VOCAB = 4096
KS = tuple(range(1, 25))
"""64*k+1 tokens for k in 1..24: 65 to 1537 tokens."""
SEED = 60732


def prompts() -> list[list[int]]:
    rng = random.Random(SEED)
    return [[rng.randrange(2, VOCAB) for _ in range(64 * k + 1)] for k in KS]


def render() -> str:
    return "".join(json.dumps({"prompt_token_ids": ids}) + "\n" for ids in prompts())


if __name__ == "__main__":
    PROMPTS.parent.mkdir(parents=True, exist_ok=True)
    PROMPTS.write_text(render())
    print(f"wrote {len(KS)} prompts to {PROMPTS}")
