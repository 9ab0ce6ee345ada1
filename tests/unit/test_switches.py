"""DBO_RUNTIME_* switches: the usual spellings or one named error, never a silent 'off'."""

from __future__ import annotations

import pytest

from dbo_runtime.core.errors import ConfigError
from dbo_runtime.core.switches import parse_switch


@pytest.mark.parametrize(("raw", "value"), [("1", True), (" TRUE ", True), ("on", True), ("yes", True), ("0", False), ("off", False), ("", False), ("No", False)])
def test_spellings(raw: str, value: bool) -> None:
    assert parse_switch("DBO_RUNTIME_DISABLE", {"DBO_RUNTIME_DISABLE": raw}) is value


def test_unset_is_off() -> None:
    assert parse_switch("DBO_RUNTIME_STRICT", {}) is False


@pytest.mark.parametrize("raw", ["ture", "2", "maybe", "enabled"])
def test_typos_are_one_named_error(raw: str) -> None:
    with pytest.raises(ConfigError) as e:
        parse_switch("DBO_RUNTIME_DISABLE", {"DBO_RUNTIME_DISABLE": raw})
    assert e.value.parameter == "DBO_RUNTIME_DISABLE" and "'true'" in str(e.value) and repr(raw) in str(e.value)


def test_plugin_refuses_a_mistyped_disable_instead_of_patching(monkeypatch: pytest.MonkeyPatch) -> None:
    from dbo_runtime.integration import plugin

    plugin.uninstall()
    monkeypatch.setenv("DBO_RUNTIME_DISABLE", "ture")
    with pytest.raises(ConfigError, match="DBO_RUNTIME_DISABLE='ture'"):
        plugin.register()
    assert plugin.installed_patch_set() is None


def test_doctor_reports_every_mistyped_setting(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from dbo_runtime.cli.main import main

    monkeypatch.setenv("DBO_RUNTIME_STRICT", "2")
    monkeypatch.setenv("DBO_RUNTIME_TOPK_LAYOUT", "foo")
    monkeypatch.setenv("DBO_RUNTIME_PLANNER_WARM_MAX_BATCH", "-1")
    monkeypatch.setenv("VLLM_PLUGINS", "lora_filesystem_resolver")
    rc = main(["doctor", "--json"])
    problems = json.loads(capsys.readouterr().out)["problems"]
    assert rc == 1
    for needle in ("DBO_RUNTIME_STRICT='2'", "DBO_RUNTIME_TOPK_LAYOUT='foo'", "DBO_RUNTIME_PLANNER_WARM_MAX_BATCH='-1'", "VLLM_PLUGINS="):
        assert any(needle in p for p in problems), (needle, problems)
