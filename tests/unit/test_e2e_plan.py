"""The real-engine plan (tests/e2e/plan.py) parses with vLLM 0.33's own argument parser.

CPU side of the e2e suites: a flag vLLM rejects, or a DeepEP-LL run left at vLLM's 256-token default
(with which MRV1 never microbatched on 2x H200), is caught here, before any GPU time is spent.
"""

from __future__ import annotations

import json
from pathlib import Path

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
    width = spec.meta["model"] in plan.WIDTH_MODELS
    assert args.load_format == ("dbo_runtime_random" if width else plan.LOAD_FORMAT)  # width runs need varying tokens
    if "deepep_low_latency" in spec.engine_args:
        assert args.max_num_batched_tokens == int(plan.LL_BATCHED_TOKENS[1]) >= 512  # prefill steps can reach DBO's threshold
        assert "h2048" in spec.meta["model"] or width  # a hidden size DeepEP LL has kernels for (2048 the smallest)
        # deep_ep/buffer.py asserts this on the first dispatch: an LL engine without it dies there
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


@pytest.mark.parametrize(
    ("env", "needle"),
    [
        ({}, None),
        ({"DBO_E2E_MAX_ENGINES": "4", "DBO_E2E_LOAD_FORMAT": "dbo_runtime_random", "DBO_E2E_WEIGHT_GAINS": '{"qk_gain": 2}'}, None),
        ({"DBO_E2E_MAX_ENGINES": "abc"}, "DBO_E2E_MAX_ENGINES='abc' is not allowed; allowed values: an integer >= 1"),
        ({"DBO_E2E_MAX_ENGINES": "0"}, "DBO_E2E_MAX_ENGINES=0"),
        ({"DBO_E2E_LOAD_FORMAT": "foo"}, "DBO_E2E_LOAD_FORMAT='foo' is not allowed; allowed values: 'dummy', 'dbo_runtime_random'"),
        ({"DBO_E2E_WEIGHT_GAINS": "{bad"}, "DBO_E2E_WEIGHT_GAINS='{bad'"),
        ({"DBO_E2E_WEIGHT_GAINS": '{"qk_gain": -1}'}, "DBO_E2E_WEIGHT_GAINS="),
    ],
)
def test_e2e_settings_are_checked_before_any_engine(env: dict[str, str], needle: str | None) -> None:
    """The e2e settings are checked on the CPU side: read only when the engines start, a typo would cost a
    traceback on the GPU machine."""
    problems = plan.env_problems(env)
    if needle is None:
        assert problems == []
    else:
        assert len(problems) == 1 and needle in problems[0], problems


def test_e2e_collection_refuses_a_bad_setting_in_one_line(tmp_path: object) -> None:
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = {**__import__("os").environ, "DBO_E2E_MAX_ENGINES": "abc"}
    env.pop("DBO_E2E_REPLAY", None)
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-m", "e2e_dp2", "--collect-only", "tests/e2e"],
        cwd=root, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 4 and "DBO_E2E_MAX_ENGINES='abc' is not allowed" in proc.stderr + proc.stdout, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr


def test_a_k_selection_starts_only_the_runs_of_the_cases_it_selects(tmp_path: Path) -> None:
    """The session starts every run its selected tests name: a parametrized case names its own runs, so
    ``-k v4-graphs`` starts two engines, not the whole family's."""
    import subprocess
    import sys

    script = tmp_path / "collect.py"
    script.write_text(
        "import sys, pytest\n"
        "class P:\n"
        "    def pytest_collection_finish(self, session):\n"
        "        labels = sorted({a for i in session.items for m in i.iter_markers('runs') for a in m.args})\n"
        "        print('LABELS', ','.join(labels))\n"
        "pytest.main(['--collect-only', '-q', '-p', 'no:cacheprovider', 'tests/e2e', '-m', 'e2e', '-k', sys.argv[1]], plugins=[P()])\n"
    )
    out = subprocess.run([sys.executable, str(script), "v4-graphs or jit-sweep-eager"], capture_output=True, text=True, timeout=120)
    [line] = [ln for ln in out.stdout.splitlines() if ln.startswith("LABELS")]
    assert line.split(" ", 1)[1].split(",") == [
        "1gpu-deepseek-v4-graphs-plugin",
        "1gpu-deepseek-v4-graphs-vanilla",
        "1gpu-jit-sweep-eager-dbo-dp1",
    ]


def test_the_jit_sweep_judge_reads_deepgemms_cache_and_the_counters() -> None:
    """``judge_sweep`` on synthetic records (its GPU twin is the sweep itself): a planner kernel new in serving
    fails it, a listing without any planner kernel proves nothing and fails it, sparse or temporary folders are
    not planners."""
    from tests.e2e.test_planner_jit_1gpu import is_planner_kernel, judge_sweep

    assert is_planner_kernel("cache/kernel.sm90_paged_mqa_logits_metadata.1a2b")
    assert not is_planner_kernel("cache/kernel.sm100_paged_sparse_mqa_logits_metadata.1a2b")
    assert not is_planner_kernel("tmp/abc/kernel.sm90_paged_mqa_logits_metadata.1a2b")
    counters = {"warmups": 3, "warm_failures": 0, "jit_in_step": 0}
    ready = ["cache/kernel.sm90_paged_mqa_logits_metadata.1", "cache/kernel.sm90_fp8_paged_mqa_logits.2"]

    def record(new: list[str], at_ready: list[str] = ready, **more: int) -> dict:
        return {
            "dp": 1,
            "requests": [{"tokens": [0] * (8 + i)} for i in range(4)],
            "counters": [{**counters, **more}],
            "jit_cache": [{"at_ready": at_ready, "new_in_serving": new}],
        }

    judge_sweep(record(["cache/kernel.sm90_fp8_paged_mqa_logits.3"]), 4, 8)  # a logits kernel may be new: not a planner
    with pytest.raises(AssertionError):
        judge_sweep(record(["cache/kernel.sm90_paged_mqa_logits_metadata.9"]), 4, 8)
    with pytest.raises(AssertionError, match="proves nothing"):
        judge_sweep(record([], at_ready=["cache/kernel.sm90_fp8_paged_mqa_logits.2"]), 4, 8)
    with pytest.raises(AssertionError):
        judge_sweep(record([], jit_in_step=1), 4, 8)
    with pytest.raises(AssertionError, match="wrote no listing"):
        judge_sweep({**record([]), "jit_cache": None}, 4, 8)
