"""Per-microbatch shared top-k state for DSA layers that reuse an earlier layer's top-k (vllm#60734, #56476).

GLM-5.x runs the indexer only on leader layers and its followers reuse the leader's top-k through state with
no microbatch dimension (the model-wide logical buffer and, per index group, the physical indices, valid counts
and ready events); DeepSeek-V4.1 does the same through its model buffers alone. DBO yields between layers, so
the other microbatch overwrites that state in between (GSM8K 0.93 -> 0.61). Each microbatch after the first
gets its own view, resolved by the calling thread's microbatch id and token offset (an injected locator).
Groups without followers are never attached and cost nothing. Layouts (``TopkLayout``): ``COPIES`` is
upstream's (one buffer and one workspace per extra microbatch; 216 MiB for GLM-5.3, ``docs/topk-memory.md``);
``WINDOWS`` (default) allocates nothing: microbatch *i* uses the rows from its token offset, correct because
vLLM's microbatch slices are consecutive and disjoint, every reader and writer indexes from row 0 of its own
slice, and the padded total never exceeds ``max_num_batched_tokens``; a FULL graph's split point is fixed per
graph size, so replays reuse the same disjoint rows. One writer can pass a window's end: vLLM's padded decode path
(MTP, a decode batch whose lengths differ, as when the split cuts a request in two) writes ``B x next_n`` top-k
rows, more than the microbatch's tokens, and a window past the split holds only the rows after it; so where
``window_end_reachable`` says a configuration can get there, the layout is ``COPIES`` (each a full buffer). A
window that does not fit the physical workspace makes vLLM's ``_convert_once`` convert per layer from the
(windowed) logical buffer, as upstream does for any step larger than the workspace. No vLLM import: tensors, events
and streams are duck-typed (the GPU twin drives the same code with real CUDA objects).
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from dbo_runtime.core.errors import DboRuntimeError
from dbo_runtime.core.log import get_logger
from dbo_runtime.core.settings import LAYOUT_ENV, TopkLayout, parse_layout

logger = get_logger("dbo_runtime.topk_state")

UbatchLocator = Callable[[], tuple[int, int]]
"""Returns ``(microbatch id, token offset)`` of the calling thread; ``(0, 0)`` outside DBO."""

def window_end_reachable(max_decode_rows: int, max_num_batched_tokens: int, next_n: int, num_ubatches: int) -> bool:
    """Whether a microbatch after the first can need more top-k rows than its window holds.

    A window past a split starts at most at ``max_num_batched_tokens * (n - 1) / n`` and so holds at least
    ``max_num_batched_tokens // n`` rows. Without speculative tokens every decode request is one row, one token, and
    no microbatch writes past its tokens. With ``next_n > 1`` vLLM's padded decode path writes ``next_n`` rows for
    each request of the microbatch, padding requests included: at most ``max_decode_rows``, the larger of
    ``max_num_seqs * next_n`` and, under FULL CUDA graphs, the largest capture size (a uniform decode batch is
    padded with requests up to it)."""
    if next_n <= 1 or num_ubatches < 2:
        return False
    return max_decode_rows > max_num_batched_tokens // num_ubatches


# -- per-microbatch views ------------------------------------------------------------------------
@dataclass
class GroupView:
    """What ``SparseMLAIndexGroup._convert_once`` / ``set_logical_topk_ready`` read, for one microbatch.

    vLLM's methods run unchanged on this object (they only read these fields),
    so the conversion algorithm stays upstream's.
    """

    logical_topk_indices: Any
    physical_topk_indices: Any
    valid_topk_counts: Any
    side_stream: Any
    logical_topk_ready: Any
    physical_topk_ready: Any
    has_indexer: bool
    num_layers: int
    stream_of: Any = None
    """The group class's ``_current_stream`` (vLLM 0.34's methods call ``self._current_stream()``), taken unbound so
    the view holds no reference to the group; it reads no field of the group. None where the class has none."""

    def _current_stream(self) -> Any:
        return self.stream_of(self)


STATE_ATTR = "_dbo_runtime_topk_state"
"""Attribute under which an attached index group carries its own per-microbatch state."""


class _LogicalState:
    """Per-microbatch views (``WINDOWS``) or copies (``COPIES``) of one logical top-k buffer.

    Owned by the ``_GroupState`` of every attached group that reads this buffer;
    the registry holds it only weakly.
    """

    def __init__(self, base: torch.Tensor, layout: TopkLayout, num_ubatches: int) -> None:
        self.base_ref = weakref.ref(base)
        self.base_rows = int(base.shape[0])
        self.layout = layout
        self.num_ubatches = num_ubatches
        self.copies = [torch.empty_like(base) for _ in range(num_ubatches - 1)] if layout is TopkLayout.COPIES else []
        self.cache: dict[int, tuple[int, torch.Tensor]] = {}
        """``ubatch -> (token offset, its buffer)``, written only by that microbatch's thread; an entry is
        made after the registry checked the pair, so a hit needs no check."""

    def resolve(self, base: torch.Tensor, ubatch: int, offset: int) -> torch.Tensor:
        """Microbatch ``ubatch``'s buffer, remembered per microbatch with the offset it was made for: the
        registry's hot path returns a remembered one without calling here (``UbatchTopkState.logical``)."""
        view = self.copies[ubatch - 1] if self.layout is TopkLayout.COPIES else base[offset:]
        self.cache[ubatch] = (offset, view)
        return view

    def nbytes(self) -> int:
        return sum(c.numel() * c.element_size() for c in self.copies)


