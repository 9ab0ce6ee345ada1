"""``microbatch_window``: window patches hold vLLM's originals outside microbatched runs, all-or-none inside.

Plain classes stand in for vLLM's here (the window only sets and restores attributes); the real targets and
the real runners' join points are exercised in tests/vllm/test_topk_patches.py and test_ubatch_guard.py.
"""

from __future__ import annotations

from typing import Any

import pytest

from dbo_runtime.core.errors import PatchError
from dbo_runtime.integration.microbatch_window import MicrobatchWindow
from dbo_runtime.integration.patching import Patch, PatchSet


class Target:
    def method(self) -> str:
        return "vllm"


ORIGINAL = Target.__dict__["method"]


class Registered:
    """Stands in for vLLM's thread table: whether a microbatch thread is registered now."""

    def __init__(self) -> None:
        self.busy = False

    def __call__(self) -> bool:
        return self.busy


def _patch(name: str = "t.method", attr: str = "Target.method", *, adds: bool = False, **kw: Any) -> Patch:
    return Patch(
        name=name,
        module=__name__,
        attr=attr,
        make=lambda original: (lambda self: "hook") if not adds else property(lambda self: "added"),
        reason="test",
        upstream_pr="none",
        removal="never",
        adds=adds,
        anchors=(),
        while_microbatching=True,
        **kw,
    )


@pytest.fixture
def window(monkeypatch: pytest.MonkeyPatch) -> tuple[MicrobatchWindow, Registered]:
    from dbo_runtime.integration import patching

    registered = Registered()
    win = MicrobatchWindow(registered)
    monkeypatch.setattr(patching, "WINDOW", win)
    return win, registered


def test_installed_window_patch_is_vllms_original_until_a_run_opens(window: tuple[MicrobatchWindow, Registered]) -> None:
    win, _ = window
    ps = PatchSet([_patch(), _patch("t.added", "Target.extra", adds=True)])
    ps.install()
    try:
        assert Target.__dict__["method"] is ORIGINAL and "extra" not in Target.__dict__
        assert Target().method() == "vllm"
        win.open()
        assert Target().method() == "hook" and Target().extra == "added"  # type: ignore[attr-defined]
        win.close()
        assert Target.__dict__["method"] is ORIGINAL and "extra" not in Target.__dict__
        assert win.counters() == {"windows_opened": 1, "window_patches": 2, "window_patches_armed": 0, "window_kept_armed": 0}
        assert [s.state for s in ps.status()] == ["installed", "installed"]
    finally:
        ps.uninstall()
    assert Target.__dict__["method"] is ORIGINAL and win.names() == []


def test_uninstall_inside_a_run_restores_the_identical_original(window: tuple[MicrobatchWindow, Registered]) -> None:
    win, _ = window
    ps = PatchSet([_patch(), _patch("t.added", "Target.extra", adds=True)])
    ps.install()
    win.open()
    ps.uninstall()
    assert Target.__dict__["method"] is ORIGINAL and "extra" not in Target.__dict__
    win.close()
    assert Target.__dict__["method"] is ORIGINAL and win.names() == []


def test_nested_runs_and_a_registered_thread_keep_the_hooks(window: tuple[MicrobatchWindow, Registered]) -> None:
    win, registered = window
    ps = PatchSet([_patch()])
    ps.install()
    try:
        win.open()
        win.open()
        win.close()
        assert Target().method() == "hook"  # the outer run is still open
        registered.busy = True  # a microbatch thread outlived its join: armed is correct, so stay armed
        win.close()
        assert Target().method() == "hook" and win.kept_armed == 1
        registered.busy = False
        win.open()
        win.close()
        assert Target().method() == "vllm"
        win.close()  # an extra close (a finish() called twice) never goes below zero
        assert win.depth == 0
    finally:
        ps.uninstall()


def test_a_target_that_cannot_be_set_stops_the_run_with_nothing_armed(window: tuple[MicrobatchWindow, Registered]) -> None:
    from dbo_runtime.integration.microbatch_window import WindowEntry

    win, _ = window
    ps = PatchSet([_patch()])
    ps.install()
    try:

        def refuse() -> None:
            raise TypeError("read-only")

        win.register(WindowEntry("t.broken", arm=refuse, disarm=lambda: None))
        with pytest.raises(PatchError, match=r"could not put t\.broken in force.*shared top-k state"):
            win.open()
        assert win.depth == 0 and win.armed_names() == [] and Target().method() == "vllm"
    finally:
        ps.uninstall()
        for entry in list(win._entries):
            win.unregister(entry)


def test_a_module_imported_inside_a_run_is_armed_at_once(window: tuple[MicrobatchWindow, Registered]) -> None:
    win, _ = window
    win.open()
    ps = PatchSet([_patch()])
    ps.install()
    try:
        assert Target().method() == "hook"
        win.close()
        assert Target().method() == "vllm"
    finally:
        ps.uninstall()

