"""The suite's collector set-up (``tests/conftest.py``) freezes only what is alive."""

from __future__ import annotations

import gc
import weakref

from tests import conftest


class _Node:
    cycle: object = None


def test_collection_freeze_leaves_no_garbage_uncollectable() -> None:
    """Garbage in a reference cycle when collection ends (a module's import-time leftovers) is collected, not
    frozen for the whole session, where no later ``gc.collect()`` could reach it."""
    was_enabled = gc.isenabled()
    gc.disable()  # no automatic collection between the drop and the freeze
    try:
        node = _Node()
        node.cycle = node
        ref = weakref.ref(node)
        del node
        conftest.pytest_collection_finish(None)  # type: ignore[arg-type]
    finally:
        if was_enabled:
            gc.enable()
    gc.collect()
    assert ref() is None
