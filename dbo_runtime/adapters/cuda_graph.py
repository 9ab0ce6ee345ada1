"""The id of the CUDA-graph capture of the current stream: a re-plan recorded into one capture may be
reused only within it. None when unreadable; callers then share nothing."""

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
    except (OSError, ValueError):  # no /proc: the fixed names below remain
        pass
    return paths


_RUNTIME_SYMBOLS = ("cudaStreamGetCaptureInfo_v3", "cudaStreamGetCaptureInfo_v2", "cudaStreamGetCaptureInfo")
_DRIVER_SYMBOLS = ("cuStreamGetCaptureInfo_v3", "cuStreamGetCaptureInfo_v2", "cuStreamGetCaptureInfo")


def prepare_capture_id() -> None:
    """Find the capture-info entry point now, outside any capture (the search dlopens). Never raises."""
    try:
        _get_capture_info()
    except Exception as exc:
        logger.warning("dbo_runtime: stream capture-info lookup failed (%r); captured re-plans are not shared", exc)


@functools.cache
def _get_capture_info() -> Any | None:
    """The runtime's capture-info entry point, else the driver's; extra NULL outputs suit every variant."""
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
            outputs = [ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_ulonglong)]
            fn.argtypes = [ctypes.c_void_p, *outputs, *[ctypes.c_void_p] * 4]
            return fn
    logger.warning("dbo_runtime: no stream capture-info entry point; captured re-plans are not shared between layers")
    return None


def capture_id(stream_handle: int | None = None) -> int | None:
    """Capture id of ``stream_handle`` (default: current stream), None when not capturing."""
    import torch

    if stream_handle is None:
        stream_handle = torch.cuda.current_stream().cuda_stream
    try:
        fn = _get_capture_info()
    except Exception:
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
    """Captures in progress, counted by the capture hooks: with ``installed`` and ``active == 0`` the call
    site skips the costly precise check."""

    __slots__ = ("active", "installed")

    def __init__(self) -> None:
        self.active = 0
        self.installed = False


CAPTURES = CaptureCounter()


def counting_capture_begin(original: Any) -> Any:
    def capture_begin(self: Any, *args: Any, **kwargs: Any) -> Any:
        # Counted before the capture starts, so no other thread takes the fast path during set-up.
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
