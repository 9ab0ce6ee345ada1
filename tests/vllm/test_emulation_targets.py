"""The one-GPU DBO emulation (``tests/e2e/dp_emulation.py``) against the installed vLLM release.

Every target in the release's table exists with the parameters the emulation relies on; the emulation's vote
is vLLM's own DP vote with a peer that runs the same batch (checked against vLLM's post-processing of the
all-reduced DP tensor on V1, and against ``check_ubatch_thresholds`` through the patched V2 dispatch); and the
sitecustomize loader patches a fresh process's vLLM by name. The patches themselves run only in a child
process: they change vLLM for the whole process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
import torch

from tests.e2e import dp_emulation

ROOT = Path(__file__).resolve().parents[2]
SITE = ROOT / "tests" / "e2e" / "emulate" / "dp_peer"
RELEASE = dp_emulation.release_of(metadata.version("vllm"))
ML4_ATTENTION = "vllm.models.mistral.nvidia.attention"


def test_the_installed_vllm_has_a_target_table() -> None:
    assert RELEASE is not None, f"no emulation target table for vLLM {metadata.version('vllm')}"


@pytest.mark.skipif(RELEASE is None, reason="no table for this vLLM (the test above fails)")
def test_every_target_exists_with_the_parameters_the_emulation_relies_on() -> None:
    assert dp_emulation.problems(RELEASE) == []  # type: ignore[arg-type]


@pytest.mark.skipif(RELEASE is None, reason="no table for this vLLM (the test above fails)")
def test_each_release_table_names_only_its_runners() -> None:
    modules = {t.module for t in dp_emulation.TARGETS[RELEASE]}  # type: ignore[index]
    assert ("vllm.v1.worker.gpu_model_runner" in modules) == ("v1" in dp_emulation.RUNNERS[RELEASE])  # type: ignore[index]
    assert "vllm.v1.worker.gpu.model_runner" in modules


def _config(decode: int = 4, prefill: int = 8) -> object:
    from vllm.config import ParallelConfig

    return ParallelConfig(enable_dbo=True, dbo_decode_token_threshold=decode, dbo_prefill_token_threshold=prefill)


def test_the_v1_vote_is_vllms_dp_vote_with_a_peer_running_the_same_batch() -> None:
    """What a DP-2 rank decides after the all-reduce when the peer's row equals its own."""
    from vllm.v1.worker.dp_utils import _post_process_ubatch
    from vllm.v1.worker.ubatch_utils import check_ubatch_thresholds

    config = _config()
    seen = set()
    for tokens in range(1, 20):
        for pad in range(0, 12, 3):
            padded = tokens + pad
            for uniform in (False, True):
                for allow in (False, True):
                    should, across = dp_emulation.peer_vote(config, tokens, padded, allow, uniform, 0)
                    attempt = allow and check_ubatch_thresholds(config, tokens, uniform_decode=uniform)
                    column = [tokens, padded, int(attempt), 0]
                    reduced = torch.tensor([[v, v] for v in column], dtype=torch.int32)
                    assert should == _post_process_ubatch(reduced, 2), (tokens, padded, uniform, allow)
                    assert across.tolist() == [padded]
                    seen.add(should)
    assert seen == {False, True}


def test_the_peer_config_changes_only_the_dp_view() -> None:
    config = _config(decode=6, prefill=10)
    peer = dp_emulation.PeerConfig(config)
    assert (peer.data_parallel_size, peer.data_parallel_rank) == (2, 0)
    assert (peer.dbo_decode_token_threshold, peer.num_ubatches, peer.use_ubatching) == (6, 2, True)
    assert config.data_parallel_size == 1