class _GroupState:
    """Per-microbatch events, workspaces (``COPIES``) and cached views of one index group.

    Stored on the group itself (``STATE_ATTR``), so it lives exactly as long as
    the group. It never references the group (only its tensors and stream), so
    there is no cycle to wait for the garbage collector on.
    """

    def __init__(
        self,
        owner: UbatchTopkState,
        group: Any,
        logical: _LogicalState,
        layout: TopkLayout,
        num_ubatches: int,
        make_event: Callable[[], Any],
    ) -> None:
        self.owner = owner
        self.logical = logical
        self.layout = layout
        self.events = [(make_event(), make_event()) for _ in range(num_ubatches - 1)]
        self.copies: list[tuple[torch.Tensor, torch.Tensor]] = []
        if layout is TopkLayout.COPIES:
            self.copies = [
                (torch.empty_like(group.physical_topk_indices), torch.empty_like(group.valid_topk_counts))
                for _ in range(num_ubatches - 1)
            ]
        self.cache: dict[int, tuple[int, GroupView]] = {}
        """``ubatch -> (token offset, its view)``, as ``_LogicalState.cache``: a hit needs no check."""

    def view(self, group: Any, ubatch: int, offset: int) -> GroupView:
        """Microbatch ``ubatch``'s view, made and remembered; the registry's hot path returns a remembered one."""
        logical_ready, physical_ready = self.events[ubatch - 1]
        if self.layout is TopkLayout.COPIES:
            physical, valid = self.copies[ubatch - 1]
        else:
            physical = group.physical_topk_indices[offset:]
            valid = group.valid_topk_counts[offset:]
        view = GroupView(
            logical_topk_indices=group.logical_topk_indices,
            physical_topk_indices=physical,
            valid_topk_counts=valid,
            side_stream=group.side_stream,
            logical_topk_ready=logical_ready,
            physical_topk_ready=physical_ready,
            has_indexer=group.has_indexer,
            num_layers=group.num_layers,
            stream_of=getattr(type(group), "_current_stream", None),
        )
        self.cache[ubatch] = (offset, view)
        return view

    def nbytes(self) -> int:
        return sum(p.numel() * p.element_size() + v.numel() * v.element_size() for p, v in self.copies)


