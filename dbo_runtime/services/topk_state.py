"""Per-microbatch views of shared top-k state (vllm#60734, #56476), which the other microbatch overwrites between
layers, found by the thread's microbatch id and token offset: ``WINDOWS`` (default) are the rows from that offset,
``COPIES`` (upstream's design) allocate. No vLLM import."""

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
"""``(microbatch id, token offset)`` of the calling thread; ``(0, 0)`` outside DBO."""

def window_end_reachable(max_decode_rows: int, max_num_batched_tokens: int, next_n: int, num_ubatches: int) -> bool:
    """Whether a microbatch after the first can need more top-k rows than its window holds: with ``next_n > 1``
    the padded decode path writes up to ``max_decode_rows``; a window holds ``max_num_batched_tokens // n``."""
    if next_n <= 1 or num_ubatches < 2:
        return False
    return max_decode_rows > max_num_batched_tokens // num_ubatches


@dataclass
class GroupView:
    """What the group's methods read, for one microbatch."""

    logical_topk_indices: Any
    physical_topk_indices: Any
    valid_topk_counts: Any
    side_stream: Any
    logical_topk_ready: Any
    physical_topk_ready: Any
    has_indexer: bool
    num_layers: int
    stream_of: Any = None
    """The group class's ``_current_stream``, as the view's methods call it."""

    def _current_stream(self) -> Any:
        return self.stream_of(self)


STATE_ATTR = "_dbo_runtime_topk_state"
"""Where an attached index group carries its per-microbatch state."""


class _LogicalState:
    """Per-microbatch views (``WINDOWS``) or copies (``COPIES``) of one logical top-k buffer."""

    def __init__(self, base: torch.Tensor, layout: TopkLayout, num_ubatches: int) -> None:
        self.base_ref = weakref.ref(base)
        self.base_rows = int(base.shape[0])
        self.layout = layout
        self.num_ubatches = num_ubatches
        self.copies = [torch.empty_like(base) for _ in range(num_ubatches - 1)] if layout is TopkLayout.COPIES else []
        self.cache: dict[int, tuple[int, torch.Tensor]] = {}
        """``ubatch -> (token offset, buffer)``, written only by that microbatch's thread."""

    def resolve(self, base: torch.Tensor, ubatch: int, offset: int) -> torch.Tensor:
        """Microbatch ``ubatch``'s buffer, remembered with its offset."""
        view = self.copies[ubatch - 1] if self.layout is TopkLayout.COPIES else base[offset:]
        self.cache[ubatch] = (offset, view)
        return view

    def nbytes(self) -> int:
        return sum(c.numel() * c.element_size() for c in self.copies)


