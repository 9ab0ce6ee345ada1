"""``dbo-runtime doctor`` against the real vLLM installed in the venv.

Failure paths change only dbo_runtime's own inputs (the patch list, the version it reads) or a copy of
vLLM's sources (``tests/fakes/vllm_build``), never the installed vLLM.
"""

from __future__ import annotations

import json

import pytest

from dbo_runtime.cli.main import main
from dbo_runtime.integration import plugin, releases
from dbo_runtime.integration.patching import Patch

VERIFIED = releases.identify().release is not None
"""Whether the installed vLLM is a release dbo_runtime recorded (its fixes are in force only then)."""


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("DBO_RUNTIME_DISABLE", "DBO_RUNTIME_STRICT", "VLLM_DBO_COMM_SMS", "DBO_RUNTIME_TOPK_LAYOUT", "VLLM_PLUGINS"):
        monkeypatch.delenv(name, raising=False)


def doctor(capsys: pytest.CaptureFixture[str]) -> tuple[int, dict, str]:
    """The JSON document and the text output of one state."""
    rc = main(["doctor", "--json"])
    doc = json.loads(capsys.readouterr().out)
    assert main(["doctor"]) == rc
    out, err = capsys.readouterr()
    assert err == "", err  # vLLM's and torch's import noise is kept off stderr
    assert all(len(line) <= 100 for line in out.splitlines()), max(out.splitlines(), key=len)
    assert out.strip().splitlines()[-1].startswith("next: ") or out.strip().splitlines()[-2].startswith("next: ")
    return rc, doc, out


def bogus_patch(**kw: object) -> Patch:
    fields: dict = {
        "name": "test.bogus", "module": "vllm.v1.worker.ubatch_utils", "attr": "no_such_function_in_vllm",
        "make": lambda original: original, "reason": "test", "upstream_pr": "none", "removal": "never",
    }  # fmt: skip
    return Patch(**{**fields, **kw})


def test_the_real_vllm_is_judged_by_its_code(capsys: pytest.CaptureFixture[str]) -> None:
    """A recorded release: every fix in force, exit 0. Any other build: the features it would refuse, exit 1,
    and ``next:`` names the releases to install."""
    rc, doc, out = doctor(capsys)
    assert doc["schema"] == "dbo-runtime/doctor/v3" and doc["vllm"]["version"] == releases.installed_version()
    assert doc["vllm"]["verified"] == releases.identify().describe() and doc["vllm"]["supported"] == list(releases.SUPPORTED)
    assert {f["name"] for f in doc["features"]} == {f.name for f in plugin.all_features()}
    assert [p["name"] for p in doc["patches"]] == [p.name for p in plugin.all_patches()]
    assert all(g["state"] == "found" for g in doc["guard"]) and doc["plugin"]["entry_point"]
    assert doc["nvml"]["available"] is False and doc["deep_gemm"]["detail"]  # no driver here: reported, not a failure
    if VERIFIED:
        assert rc == 0 and doc["ok"] and doc["problems"] == [] and all(f["in_force"] or not f["applies"] for f in doc["features"])
        for p in doc["patches"]:  # found, or a lazy/optional module that cannot be imported on this CPU box
            assert p["state"] == "found" or (p["state"] == "skipped" and (p["lazy"] or p["optional"])), p
        assert "next: dbo-runtime simulate" in out and ("\nWARNINGS\n" if doc["warnings"] else "\nOK\n") in out
    else:
        assert rc == 1 and not all(f["in_force"] for f in doc["features"]) and "not a release dbo_runtime verifies" in doc["vllm"]["verified"]
        assert "next: install vLLM " in out and "NOT OK" in out


