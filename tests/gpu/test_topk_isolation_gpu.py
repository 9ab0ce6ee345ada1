"""GPU twin of tests/vllm/test_topk_isolation.py: real CUDA tensors, events, streams and CUDA graphs.

No vLLM on the GPU machine, so the index group and its two methods are
reproduced field for field from vLLM 0.33.0 (``index_group.py:35-167``:
``set_logical_topk_ready``, ``_convert_once``) and run on whatever
``UbatchTopkState.group_view`` returns, exactly as the patches in
``dbo_runtime.integration.topk_hooks`` do. Two microbatch threads ping-pong
like vLLM's ``UBatchContext`` (one runs Python at a time), each on its own
compute stream, yielding at random layer boundaries, with random GPU delays
before leader writes. FULL-graph mode captures both microbatches' work into one
``torch.cuda.CUDAGraph`` the way MRV1 does (capture begins on the main thread's
stream, the threads run inside it) and replays it with new inputs.

Checked: every (microbatch, layer) reads its own leader's logical and physical
top-k bit for bit -- 0 cross-microbatch reads -- over >= 100 eager
interleavings and >= 100 replays per layout. A control with a resolver pinned to
microbatch 0 must show mismatches (the test can fail).
"""

from __future__ import annotations

import datetime
import json
import pathlib
import random
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch

from dbo_runtime.core.topk_memory import index_leaders
from dbo_runtime.services.topk_state import TopkLayout, UbatchTopkState

NUM_LAYERS = 12  # freq 4, offset 3 -> leaders 0, 1, 2, 6, 10; groups with followers at 2, 6, 10
TOPK = 64
MAX_TOKENS = 256
DECODE_ROWS = 64  # physical workspace rows = 65
BLOCK_SIZE = 16
NUM_BLOCKS = 32
NUM_REQS = 8
STEPS = (64, 256)  # decode-sized (microbatch 1's window fits the workspace) and prefill-sized (it does not)
EAGER_TRIALS = 100
GRAPH_PATTERNS = 3  # random yield patterns captured per step size
GRAPH_REPLAYS = 20  # per captured graph -> 3 * 2 * 20 = 120 replays per layout


class Group:
    """Field for field vLLM 0.33.0 ``SparseMLAIndexGroup`` (``index_group.py:35-46``)."""

    def __init__(self, base: torch.Tensor, has_indexer: bool) -> None:
        self.logical_topk_indices = base
        self.physical_topk_indices = torch.empty((DECODE_ROWS + 1, TOPK), dtype=torch.int32, device=base.device)
        self.valid_topk_counts = torch.empty(DECODE_ROWS + 1, dtype=torch.int32, device=base.device)
        self.side_stream = torch.cuda.Stream()
        self.logical_topk_ready = torch.cuda.Event()
        self.physical_topk_ready = torch.cuda.Event()
        self.has_indexer = has_indexer
        self.num_layers = 0