class _GroupState:
    """Per-microbatch events, workspaces and cached views of one index group."""

    def __init__(
        self, owner: UbatchTopkState, group: Any, logical: _LogicalState, layout: TopkLayout, num_ubatches: int,
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

    def view(self, group: Any, ubatch: int, offset: int) -> GroupView:
        """Microbatch ``ubatch``'s view, made and remembered."""
        logical_ready, physical_ready = self.events[ubatch - 1]
        if self.layout is TopkLayout.COPIES:
            physical, valid = self.copies[ubatch - 1]
        else:
            physical = group.physical_topk_indices[offset:]
            valid = group.valid_topk_counts[offset:]
        view = GroupView(
            logical_topk_indices=group.logical_topk_indices, physical_topk_indices=physical, valid_topk_counts=valid,
            side_stream=group.side_stream, logical_topk_ready=logical_ready, physical_topk_ready=physical_ready,
            has_indexer=group.has_indexer, num_layers=group.num_layers,
            stream_of=getattr(type(group), "_current_stream", None),
        )
        self.cache[ubatch] = (offset, view)
        return view

    def nbytes(self) -> int:
        return sum(p.numel() * p.element_size() + v.numel() * v.element_size() for p, v in self.copies)


class UbatchTopkState:
    """Registry of the buffers and index groups that need per-microbatch state (one per process), built at model
    construction; the hot path only reads dicts. Weak references only: dropping the model frees the state by
    reference counting (a ``weakref.finalize`` could run on a microbatch thread)."""

    def __init__(self, locate: UbatchLocator, layout: TopkLayout | None = None) -> None:
        # held strongly: ``locate`` must not close over the model
        self.locate = locate
        self.layout: TopkLayout | None = layout
        """``None``: read the setting at the first ``attach``."""
        self._layout_given = layout
        self.windows_unsafe: str | None = None
        """Why ``WINDOWS`` is unsafe here, or None: then the default is ``COPIES``."""
        self.windows_too_short: str | None = None
        """Why a window can be shorter than vLLM's writes into it, or None: then always ``COPIES``."""
        self._lock = threading.Lock()
        self._model_buffers: dict[int, weakref.ref[torch.Tensor]] = {}
        self._logical: dict[int, weakref.ref[_LogicalState]] = {}
        self._groups: dict[int, weakref.ref[Any]] = {}

    def mark_model_buffer(self, tensor: Any) -> None:
        if isinstance(tensor, torch.Tensor):
            with self._lock:
                self._model_buffers[id(tensor)] = weakref.ref(tensor)

    def is_model_buffer(self, tensor: Any) -> bool:
        ref = self._model_buffers.get(id(tensor))
        return ref is not None and ref() is tensor

    def attach(self, group: Any, num_ubatches: int, make_event: Callable[[], Any]) -> None:
        """Give ``group`` (now led) and its buffer per-microbatch state; ``COPIES`` allocate here, in vLLM's profile."""
        if num_ubatches < 2:
            return
        base = group.logical_topk_indices
        with self._lock:
            self._prune()
            layout = self._settle_layout()
            if self._group_state(group) is not None:
                return
            logical = self._logical_for(base, layout, num_ubatches)
            setattr(group, STATE_ATTR, _GroupState(self, group, logical, layout, num_ubatches, make_event))
            self._groups[id(group)] = weakref.ref(group)

    def register_logical(self, base: Any, num_ubatches: int) -> _LogicalState | None:
        """Per-microbatch views of a model-wide buffer with no index group; the caller anchors the state."""
        if num_ubatches < 2 or not isinstance(base, torch.Tensor):
            return None
        with self._lock:
            self._prune()
            return self._logical_for(base, self._settle_layout(), num_ubatches)

    def _logical_for(self, base: torch.Tensor, layout: TopkLayout, num_ubatches: int) -> _LogicalState:
        """``base``'s state, found or created (caller holds the lock)."""
        ref = self._logical.get(id(base))
        state = ref() if ref is not None else None
        if state is None or state.base_ref() is not base:
            state = _LogicalState(base, layout, num_ubatches)
            self._logical[id(base)] = weakref.ref(state)
        return state

    def _settle_layout(self) -> TopkLayout:
        """The layout for a new buffer (caller holds the lock)."""
        if self.layout is None or (self.layout is TopkLayout.WINDOWS and self.windows_too_short is not None):
            self.layout = self._chosen_layout()
        return self.layout

    def _chosen_layout(self) -> TopkLayout:
        """The setting, or ``COPIES`` where windows are too short or unsafe; said once."""
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
        """Drop dead entries (caller holds the lock)."""
        for table in (self._model_buffers, self._logical, self._groups):
            for key in [k for k, ref in table.items() if ref() is None]:
                del table[key]

    def attached_alive(self) -> int:
        """Attached groups and model buffers still alive."""
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
        """The calling microbatch's logical top-k buffer for ``tensor``."""
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

    def is_attached(self, group: Any) -> bool:
        return self._group_state(group) is not None

    def _live_group_states(self) -> list[_GroupState]:
        with self._lock:
            self._prune()
            groups = [ref() for ref in self._groups.values()]
        states = [self._group_state(g) for g in groups if g is not None]
        return [s for s in states if s is not None]

    def max_logical_rows(self) -> int:
        live = [ref() for ref in list(self._logical.values())]
        return max((state.base_rows for state in live if state is not None), default=0)

    def num_groups(self) -> int:
        return len(self._live_group_states())

    def extra_bytes(self) -> int:
        """Device bytes for microbatches after the first (0 with ``WINDOWS``)."""
        states = self._live_group_states()
        with self._lock:
            logical = {id(st): st for st in (ref() for ref in self._logical.values()) if st is not None}
        return sum(s.nbytes() for s in logical.values()) + sum(s.nbytes() for s in states)

    def num_logical(self) -> int:
        with self._lock:
            self._prune()
            return len(self._logical)
