"""The upstream reproducer's inputs: the committed prompt file is its generator's, and the repeat pass mixes
every prompt again with fresh ones (``tests/harness/engine_runner._repeat_mixed``, driven here by a recording stand-in for
``vllm.LLM``: boundary, no GPU in CI; GPU twin: the ``dp2w-repro-*`` runs of tests/e2e/test_width_2gpu.py)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from dbo_runtime.harness import runner
from dbo_runtime.harness.prompts import PromptSpec
from tests.e2e import reproducer
from tests.harness import engine_runner


def test_the_committed_prompts_are_the_generators() -> None:
    assert reproducer.PROMPTS.read_text() == reproducer.render(), "regenerate: python -m tests.e2e.reproducer"
    lengths = [len(p) for p in reproducer.prompts()]
    assert lengths == [64 * k + 1 for k in reproducer.KS]  # one token past whole 64-token blocks


class RecordingLLM:
    """What ``_repeat_mixed`` calls on ``vllm.LLM``: ``generate`` (recorded) and the plugin's counters."""

    def __init__(self) -> None:
        self.batches: list[list[Any]] = []
        self.builds = 0

    def generate(self, prompts: list[Any], params: Any, use_tqdm: bool = False) -> list[Any]:
        self.batches.append(prompts)
        self.builds += 3
        return [
            SimpleNamespace(outputs=[SimpleNamespace(token_ids=[1])], num_cached_tokens=len(p["prompt_token_ids"]) - 1 if len(p["prompt_token_ids"]) > 10 else 0)
            for p in prompts
        ]

    def collective_rpc(self, method: str, timeout: float = 0) -> list[dict[str, Any]]:
        return [{"summary": {"microbatched_builds": self.builds}}]


def test_the_repeat_pass_interleaves_every_prompt_with_fresh_ones(monkeypatch: Any) -> None:
    from dbo_runtime.integration import plugin

    monkeypatch.setattr(runner, "barrier", lambda *a: None)
    monkeypatch.setattr(plugin, "installed_patch_set", lambda: object())  # the counters answer
    llm = RecordingLLM()
    first = [{"prompt_token_ids": [i] * (64 * i + 1)} for i in (1, 2, 3)]
    out = engine_runner._repeat_mixed(llm, None, first, PromptSpec(num=4, min_len=10, max_len=10, seed=1), 4096, 0, 2)
    [mixed] = llm.batches
    assert mixed[0] == first[0] and mixed[2] == first[1] and mixed[4] == first[2]  # repeats at the head of each pair
    assert len(mixed) == 5 and all(len(p["prompt_token_ids"]) == 10 for p in (mixed[1], mixed[3]))  # rank 0's fresh half
    assert out["repeats"] == 3 and out["fresh"] == 2 and out["completed"] == 5 and out["microbatched_builds"] == 3
    assert out["repeat_cached_short_by"] == [1, 1, 1] and out["fresh_cached"] == [0, 0]