def convert(
    req: torch.Tensor, block_table: torch.Tensor, logical: torch.Tensor, out: Any = None, valid_out: Any = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``triton_convert_req_index_to_global_index``'s formula in torch ops (capturable, no host sync)."""
    block = torch.div(logical, BLOCK_SIZE, rounding_mode="floor")
    ok = (logical >= 0) & (block < NUM_BLOCKS)
    rows = block_table.index_select(0, req.long())
    gathered = torch.gather(rows, 1, block.clamp(0, NUM_BLOCKS - 1).long()).to(torch.int32)
    phys = torch.where(ok, gathered * BLOCK_SIZE + torch.remainder(logical, BLOCK_SIZE), -1).to(torch.int32)
    counts = ok.sum(dim=1).to(torch.int32)
    if out is not None:
        out.copy_(phys)
        valid_out.copy_(counts)
        return out, valid_out
    return phys, counts


def set_logical_topk_ready(g: Any, layer_index: int) -> None:
    """vLLM's ``SparseMLAIndexGroup.set_logical_topk_ready`` body (not piecewise)."""
    if layer_index != 0 or not g.has_indexer:
        return
    g.logical_topk_ready.record(torch.cuda.current_stream())


def convert_once(g: Any, layer_index: int, logical: torch.Tensor, req: torch.Tensor, bt: torch.Tensor) -> Any:
    """vLLM's ``SparseMLAIndexGroup._convert_once`` body (not piecewise), conversion in torch ops."""
    n = logical.shape[0]
    if n > g.physical_topk_indices.shape[0]:
        return convert(req, bt, logical)
    phys = g.physical_topk_indices[:n]
    valid = g.valid_topk_counts[:n]
    compute = torch.cuda.current_stream()
    if layer_index == 0:
        if g.has_indexer:
            g.side_stream.wait_event(g.logical_topk_ready)
        else:
            g.side_stream.wait_stream(compute)
        with torch.cuda.stream(g.side_stream):
            convert(req, bt, logical, out=phys, valid_out=valid)
            g.physical_topk_ready.record(g.side_stream)
    compute.wait_event(g.physical_topk_ready)
    return phys, valid


def leader_values(x: torch.Tensor, layer: int) -> torch.Tensor:
    return torch.remainder(x * (2 * layer + 1) + layer, NUM_BLOCKS * BLOCK_SIZE + 1) - 1


class PingPong:
    """vLLM ``UBatchContext``'s CPU hand-off: one thread runs, ``yield_`` wakes the other and parks."""

    def __init__(self, offsets: list[int]) -> None:
        self.offsets = offsets
        self.wake = [threading.Event() for _ in offsets]
        self.done = [False for _ in offsets]
        self.table: dict[int, int] = {}

    def locate(self) -> tuple[int, int]:
        u = self.table.get(threading.get_ident())
        return (0, 0) if u is None else (u, self.offsets[u])

    def enter(self, u: int) -> None:
        self.table[threading.get_ident()] = u
        self.wake[u].wait()
        self.wake[u].clear()

    def yield_(self, u: int) -> None:
        other = (u + 1) % len(self.wake)
        if self.done[other]:
            return
        self.wake[other].set()
        self.wake[u].wait()
        self.wake[u].clear()

    def exit(self, u: int) -> None:
        self.done[u] = True
        del self.table[threading.get_ident()]
        self.wake[(u + 1) % len(self.wake)].set()


class Harness:
    def __init__(self, layout: TopkLayout, device: torch.device, pinned_to_ubatch0: bool = False) -> None:
        self.locator: dict[str, Callable[[], tuple[int, int]]] = {"fn": lambda: (0, 0)}
        # The registry holds its locator strongly (``UbatchTopkState.locate``, like vLLM's thread-table
        # reader in production). A locator closing over ``self`` made the registry own the harness -- the
        # "model": its top-k buffer and every group -- so the teardown test, which keeps the registry to
        # inspect it, kept the model alive itself (H200 run: bytes_after - bytes_before was exactly the
        # harness's tensors). Close over the locator dict only.
        locator = self.locator
        locate = (lambda: (0, 0)) if pinned_to_ubatch0 else (lambda: locator["fn"]())
        self.state = UbatchTopkState(locate, layout)
        self.device = device
        self.base = torch.full((MAX_TOKENS, TOPK), -7, dtype=torch.int32, device=device)
        self.state.mark_model_buffer(self.base)
        leaders = index_leaders(NUM_LAYERS, 4, 3)
        self.layers: list[tuple[Group, int, bool]] = []
        self.leader_of: list[int] = []
        group: Group | None = None
        last = 0
        for i, is_leader in enumerate(leaders):
            if is_leader or group is None:
                group = Group(self.base, is_leader)
                last = i
            index = group.num_layers
            group.num_layers += 1
            if index == 1:
                self.state.attach(group, 2, torch.cuda.Event)
            self.layers.append((group, index, is_leader))
            self.leader_of.append(last)

    def inputs(self, total: int) -> dict[str, list[torch.Tensor]]:
        n0 = total // 2
        sizes = [n0, total - n0]
        d = self.device
        return {
            "x": [torch.zeros((n, TOPK), dtype=torch.int32, device=d) for n in sizes],
            "req": [torch.zeros(n, dtype=torch.int32, device=d) for n in sizes],
            "bt": [torch.zeros((NUM_REQS, NUM_BLOCKS), dtype=torch.int32, device=d) for _ in sizes],
            "out_l": [torch.zeros((NUM_LAYERS, n, TOPK), dtype=torch.int32, device=d) for n in sizes],
            "out_p": [torch.zeros((NUM_LAYERS, n, TOPK), dtype=torch.int32, device=d) for n in sizes],
            "out_v": [torch.zeros((NUM_LAYERS, n), dtype=torch.int32, device=d) for n in sizes],
        }

    @staticmethod
    def refill(io: dict[str, list[torch.Tensor]], gen: torch.Generator) -> None:
        for u in range(2):
            io["x"][u].copy_(torch.randint(0, 1 << 20, io["x"][u].shape, generator=gen, dtype=torch.int32))
            io["req"][u].copy_(torch.randint(0, NUM_REQS, io["req"][u].shape, generator=gen, dtype=torch.int32))
            io["bt"][u].copy_(torch.randint(0, 1 << 16, io["bt"][u].shape, generator=gen, dtype=torch.int32))
            for key in ("out_l", "out_p", "out_v"):
                io[key][u].fill_(-9)

    def step(self, io: dict[str, list[torch.Tensor]], rng: random.Random, origin: torch.cuda.Stream,
             other: torch.cuda.Stream) -> None:
        """Both microbatches' forward on two threads; returns with ``origin`` joined to all work."""
        sizes = [t.shape[0] for t in io["x"]]
        pp = PingPong([0, sizes[0]])
        self.locator["fn"] = pp.locate
        yields = [[rng.random() < 0.7 for _ in range(NUM_LAYERS)] for _ in range(2)]
        sleeps = [[rng.randrange(0, 20000) for _ in range(NUM_LAYERS)] for _ in range(2)]
        errors: list[BaseException] = []
        streams = [origin, other]

        def body(u: int) -> None:
            try:
                pp.enter(u)
                try:
                    with torch.cuda.stream(streams[u]):
                        if u:
                            other.wait_stream(origin)
                        n = sizes[u]
                        for i, (group, index, is_leader) in enumerate(self.layers):
                            if is_leader:
                                torch.cuda._sleep(sleeps[u][i])
                                buf = self.state.logical(self.base)
                                buf[:n].fill_(-1)
                                buf[:n].copy_(leader_values(io["x"][u], i))
                                view = self.state.group_view(group)
                                set_logical_topk_ready(group if view is None else view, index)
                            topk = self.state.logical(self.base)[:n]
                            view = self.state.group_view(group)
                            phys, valid = convert_once(group if view is None else view, index, topk,
                                                       io["req"][u], io["bt"][u])
                            io["out_l"][u][i].copy_(topk)
                            io["out_p"][u][i].copy_(phys)
                            io["out_v"][u][i].copy_(valid)
                            if yields[u][i]:
                                pp.yield_(u)
                finally:
                    pp.exit(u)
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=body, args=(u,), daemon=True) for u in range(2)]
        for t in threads:
            t.start()
        pp.wake[0].set()
        for t in threads:
            t.join(timeout=120)
        assert not any(t.is_alive() for t in threads), f"microbatch threads hung: {errors!r}"
        if errors:
            raise errors[0]
        origin.wait_stream(other)

    def check(self, io: dict[str, list[torch.Tensor]]) -> tuple[int, int]:
        """(mismatching (microbatch, layer) pairs, of which reads of the other microbatch's top-k)."""
        bad = cross = 0
        for u in range(2):
            for i in range(NUM_LAYERS):
                lead = self.leader_of[i]
                ref_l = leader_values(io["x"][u], lead)
                ref_p, ref_v = convert(io["req"][u], io["bt"][u], ref_l)
                ok = (torch.equal(io["out_l"][u][i], ref_l) and torch.equal(io["out_p"][u][i], ref_p)
                      and torch.equal(io["out_v"][u][i], ref_v))
                if not ok:
                    bad += 1
                    m = min(io["x"][0].shape[0], io["x"][1].shape[0])
                    other_l = leader_values(io["x"][1 - u], lead)
                    if torch.equal(io["out_l"][u][i][:m], other_l[:m]):
                        cross += 1
        return bad, cross


