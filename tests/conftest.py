"""Session-wide pytest set-up for every test folder."""

from __future__ import annotations

import gc

import pytest


def pytest_collection_finish(session: pytest.Session) -> None:
    """Freeze what collection built (vLLM, torch, the test modules) into the collector's permanent generation.

    ``plugin.uninstall`` runs a full ``gc.collect()`` so that a shut-down engine held in a reference cycle is no
    live model; with vLLM imported that walks several hundred thousand objects on every uninstall. Objects a test
    creates stay collectable, so a test that drops a model and checks it is gone still sees it collected. Collected
    first: garbage frozen here could never be collected.
    """
    gc.collect()
    gc.freeze()


@pytest.fixture(autouse=True, scope="module")
def _freeze_what_earlier_modules_keep() -> None:
    """The same for what earlier test modules left alive (the vLLM modules their tests imported): collected
    first, so no garbage is frozen; everything this module's tests create stays collectable."""
    gc.collect()
    gc.freeze()
