"""``microbatch_arming``: armable patches keep vLLM's originals until the first microbatched run, then stay.

Plain classes stand in for vLLM's (arming only sets attributes); the real targets, the runners' join points and
the ``UBatchContext.__enter__`` net run in tests/vllm/test_topk_patches.py, test_ubatch_guard.py and
test_topk_isolation.py.
"""

from __future__ import annotations

from typing import Any

import pytest

from dbo_runtime.core.errors import PatchError
from dbo_runtime.integration.microbatch_arming import ArmedEntry, MicrobatchArming
from dbo_runtime.integration.patching import Patch, PatchSet


class Target:
    def method(self) -> str:
        return "vllm"


ORIGINAL = Target.__dict__["method"]


def _patch(name: str = "t.method", attr: str = "Target.method", *, adds: bool = False) -> Patch:
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
        armed_at_first_microbatch=True,
    )


@pytest.fixture
def arming(monkeypatch: pytest.MonkeyPatch) -> MicrobatchArming:
    from dbo_runtime.integration import patching

    fresh = MicrobatchArming()
    monkeypatch.setattr(patching, "ARMING", fresh)
    return fresh


def test_an_armable_patch_is_vllms_original_until_the_first_microbatched_run(arming: MicrobatchArming) -> None:
    ps = PatchSet([_patch(), _patch("t.added", "Target.extra", adds=True)])
    ps.install()
    try:
        assert Target.__dict__["method"] is ORIGINAL and "extra" not in Target.__dict__
        assert [s.state for s in ps.status()] == ["installed", "installed"]
        arming.arm("run")
        assert Target().method() == "hook" and Target().extra == "added"  # type: ignore[attr-defined]
        arming.arm("later run")  # once armed, a run changes no class (no type-version churn)
        assert arming.armed_by == "run"
        assert arming.counters() == {"armed_patches": 2, "armable_patches": 2, "armed_by": "run"}
    finally:
        ps.uninstall()
    assert Target.__dict__["method"] is ORIGINAL and "extra" not in Target.__dict__
    assert arming.names() == [] and not arming.armed and arming.armed_by is None


def test_uninstall_before_any_run_leaves_the_originals_untouched(arming: MicrobatchArming) -> None:
    ps = PatchSet([_patch(), _patch("t.added", "Target.extra", adds=True)])
    ps.install()
    ps.uninstall()
    assert Target.__dict__["method"] is ORIGINAL and "extra" not in Target.__dict__
    assert arming.names() == []


def test_a_target_that_cannot_be_set_stops_the_run_and_the_next_run_tries_again(arming: MicrobatchArming) -> None:
    ps = PatchSet([_patch()])
    ps.install()
    fails = [True]

    def flaky() -> None:
        if fails[0]:
            raise TypeError("read-only")

    entry = ArmedEntry("t.flaky", arm=flaky)
    arming.register(entry)
    try:
        with pytest.raises(PatchError, match=r"t\.flaky could not be put in force.*shared top-k state"):
            arming.arm("run")
        assert not arming.armed and Target().method() == "hook"  # what was set stays set: correct, only slower
        fails[0] = False
        arming.arm("next run")
        assert arming.armed and arming.armed_by == "next run" and entry.armed
    finally:
        arming.unregister(entry)
        ps.uninstall()
    assert Target.__dict__["method"] is ORIGINAL


def test_a_module_imported_after_the_first_run_is_armed_at_install(arming: MicrobatchArming) -> None:
    first = PatchSet([_patch("t.added", "Target.extra", adds=True)])
    first.install()
    arming.arm("run")
    second = PatchSet([_patch()])  # a lazy module's patches arrive later
    second.install()
    try:
        assert Target().method() == "hook"
    finally:
        second.uninstall()
        first.uninstall()
    assert Target.__dict__["method"] is ORIGINAL and "extra" not in Target.__dict__


def test_arming_is_one_attribute_read_once_armed(arming: MicrobatchArming, monkeypatch: pytest.MonkeyPatch) -> None:
    """The join points call ``arm`` on every microbatched run: once armed it must not take the lock."""
    arming.armed = True

    class Refuse:
        def __enter__(self) -> Any:
            raise AssertionError("the lock was taken")

        def __exit__(self, *args: Any) -> None: ...

    monkeypatch.setattr(arming, "_lock", Refuse())
    arming.arm("run")


def test_arming_never_overwrites_a_target_rebound_after_install(arming: MicrobatchArming) -> None:
    """A replacement is set only over the original it was built around: a rebinding behind the plugin fails the run
    loudly instead of being overwritten now and replaced by the install-time original at uninstall."""
    ps = PatchSet([_patch()])
    ps.install()

    def rebound(self: Any) -> str:
        return "someone else"

    Target.method = rebound  # type: ignore[method-assign]
    try:
        with pytest.raises(PatchError, match=r"rebound after dbo_runtime installed t\.method"):
            arming.arm("run")
        assert Target().method() == "someone else"
    finally:
        Target.method = ORIGINAL  # type: ignore[method-assign]
        ps.uninstall()
    assert Target.__dict__["method"] is ORIGINAL


def test_a_target_that_cannot_be_set_is_broken_and_told_to_the_failure_listeners(arming: MicrobatchArming) -> None:
    """The guard names what is missing: the patch that failed is ``broken`` in its set's status, and the set's failure
    listeners (the plugin marks that patch's feature broken) hear it, whichever hook called ``arm``."""
    ps = PatchSet([_patch("topk.method")])
    heard: list[tuple[list[str], str]] = []
    ps.failure_listeners.append(lambda patches, message: heard.append(([p.name for p in patches], message)))
    ps.install()
    try:
        [entry] = [e for e in arming._entries]

        def rebound() -> None:
            raise PatchError("rebound")

        entry.arm = rebound
        with pytest.raises(PatchError, match=r"topk\.method"):
            arming.arm("an indexer builder")
        [status] = [st for st in ps.status() if st.patch.name == "topk.method"]
        assert status.state == "broken" and "topk.method could not be put in force" in status.detail
        [(names, message)] = heard
        assert names == ["topk.method"] and "could not be put in force" in message
        with pytest.raises(PatchError, match=r"topk\.method"):  # the next step (or the other thread) retries: told once
            arming.arm("UBatchContext.__enter__")
        assert len(heard) == 1
    finally:
        ps.uninstall()
