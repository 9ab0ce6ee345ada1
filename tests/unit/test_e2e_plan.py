"""The real-engine plan (tests/e2e/plan.py) parses with vLLM 0.33's own argument parser.

CPU side of the e2e suites: a flag vLLM rejects, or a DeepEP-LL run left at vLLM's 256-token default
(which kept MRV1 from microbatching at all on 2x H200, 2026-11-30), is caught here, not after a GPU lease.
"""

from __future__ import annotations

import json

import pytest

from tests.e2e import plan


@pytest.fixture(autouse=True)
def _device_type(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fake at the boundary CI lacks: vLLM's parser defaults need a platform device type, and a CPU
    box without vLLM's CPU build has none (GPU twin: the runner parses the same args on the H200)."""
    from vllm.platforms import current_platform

    if not current_platform.device_type:
        monkeypatch.setattr(current_platform, "device_type", "cpu", raising=False)


def _parse(args: list[str]) -> object:
    """vLLM's parser, as the runner uses it (building the configs needs a device; parsing does not)."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = EngineArgs.add_cli_args(FlexibleArgumentParser(prog="vllm"))
    return parser.parse_args(args)


@pytest.mark.parametrize("label", sorted(plan.all_specs()))
def test_every_run_parses_with_vllm(label: str) -> None:
    spec = plan.all_specs()[label]
    args = _parse(spec.engine_args)
    assert args.load_format == plan.LOAD_FORMAT
    if "deepep_low_latency" in spec.engine_args:
        assert args.max_num_batched_tokens == int(plan.LL_BATCHED_TOKENS[1]) >= 512  # prefill steps can reach DBO's threshold
        assert "h2048" in spec.meta["model"]  # DeepEP LL's smallest hidden size
        # deep_ep/buffer.py asserts this on the first dispatch (every LL engine died of it on 2026-11-30)
        assert int(spec.env["NVSHMEM_QP_DEPTH"]) >= (args.max_num_batched_tokens + 1) * 2


def test_random_weights_come_with_their_gains(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib

    monkeypatch.setenv("DBO_E2E_LOAD_FORMAT", "dbo_runtime_random")
    monkeypatch.setenv("DBO_E2E_WEIGHT_GAINS", json.dumps({"qk_gain": 3.0}))
    fresh = importlib.reload(plan)
    try:
        args = _parse(fresh.tiny_args("shared-topk", eager=True))
        assert args.load_format == "dbo_runtime_random" and args.model_loader_extra_config == {"qk_gain": 3.0}
    finally:
        monkeypatch.delenv("DBO_E2E_LOAD_FORMAT")
        monkeypatch.delenv("DBO_E2E_WEIGHT_GAINS")
        importlib.reload(plan)
