"""The DeepSeek-V4 / V4.1 MTP hidden buffer under DBO, on the real vLLM 0.33.0 model classes.

Each microbatch runs the model's own write (``self._mtp_hidden_buffer[:num_tokens].copy_(...)``, asserted to be
vLLM's statement below) on a real ``UBatchContext`` thread; the drafter's read happens on the main thread after
the join, in global token order (``gpu_model_runner.py:4879-4883``), as in MRV1.
"""

from __future__ import annotations

import inspect
from typing import Any

import pytest
import torch
import torch.nn as nn

from dbo_runtime.integration import mtp_hooks
from dbo_runtime.integration.patching import PatchSet
from tests.fakes.ubatch_threads import run_microbatches
from tests.vllm.test_topk_isolation import arming_net

HIDDEN = 4
WRITE = "self._mtp_hidden_buffer[:num_tokens].copy_(hidden_states.flatten(1))"
MODELS = ("vllm.models.deepseek_v4.nvidia.model", "vllm.models.deepseek_v41.nvidia.model")


def _model(module: str) -> Any:
    import importlib

    cls = importlib.import_module(module).DeepseekV4Model
    assert WRITE in inspect.getsource(cls.forward), "vLLM's write changed: re-derive this test"
    obj = object.__new__(cls)
    nn.Module.__init__(obj)
    obj._mtp_hidden_buffer = torch.zeros((32, HIDDEN))
    return obj


def _step(model: Any, sizes: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    hidden = [torch.full((n, HIDDEN), float(u + 1)) + torch.arange(n)[:, None] for u, n in enumerate(sizes)]

    def body(u: int) -> None:
        from vllm.v1.worker import ubatching

        ubatching.dbo_yield()  # the layers run before the write, each microbatch yielding in its MoE
        hidden_states, num_tokens = hidden[u], sizes[u]
        model._mtp_hidden_buffer[:num_tokens].copy_(hidden_states.flatten(1))  # vLLM's statement (WRITE)

    run_microbatches([body, body], [0, sizes[0]])
    return model._mtp_hidden_buffer[: sum(sizes)].clone(), torch.cat(hidden)


@pytest.fixture()
def installed(request: pytest.FixtureRequest) -> PatchSet:
    ps = PatchSet([*mtp_hooks.patches(), arming_net()])
    ps.install()
    request.addfinalizer(ps.uninstall)
    return ps


@pytest.mark.parametrize("module", MODELS)
def test_the_drafter_reads_both_microbatches_hidden_states(installed: PatchSet, module: str) -> None:
    model = _model(module)
    for sizes in ([5, 7], [16, 16], [1, 30]):
        got, want = _step(model, sizes)
        assert torch.equal(got, want)
    assert model._mtp_hidden_buffer is model.__dict__["_mtp_hidden_buffer"]  # the main thread reads the base
    model._mtp_hidden_buffer = torch.zeros((32, HIDDEN))  # a new buffer: the window kept for the old one goes
    got, want = _step(model, [5, 7])
    assert torch.equal(got, want) and not any("_dbo_runtime" in k for k in model.state_dict())


@pytest.mark.parametrize("module", MODELS)
def test_without_the_fix_the_buffer_is_clobbered(module: str) -> None:
    """vLLM 0.33.0 as shipped: microbatch 1 overwrites microbatch 0's rows and never writes its own."""
    got, want = _step(_model(module), [5, 7])
    assert not torch.equal(got[:5], want[:5]) and not torch.equal(got[5:], want[5:])


def test_a_model_without_a_drafter_keeps_none(installed: PatchSet) -> None:
    model = _model(MODELS[0])
    model._mtp_hidden_buffer = None
    assert model._mtp_hidden_buffer is None
