"""The identity of the CUDA-graph capture the current stream belongs to.

PyTorch exposes only ``torch.cuda.is_current_stream_capturing()``. The
schedule cache needs more: a re-plan recorded into one capture may be reused by
later indexer layers of *the same* capture only -- a graph-pool tensor read by
another graph is whatever that other graph's last replay left there. CUDA gives
every capture sequence an id (``cudaStreamGetCaptureInfo``); streams joined to
a capture through events share it. We read it through the CUDA runtime library
torch already loaded, with ctypes. When the library or symbol cannot be found
the answer is None and callers must assume nothing is shared (record again).

Not on the hot path: only called while a capture is underway.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from typing import Any

logger = logging.getLogger(__name__)

_CAPTURE_ACTIVE = 1  # cudaStreamCaptureStatusActive


def _loaded_cudart_paths() -> list[str]:
    paths: list[str] = []
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.rsplit(" ", 1)[-1].strip()
                if "libcudart.so" in path and path not in paths:
                    paths.append(path)
    except OSError:
        pass
    return paths


@functools.cache
def _get_capture_info() -> Any | None:
    candidates = [*_loaded_cudart_paths(), "libcudart.so.13", "libcudart.so.12", "libcudart.so"]
    for path in candidates:
        try:
            lib = ctypes.CDLL(path)
            fn = lib.cudaStreamGetCaptureInfo
        except (OSError, AttributeError):
            continue
        # CUDA 12: (stream, status*, id*, graph*, deps**, numDeps*); CUDA 13 adds edgeData** before
        # numDeps*. Every output after id* is optional (NULL), so passing 7 NULL-padded arguments
        # is valid for both ABIs (x86-64 SysV: unused trailing arguments are ignored).
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
    logger.warning("dbo_runtime: cudaStreamGetCaptureInfo not found; captured re-plans are not shared between layers")
    return None


def capture_id(stream_handle: int | None = None) -> int | None:
    """Capture-sequence id of ``stream_handle`` (default: torch's current stream), None when not capturing."""
    import torch

    if stream_handle is None:
        stream_handle = torch.cuda.current_stream().cuda_stream
    fn = _get_capture_info()
    if fn is None:
        return None
    status = ctypes.c_int(0)
    ident = ctypes.c_ulonglong(0)
    err = fn(ctypes.c_void_p(stream_handle), ctypes.byref(status), ctypes.byref(ident), None, None, None, None)
    if err != 0 or status.value != _CAPTURE_ACTIVE:
        return None
    return int(ident.value)