class UbatchTopkState:
    """Registry of the logical buffers and index groups that need per-microbatch state (one per process).

    Built on one thread at model construction; the hot path (``logical``, ``group_view``) only reads dicts and
    is safe from the microbatch threads. It holds nothing strongly: the state is anchored on what needs it (an
    attached group carries its ``_GroupState``, which holds its buffer's ``_LogicalState``; a model buffer's
    views hang on its module), so dropping the model frees every view and copy by reference counting, on the
    dropping thread. vLLM has no model-teardown callback, and a ``weakref.finalize`` would run inside the
    garbage collector, possibly on a microbatch thread mid-lookup.
    """

    def __init__(self, locate: UbatchLocator, layout: TopkLayout | None = None) -> None:
        # Held strongly, so ``locate`` must not reference the model (vLLM's is a module-level function,
        # ``ubatch_ids.current_ubatch``): a closure over the model would keep it alive as long as the registry.
        self.locate = locate
        self.layout: TopkLayout | None = layout
        """``None``: read ``DBO_RUNTIME_TOPK_LAYOUT`` at the first ``attach`` (model construction)."""
        self._layout_given = layout
        """What ``clear`` returns ``layout`` to: a later model in the process reads the setting in force then."""
        self.windows_unsafe: str | None = None
        """Why ``WINDOWS`` is not safe in this process (a cache keyed on a window's length that dbo_runtime could
        not key on the whole buffer), or None. Then the default layout is ``COPIES``."""
        self.windows_too_short: str | None = None
        """Why a window can be shorter than what vLLM writes into it (``window_end_reachable``), or None. Then the
        layout is ``COPIES`` whatever ``DBO_RUNTIME_TOPK_LAYOUT`` asks: a write past a window's end is no choice."""
        self._lock = threading.Lock()
        self._model_buffers: dict[int, weakref.ref[torch.Tensor]] = {}
        self._logical: dict[int, weakref.ref[_LogicalState]] = {}
        self._groups: dict[int, weakref.ref[Any]] = {}

    # -- construction (model build) ------------------------------------------------------------
    def mark_model_buffer(self, tensor: Any) -> None:
        """Record a logical buffer whose every writer and reader resolves through this registry."""
        if isinstance(tensor, torch.Tensor):
            with self._lock:
                self._model_buffers[id(tensor)] = weakref.ref(tensor)

    def is_model_buffer(self, tensor: Any) -> bool:
        ref = self._model_buffers.get(id(tensor))
        return ref is not None and ref() is tensor

    def attach(self, group: Any, num_ubatches: int, make_event: Callable[[], Any]) -> None:
        """Give ``group`` (which now has a follower) and its logical buffer per-microbatch state.

        Idempotent. Allocates (``COPIES`` only) right here, at model
        construction, so vLLM's KV-cache memory profile accounts for it. The
        state lives as long as ``group`` does (see the class docstring).
        """
        if num_ubatches < 2:
            return
        base = group.logical_topk_indices
        with self._lock:
            self._prune()
            layout = self._settle_layout()
            if self._group_state(group) is not None:
                return
            ref = self._logical.get(id(base))
            logical = ref() if ref is not None else None
            if logical is None or logical.base_ref() is not base:
                logical = _LogicalState(base, layout, num_ubatches)
                self._logical[id(base)] = weakref.ref(logical)
            setattr(group, STATE_ATTR, _GroupState(self, group, logical, layout, num_ubatches, make_event))
            self._groups[id(group)] = weakref.ref(group)

    def register_logical(self, base: Any, num_ubatches: int) -> _LogicalState | None:
        """Give a model-wide buffer that layers hand to each other per-microbatch views, without an index
        group (DeepSeek-V4.1 shares top-k through its model buffers alone). The caller anchors the returned
        state on the module that owns ``base``; the registry keeps a weak reference, as for groups."""
        if num_ubatches < 2 or not isinstance(base, torch.Tensor):
            return None
        with self._lock:
            self._prune()
            layout = self._settle_layout()
            ref = self._logical.get(id(base))
            state = ref() if ref is not None else None
            if state is None or state.base_ref() is not base:
                state = _LogicalState(base, layout, num_ubatches)
                self._logical[id(base)] = weakref.ref(state)
            return state

    def _settle_layout(self) -> TopkLayout:
        """The layout for a new buffer (caller holds the lock): chosen at the first one, and again where windows
        were chosen and a later buffer's engine can write past a window's end."""
        if self.layout is None or (self.layout is TopkLayout.WINDOWS and self.windows_too_short is not None):
            self.layout = self._chosen_layout()
        return self.layout

    def _chosen_layout(self) -> TopkLayout:
        """``DBO_RUNTIME_TOPK_LAYOUT``, with ``COPIES`` in two cases: always where a window can be shorter than what
        vLLM writes into it (``windows_too_short``), and instead of the default ``WINDOWS`` where a window per split
        point would grow a never-evicted cache (``windows_unsafe``). Said once, at model build."""
        raw = os.environ.get(LAYOUT_ENV)
        layout = parse_layout(raw)
        if layout is TopkLayout.WINDOWS and self.windows_too_short is not None:
            logger.warning(
                "dbo_runtime: per-microbatch top-k uses the copies layout (extra device memory, counted in vLLM's "
                "profile)%s: %s", "" if raw is None or raw.strip() == "" else f", not {LAYOUT_ENV}=windows",
                self.windows_too_short,
            )
            return TopkLayout.COPIES
        if layout is not TopkLayout.WINDOWS or self.windows_unsafe is None:
            return layout
        if raw is None or raw.strip() == "":
            logger.warning(
                "dbo_runtime: per-microbatch top-k uses the copies layout (extra device memory, counted in vLLM's "
                "profile) instead of windows: %s", self.windows_unsafe,
            )
            return TopkLayout.COPIES
        logger.warning(
            "dbo_runtime: %s=windows kept as asked, although %s; unset it (or set copies) to avoid that",
            LAYOUT_ENV, self.windows_unsafe,
        )
        return layout

    def _prune(self) -> None:
        """Drop registry entries whose object is gone (caller holds the lock)."""
        for table in (self._model_buffers, self._logical, self._groups):
            for key in [k for k, ref in table.items() if ref() is None]:
                del table[key]

    def attached_alive(self) -> int:
        """How many attached index groups and model buffers are still alive (a model that may still run DBO)."""
        with self._lock:
            self._prune()
            return len(self._groups) + len(self._model_buffers)

    def clear(self) -> None:
        with self._lock:
            for ref in list(self._groups.values()):
                group = ref()
                if group is not None and self._group_state(group) is not None:
                    delattr(group, STATE_ATTR)
            self._model_buffers.clear()
            self._logical.clear()
            self._groups.clear()
            self.layout = self._layout_given
            self.windows_unsafe = None
            self.windows_too_short = None

    # -- hot path ----------------------------------------------------------------------------------
    def _group_state(self, group: Any) -> _GroupState | None:
        try:
            state = group.__dict__.get(STATE_ATTR)
        except AttributeError:  # a group without a __dict__ was never attached
            return None
        return state if state is not None and state.owner is self else None

    def _check(self, ubatch: int, offset: int, num_ubatches: int) -> None:
        if ubatch >= num_ubatches:
            raise DboRuntimeError(
                f"microbatch {ubatch} resolved top-k state built for {num_ubatches} microbatches "
                "(parallel_config.num_ubatches changed after model construction?)"
            )
        if ubatch > 0 and offset <= 0 and self.layout is not TopkLayout.COPIES:
            raise DboRuntimeError(
                f"microbatch {ubatch} has token offset {offset}: top-k windows need vLLM's "
                "make_ubatch_contexts(token_offsets=...) (or set DBO_RUNTIME_TOPK_LAYOUT=copies)"
            )

    def logical(self, tensor: Any) -> Any:
        """The calling microbatch's logical top-k buffer for ``tensor`` (itself when not shared)."""
        if not self._logical:
            return tensor
        ubatch, offset = self.locate()  # first: outside a microbatch thread nothing else is looked up
        if ubatch == 0:
            return tensor
        ref = self._logical.get(id(tensor))
        state = ref() if ref is not None else None
        if state is None or state.base_ref() is not tensor:
            return tensor
        hit = state.cache.get(ubatch)
        if hit is not None and hit[0] == offset:
            return hit[1]  # every layer after the first in a step: no check and no call
        self._check(ubatch, offset, state.num_ubatches)
        return state.resolve(tensor, ubatch, offset)

    def group_view(self, group: Any) -> GroupView | None:
        """The calling microbatch's view of ``group``; ``None`` means "use the group itself"."""
        state = self._group_state(group)
        if state is None:
            return None
        ubatch, offset = self.locate()
        if ubatch == 0:
            return None
        hit = state.cache.get(ubatch)
        if hit is not None and hit[0] == offset:
            return hit[1]
        self._check(ubatch, offset, len(state.events) + 1)
        return state.view(group, ubatch, offset)

    # -- introspection -----------------------------------------------------------------------------
    def is_attached(self, group: Any) -> bool:
        return self._group_state(group) is not None

    def _live_group_states(self) -> list[_GroupState]:
        with self._lock:
            self._prune()
            groups = [ref() for ref in self._groups.values()]
        states = [self._group_state(g) for g in groups if g is not None]
        return [s for s in states if s is not None]

    def max_logical_rows(self) -> int:
        """Rows of the largest shared logical buffer (0 when none is attached)."""
        live = [ref() for ref in list(self._logical.values())]
        return max((state.base_rows for state in live if state is not None), default=0)

    def num_groups(self) -> int:
        return len(self._live_group_states())

    def extra_bytes(self) -> int:
        """Device bytes allocated for microbatches after the first (0 with ``WINDOWS``)."""
        states = self._live_group_states()
        with self._lock:
            logical = {id(st): st for st in (ref() for ref in self._logical.values()) if st is not None}
        return sum(s.nbytes() for s in logical.values()) + sum(s.nbytes() for s in states)

    def num_logical(self) -> int:
        """Live shared logical buffers (index-group buffers and model buffers registered directly)."""
        with self._lock:
            self._prune()
            return len(self._logical)


__all__ = ["LAYOUT_ENV", "GroupView", "TopkLayout", "UbatchTopkState", "parse_layout", "window_end_reachable"]
