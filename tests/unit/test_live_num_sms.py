"""``adapters.deep_gemm.LiveNumSms``: the indexer call site's read of DeepGEMM's live SM count."""

from __future__ import annotations

from dbo_runtime.adapters.deep_gemm import LiveNumSms


class _Runtime:
    """DeepGEMM's process-global count, and how often it was asked (each ask is a torch op in vLLM's build)."""

    def __init__(self) -> None:
        self.num_sms = 132
        self.asked = 0

    def get(self) -> int:
        self.asked += 1
        return self.num_sms


def _tracker(runtime: _Runtime, *, watched: bool = False) -> LiveNumSms:
    live = LiveNumSms(lambda: runtime.get)
    for writer in LiveNumSms.WRITERS if watched else ():
        live.watch(writer)
    return live


def test_unwatched_every_read_asks_deep_gemm() -> None:
    rt = _Runtime()
    live = _tracker(rt)
    assert [live.read() for _ in range(3)] == [132] * 3 and rt.asked == 3
    live.watch(next(iter(LiveNumSms.WRITERS)))  # one writer of two: still not trusted
    rt.num_sms = 112
    assert not live.trusted and [live.read() for _ in range(2)] == [112] * 2 and rt.asked == 5


def test_watched_one_read_per_write() -> None:
    rt = _Runtime()
    live = _tracker(rt, watched=True)
    assert live.trusted
    assert [live.read() for _ in range(21)] == [132] * 21 and rt.asked == 1  # 21 leader layers, one ask
    rt.num_sms = 112
    live.stale()  # what every watched writer does after its write
    assert [live.read() for _ in range(21)] == [112] * 21 and rt.asked == 2


def test_unwatching_a_writer_drops_the_cache_and_the_trust() -> None:
    rt = _Runtime()
    live = _tracker(rt, watched=True)
    live.read()
    live.unwatch(sorted(LiveNumSms.WRITERS)[0])
    rt.num_sms = 112  # a write nobody watches any more
    assert not live.trusted and live.read() == 112 and live.read() == 112 and rt.asked == 3


def test_a_read_that_overlaps_a_write_does_not_cache_the_count_from_before_it() -> None:
    rt = _Runtime()
    live: LiveNumSms

    def reader_with_a_write_in_between() -> int:
        value = rt.get()  # DeepGEMM answered 132 ...
        rt.num_sms = 112  # ... then a writer changed it and marked the cache stale before the read returned
        live.stale()
        return value

    live = LiveNumSms(lambda: reader_with_a_write_in_between)
    for writer in LiveNumSms.WRITERS:
        live.watch(writer)
    assert live.read() == 132  # the overlapped read answers what it read ...
    live._reader = rt.get  # (the writer is done)
    assert live.read() == 112 and live.read() == 112 and rt.asked == 2  # ... but did not cache it


def test_distrust_drops_the_cache_until_the_writers_are_watched_again() -> None:
    rt = _Runtime()
    live = _tracker(rt, watched=True)
    live.read()
    live.distrust()
    rt.num_sms = 112
    assert not live.trusted and live.read() == 112 and live.read() == 112 and rt.asked == 3


def test_a_binding_that_no_longer_holds_its_hook_is_seen() -> None:
    """``bindings_intact``: each watched writer's module (still the one imported) and what its name held when its
    hook was installed, by identity (the per-step check of ``indexer_hooks._refresh_live_count``)."""
    import sys
    import types

    rt = _Runtime()
    live = _tracker(rt)
    modules = {writer: types.ModuleType(f"fake_writer_{i}") for i, writer in enumerate(sorted(LiveNumSms.WRITERS))}
    for module in modules.values():
        module.set_num_sms = lambda n: None
        sys.modules[module.__name__] = module
    try:
        live.watch(sorted(LiveNumSms.WRITERS)[0])  # watched with no binding: nothing to check, never intact
        assert not live.bindings_intact()
        for writer, module in modules.items():
            live.watch(writer, (module.__name__, module, "set_num_sms", module.set_num_sms))
        assert live.trusted and live.bindings_intact()
        first, second = (modules[w] for w in sorted(LiveNumSms.WRITERS))
        first.set_num_sms = lambda n: None  # rebound behind the plugin
        assert not live.bindings_intact()
        live.unwatch(sorted(LiveNumSms.WRITERS)[0])
        assert live.bindings_intact() and not live.trusted
        sys.modules[second.__name__] = types.ModuleType(second.__name__)  # imported again: a new, unhooked module
        assert not live.bindings_intact()
    finally:
        for module in modules.values():
            sys.modules.pop(module.__name__, None)
