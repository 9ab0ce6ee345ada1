"""Shared fixtures for the GPU twin tests.

The GPU machine has CUDA and the DeepGEMM wheel but no vLLM, and the CPU box has
vLLM but no CUDA; so every test here asks for a fixture that skips cleanly when
its boundary is absent instead of importing CUDA-only code at module level.

Set ``DBO_REQUIRE_GPU=1`` on the GPU machine: then a missing CUDA device, or a
DeepGEMM / DeepEP / pynvml module that fails to import, is a test *error*, not a
silent skip (a skip there would hide exactly the breakage these twins exist to
catch). Tests take such modules from the fixtures below, never from
``pytest.importorskip`` (which skips regardless of ``DBO_REQUIRE_GPU``).

Fixtures:
- ``cuda_device``: ``torch.device("cuda")`` or skip.
- ``sm_major``: compute-capability major of device 0 (9 on H200).
- ``deep_gemm``: the imported ``deep_gemm`` module; DeepGEMM's SM count is a
  process-global (``csrc/jit/device_runtime.hpp``), so the fixture restores the
  value it found after each test, whatever the test did with ``set_num_sms``.
- ``deep_ep``: the imported ``deep_ep`` module (needs ``cuda_device``).
- ``pynvml``: the imported ``pynvml`` module (NVML bindings).
- ``out_dir``: ``pathlib.Path`` of ``$OUT`` (created) or ``None`` when unset;
  GPU scripts write their JSON summaries there.
"""

from __future__ import annotations

import os
import pathlib
from collections.abc import Iterator
from types import ModuleType

import pytest
import torch

from dbo_runtime.core.errors import ConfigError
from tests.require_gpu import require_gpu

_REQUIRE = False
"""``DBO_REQUIRE_GPU`` (the project switches' spellings, 1/true/yes/on), read at collection."""
_HERE = pathlib.Path(__file__).resolve().parent


def _unavailable(reason: str) -> None:
    if _REQUIRE:
        pytest.fail(f"DBO_REQUIRE_GPU is set but {reason}", pytrace=False)
    pytest.skip(reason)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tag every test under tests/gpu with the ``gpu`` marker (``-m 'not gpu'`` deselects them), and
    read ``DBO_REQUIRE_GPU`` (here, not at import or configure time: a UsageError raised then is shown
    as a collection error with a traceback)."""
    global _REQUIRE
    try:
        _REQUIRE = require_gpu()
    except ConfigError as exc:  # a typo must not turn every GPU test into a passing skip
        raise pytest.UsageError(str(exc)) from None
    for item in items:
        if _HERE in pathlib.Path(str(item.path)).resolve().parents:
            item.add_marker(pytest.mark.gpu)


@pytest.fixture(scope="session")
def cuda_device() -> torch.device:
    if not torch.cuda.is_available():
        _unavailable("no CUDA device")
    return torch.device("cuda", torch.cuda.current_device())


@pytest.fixture(scope="session")
def sm_major(cuda_device: torch.device) -> int:
    return int(torch.cuda.get_device_capability(cuda_device)[0])


@pytest.fixture(scope="session")
def _deep_gemm_module(cuda_device: torch.device) -> ModuleType:
    try:
        import deep_gemm
    except ImportError as exc:
        _unavailable(f"deep_gemm is not importable: {exc!r}")
    except Exception as exc:  # a wheel built for another torch ABI raises OSError/RuntimeError
        _unavailable(f"deep_gemm failed to load: {exc!r}")
    return deep_gemm


@pytest.fixture()
def deep_gemm(_deep_gemm_module: ModuleType) -> Iterator[ModuleType]:
    original = int(_deep_gemm_module.get_num_sms())
    try:
        yield _deep_gemm_module
    finally:
        _deep_gemm_module.set_num_sms(original)


def _import_or_unavailable(name: str) -> ModuleType:
    """Import ``name``; on failure skip, or fail under ``DBO_REQUIRE_GPU=1``."""
    import importlib

    try:
        return importlib.import_module(name)
    except ImportError as exc:
        _unavailable(f"{name} is not importable: {exc!r}")
    except Exception as exc:  # a wheel built for another torch ABI raises OSError/RuntimeError
        _unavailable(f"{name} failed to load: {exc!r}")
    raise AssertionError("unreachable")  # _unavailable always raises


@pytest.fixture(scope="session")
def deep_ep(cuda_device: torch.device) -> ModuleType:
    return _import_or_unavailable("deep_ep")


@pytest.fixture(scope="session")
def pynvml() -> ModuleType:
    return _import_or_unavailable("pynvml")


@pytest.fixture(scope="session")
def out_dir() -> pathlib.Path | None:
    out = os.environ.get("OUT")
    if not out:
        return None
    path = pathlib.Path(out)
    path.mkdir(parents=True, exist_ok=True)
    return path
