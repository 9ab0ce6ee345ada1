"""PatchSet: all-or-nothing install, identical originals on uninstall, lazy targets."""

from __future__ import annotations

import sys
import textwrap
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dbo_runtime.core.errors import PatchError
from dbo_runtime.integration.doctor_probes import probe_target
from dbo_runtime.integration.patching import PATCH_MARK, Patch, PatchSet


@pytest.fixture
def target(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A throwaway module with a function, a class method and an inherited method."""
    name = f"dbo_patch_target_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(
        textwrap.dedent(
            """
            def func(x):
                return x + 1

            class Base:
                def inherited(self):
                    return "base"

            class Klass(Base):
                def method(self):
                    return "orig"

                @staticmethod
                def static():
                    return "static"
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    sys.modules.pop(name, None)


def wrap(tag: str):  # type: ignore[no-untyped-def]
    def make(original):  # type: ignore[no-untyped-def]
        if isinstance(original, staticmethod):
            return staticmethod(lambda: f"{tag}:{original.__func__()}")

        def replacement(*a, **k):  # type: ignore[no-untyped-def]
            return f"{tag}:{original(*a, **k)}"

        return replacement

    return make


def p(name: str, module: str, attr: str, make=None, **kw) -> Patch:  # type: ignore[no-untyped-def]
    return Patch(name=name, module=module, attr=attr, make=make or wrap(name), reason="test", upstream_pr="-", removal="-", **kw)


def test_install_and_uninstall_restore_identical_objects(target: str) -> None:
    import importlib

    mod = importlib.import_module(target)
    originals = (mod.func, mod.Klass.__dict__["method"], mod.Klass.__dict__["static"])
    ps = PatchSet(
        [
            p("f", target, "func"),
            p("m", target, "Klass.method"),
            p("s", target, "Klass.static"),
            p("i", target, "Klass.inherited"),
        ]
    )
    ps.install()
    assert mod.func(1) == "f:2"
    assert mod.Klass().method() == "m:orig" and mod.Klass.static() == "s:static"
    assert mod.Klass().inherited() == "i:base"
    assert getattr(mod.func, PATCH_MARK) == "f" and mod.func.__wrapped__ is originals[0]
    ps.install()  # idempotent
    assert mod.func(1) == "f:2"
    ps.uninstall()
    assert (mod.func, mod.Klass.__dict__["method"], mod.Klass.__dict__["static"]) == originals
    assert mod.func is originals[0] and mod.Klass.__dict__["method"] is originals[1]
    # An inherited attribute is removed again, not frozen into the subclass.
    assert "inherited" not in mod.Klass.__dict__


def test_failing_factory_leaves_every_target_untouched(target: str) -> None:
    import importlib

    mod = importlib.import_module(target)
    before = (mod.func, mod.Klass.__dict__["method"])

    def broken(original):  # type: ignore[no-untyped-def]
        raise RuntimeError("target moved")

    ps = PatchSet([p("f", target, "func"), p("bad", target, "Klass.method", make=broken)])
    with pytest.raises(PatchError, match="bad"):
        ps.install()
    assert (mod.func, mod.Klass.__dict__["method"]) == before and not ps.installed


def test_missing_target_fails_whole_set(target: str) -> None:
    import importlib

    mod = importlib.import_module(target)
    before = mod.func
    with pytest.raises(PatchError, match="nope"):
        PatchSet([p("f", target, "func"), p("x", target, "Klass.nope")]).install()
    assert mod.func is before


def test_setattr_failure_mid_apply_rolls_back(target: str) -> None:
    import importlib

    mod = importlib.import_module(target)
    before = mod.func
    frozen = types.MappingProxyType({"x": 1})  # setattr on it raises at apply time
    holder = types.ModuleType("dbo_holder")
    holder.mapping = frozen  # type: ignore[attr-defined]
    sys.modules["dbo_holder"] = holder
    try:
        ps = PatchSet([p("f", target, "func"), p("ro", "dbo_holder", "mapping.keys")])
        with pytest.raises(PatchError, match="rolled back"):
            ps.install()
        assert mod.func is before
    finally:
        sys.modules.pop("dbo_holder")


def _failing_hook() -> None:
    raise RuntimeError("subscriber refused")


def test_failing_on_install_hook_leaves_its_own_target_untouched(target: str) -> None:
    """The hook runs before the setattr: a raising hook run after it would leave its patch in place (not
    yet in the rolled-back list) while the error says "rolled back"."""
    import importlib

    mod = importlib.import_module(target)
    before = (mod.func, mod.Klass.__dict__["method"])
    ps = PatchSet([p("f", target, "func"), p("hooked", target, "Klass.method", on_install=_failing_hook)])
    with pytest.raises(PatchError, match="rolled back"):
        ps.install()
    assert (mod.func, mod.Klass.__dict__["method"]) == before and not ps.installed


def test_rollback_runs_every_undo_even_when_one_fails_or_the_user_interrupts(target: str) -> None:
    """The rollback finishes whatever a hook does: a raising on_uninstall must not stop it half way, a
    KeyboardInterrupt in a hook must not skip it, and a hook that registered and then raised is told to
    unregister."""
    import importlib

    mod = importlib.import_module(target)
    before = (mod.func, mod.Klass.__dict__["method"], mod.Klass.__dict__["static"])
    calls: list[str] = []

    def refuse_undo() -> None:
        calls.append("undo f")
        raise RuntimeError("cannot unregister")

    def register_then_fail() -> None:
        calls.append("registered")
        raise RuntimeError("half registered")

    ps = PatchSet(
        [
            p("f", target, "func", on_uninstall=refuse_undo),
            p("m", target, "Klass.method"),
            p("hooked", target, "Klass.static", on_install=register_then_fail, on_uninstall=lambda: calls.append("unregistered")),
        ]
    )
    with pytest.raises(PatchError, match="rolled back"):
        ps.install()
    assert (mod.func, mod.Klass.__dict__["method"], mod.Klass.__dict__["static"]) == before
    assert calls == ["registered", "unregistered", "undo f"]

    def interrupt() -> None:
        raise KeyboardInterrupt

    ps = PatchSet([p("f", target, "func"), p("ctrl-c", target, "Klass.method", on_install=interrupt)])
    with pytest.raises(KeyboardInterrupt):
        ps.install()
    assert (mod.func, mod.Klass.__dict__["method"]) == before[:2] and not ps.installed


def test_failing_lazy_apply_leaves_its_module_unpatched_and_the_rest_in_place(target: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A lazy module whose patch fails while being applied (not prepared) is not left half patched, and the
    patches already in force elsewhere stay: the engine may be running with them."""
    import importlib

    monkeypatch.delenv("DBO_RUNTIME_STRICT", raising=False)
    holder = types.ModuleType("dbo_holder_eager")
    holder.value = lambda: "orig"  # type: ignore[attr-defined]
    before = holder.value  # type: ignore[attr-defined]
    sys.modules["dbo_holder_eager"] = holder
    try:
        ps = PatchSet(
            [
                p("eager", "dbo_holder_eager", "value"),
                p("lazy-ok", target, "func", lazy=True),
                p("lazy-hooked", target, "Klass.method", lazy=True, on_install=_failing_hook),
            ]
        )
        ps.install()
        assert holder.value() == "eager:orig"  # type: ignore[attr-defined]
        mod = importlib.import_module(target)  # the import hook applies the lazy pair; the hook fails
        assert mod.func(1) == 2 and mod.Klass().method() == "orig"
        assert holder.value() == "eager:orig" and ps.installed  # type: ignore[attr-defined]
        states = {st.patch.name: st.state for st in ps.status()}
        assert states == {"eager": "installed", "lazy-ok": "broken", "lazy-hooked": "broken"}
        monkeypatch.setenv("DBO_RUNTIME_STRICT", "1")
        ps.uninstall()
        assert holder.value is before  # type: ignore[attr-defined]
    finally:
        sys.modules.pop("dbo_holder_eager")


@pytest.mark.parametrize("strict", [True, False], ids=["strict", "not-strict"])
def test_a_lazy_failure_on_a_microbatch_thread_is_raised_after_the_join(strict: bool, target: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A required lazy patch that fails where model code first imports its module on a microbatch thread is
    recorded there and raised on the main thread by the runner's join point, with or without
    ``DBO_RUNTIME_STRICT`` (a raise on the thread would leave its partner waiting forever; a log line alone would
    leave this and later steps on vLLM's unpatched code, the guard having judged at load). Off a microbatch thread
    STRICT fails the import and otherwise it stays a log line (load, warm-up: the guard still decides)."""
    import importlib

    from dbo_runtime.core.errors import MicrobatchFailure
    from dbo_runtime.integration import ubatch_failures, ubatch_ids

    if strict:
        monkeypatch.setenv("DBO_RUNTIME_STRICT", "1")
    else:
        monkeypatch.delenv("DBO_RUNTIME_STRICT", raising=False)
    ubatch_failures.FAILURES.take()
    for on_thread in (True, False):
        monkeypatch.setattr(ubatch_ids, "ubatch_thread_id", lambda ubatch=1 if on_thread else None: ubatch)
        sys.modules.pop(target, None)
        ps = PatchSet([p("lazy-hooked", target, "Klass.method", lazy=True, on_install=_failing_hook)])
        ps.install()
        try:
            if strict and not on_thread:
                with pytest.raises(PatchError, match=r"\(lazy-hooked\) cannot be applied"):
                    importlib.import_module(target)
            else:
                assert importlib.import_module(target).Klass().method() == "orig"  # no raise at the import
                assert [st.state for st in ps.status()] == ["broken"]
            if on_thread:
                with pytest.raises(MicrobatchFailure, match=r"lazy patches for .*lazy-hooked.*cannot be applied"):
                    ubatch_failures.FAILURES.raise_pending()  # what the join point calls
            else:
                assert not ubatch_failures.FAILURES.take()
        finally:
            ps.uninstall()


def test_optional_missing_target_is_skipped(target: str) -> None:
    ps = PatchSet([p("f", target, "func"), p("opt", "dbo_no_such_module_xyz", "f", optional=True)])
    ps.install()
    states = {s.patch.name: s.state for s in ps.status()}
    assert states == {"f": "installed", "opt": "skipped"}
    ps.uninstall()


def test_lazy_patch_applies_on_first_import_and_uninstall_disarms(target: str) -> None:
    assert target not in sys.modules
    ps = PatchSet([p("lazy", target, "func", lazy=True)])
    ps.install()
    assert {s.state for s in ps.status()} == {"pending"}
    import importlib

    mod = importlib.import_module(target)
    assert mod.func(1) == "lazy:2"
    assert {s.state for s in ps.status()} == {"installed"}
    original = mod.func.__wrapped__
    ps.uninstall()
    assert mod.func is original
    sys.modules.pop(target)
    assert importlib.import_module(target).func(1) == 2  # finder removed


def test_a_lazily_patched_module_keeps_its_loaders_source_and_file(target: str) -> None:
    import importlib
    import inspect
    import linecache

    ps = PatchSet([p("lazy", target, "func", lazy=True)])
    ps.install()
    try:
        mod = importlib.import_module(target)
        loader = mod.__loader__
        assert "def func(x):" in loader.get_source(target)
        assert loader.get_filename(target) == mod.__file__ and not loader.is_package(target)
        assert not hasattr(loader, "get_code")  # runpy would run the module through it, without its patches
        assert "class Klass(Base):" in inspect.getsource(mod)
        linecache.clearcache()
        assert "return x + 1" in "".join(linecache.getlines(mod.__file__, mod.__dict__))
    finally:
        ps.uninstall()


def test_lazy_patch_on_already_imported_module_is_eager(target: str) -> None:
    import importlib

    mod = importlib.import_module(target)
    ps = PatchSet([p("lazy", target, "func", lazy=True)])
    ps.install()
    assert mod.func(1) == "lazy:2"
    ps.uninstall()
    assert mod.func(1) == 2


def test_duplicate_names_rejected(target: str) -> None:
    with pytest.raises(PatchError, match="duplicate"):
        PatchSet([p("a", target, "func"), p("a", target, "Klass.method")])


def test_probe_target(target: str) -> None:
    assert probe_target(p("f", target, "func")).state == "found"
    assert probe_target(p("x", target, "nope")).state == "missing"
    assert probe_target(p("y", target, "nope", optional=True)).state == "skipped"


def test_probe_target_of_a_lazy_patch_is_skipped_only_when_its_module_cannot_import(target: str) -> None:
    """A lazy module that imports here is checked like any other: a target gone from it is missing, not "not
    checked here" (doctor would otherwise call a checked, absent target unchecked)."""
    assert probe_target(p("gone", target, "nope", lazy=True)).state == "missing"
    assert probe_target(p("here", target, "func", lazy=True)).state == "found"
    unimportable = probe_target(p("away", "dbo_no_such_module_here.sub", "func", lazy=True))
    assert unimportable.state == "skipped" and "ModuleNotFoundError" in unimportable.detail


def test_a_patch_that_runs_on_microbatch_threads_is_shielded_by_the_set(target: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """``runs_on_ubatch_thread`` is applied by PatchSet, not by each hook: on a microbatch thread a failure is
    recorded and vLLM's original answers; off one it raises as it came."""
    import importlib

    from dbo_runtime.integration import ubatch_failures, ubatch_ids

    def failing(original: object) -> object:
        def replacement(x: int) -> int:
            raise RuntimeError("plugin bug")

        return replacement

    ps = PatchSet([Patch(name="t.shielded", module=target, attr="func", make=failing, reason="t", upstream_pr="-",
                         removal="-", runs_on_ubatch_thread=True)])  # fmt: skip
    ps.install()
    try:
        mod = importlib.import_module(target)
        with pytest.raises(RuntimeError, match="plugin bug"):
            mod.func(1)  # not a microbatch thread
        monkeypatch.setattr(ubatch_ids, "ubatch_thread_id", lambda: 1)
        ubatch_failures.FAILURES.take()
        assert mod.func(1) == 2  # vLLM's original answered
        [(where, ubatch, exc)] = ubatch_failures.FAILURES.take()
        assert where == "t.shielded" and ubatch == 1 and str(exc) == "plugin bug"
    finally:
        ps.uninstall()


def test_a_replacement_that_cannot_be_shielded_does_not_install(target: str) -> None:
    ps = PatchSet([Patch(name="t.value", module=target, attr="func", make=lambda o: 42, reason="t", upstream_pr="-",
                         removal="-", runs_on_ubatch_thread=True)])  # fmt: skip
    with pytest.raises(PatchError, match="cannot be shielded"):
        ps.install()
    assert not ps.installed


def test_a_replacement_that_shields_itself_is_installed_unwrapped(target: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """``shields_itself``: the hook's own ``try`` records the failure, so the set adds no second frame around it."""
    import importlib

    from dbo_runtime.integration import ubatch_failures, ubatch_ids

    made: list[object] = []

    def own_shield(original: Any) -> object:
        @ubatch_failures.shields_itself
        def replacement(x: int) -> int:
            try:
                raise RuntimeError("plugin bug")
            except Exception as exc:
                if not ubatch_failures.record("t.own", exc):
                    raise
                return int(original(x))

        made.append(replacement)
        return replacement

    ps = PatchSet([Patch(name="t.own", module=target, attr="func", make=own_shield, reason="t", upstream_pr="-",
                         removal="-", runs_on_ubatch_thread=True)])  # fmt: skip
    ps.install()
    try:
        mod = importlib.import_module(target)
        assert mod.func is made[0]
        with pytest.raises(RuntimeError, match="plugin bug"):
            mod.func(1)
        monkeypatch.setattr(ubatch_ids, "ubatch_thread_id", lambda: 1)
        ubatch_failures.FAILURES.take()
        assert mod.func(1) == 2
        [(where, _, _)] = ubatch_failures.FAILURES.take()
        assert where == "t.own"
    finally:
        ps.uninstall()


@pytest.mark.parametrize("lazy", [False, True])
def test_an_optional_patch_that_fails_to_apply_is_skipped_not_the_sets_failure(target: str, lazy: bool) -> None:
    """An optional patch whose ``on_install`` raises comes out alone (reported skipped); the required patches of
    the same module stay, and nothing is reported broken (a broken patch makes the guard refuse the model)."""
    import importlib

    def boom() -> None:
        raise RuntimeError("optional hook failed")

    if lazy:
        sys.modules.pop(target, None)
    else:
        importlib.import_module(target)
    ps = PatchSet([
        p("required", target, "func", lazy=lazy),
        Patch(name="extra", module=target, attr="Klass.method", make=lambda o: (lambda self: "extra"), reason="t",
              upstream_pr="-", removal="-", lazy=lazy, optional=True, on_install=boom),
    ])  # fmt: skip
    ps.install()
    try:
        mod = importlib.import_module(target)
        assert mod.func(1) == "required:2"
        states = {s.patch.name: s.state for s in ps.status()}
        assert states == {"required": "installed", "extra": "skipped"}
        assert mod.Klass().method() != "extra"
    finally:
        ps.uninstall()


def test_arg_slots_read_every_name_from_positions_keywords_and_defaults() -> None:
    """``ArgSlots``: a wrapper forwards ``*args, **kwargs`` untouched and reads only the parameters it needs, at
    the positions or keywords vLLM passed them, a missing one being its default; ``read`` gives all in one call,
    as ``get`` would one by one, and a name the signature lacks refuses the patch."""
    from dbo_runtime.core.errors import PatchError
    from dbo_runtime.integration.patching import ArgSlots

    def planner(context_lens: object, block_size: int, num_sms: int, indices: object = None) -> None: ...

    slots = ArgSlots(planner, ("context_lens", "block_size", "num_sms", "indices"))
    for args, kwargs, want in (
        (("c", 64, 132), {"indices": "i"}, ["c", 64, 132, "i"]),  # how vLLM 0.33's builder calls it
        (("c", 64, 132), {}, ["c", 64, 132, None]),
        ((), {"context_lens": "c", "block_size": 64, "num_sms": 112}, ["c", 64, 112, None]),
        (("c", 64, 132, "i"), {}, ["c", 64, 132, "i"]),
    ):
        names = ("context_lens", "block_size", "num_sms", "indices")
        assert slots.read(args, kwargs) == want == [slots.get(n, args, kwargs) for n in names]
    with pytest.raises(PatchError, match="has no parameter"):
        ArgSlots(planner, ("context_lens", "num_states"))