def _run(layout: TopkLayout, device: torch.device, graphs: bool, pinned: bool = False) -> dict[str, Any]:
    h = Harness(layout, device, pinned_to_ubatch0=pinned)
    rng = random.Random(1234)
    gen = torch.Generator().manual_seed(5678)
    summary = {"layout": layout.value, "pinned_to_ubatch0": pinned, "eager_trials": 0, "graph_replays": 0,
               "mismatches": 0, "cross_reads": 0, "extra_bytes": h.state.extra_bytes(),
               "groups_with_state": h.state.num_groups()}
    main = torch.cuda.Stream()
    other = torch.cuda.Stream()
    for trial in range(EAGER_TRIALS):
        io = h.inputs(STEPS[trial % len(STEPS)])
        h.refill(io, gen)
        main.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(main):
            h.step(io, rng, main, other)
        torch.cuda.current_stream().wait_stream(main)
        torch.cuda.synchronize()
        bad, cross = h.check(io)
        summary["eager_trials"] += 1
        summary["mismatches"] += bad
        summary["cross_reads"] += cross
    if graphs:
        for total in STEPS:
            for _ in range(GRAPH_PATTERNS):
                io = h.inputs(total)
                h.refill(io, gen)
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                capture = torch.cuda.Stream()
                with torch.cuda.graph(graph, stream=capture):
                    h.step(io, rng, capture, other)
                torch.cuda.synchronize()
                for _ in range(GRAPH_REPLAYS):
                    h.refill(io, gen)
                    torch.cuda.synchronize()
                    graph.replay()
                    torch.cuda.synchronize()
                    bad, cross = h.check(io)
                    summary["graph_replays"] += 1
                    summary["mismatches"] += bad
                    summary["cross_reads"] += cross
                del graph
    return summary