CHILD = """
import json, sys
import vllm.forward_context as fc
import vllm.v1.worker.gpu.model_runner as mr2
import vllm.v1.worker.gpu_worker as gw
import vllm.model_executor.layers.fused_moe.prepare_finalize.no_dp_ep as pf
import vllm.models.deepseek_v32.attention as attn
import vllm.models.deepseek_v4.nvidia.model as v4
from vllm.config import ParallelConfig
import torch
from tests.e2e import dp_emulation as d
if "v1" in d.RUNNERS[d.release_of(__import__("importlib.metadata").metadata.version("vllm"))]:
    import vllm.v1.worker.gpu_model_runner  # noqa: F401
try:
    import vllm.models.mistral.nvidia.attention as ml4
except ImportError:  # a release without Mistral Large 4
    ml4 = None

config = ParallelConfig(enable_dbo=True, dbo_decode_token_threshold=4, dbo_prefill_token_threshold=8)
v2 = []
for tokens in range(1, 20):
    for uniform in (False, True):
        desc, sync = mr2.dispatch_cg_and_sync_dp(
            None, tokens, tokens, 1 if uniform else None, 1, 0, need_eager=True,
            parallel_config=config, allow_ubatching=True, uniform_decode=uniform)
        v2.append([tokens, uniform, desc.num_ubatches, desc.num_tokens, sync.num_tokens_across_dp.tolist()])
off = mr2.dispatch_cg_and_sync_dp(None, 9, 9, None, 1, 0, need_eager=True, parallel_config=config, allow_ubatching=False)
meta = fc.DPMetadata.make(config, 7, torch.tensor([7], dtype=torch.int32))
print(json.dumps({
    "patched": sorted(d.PATCHED),
    "v2": v2,
    "off": [off[0].num_ubatches, off[1] is None],
    "meta": meta.num_tokens_across_dp_cpu.tolist(),
    "rpc": hasattr(gw.Worker, d.RPC),
    "dbo": [c.supports_dbo(c.__new__(c)) for c in (pf.MoEPrepareAndFinalizeNoDPEPModular, pf.MoEPrepareAndFinalizeNoDPEPMonolithic)],
    "deferred": [c.supports_deferred_moe_finalize(c.__new__(c)) for c in (pf.MoEPrepareAndFinalizeNoDPEPModular, pf.MoEPrepareAndFinalizeNoDPEPMonolithic)],
    "checked": attn.DeepseekV32Attention._sparse_indexer_and_attn.__name__,
    "v4_checked": [hasattr(v4.DeepseekV4Model.forward, "__wrapped__"), hasattr(v4.hc_head_fused_kernel_tilelang, "__wrapped__")],
    "ml4_checked": None if ml4 is None else getattr(ml4.MistralMLAAttention.forward, "__wrapped__", None) is not None,
    "counters": d.COUNTERS.snapshot(),
}))
"""


