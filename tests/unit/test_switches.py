"""DBO_RUNTIME_* switches: the usual spellings; a typo is one named warning, never stops vLLM, and keeps the
plugin's protection (only an explicit true DBO_RUNTIME_DISABLE gives vanilla vLLM)."""

from __future__ import annotations

import logging
import os

import pytest

from dbo_runtime.core import switches
from dbo_runtime.core.switches import parse_switch


@pytest.mark.parametrize(("raw", "value"), [("1", True), (" TRUE ", True), ("on", True), ("yes", True), ("0", False), ("off", False), ("", False), ("No", False)])
def test_spellings(raw: str, value: bool) -> None:
    assert parse_switch("DBO_RUNTIME_DISABLE", {"DBO_RUNTIME_DISABLE": raw}) is value


def test_unset_is_off() -> None:
    assert parse_switch("DBO_RUNTIME_STRICT", {}) is False


@pytest.mark.parametrize(
    ("raw", "shown"), [("ture", "'ture'"), ("2", "2"), ("maybe", "'maybe'"), ("enabled", "'enabled'"), ("unset", "'unset'")]
)
def test_a_typo_never_raises_and_keeps_the_plugin_active(raw: str, shown: str) -> None:
    """DISABLE typo -> the plugin stays (fail safe); STRICT typo -> raise nothing; one line names the variable and
    the allowed values."""
    disable = switches.read_switch("DBO_RUNTIME_DISABLE", {"DBO_RUNTIME_DISABLE": raw})
    strict = switches.read_switch("DBO_RUNTIME_STRICT", {"DBO_RUNTIME_STRICT": raw})
    assert (disable.on, disable.recognised) == (False, False)
    assert (strict.on, strict.recognised) == (False, False)
    line = disable.problem()
    assert "\n" not in line and line.startswith(f"DBO_RUNTIME_DISABLE={shown} is not allowed; allowed values: ")
    assert "'true'" in line and "'0'" in line and "read as off: the plugin stays active" in line
    assert "read as off" in strict.problem()


def test_allowed_values_do_not_list_the_word_unset() -> None:
    """A refusal of `DBO_RUNTIME_DISABLE=unset` must not offer 'unset' as an allowed value: the allowed
    state is 'not set'."""
    line = switches.read_switch("DBO_RUNTIME_DISABLE", {"DBO_RUNTIME_DISABLE": "unset"}).problem()
    allowed = line.split("allowed values: ", 1)[1]
    assert "'unset'" not in allowed and "not set" in allowed