def _report(out_dir: pathlib.Path | None, name: str, summary: dict[str, Any]) -> None:
    summary = dict(summary)
    summary.update(
        device=torch.cuda.get_device_name(),
        torch=torch.__version__,
        cuda=torch.version.cuda,
        date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    )
    print(f"TOPK_ISOLATION {name}: " + json.dumps(summary, sort_keys=True))
    if out_dir is not None:
        (out_dir / f"topk_isolation_{name}.json").write_text(json.dumps(summary, indent=2, sort_keys=True))


@pytest.mark.parametrize("layout", list(TopkLayout))
def test_no_cross_microbatch_reads_eager_and_full_graph(
    cuda_device: torch.device, out_dir: pathlib.Path | None, layout: TopkLayout
) -> None:
    summary = _run(layout, cuda_device, graphs=True)
    _report(out_dir, layout.value, summary)
    assert summary["groups_with_state"] == 3
    assert summary["eager_trials"] >= 100 and summary["graph_replays"] >= 100
    assert summary["mismatches"] == 0 and summary["cross_reads"] == 0
    if layout is TopkLayout.WINDOWS:
        assert summary["extra_bytes"] == 0
    else:
        assert summary["extra_bytes"] == MAX_TOKENS * TOPK * 4 + 3 * (DECODE_ROWS + 1) * (TOPK * 4 + 4)


def test_control_resolver_pinned_to_ubatch0_is_caught(cuda_device: torch.device, out_dir: pathlib.Path | None) -> None:
    summary = _run(TopkLayout.WINDOWS, cuda_device, graphs=False, pinned=True)
    _report(out_dir, "control_pinned_ubatch0", summary)
    assert summary["mismatches"] > 0


