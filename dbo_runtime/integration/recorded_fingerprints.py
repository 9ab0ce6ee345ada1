"""Fingerprints of the vLLM code every patch relies on, per release.

Written by ``python tools/record_release.py VERSION --write`` after review (``docs/new-release.md``);
a test recomputes the installed release's from its source. ``missing``: the patch's target does not
exist in that release, so the patch is not part of its set."""

RELEASES: dict[str, dict[str, str]] = {
    "0.33.0": {
        "ubatch_guard.mrv1_run": "f309ab8d43c99fa8",
        "ubatch_guard.mrv1_capture": "144391a0c0db992f",
        "ubatch_guard.mrv2_finish": "0e284d19d5a662d4",
        "ubatch_guard.context_enter": "7d830eb707f4836b",
        "sm_control.mrv1": "e2c801eeb1b64f1b",
        "sm_control.mrv2": "625823d62f2d659e",
        "indexer.builder_init": "7542591c0a1b52c0",
        "indexer.builder_planner": "7f9baba490a98982",
        "indexer.builder_build": "4a8f6f19c737054c",
        "indexer.builder_update_draft": "f9aa1d16166b5e6a",
        "indexer.logits.sparse_attn_indexer": "07832e7702cbffcd",
        "indexer.logits.glm5next": "6294e8de08c2737f",
        "indexer.sm_writes.deep_gemm": "8f930bac9038d39f",
        "indexer.sm_writes.ubatch_alias": "8f930bac9038d39f",
        "indexer.plan_ahead.mrv1": "0d8cf98fde8af47a",
        "indexer.plan_ahead.mrv2": "d60c300e0fee5c4b",
        "topk.builder_register_layer": "9ac202ff87d802e6",
        "topk.group_convert_once": "91124fb12cb56e9b",
        "topk.group_set_logical_topk_ready": "89895eefc82a9027",
        "topk.SharedTopkIndicesBuffer.topk_indices_buffer": "97acd2d0324f28df",
        "topk.DeepseekV32Attention.topk_indices_buffer": "f2f536958494fa81",
        "topk.DeepseekV32Indexer.topk_indices_buffer": "16bb4477b807b60b",
        "topk.SparseAttnIndexer.topk_indices_buffer": "1d667b9a30df322d",
        "topk.DeepseekV32Model.topk_indices_buffer": "db2c6b0aa9a0bd05",
        "topk.fa4_varlen_scalars": "6a7d3e0548144ce4",
        "topk_v41.DeepseekV4Model.topk_indices_buffer": "a55ff6c86c4eee25",
        "topk_v41.DeepseekV4Model.candidate_block_buffer": "a55ff6c86c4eee25",
        "topk_v41.DeepseekV4Attention.topk_indices_buffer": "77ce834df28993ed",
        "topk_v41.DeepseekV4Attention.candidate_block_buffer": "77ce834df28993ed",
        "topk_v41.DeepseekV4Indexer.topk_indices_buffer": "8bf9269d37818b74",
        "topk_v41.SparseAttnIndexer.candidate_blocks": "1d667b9a30df322d",
        "topk_v41.SparseMQAIndexer.topk_indices_buffer": "e1f4cd7b759bdcf9",
        "topk_v41.SparseMQAIndexer.candidate_blocks": "e1f4cd7b759bdcf9",
        "mtp_hidden.deepseek_v4": "ae328bd07efdd6bf",
        "mtp_hidden.deepseek_v41": "a55ff6c86c4eee25",
    },
}