def test_plugin_never_raises_on_a_mistyped_switch(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """vLLM's plugin loader has no try: a raise on a typo would kill every vLLM process at start."""
    import vllm.plugins

    from dbo_runtime.integration import plugin

    plugin.uninstall()
    monkeypatch.setenv("DBO_RUNTIME_DISABLE", "ture")
    monkeypatch.setenv("DBO_RUNTIME_STRICT", "yes please")
    monkeypatch.setattr(vllm.plugins, "plugins_loaded", False)
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    try:
        with caplog.at_level(logging.WARNING, logger="vllm.dbo_runtime"):
            vllm.plugins.load_general_plugins()  # vLLM's own loader, which does not catch
        patch_set = plugin.installed_patch_set()
        assert patch_set is not None and patch_set.installed  # a DISABLE typo keeps the plugin (fail safe)
    finally:
        plugin.uninstall()
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(line.startswith("dbo_runtime: DBO_RUNTIME_DISABLE='ture' is not allowed; allowed values: ") for line in lines), lines
    assert any("DBO_RUNTIME_STRICT='yes please'" in line and "read as off" in line for line in lines), lines


def test_strict_typo_does_not_raise_on_an_unverified_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    from dbo_runtime.integration import plugin
    from dbo_runtime.integration.features import REGISTRY
    from tests.fakes.vllm_build import edited_sources, replace_once

    plugin.uninstall()
    monkeypatch.setenv("DBO_RUNTIME_STRICT", "ture")
    moved = {"vllm.v1.attention.backends.mla.index_group": replace_once("workspace_rows = self.max_decode_rows", "workspace_rows = self.max_decode_rows + 0")}
    try:
        with edited_sources(moved):
            plugin.register()  # strict would raise PatchError on an unverified feature; a typo of it must not
            state = REGISTRY.get("topk")
            assert state is not None and state.verdict == "unverified", state
    finally:
        plugin.uninstall()


def test_every_entry_point_shows_the_plugins_line(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """The plugin, doctor, sms and simulate read a switch the same way and say so in the same words."""
    import json

    from dbo_runtime.cli.main import main

    monkeypatch.setenv("DBO_RUNTIME_DISABLE", "ture")
    monkeypatch.delenv("VLLM_DBO_COMM_SMS", raising=False)
    [line] = switches.switch_problems()
    main(["doctor", "--json"])
    doctor = json.loads(capsys.readouterr().out)
    assert line in doctor["problems"] and doctor["plugin"]["disabled_by_env"] is False
    assert main(["sms", "--json", "--total-sms", "132"]) == 0
    out, err = capsys.readouterr()
    assert err.strip() == f"dbo-runtime sms: warning: {line}" and json.loads(out)["plugin"] == {"disabled_by_env": False}


def test_a_mistyped_switch_is_in_the_json_too(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """A script that reads only stdout (--json) gets the warning the text output shows on stderr, in "warnings";
    simulate's list also holds the split warning it shows."""
    import json

    from dbo_runtime.cli.main import main

    monkeypatch.setenv("DBO_RUNTIME_DISABLE", "yes-please")
    monkeypatch.delenv("VLLM_DBO_COMM_SMS", raising=False)
    [line] = switches.switch_problems()
    assert main(["sms", "--json", "--total-sms", "132"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["warnings"] == [line] and err.strip() == f"dbo-runtime sms: warning: {line}"
    fast = ["simulate", "--json", "--backend", "cpu", "--steps", "1", "--requests", "4", "--no-contrast"]
    assert main([*fast, "--comm-sms", "24"]) == 0  # 4 of the 24 comm SMs stay idle under DeepEP HT's clamp
    out, err = capsys.readouterr()
    warnings = json.loads(out)["warnings"]
    assert warnings[0] == line and len(warnings) == 2 and "4 of the 24 comm SMs stay idle" in warnings[1]
    assert all(f"dbo-runtime simulate: warning: {w}" in err for w in warnings)
    monkeypatch.delenv("DBO_RUNTIME_DISABLE")
    assert main(["sms", "--json", "--total-sms", "132"]) == 0
    assert json.loads(capsys.readouterr().out)["warnings"] == []


def test_simulate_and_doctor_say_disable_the_same_way(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """DBO_RUNTIME_DISABLE=1 is the operator's choice of vanilla vLLM: doctor and simulate both report it as the
    same one warning (exit 0), and simulate's verdict stays about the simulation, with the warning beside it."""
    import json

    from dbo_runtime.cli._common import disabled_warning
    from dbo_runtime.cli.main import main

    monkeypatch.setenv("DBO_RUNTIME_DISABLE", "On")
    monkeypatch.delenv("VLLM_DBO_COMM_SMS", raising=False)
    line = disabled_warning()
    assert line is not None and line.startswith("DBO_RUNTIME_DISABLE=On: nothing patched, nothing refused")
    assert main(["doctor", "--json"]) == 0
    doctor = json.loads(capsys.readouterr().out)
    assert line in doctor["warnings"] and doctor["problems"] == []
    assert main(["sms", "--json", "--total-sms", "132"]) == 0  # sms says it in the same words, in its JSON too
    assert json.loads(capsys.readouterr().out)["warnings"] == [line]
    fast = ["simulate", "--backend", "cpu", "--steps", "1", "--requests", "4", "--no-contrast"]
    assert main([*fast, "--json"]) == 1  # the logic passes; a server with this environment is not protected
    doc = json.loads(capsys.readouterr().out)
    assert doc["verdict"] == "NOT PROTECTED" and doc["simulation"] == "PASS" and doc["exit_code"] == 1
    assert doc["dbo_runtime_disabled_by_env"] is True and doc["warnings"] == [line]
    assert doc["server_runs"] == "vanilla vLLM"  # whose PASS it is, in the document itself
    [run] = doc["runs"]
    assert run["name"] == "dbo_runtime" and run["ok"] and run["as_expected"]
    assert main(fast) == 1
    out = capsys.readouterr().out.splitlines()
    at = next(i for i, text in enumerate(out) if text.startswith("verdict: "))
    assert out[at] == (
        "verdict: NOT PROTECTED: DBO_RUNTIME_DISABLE turns dbo_runtime off here (a server with this environment runs "
        "vanilla vLLM); the simulation of dbo_runtime's own logic passed"
    )
    assert " ".join(t.strip() for t in out[at + 1 :]) == f"WARNING: {line}"  # folded to the CLI's width
    assert all(len(t) <= 100 for t in out[at + 1 :]) and "FAIL" not in "\n".join(out) and "PASS" not in "\n".join(out)
    monkeypatch.delenv("DBO_RUNTIME_DISABLE")
    assert disabled_warning() is None
    assert main([*fast, "--json"]) == 0
    enabled = json.loads(capsys.readouterr().out)
    assert enabled["warnings"] == [] and enabled["server_runs"] == "dbo_runtime"


def test_doctor_reports_every_mistyped_setting(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from dbo_runtime.cli.main import main

    monkeypatch.setenv("DBO_RUNTIME_STRICT", "2")
    monkeypatch.setenv("DBO_RUNTIME_TOPK_LAYOUT", "foo")
    monkeypatch.setenv("DBO_RUNTIME_PLANNER_WARM_MAX_BATCH", "-1")
    monkeypatch.setenv("VLLM_PLUGINS", "lora_filesystem_resolver")
    monkeypatch.setenv("DBO_RUNTIME_SELF_TIME", "maybe")
    monkeypatch.setenv("VLLM_DBO_COMM_SMS", "abc")
    rc = main(["doctor", "--json"])
    problems = json.loads(capsys.readouterr().out)["problems"]
    assert rc == 1
    for needle in (
        "DBO_RUNTIME_STRICT=2 is not allowed",
        "DBO_RUNTIME_TOPK_LAYOUT='foo'",
        "DBO_RUNTIME_PLANNER_WARM_MAX_BATCH=-1",
        "VLLM_PLUGINS=",
        "DBO_RUNTIME_SELF_TIME='maybe' is not allowed",
        "VLLM_DBO_COMM_SMS='abc'",
    ):
        assert any(needle in p for p in problems), (needle, problems)
    assert any("DBO_RUNTIME_SELF_TIME" in p and "read as off" in p for p in problems)
    for good in ("20", "0"):
        monkeypatch.setenv("VLLM_DBO_COMM_SMS", good)
        main(["doctor", "--json"])
        assert not any("VLLM_DBO_COMM_SMS" in p for p in json.loads(capsys.readouterr().out)["problems"])


def test_doctor_says_when_installed_vllm_does_not_import(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """A vLLM whose import fails (torch ABI mismatch) is a problem, not a list of "skipped" targets.
    ``sys.modules['vllm'] = None`` makes ``import vllm`` fail as such a build does."""
    import json
    import sys

    from dbo_runtime.cli import doctor
    from dbo_runtime.cli.main import main

    assert doctor._vllm_import_error() is None  # the real vLLM 0.33.0 imports here
    monkeypatch.setitem(sys.modules, "vllm", None)
    assert doctor._vllm_import_error() is not None
    rc = main(["doctor", "--json"])
    problems = json.loads(capsys.readouterr().out)["problems"]
    assert rc == 1 and any("is installed but does not import (ModuleNotFoundError" in p for p in problems), problems


def test_without_torch_simulate_is_one_line_and_doctor_still_reports() -> None:
    """``pip install --no-deps`` in a bare venv, then doctor or simulate: one line, no traceback; doctor, the
    command that diagnoses exactly that install, reports (exit 1). A fresh interpreter, torch made unimportable."""
    import json
    import subprocess
    import sys

    code = (
        "import contextlib, io, json, sys; sys.modules['torch'] = None; from dbo_runtime.cli.main import main\n"
        "results = []\n"
        "for argv in (['simulate', '--steps', '1', '--no-contrast'], ['doctor', '--json']):\n"
        "    out, err = io.StringIO(), io.StringIO()\n"
        "    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):\n"
        "        try:\n"
        "            rc = main(argv)\n"
        "        except SystemExit as exc:\n"
        "            rc = exc.code\n"
        "    results.append([rc, out.getvalue(), err.getvalue()])\n"
        "print(json.dumps(results))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (sim_rc, _, sim_err), (doc_rc, doc_out, doc_err) = json.loads(proc.stdout)
    assert sim_rc == 3 and "Traceback" not in sim_err, sim_err[-2000:]
    assert sim_err.strip().splitlines()[-1] == (
        "dbo-runtime simulate: torch is not installed: this command needs torch (install vLLM with its torch)"
    )
    assert doc_rc == 1 and "Traceback" not in doc_err, doc_err[-2000:]
    problems = json.loads(doc_out)["problems"]
    assert any(p.startswith("torch is not installed") for p in problems), problems


def test_a_mistyped_setting_name_is_said_with_the_name_it_resembles(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """``DBO_RUNTIME_DISABEL=1`` disables nothing: every entry point says so in one line, with the closest name and
    every name the plugin reads; doctor counts it as a problem."""
    import json

    from dbo_runtime.cli.main import main

    for name in [n for n in list(os.environ) if n.startswith("DBO_RUNTIME_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("DBO_RUNTIME_DISABEL", "1")
    monkeypatch.setenv("DBO_RUNTIME_NOTHING_LIKE_IT", "x")
    monkeypatch.delenv("VLLM_DBO_COMM_SMS", raising=False)
    first, second = switches.switch_problems()
    assert first.startswith("DBO_RUNTIME_DISABEL is not a dbo_runtime setting and is ignored (did you mean DBO_RUNTIME_DISABLE?")
    assert second.startswith("DBO_RUNTIME_NOTHING_LIKE_IT is not a dbo_runtime setting and is ignored (allowed names: ")
    assert all(name in first for name in switches.NAMES)
    main(["doctor", "--json"])
    assert first in json.loads(capsys.readouterr().out)["problems"]
    monkeypatch.delenv("DBO_RUNTIME_DISABEL")
    monkeypatch.delenv("DBO_RUNTIME_NOTHING_LIKE_IT")
    assert switches.switch_problems() == []


@pytest.mark.parametrize(
    ("name", "line"),
    [
        ("DBO_RUNTIME_disable", "DBO_RUNTIME_disable is not a dbo_runtime setting and is ignored (did you mean DBO_RUNTIME_DISABLE?"),
        ("dbo_runtime_disable", "dbo_runtime_disable is not a dbo_runtime setting and is ignored (did you mean DBO_RUNTIME_DISABLE?"),
        ("VLLM_DBO_COMM_SM", "VLLM_DBO_COMM_SM is not a vLLM setting and is ignored (did you mean VLLM_DBO_COMM_SMS? allowed names: VLLM_DBO_COMM_SMS)"),
        ("vllm_dbo_comm_sms", "vllm_dbo_comm_sms is not a vLLM setting and is ignored (did you mean VLLM_DBO_COMM_SMS?"),
    ],
)
def test_a_name_in_the_wrong_case_or_a_misspelt_vllm_dbo_name_is_named(name: str, line: str) -> None:
    """Environment names are case-sensitive: each of these changes nothing, which is what the user did not mean."""
    [problem] = switches.unknown_names({name: "1", "DBO_RUNTIME_DISABLE": "1", "VLLM_DBO_COMM_SMS": "8", "PATH": "/bin"})
    assert problem.startswith(line)
