"""The identity of the CUDA-graph capture the current stream belongs to.

PyTorch exposes only ``torch.cuda.is_current_stream_capturing()``. The
schedule cache needs more: a re-plan recorded into one capture may be reused by
later indexer layers of *the same* capture only -- a graph-pool tensor read by
another graph is whatever that other graph's last replay left there. CUDA gives
every capture sequence an id (``cudaStreamGetCaptureInfo``); streams joined to
a capture through events share it. We read it through the CUDA runtime library
torch already loaded, with ctypes. When the library or symbol cannot be found
the answer is None and callers must assume nothing is shared (record again).

Not on the hot path: only called while a capture is underway. The entry point is looked up
before any capture (``prepare_capture_id``, at indexer-builder registration of a DBO engine).
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any

from dbo_runtime.core.log import get_logger

logger = get_logger(__name__)

_CAPTURE_ACTIVE = 1  # cudaStreamCaptureStatusActive


def _loaded_cudart_paths() -> list[str]:
    paths: list[str] = []
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.rsplit(" ", 1)[-1].strip()
                if "libcudart.so" in path and path not in paths:
                    paths.append(path)
    except (OSError, ValueError):  # no /proc, or a mapped path that is not text: the fixed names below remain
        pass
    return paths


_RUNTIME_SYMBOLS = ("cudaStreamGetCaptureInfo_v3", "cudaStreamGetCaptureInfo_v2", "cudaStreamGetCaptureInfo")
_DRIVER_SYMBOLS = ("cuStreamGetCaptureInfo_v3", "cuStreamGetCaptureInfo_v2", "cuStreamGetCaptureInfo")


def prepare_capture_id() -> None:
    """Find the capture-info entry point now, outside any capture: the search reads ``/proc/self/maps`` and
    dlopens libraries, which must not happen at the first re-plan inside a capture. Never raises."""
    try:
        _get_capture_info()
    except Exception as exc:  # an unreadable map or a broken library: capture_id() answers None, as without one
        logger.warning("dbo_runtime: stream capture-info lookup failed (%r); captured re-plans are not shared", exc)


@functools.cache
def _get_capture_info() -> Any | None:
    """First usable capture-info entry point: the runtime torch loaded, then the driver.

    Every variant (legacy v1, v2, v3, CUDA 13's) starts with ``(stream, status*, id*)`` and takes
    only optional outputs after that, so calling with four extra NULLs is valid for each of them
    (x86-64 SysV: surplus trailing arguments are ignored by the callee). Status 1 means "active"
    in both the runtime and the driver enum.
    """
    libraries = [*_loaded_cudart_paths(), "libcudart.so.13", "libcudart.so.12", "libcudart.so"]
    attempts = [(path, _RUNTIME_SYMBOLS) for path in libraries] + [("libcuda.so.1", _DRIVER_SYMBOLS)]
    for path, symbols in attempts:
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for symbol in symbols:
            fn = getattr(lib, symbol, None)
            if fn is None:
                continue
            fn.restype = ctypes.c_int
            fn.argtypes = [
                ctypes.c_void_p,
                ctypes.POINTER(ctypes.c_int),
                ctypes.POINTER(ctypes.c_ulonglong),
                ctypes.c_void_p,
                ctypes.c_void_p,
                ctypes.c_void_p,
                ctypes.c_void_p,
            ]
            return fn
    logger.warning("dbo_runtime: no stream capture-info entry point; captured re-plans are not shared between layers")
    return None


def capture_id(stream_handle: int | None = None) -> int | None:
    """Capture-sequence id of ``stream_handle`` (default: torch's current stream), None when not capturing."""
    import torch

    if stream_handle is None:
        stream_handle = torch.cuda.current_stream().cuda_stream
    try:
        fn = _get_capture_info()
    except Exception:  # prepare_capture_id() logged it; every capture records its own re-plan
        return None
    if fn is None:
        return None
    status = ctypes.c_int(0)
    ident = ctypes.c_ulonglong(0)
    err = fn(ctypes.c_void_p(stream_handle), ctypes.byref(status), ctypes.byref(ident), None, None, None, None)
    if err != 0 or status.value != _CAPTURE_ACTIVE:
        return None
    return int(ident.value)


class CaptureCounter:
    """How many torch CUDA-graph captures are in progress in this process, if we are told.

    ``torch.cuda.is_current_stream_capturing()`` costs 300-650 ns on the H200
    host (a runtime call through the current-stream lookup), more than the
    whole budget of the indexer call site, which runs once per indexer layer.
    Captures are rare (engine start), so the call site first reads this
    counter: with ``installed`` and ``active == 0`` no capture can be underway
    and the precise check is skipped. ``installed`` is True only while the
    capture hooks (``dbo_runtime.integration.capture_hooks``) wrap
    ``torch.cuda.graphs.CUDAGraph.capture_begin/capture_end``; without them
    callers must fall back to the precise check. Captures that bypass torch's
    ``CUDAGraph`` (raw ``cudaStreamBeginCapture``) are not counted; vLLM
    captures through ``torch.cuda.graph``.
    """

    __slots__ = ("active", "installed")

    def __init__(self) -> None:
        self.active = 0
        self.installed = False

    def no_capture_possible(self) -> bool:
        return self.installed and self.active == 0


CAPTURES = CaptureCounter()


def counting_capture_begin(original: Any) -> Any:
    def capture_begin(self: Any, *args: Any, **kwargs: Any) -> Any:
        # Counted before the capture starts: a layer on another thread must not take the
        # fast path while this capture is being set up.
        CAPTURES.active += 1
        try:
            return original(self, *args, **kwargs)
        except BaseException:
            CAPTURES.active -= 1
            raise

    return capture_begin


def counting_capture_end(original: Any) -> Any:
    def capture_end(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return original(self, *args, **kwargs)
        finally:
            CAPTURES.active = max(0, CAPTURES.active - 1)

    return capture_end


def counting_installed() -> None:
    CAPTURES.active = 0
    CAPTURES.installed = True


def counting_uninstalled() -> None:
    CAPTURES.installed = False
    CAPTURES.active = 0