@pytest.fixture(scope="module")
def child() -> dict:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(SITE), str(ROOT), os.environ.get("PYTHONPATH", "")]),
        dp_emulation.ENV: "1",
        dp_emulation.CHECK_ENV: "1",
    }
    done = subprocess.run([sys.executable, "-c", CHILD], env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(RELEASE is None, reason="no table for this vLLM (the test above fails)")
def test_sitecustomize_patches_every_target_module_of_the_release(child: dict) -> None:
    expected = {t.module for t in dp_emulation.TARGETS[RELEASE]} & (set(dp_emulation.PATCHES) | set(dp_emulation.CHECK_PATCHES))  # type: ignore[index]
    assert expected <= set(child["patched"]), child["patched"]
    assert child["rpc"] and child["dbo"] == [True, True] and child["deferred"] == [False, False]
    assert child["checked"] == "_sparse_indexer_and_attn"
    assert child["v4_checked"] == [True, True], "the V4 MTP hidden check wraps the model's forward and its hc head"


@pytest.mark.skipif(RELEASE is None, reason="no table for this vLLM (the test above fails)")
def test_the_release_table_checks_mistral_large4_exactly_where_vllm_has_it(child: dict) -> None:
    """Row c's Mistral Large 4 check: in the table and wrapping its attention where the installed vLLM has the
    model (0.34), absent from both where it has not (0.33: importing its attention module fails)."""
    listed = any(t.module == ML4_ATTENTION for t in dp_emulation.TARGETS[RELEASE])  # type: ignore[index]
    assert child["ml4_checked"] is (True if listed else None), child["ml4_checked"]


def test_the_patched_v2_dispatch_microbatches_by_vllms_thresholds_at_dp1(child: dict) -> None:
    from vllm.v1.worker.ubatch_utils import check_ubatch_thresholds

    config = _config()
    for tokens, uniform, num_ubatches, num_tokens, across in child["v2"]:
        expected = check_ubatch_thresholds(config, tokens, uniform_decode=uniform)
        assert num_ubatches == (2 if expected else 1), (tokens, uniform)
        assert across == [num_tokens], "one rank's DP row, the agreed padded count"
    assert {row[2] for row in child["v2"]} == {1, 2}
    assert child["off"] == [1, True], "a step that may not microbatch keeps DP 1's answer"
    assert child["counters"]["votes_outside_steps"] == len(child["v2"])
    assert child["counters"]["microbatched_outside_steps"] == sum(row[2] == 2 for row in child["v2"])
    assert child["counters"]["dp_emulated"] is True


def test_dp_metadata_is_made_for_one_rank(child: dict) -> None:
    assert child["meta"] == [7]


def test_the_mtp_hidden_check_counts_microbatches_whose_rows_are_not_at_their_offset() -> None:
    """What V4 writes per microbatch (rows 0-2 and 3-6 of a step): vanilla copies both from row 0 (the second
    overwrites the first, rows 3-6 keep the previous step's), the fixed model at each microbatch's offset."""
    counters = dp_emulation.COUNTERS
    saved = (counters.mtp_hidden_checks, counters.mtp_hidden_wrong)
    try:
        first, second = torch.arange(12.0).view(3, 4), 100 + torch.arange(16.0).view(4, 4)
        counters.mtp_hidden_checks, counters.mtp_hidden_wrong = 0, None
        vanilla = torch.zeros(8, 4)
        vanilla[:3] = first
        vanilla[:4] = second
        dp_emulation._MTP_ROWS.extend([(0, first, vanilla), (3, second, vanilla)])
        dp_emulation._after_join()
        assert (counters.mtp_hidden_checks, int(counters.mtp_hidden_wrong)) == (2, 2)
        fixed = torch.zeros(8, 4)
        fixed[:3], fixed[3:7] = first, second
        dp_emulation._MTP_ROWS.extend([(0, first, fixed), (3, second, fixed)])
        dp_emulation._after_join()
        assert (counters.mtp_hidden_checks, int(counters.mtp_hidden_wrong)) == (4, 2)
        assert dp_emulation._MTP_ROWS == []
    finally:
        counters.mtp_hidden_checks, counters.mtp_hidden_wrong = saved


def test_the_ml4_topk_check_counts_followers_that_read_another_microbatchs_topk(monkeypatch: pytest.MonkeyPatch) -> None:
    """Leaders (an indexer) write the top-k their impl reads, followers read it; microbatch 1's leader runs between
    microbatch 0's leader and follower. One shared buffer (vanilla): microbatch 0's follower reads microbatch 1's
    top-k, one wrong read of two; a buffer per microbatch (dbo_runtime): none."""
    from types import SimpleNamespace

    from vllm.v1.worker import ubatching

    current = {"ubatch": 0}
    monkeypatch.setattr(ubatching, "dbo_enabled", lambda: True)
    monkeypatch.setattr(ubatching, "dbo_current_ubatch_id", lambda: current["ubatch"])

    class MistralMLAAttention:
        def __init__(self, leads: bool, buffers: dict[int, torch.Tensor]) -> None:
            self.indexer = object() if leads else None
            self.buffers = buffers
            self.attn = SimpleNamespace(impl=self)

        @property
        def topk_indices_buffer(self) -> torch.Tensor:
            return self.buffers[current["ubatch"]]

        def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> None:
            if self.indexer is not None:
                self.topk_indices_buffer[: positions.shape[0]] = hidden_states

    module = SimpleNamespace(MistralMLAAttention=MistralMLAAttention)
    dp_emulation._patch_ml4_topk_check(module)
    counters = dp_emulation.COUNTERS
    saved = (counters.topk_reads, counters.topk_wrong)
    try:
        for shared, wrong in ((True, 1), (False, 0)):
            counters.topk_reads, counters.topk_wrong = 0, None
            one = torch.zeros(8, 4, dtype=torch.int32)
            buffers = {0: one, 1: one} if shared else {0: one, 1: torch.zeros(8, 4, dtype=torch.int32)}
            leader, follower = MistralMLAAttention(True, buffers), MistralMLAAttention(False, buffers)
            for ubatch, layer in ((0, leader), (1, leader), (0, follower), (1, follower)):
                current["ubatch"] = ubatch
                layer.forward(torch.arange(3), torch.full((3, 4), 10 + ubatch, dtype=torch.int32))
            assert (counters.topk_reads, int(counters.topk_wrong)) == (2, wrong), shared
    finally:
        counters.topk_reads, counters.topk_wrong = saved


@pytest.mark.skipif(RELEASE is None, reason="no table for this vLLM (the test above fails)")
def test_a_parameter_the_vote_reads_by_name_is_checked_wherever_it_stands(monkeypatch: pytest.MonkeyPatch) -> None:
    """``dp_sync_state`` is read with ``.get``: renamed, the vote would silently run on reused-sync calls."""
    import vllm.v1.worker.gpu.model_runner as mr2

    real = mr2.dispatch_cg_and_sync_dp

    def renamed(cudagraph_manager, num_reqs, num_tokens, uniform_token_count, dp_size, dp_rank, allow_ubatching=True, sync_state=None):  # type: ignore[no-untyped-def]
        return real

    monkeypatch.setattr(mr2, "dispatch_cg_and_sync_dp", renamed)
    [problem] = dp_emulation.problems(RELEASE)  # type: ignore[arg-type]
    assert problem.startswith("vllm.v1.worker.gpu.model_runner:dispatch_cg_and_sync_dp takes") and "dp_sync_state" in problem
