"""Deterministic prompts: synthetic token ids (no tokenizer needed, the same on every rank and run, so
runs compare request by request) or an operator's prompt file."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dbo_runtime.core.errors import ConfigError

MAX_PROMPTS = 100_000
MAX_PROMPT_LEN = 1 << 20
"""Longest synthetic prompt: above any model's context, low enough to refuse a typo at once."""


@dataclass(frozen=True)
class PromptSpec:
    num: int = 64
    min_len: int = 300
    max_len: int = 2500
    seed: int = 0
    file: str | None = None

    def validate(self) -> None:
        if self.file is None:
            if not 1 <= self.num <= MAX_PROMPTS:
                raise ConfigError("--prompts", self.num, f"an integer in [1, {MAX_PROMPTS}]")
            if not 1 <= self.min_len <= self.max_len <= MAX_PROMPT_LEN:
                raise ConfigError("--prompt-len", f"{self.min_len}-{self.max_len}", f"MIN-MAX with 1 <= MIN <= MAX <= {MAX_PROMPT_LEN}")


def synthetic(spec: PromptSpec, vocab_size: int) -> list[dict[str, Any]]:
    rng = random.Random(spec.seed)
    out = []
    for _ in range(spec.num):
        n = rng.randint(spec.min_len, spec.max_len)
        out.append({"prompt_token_ids": [rng.randrange(2, vocab_size) for _ in range(n)]})
    return out


PROMPT_OBJECTS = (
    'objects with a non-empty "prompt_token_ids" list of non-negative integers, or a non-empty "prompt" text'
)


def from_file(path: str) -> list[dict[str, Any]]:
    """``.jsonl`` / ``.json`` (any case): one prompt object per line, or (``.json``) one JSON array of them; any
    other file: one text prompt per line. A token id must be an ``int`` proper: ``true`` would read as token 1."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeError) as exc:
        raise ConfigError("--prompt-file", path, f"a readable UTF-8 text file ({exc})") from None
    lines = [line.rstrip("\r") for line in text.split("\n") if line.strip()]  # U+2028 may sit in a prompt
    suffix = Path(path).suffix.lower()
    if suffix not in (".jsonl", ".json"):
        items: list[Any] = [{"prompt": line} for line in lines]
    else:
        try:
            whole = suffix == ".json" and text.lstrip().startswith("[")
            items = json.loads(text) if whole else [json.loads(line) for line in lines]
        except json.JSONDecodeError as exc:
            why = f"{PROMPT_OBJECTS}, one per line or in one array ({exc})"
            raise ConfigError("--prompt-file", path, why) from None
    out: list[dict[str, Any]] = []
    for number, item in enumerate(items, 1):
        ids, prompt = (item.get("prompt_token_ids"), item.get("prompt")) if isinstance(item, dict) else (None, None)
        if (ids is None) == (prompt is None):
            raise ConfigError("--prompt-file", path, f"{PROMPT_OBJECTS}, one of the two (prompt {number} is not)")
        if isinstance(ids, list) and ids and all(type(i) is int and i >= 0 for i in ids):
            out.append({"prompt_token_ids": ids})
        elif isinstance(prompt, str) and prompt:
            out.append({"prompt": prompt})
        else:
            raise ConfigError("--prompt-file", path, f"{PROMPT_OBJECTS} (prompt {number} is not)")
    if not 1 <= len(out) <= MAX_PROMPTS:
        raise ConfigError("--prompt-file", path, f"a file with 1 to {MAX_PROMPTS} prompts ({len(out)} here)")
    return out


def load(spec: PromptSpec, vocab_size: int) -> list[dict[str, Any]]:
    return from_file(spec.file) if spec.file is not None else synthetic(spec, vocab_size)


def for_rank(prompts: list[Any], rank: int, size: int) -> list[int]:
    """Indices of the prompts rank ``rank`` of ``size`` serves (round robin: equal loads keep DP ranks in step)."""
    return list(range(rank, len(prompts), size))
