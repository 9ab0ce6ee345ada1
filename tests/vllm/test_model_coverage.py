"""Every DSA-family architecture in the installed vLLM's model registry (run against each supported release) has a rule in ``core.coverage``
and a row in ``docs/models.md`` (``tools/models_table.py``); a new one shows up here as unknown instead of silently unprotected.

The registry is vLLM's own (``vllm.model_executor.models.registry._VLLM_MODELS``); an architecture counts as
DSA-family when the source of its module (a ``vllm.models.*`` package as a whole) builds the DSA indexer,
shares top-k between layers, or reuses the DeepSeek-V2/V3.2 layers that can. Sources are read by path:
importing them would run CUDA-only package ``__init__`` files.
"""

from __future__ import annotations

import functools
import importlib.util
import pathlib
import re

from dbo_runtime.core import coverage
from tools import models_table

INDEXER = ("DeepseekV32Indexer", "SparseAttnIndexer", "fp8_fp4_paged_mqa_logits", "DeepseekV32IndexerMetadataBuilder")
SHARING = (
    "index_topk_freq", "index_topk_pattern", "indexer_types", "index_sharing", "index_source_layer_ids",
    "SparseMLAIndexGroupBuilder",
)  # fmt: skip
REUSE = ("DeepseekV2MLAAttention", "DeepseekV32Attention", "DeepseekV32Model", "DeepseekV2DecoderLayer", "DeepseekV3ForCausalLM", "DeepseekV2ForCausalLM")
ROOT = pathlib.Path(importlib.util.find_spec("vllm").origin).parent  # type: ignore[arg-type]


def _sources(module: str) -> str:
    base = ROOT.joinpath(*module.split(".")[1:])
    files = sorted(base.rglob("*.py")) if base.is_dir() else [base.with_suffix(".py")]
    return "\n".join(p.read_text(errors="replace") for p in files if p.is_file())


def dsa_family() -> dict[str, str]:
    from vllm.model_executor.models import registry

    out = {}
    for arch, (module, _cls) in registry._VLLM_MODELS.items():
        name = registry._resolve_module_name(module)
        text = _sources(name)
        if any(m in text for m in INDEXER + SHARING) or any(re.search(rf"\b{m}\b", text) for m in REUSE):
            out[arch] = name
    return out


def test_every_dsa_family_architecture_has_a_row() -> None:
    family = dsa_family()
    assert len(family) >= 30, "the scan found almost nothing: the markers went stale"
    missing = sorted(set(family) - set(coverage.BY_ARCHITECTURE))
    assert not missing, f"architectures without a row in dbo_runtime/core/coverage.py: {missing}"


def test_the_table_shows_every_rule_and_only_those() -> None:
    shown = [row.architecture for row in models_table.ROWS]
    assert len(shown) == len(set(shown)) and set(shown) == set(coverage.BY_ARCHITECTURE)


def test_every_row_is_a_registered_architecture_of_its_module() -> None:
    """A row the installed registry lacks must say it belongs to other releases only (``Row.releases``)."""
    from vllm.model_executor.models import registry

    registered = [row for row in models_table.ROWS if row.architecture in registry._VLLM_MODELS]
    assert len(registered) >= 30
    for row in models_table.ROWS:
        if row.architecture not in registry._VLLM_MODELS:
            assert row.releases != models_table.RELEASES, f"{row.architecture} is not in vLLM's registry"
            continue
        module = registry._resolve_module_name(registry._VLLM_MODELS[row.architecture][0])
        assert module == row.module, (row.architecture, module)
    assert _installed_release()


def _installed_release() -> str:
    """The table's release whose rows are exactly the installed registry's (read from the registry, not a version)."""
    from vllm.model_executor.models import registry

    missing_here = {row.architecture for row in models_table.ROWS if row.architecture not in registry._VLLM_MODELS}
    for release in models_table.RELEASES:
        if {row.architecture for row in models_table.ROWS if release not in row.releases} == missing_here:
            return release
    raise AssertionError(f"no release's rows match this registry (absent here: {sorted(missing_here)})")


KINDS = {"multimodal": "SupportsMultiModal", "hybrid": "IsHybrid"}
"""vLLM's DBO refusal by model kind, and the interface a model class declares it with."""


@functools.cache
def _class_bases() -> dict[str, list[str]]:
    """Every class defined in vLLM's sources: name -> the text of its base lists (one per definition)."""
    out: dict[str, list[str]] = {}
    for path in ROOT.rglob("*.py"):
        for name, bases in re.findall(r"^class (\w+)\(([^)]*)\)", path.read_text(errors="replace"), flags=re.M):
            out.setdefault(name, []).append(bases)
    return out


def _declared_kinds(arch: str) -> set[str]:
    """The kinds the class and its parent classes (by name, anywhere in vLLM) declare among their bases."""
    kinds: set[str] = set()
    todo, seen = [arch], set()
    while todo:
        name = todo.pop()
        seen.add(name)
        for bases in _class_bases().get(name, []):
            kinds |= {kind for kind, base in KINDS.items() if re.search(rf"\b{base}\b", bases)}
            todo += [b for b in re.findall(r"\b(\w+)\b", bases) if b not in seen and b != name]
    return kinds


def test_vllm_refusals_shown_per_release_match_the_model_classes() -> None:
    """A cell "vLLM refuses DBO (KIND)" of the installed release names a kind the class declares; and where this
    vLLM's DBO check refuses a kind (read from its code), every DSA architecture of that kind shows the cell."""
    import inspect

    from vllm.config import VllmConfig
    from vllm.model_executor.models import registry

    release = _installed_release()
    # a build that still has Model Runner V1 runs DBO there, where these refusals (the V2 runner's) do not apply
    v1_runner = importlib.util.find_spec("vllm.v1.worker.gpu_model_runner") is not None
    check = inspect.getsource(VllmConfig)
    refused_here = set() if v1_runner else {k for k in KINDS if f"dual batch overlap with {k} models" in check}
    for row in models_table.ROWS:
        if row.architecture not in registry._VLLM_MODELS:
            continue
        declared = _declared_kinds(registry._VLLM_MODELS[row.architecture][1])  # the class the registry loads
        cell = dict(row.per_release).get(release, "")
        shown = {k for k in KINDS if cell == f"vLLM refuses DBO ({k})"}
        assert shown <= declared, (row.architecture, cell, declared)
        if declared & refused_here:
            assert shown, f"{row.architecture} declares {declared}: vLLM {release} refuses it DBO; the table must say so"


def test_rows_that_fix_or_refuse_say_how_and_why() -> None:
    for row in models_table.ROWS:
        rule = coverage.BY_ARCHITECTURE[row.architecture]
        if rule.status == "refused":
            assert rule.refusal and rule.sharing != "none", row.architecture
        if rule.status == "fixed":
            assert rule.needs and row.evidence, row.architecture
        if row.bug_b:
            assert rule.sharing != "none", row.architecture
        assert bool(row.bug_a) == (rule.indexer != "never"), row.architecture  # the table says what the guard reads


def test_docs_models_md_is_generated_from_the_table() -> None:
    committed = (pathlib.Path(__file__).parents[2] / "docs" / "models.md").read_text()
    assert committed == models_table.render(), "regenerate: python tools/models_table.py > docs/models.md"
