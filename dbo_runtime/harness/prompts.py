"""Deterministic prompts: synthetic token ids by default, or an operator's prompt file.

Synthetic ids need no tokenizer (the tiny test models have none) and are the
same on every rank and every run, so two runs can be compared request by
request. Ids start at 2 to stay clear of the usual BOS/EOS ids 0 and 1.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dbo_runtime.core.errors import ConfigError

MAX_PROMPTS = 100_000
MAX_PROMPT_LEN = 1 << 20
"""Longest synthetic prompt (tokens), tune's ``--prompt-len`` bound too: above any model's context, low enough that a
typo (``256-10240000``) is refused at once instead of drawing billions of ids in Python after the engine started."""


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
    if vocab_size < 3:
        raise ConfigError("vocab_size", vocab_size, "at least 3 (ids 0 and 1 are left out)")
    rng = random.Random(spec.seed)
    out = []
    for _ in range(spec.num):
        n = rng.randint(spec.min_len, spec.max_len)
        out.append({"prompt_token_ids": [rng.randrange(2, vocab_size) for _ in range(n)]})
    return out


def from_file(path: str) -> list[dict[str, Any]]:
    """``.jsonl``: one ``{"prompt_token_ids": [...]}`` or ``{"prompt": "..."}`` per line; else one text prompt per line."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError("--prompt-file", path, "an existing file (.jsonl of prompt_token_ids/prompt, or text lines)")
    try:
        lines = [line for line in p.read_text(encoding="utf-8").splitlines() if line.strip()]
    except UnicodeDecodeError as exc:
        raise ConfigError("--prompt-file", path, f"a readable UTF-8 text file (byte {exc.start} is not UTF-8)") from exc
    except OSError as exc:
        raise ConfigError("--prompt-file", path, f"a readable UTF-8 text file (cannot be read: {exc.strerror or exc})") from exc
    if not lines:
        raise ConfigError("--prompt-file", path, "a file with at least one prompt")
    if len(lines) > MAX_PROMPTS:
        raise ConfigError("--prompt-file", path, f"at most {MAX_PROMPTS} prompts")
    if p.suffix != ".jsonl":
        return [{"prompt": line} for line in lines]
    out: list[dict[str, Any]] = []
    for number, line in enumerate(lines, 1):
        try:
            item = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ConfigError("--prompt-file", f"{path}:{number}", f"one JSON object per line ({exc.msg})") from exc
        ids = item.get("prompt_token_ids") if isinstance(item, dict) else None
        text = item.get("prompt") if isinstance(item, dict) else None
        if isinstance(ids, list) and ids and all(isinstance(i, int) and i >= 0 for i in ids):
            out.append({"prompt_token_ids": ids})
        elif isinstance(text, str) and text:
            out.append({"prompt": text})
        else:
            raise ConfigError(
                "--prompt-file", f"{path}:{number}", 'objects with "prompt_token_ids" (non-negative ints) or "prompt" (text)'
            )
    return out


def load(spec: PromptSpec, vocab_size: int) -> list[dict[str, Any]]:
    spec.validate()
    return from_file(spec.file) if spec.file is not None else synthetic(spec, vocab_size)


def for_rank(prompts: list[Any], rank: int, size: int) -> list[int]:
    """Indices of the prompts rank ``rank`` of ``size`` serves (round robin: equal loads keep DP ranks in step)."""
    return list(range(rank, len(prompts), size))


__all__ = ["PromptSpec", "for_rank", "from_file", "load", "synthetic"]
