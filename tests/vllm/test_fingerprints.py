"""The recorded fingerprints are the installed release's, and they see code, not comments or formatting."""

from __future__ import annotations

from importlib import metadata
from pathlib import Path

import pytest

from dbo_runtime.integration import fingerprints, plugin, releases
from dbo_runtime.integration.catalog import all_reliances
from dbo_runtime.integration.features import Reliance
from dbo_runtime.integration.fingerprints import RELEASES
from dbo_runtime.integration.patching import Patch
from tests.fakes.vllm_build import edited_sources, replace_once
from tools import record_release

INDEX_GROUP = "vllm.v1.attention.backends.mla.index_group"
ANCHOR = (f"{INDEX_GROUP}:SparseMLAIndexGroupBuilder.register_layer",)


def _installed_record() -> dict[str, str]:
    """The installed release's record, less the patches it leaves out on purpose (never compared)."""
    return {n: v for n, v in RELEASES[metadata.version("vllm")].items() if v != fingerprints.EXCLUDED}


def _bound() -> list[Patch | Reliance]:
    """Everything fingerprinted: the patches bound to vLLM code and the code features rely on without patching."""
    return [*(p for p in plugin.all_patches() if p.fingerprint_anchors), *all_reliances()]


def test_recorded_from_the_installed_release() -> None:
    fingerprints.clear_caches()
    record = _installed_record()
    computed = {p.name: fingerprints.fingerprint(p.fingerprint_anchors) for p in _bound()}
    assert {n: v for n, v in computed.items() if n in record or n not in RELEASES[metadata.version("vllm")]} == record, (
        "review, then: python tools/record_release.py VERSION --write"
    )
    match = releases.identify()
    assert match.release == metadata.version("vllm") and not match.differing
    assert match.describe() == f"vLLM {match.release} (verified by its code)"


def test_every_patch_of_vllm_code_names_what_it_relies_on() -> None:
    unbound = [p.name for p in plugin.all_patches() if not p.fingerprint_anchors]
    assert unbound == ["torch.capture_begin", "torch.capture_end", "stats.worker_rpc"]  # torch's, or a method added by name


def test_comments_and_formatting_do_not_count_code_does() -> None:
    before = fingerprints.fingerprint(ANCHOR)
    cosmetic = replace_once("        group = self.current_group\n", "        # a comment in a dev build\n        group = (\n            self.current_group\n        )\n")
    with edited_sources({INDEX_GROUP: cosmetic}):
        assert fingerprints.fingerprint(ANCHOR) == before
    semantic = replace_once("        group = self.current_group\n", "        group = self.current_group or None\n")
    with edited_sources({INDEX_GROUP: semantic}):
        assert fingerprints.fingerprint(ANCHOR) != before
    assert fingerprints.fingerprint(ANCHOR) == before


def test_decorators_belong_to_the_block_they_decorate() -> None:
    """A decorator decides what a name is bound to: FA4's scalars are a never-evicted cache only by ``@cache``, which
    ``topk.fa4_varlen_scalars`` relies on. Removing or changing a decorator upstream changes the fingerprint."""
    fa4 = "vllm.v1.attention.backends.mla.flashattn_mla_sparse"
    anchor = (f"{fa4}:_fa4_varlen_scalars",)
    block = fingerprints.source_block(fa4, "_fa4_varlen_scalars")
    assert block is not None and block.startswith("@cache\ndef _fa4_varlen_scalars(")
    before = fingerprints.fingerprint(anchor)
    for decorator in ("", "@lru_cache(maxsize=8)\n"):
        with edited_sources({fa4: replace_once("@cache\ndef _fa4_varlen_scalars(", f"{decorator}def _fa4_varlen_scalars(")}):
            assert fingerprints.fingerprint(anchor) != before, decorator
    assert fingerprints.fingerprint(anchor) == before


def test_decorator_lines_are_found_without_taking_the_code_above(tmp_path: Path) -> None:
    """Multi-line decorators and comments between belong to the block; the previous block's body never does."""
    root = tmp_path / "vllm"
    root.mkdir()
    (root / "__init__.py").write_text("")
    source = (
        "import functools\n\n\nclass A:\n    @property\n    def x(self):\n        return 1\n\n"
        "    def plain(self):\n        return (\n            2\n        )\n\n"
        "    @functools.lru_cache(\n        maxsize=2,\n    )\n    # the cache is the contract\n"
        "    def cached(self):\n        return 3\n\n\n@dataclass\nclass B:\n    y: int = 0\n"
    )
    (root / "m.py").write_text(source)
    with record_release.use_source_root(root):
        blocks = {q: fingerprints.source_block("vllm.m", q) or "" for q in ("A.x", "A.plain", "A.cached", "B")}
        cached = fingerprints.fingerprint(("vllm.m:A.cached",))
    assert blocks["A.x"].lstrip().startswith("@property\n    def x(")
    assert blocks["A.plain"].lstrip().startswith("def plain(") and blocks["A.plain"].rstrip().endswith(")")
    assert blocks["A.cached"].lstrip().startswith("@functools.lru_cache(\n        maxsize=2,")
    assert blocks["B"].startswith("@dataclass\nclass B:")
    (root / "m.py").write_text(source.replace("maxsize=2", "maxsize=3"))
    with record_release.use_source_root(root):
        assert fingerprints.fingerprint(("vllm.m:A.cached",)) != cached


def test_a_missing_anchor_is_missing() -> None:
    assert fingerprints.fingerprint((f"{INDEX_GROUP}:SparseMLAIndexGroupBuilder.no_such_method",)) == fingerprints.MISSING
    assert fingerprints.fingerprint(("vllm.no_such_module:f",)) == fingerprints.MISSING


