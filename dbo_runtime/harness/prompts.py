"""Deterministic prompts: synthetic token ids (no tokenizer needed, the same on every rank and run, so
runs compare request by request) or an operator's prompt file.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dbo_runtime.core.errors import ConfigError, shown

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
    if vocab_size < 3:
        raise ConfigError("vocab_size", vocab_size, "at least 3 (ids 0 and 1 are left out)")
    rng = random.Random(spec.seed)
    out = []
    for _ in range(spec.num):
        n = rng.randint(spec.min_len, spec.max_len)
        out.append({"prompt_token_ids": [rng.randrange(2, vocab_size) for _ in range(n)]})
    return out


JSON_LINES_SUFFIXES = (".jsonl", ".json")
"""Prompt-file suffixes read as JSON lines, in any letter case; any other file is one text prompt per line."""
PROMPT_OBJECTS = (
    'objects with a non-empty "prompt_token_ids" list of non-negative integers (not true/false), or a non-empty "prompt" text'
)


class PromptFileLineError(ConfigError):
    """A refused line of a JSON-lines prompt file; the path stays as typed, the line number beside it."""

    def __init__(self, path: str, line: int, allowed: str, where: str = "line") -> None:
        super().__init__("--prompt-file", path, allowed)
        self.line = line
        self.args = (f"--prompt-file={shown(path)} {where} {line} is not allowed; allowed values: {allowed}",)


def _not_a_file(p: Path) -> str | None:
    """Why ``p`` cannot be a prompt file, in words about what it is; None for a regular file."""
    if not p.exists():
        return "an existing file (.jsonl/.json lines of prompt_token_ids/prompt objects, a .json array of them, or text lines)"
    if p.is_dir():
        return f"a regular file ({p} is a folder)"
    if not p.is_file():
        return f"a regular file ({p} is a device, pipe or socket, not a regular file)"
    return None


def from_file(path: str) -> list[dict[str, Any]]:
    """``.jsonl``/``.json``: one ``{"prompt_token_ids": [...]}`` or ``{"prompt": "..."}`` per line, or one
    JSON array of them; else one text prompt per line. A token id must be an ``int`` proper, not ``true``."""
    p = Path(path)
    problem = _not_a_file(p)
    if problem is not None:
        raise ConfigError("--prompt-file", path, problem)
    try:
        text = p.read_text(encoding="utf-8")
        lines = [line.rstrip("\r") for line in text.split("\n") if line.strip()]  # only \n ends a line: U+2028 may sit in a prompt
    except UnicodeDecodeError as exc:
        raise ConfigError("--prompt-file", path, f"a readable UTF-8 text file (byte {exc.start} is not UTF-8)") from exc
    except OSError as exc:
        raise ConfigError("--prompt-file", path, f"a readable UTF-8 text file (cannot be read: {exc.strerror or exc})") from exc
    if not lines:
        raise ConfigError("--prompt-file", path, "a file with at least one prompt (this one is empty or only blank lines)")
    items: list[tuple[int, Any]] = []
    where = "line"
    whole = _whole_json(text, path) if p.suffix.lower() == ".json" else None
    if len(whole if whole is not None else lines) > MAX_PROMPTS:  # prompts, not the lines a pretty-printed array spends
        raise ConfigError("--prompt-file", path, f"at most {MAX_PROMPTS} prompts")
    if whole is not None:  # a .json file that is one JSON document: an array of prompt objects (or one object)
        items, where = list(enumerate(whole, 1)), "item"
    elif p.suffix.lower() not in JSON_LINES_SUFFIXES:
        return [{"prompt": line} for line in lines]
    else:
        for number, line in enumerate(lines, 1):
            try:
                items.append((number, json.loads(line)))
            except json.JSONDecodeError as exc:
                one_document = " or, in a .json file, one JSON array of such objects" if p.suffix.lower() == ".json" else ""
                raise PromptFileLineError(path, number, f"one JSON object per line{one_document} ({exc.msg})") from exc
    out: list[dict[str, Any]] = []
    for number, item in items:
        ids = item.get("prompt_token_ids") if isinstance(item, dict) else None
        prompt = item.get("prompt") if isinstance(item, dict) else None
        if ids is not None and prompt is not None:
            raise PromptFileLineError(path, number, f"{PROMPT_OBJECTS}; one of the two, not both", where)
        if isinstance(ids, list) and ids and all(type(i) is int and i >= 0 for i in ids):
            out.append({"prompt_token_ids": ids})
        elif isinstance(prompt, str) and prompt:
            out.append({"prompt": prompt})
        else:
            raise PromptFileLineError(path, number, PROMPT_OBJECTS, where)
    if not out:
        raise ConfigError("--prompt-file", path, "a file with at least one prompt (this one is an empty JSON array)")
    return out


def _whole_json(text: str, path: str) -> list[Any] | None:
    """The prompts of a ``.json`` file that is one JSON document, or None where it is JSON lines; a file
    that opens an array and does not parse is reported where the parser stopped."""
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        if text.lstrip().startswith("["):
            raise PromptFileLineError(path, exc.lineno, f"one JSON array of prompt objects ({exc.msg}, column {exc.colno})") from exc
        return None
    return doc if isinstance(doc, list) else [doc]


def load(spec: PromptSpec, vocab_size: int) -> list[dict[str, Any]]:
    spec.validate()
    return from_file(spec.file) if spec.file is not None else synthetic(spec, vocab_size)


def for_rank(prompts: list[Any], rank: int, size: int) -> list[int]:
    """Indices of the prompts rank ``rank`` of ``size`` serves (round robin: equal loads keep DP ranks in step)."""
    return list(range(rank, len(prompts), size))
