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