def test_source_blocks_include_multi_line_signatures() -> None:
    block = fingerprints.source_block(INDEX_GROUP, "SparseMLAIndexGroupBuilder.register_layer")
    assert block is not None and block.lstrip().startswith("def register_layer(") and "return group, group_index" in block


def test_capability_probes_read_names_from_the_syntax_tree() -> None:
    from dbo_runtime.integration import fingerprints as fp
    from dbo_runtime.integration.features import Probe

    group = "vllm.v1.attention.backends.mla.index_group"
    assert fp.has_param(group, "SparseMLAIndexGroupBuilder.__init__", "max_decode_rows")
    assert not fp.has_param(group, "SparseMLAIndexGroupBuilder.__init__", "num_ubatches")
    assert fp.has_member(group, "SparseMLAIndexGroup", "_convert_once")
    assert fp.has_member(group, "SparseMLAIndexGroup", "logical_topk_indices")  # an annotated attribute
    assert not fp.has_member(group, "SparseMLAIndexGroup", "_topk_state")
    assert fp.has_member(group, "", "SparseMLAIndexGroupBuilder")
    assert fp.has_member(group, "SparseMLAIndexGroupBuilder", "max_decode_rows")  # ``self.max_decode_rows = ...`` in __init__
    assert fp.uses(group, "SparseMLAIndexGroup._convert_once", "physical_topk_indices")  # read, not called
    assert not fp.calls(group, "SparseMLAIndexGroup._convert_once", "physical_topk_indices")
    assert fp.calls("vllm.model_executor.layers.sparse_attn_indexer", "", "fp8_fp4_paged_mqa_logits")
    mention = replace_once('    """Layers that consume one sparse-indexer result."""',
                           '    """Layers that consume one sparse-indexer result; see _topk_state() and num_ubatches."""\n'
                           '    # def _topk_state(self): self._topk_state()')
    with edited_sources({group: mention}):
        assert not fp.has_member(group, "SparseMLAIndexGroup", "_topk_state")
        assert not fp.calls(group, "", "_topk_state")
    with pytest.raises(ValueError, match=r"Probe\.kind"):
        Probe("mentions", group, "", "x")  # type: ignore[arg-type]


def test_the_canonical_dump_leaves_out_what_only_some_pythons_have() -> None:
    """Python 3.12 added ``type_params`` to every function and class node, and ``ast.dump`` prints empty fields
    in some versions only: recorded on one Python, a fingerprint must match on every Python vLLM runs on."""
    import ast

    class FunctionDef312(ast.FunctionDef):
        _fields = (*ast.FunctionDef._fields, "type_params")

    tree = ast.parse("def f(x):\n    return x + 1\n")
    plain = tree.body[0]
    newer = FunctionDef312(**{f: getattr(plain, f) for f in ast.FunctionDef._fields}, type_params=[])
    assert fingerprints.canonical_dump(newer).replace("FunctionDef312", "FunctionDef") == fingerprints.canonical_dump(plain)
    assert "type_params" not in fingerprints.canonical_dump(newer) and "None" not in fingerprints.canonical_dump(plain)


def test_the_recorded_fingerprints_match_on_every_python_on_this_machine(tmp_path: pytest.TempPathFactory) -> None:
    """The same check as ``test_recorded_from_the_installed_release``, run by every other CPython found here
    (pyenv's, /usr/bin's) over the same vLLM source: the fingerprints module needs no import of vLLM."""
    import glob
    import json
    import subprocess

    pythons = sorted({*glob.glob("/root/.pyenv/versions/3.1[0-9]*/bin/python3"), *glob.glob("/usr/bin/python3.1[0-9]")})
    anchors = {p.name: list(p.fingerprint_anchors) for p in _bound() if p.name in _installed_record()}
    root = fingerprints._vllm_root()
    script = (
        "import importlib.util, json, pathlib, sys\n"
        "spec = importlib.util.spec_from_file_location('fp', sys.argv[1]); fp = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(fp); fp._vllm_root = lambda: pathlib.Path(sys.argv[2])\n"
        "anchors = json.loads(sys.argv[3]); print(json.dumps({n: fp.fingerprint(a) for n, a in anchors.items()}))\n"
    )
    checked = []
    for python in pythons:
        out = subprocess.run(
            [python, "-c", script, fingerprints.__file__, str(root), json.dumps(anchors)], capture_output=True, text=True, timeout=120
        )
        assert out.returncode == 0, f"{python}: {out.stderr[-2000:]}"
        assert json.loads(out.stdout) == _installed_record(), python
        checked.append(python)
    if not pythons:
        pytest.skip("no other CPython on this machine")  # the running one is checked by test_recorded_from_the_installed_release
    assert len(checked) == len(pythons) > 0


def test_f_string_parts_that_only_some_pythons_emit_do_not_change_the_fingerprint() -> None:
    """CPython 3.12.1 ends the format spec of ``f"{x:>{w}}"`` with an empty ``Constant``; 3.11 and 3.13 do not."""
    import ast

    tree = ast.parse('f"a{x:>{w}}b"')
    spec = tree.body[0].value.values[1].format_spec  # type: ignore[attr-defined]
    padded = ast.parse('f"a{x:>{w}}b"')
    padded.body[0].value.values[1].format_spec.values.append(ast.Constant(value=""))  # type: ignore[attr-defined]
    padded.body[0].value.values.insert(1, ast.Constant(value=""))  # type: ignore[attr-defined]
    assert ast.dump(padded) != ast.dump(tree) and spec is not None
    assert fingerprints.canonical_dump(padded) == fingerprints.canonical_dump(tree)
    assert fingerprints.canonical_dump(ast.parse('f"a{x}b"')) != fingerprints.canonical_dump(ast.parse('f"a{y}b"'))