def live_events() -> int:
    """``torch.cuda.Event`` objects alive in the process, counted by the collector: no weak reference to one.
    Objects frozen before this module (``gc.freeze`` in ``tests/conftest.py``) are invisible to it, so count
    before and after, never against zero."""
    import gc

    return sum(1 for obj in gc.get_objects() if isinstance(obj, torch.cuda.Event))


def _build_and_run_dropped(
    layout: TopkLayout, device: torch.device
) -> tuple[UbatchTopkState, list[tuple[str, Any]], int, int]:
    """A model's life: build, run both step sizes eagerly, drop it; returns (registry, weakrefs to what the model
    owned -- logical buffer, groups, workspaces, per-microbatch state and copies --, device bytes allocated while
    the model was alive, CUDA events alive then). Only weak references and counts leave this frame.

    No weak reference to a ``torch.cuda.Stream`` or ``torch.cuda.Event``: with torch 2.11.0+cu130 one to a used
    stream made the process segfault at a later garbage collection, and with only the events' the same twin
    segfaulted once more, when the test's frame released them (docs/accuracy.md). Events are counted instead
    (``live_events``); a side stream holds no device memory and lives exactly as long as its group, whose weak
    reference is watched."""
    import weakref

    from dbo_runtime.services.topk_state import STATE_ATTR

    h = Harness(layout, device)
    rng = random.Random(7)
    gen = torch.Generator().manual_seed(7)
    main = torch.cuda.Stream()
    other = torch.cuda.Stream()
    for total in STEPS:
        io = h.inputs(total)
        h.refill(io, gen)
        main.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(main):
            h.step(io, rng, main, other)
        torch.cuda.current_stream().wait_stream(main)
    torch.cuda.synchronize()
    watched: list[tuple[str, Any]] = [("logical top-k buffer", weakref.ref(h.base)), ("harness", weakref.ref(h))]
    groups = {id(g): g for g, _, _ in h.layers}
    for n, group in enumerate(groups.values()):
        watched += [(f"group {n}", weakref.ref(group)), (f"physical workspace {n}", weakref.ref(group.physical_topk_indices))]
        group_state = group.__dict__.get(STATE_ATTR)
        if group_state is not None:
            watched += [(f"group state {n}", weakref.ref(group_state))]
            watched += [(f"physical copy {n}/{k}", weakref.ref(p)) for k, (p, _) in enumerate(group_state.copies)]
            watched += [(f"logical copy {k}", weakref.ref(t)) for k, t in enumerate(group_state.logical.copies)]
    return h.state, watched, torch.cuda.memory_allocated(device), live_events()


@pytest.mark.parametrize("layout", list(TopkLayout))
def test_dropping_the_model_frees_all_per_microbatch_state(
    cuda_device: torch.device, out_dir: pathlib.Path | None, layout: TopkLayout
) -> None:
    """Twin of tests/vllm/test_topk_teardown.py with real CUDA tensors, streams and events: after the model
    (here the harness: logical buffer, groups) is dropped, device memory is back where it was."""
    import gc

    gc.collect()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated(cuda_device)
    events_before = live_events()
    state, watched, alive, events_alive = _build_and_run_dropped(layout, cuda_device)
    gc.collect()
    torch.cuda.synchronize()
    after = torch.cuda.memory_allocated(cuda_device)
    events_after = live_events()
    kept = [name for name, ref in watched if ref() is not None]
    summary = {"layout": layout.value, "bytes_before": before, "bytes_with_model": alive, "bytes_after": after,
               "watched": len(watched), "kept_alive": kept, "events_before": events_before,
               "events_with_model": events_alive, "events_after": events_after}  # fmt: skip
    _report(out_dir, f"teardown_{layout.value}", summary)
    assert alive > before  # the model really lived on the GPU
    assert events_alive > events_before  # its per-microbatch events are visible to the count
    assert kept == [], f"outlived the model: {kept[:6]} (+{max(0, len(kept) - 6)})"
    assert after == before, f"{after - before} device bytes kept alive after the model was dropped"
    assert events_after == events_before, f"{events_after - events_before} CUDA events outlived the model"
    assert state.num_groups() == 0 and state.extra_bytes() == 0