@pytest.mark.parametrize(("extra", "rc"), [({}, 1), ({"lazy": True}, 1), ({"optional": True}, 0)])
def test_a_missing_target_fails_unless_optional(extra: dict, rc: int, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    real = plugin.all_patches
    monkeypatch.setattr(plugin, "all_patches", lambda: [*real(), bogus_patch(**extra)])
    code, doc, out = doctor(capsys)
    [bogus] = [p for p in doc["patches"] if p["name"] == "test.bogus"]
    assert code == (rc if VERIFIED else 1) and bogus["state"] == ("skipped" if extra.get("optional") else "missing")
    assert any("no_such_function_in_vllm" in line for line in doc["problems"]) == (rc == 1)
    assert ("NOT OK" in out) == (code == 1)
    if code == 0:  # an optional target skipped: a warning naming it, and the last verdict says so
        assert any(w.startswith("test.bogus: target not checked here") and "runs without this optional patch" in w for w in doc["warnings"])
        assert "\nWARNINGS\n" in out


def test_every_target_not_checked_is_a_warning_and_the_count_says_what_the_release_leaves_out(capsys: pytest.CaptureFixture[str]) -> None:
    """Each target the doctor could not check is listed the same way, optional or not; one a release leaves out is
    counted apart, not as a skip."""
    _rc, doc, out = doctor(capsys)
    unchecked = [p["name"] for p in doc["patches"] if p["state"] == "skipped" and p["fingerprint"] != "not in release"]
    assert sorted(unchecked) == sorted(w.split(":")[0] for w in doc["warnings"] if "target not checked here" in w)
    left_out = sum(p["fingerprint"] == "not in release" for p in doc["patches"])
    line = " ".join(out.split()).split("patch targets: ", 1)[1].split("(--json lists each)", 1)[0]
    assert (f"{left_out} not in this release" in line) == bool(left_out) and (f"{len(unchecked)} not checked here" in line) == bool(unchecked), line


def test_code_that_differs_from_the_release_is_named_with_what_to_do(capsys: pytest.CaptureFixture[str]) -> None:
    from tests.fakes.vllm_build import edited_sources, replace_once

    edit = {"vllm.v1.attention.backends.mla.indexer": replace_once("self.num_sms = sm_count", "self.num_sms = int(sm_count)")}
    with edited_sources(edit):
        rc, doc, _out = doctor(capsys)
    [indexer] = [f for f in doc["features"] if f["name"] == "indexer"]
    assert rc == 1 and indexer["verdict"] == "unverified" and not indexer["in_force"]
    assert any(line.startswith("indexer (") and "refused at engine start" in line for line in doc["problems"])
    assert doc["next"].startswith("install vLLM ") and "without --enable-dbo" in doc["next"]


def test_vllm_missing_or_broken_is_one_problem(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    from dbo_runtime.cli import doctor as doctor_mod

    monkeypatch.setattr(doctor_mod, "_vllm_import_error", lambda: "ImportError: libcudart.so.13: cannot open shared object file")
    rc, doc, out = doctor(capsys)
    assert rc == 1 and [p for p in doc["problems"] if "does not import" in p and "libcudart" in p]
    assert not [w for w in doc["warnings"] if "not checked here" in w] and "next: install vLLM" in out
    monkeypatch.setattr(releases, "installed_version", lambda: None)
    rc, doc, out = doctor(capsys)
    assert rc == 1 and "vLLM is not installed" in doc["problems"] and doc["features"] == []


def test_disabled_is_one_warning_and_exit_0(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DBO_RUNTIME_DISABLE", "TRUE")
    monkeypatch.setenv("DBO_RUNTIME_TOPK_LAYOUT", "bad")  # a setting the disabled plugin never reads
    rc, doc, out = doctor(capsys)
    assert rc == 0 and doc["problems"] == [] and doc["warnings"][0].startswith("DBO_RUNTIME_DISABLE=TRUE: nothing patched")
    assert "refused at engine start" not in out and "next: unset DBO_RUNTIME_DISABLE" in out
    monkeypatch.delenv("DBO_RUNTIME_DISABLE")
    rc, doc, out = doctor(capsys)
    assert rc == 1 and any("DBO_RUNTIME_TOPK_LAYOUT='bad'" in p for p in doc["problems"])
    assert ("next: fix the settings" in out) == VERIFIED


@pytest.mark.parametrize(
    ("name", "value", "needle"),
    [
        ("VLLM_DBO_COMM_SMS", "19", "VLLM_DBO_COMM_SMS=19 is not allowed"),  # DeepEP HT's even rule
        ("VLLM_DEEP_GEMM_WARMUP", "bogus", "VLLM_DEEP_GEMM_WARMUP='bogus' is not allowed"),
        ("VLLM_PLUGINS", "other", "VLLM_PLUGINS='other' does not list dbo_runtime"),
    ],
)
def test_a_setting_the_engines_refuse_is_a_problem(name: str, value: str, needle: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(name, value)
    rc = main(["doctor", "--json"])
    problems = json.loads(capsys.readouterr().out)["problems"]
    assert rc == 1 and any(p.startswith(needle) for p in problems), problems


def test_an_unreadable_fingerprint_record_is_a_problem_not_a_traceback(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """A wheel without ``recorded_fingerprints.json`` (the engine refuses DBO models): doctor names it and exits 1."""
    from dbo_runtime.integration import fingerprints

    monkeypatch.setattr(releases, "RELEASES", {})  # what fingerprints.py leaves when the file cannot be read
    monkeypatch.setattr(fingerprints, "RECORD_PROBLEM", "recorded_fingerprints.json unreadable (FileNotFoundError())")
    rc, doc, _ = doctor(capsys)
    assert rc == 1 and not doc["ok"]
    assert any("recorded_fingerprints.json unreadable" in p for p in doc["problems"]), doc["problems"]
