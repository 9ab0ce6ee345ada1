"""dbo_runtime reads vLLM's ``VLLM_DEEP_GEMM_WARMUP`` as vLLM 0.33.0 does: the values vLLM takes are taken, and
every value vLLM raises on is refused (the commands refuse it before any engine starts, because vLLM would stop
the engine only at the end of its start-up, in ``enable_envs_cache``)."""

from __future__ import annotations

import pytest
import vllm.envs

from dbo_runtime.core.cli_support import vllm_setting_problems
from dbo_runtime.core.errors import ConfigError
from dbo_runtime.core.settings import VLLM_WARMUP_ENV, VLLM_WARMUP_MODES, vllm_warmup_mode


def _vllm_reads(monkeypatch: pytest.MonkeyPatch, raw: str | None) -> str | None:
    if raw is None:
        monkeypatch.delenv(VLLM_WARMUP_ENV, raising=False)
    else:
        monkeypatch.setenv(VLLM_WARMUP_ENV, raw)
    return vllm.envs.environment_variables[VLLM_WARMUP_ENV]()


@pytest.mark.parametrize("raw", [None, *VLLM_WARMUP_MODES])
def test_every_value_vllm_takes_is_taken(raw: str | None, monkeypatch: pytest.MonkeyPatch) -> None:
    vllm_value = _vllm_reads(monkeypatch, raw)
    assert vllm_warmup_mode({} if raw is None else {VLLM_WARMUP_ENV: raw}) == vllm_value
    assert vllm_setting_problems({} if raw is None else {VLLM_WARMUP_ENV: raw}) == []


@pytest.mark.parametrize("raw", ["bogus", "", "FULL", " skip", "none"])
def test_every_value_vllm_raises_on_is_refused(raw: str, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match=VLLM_WARMUP_ENV):
        _vllm_reads(monkeypatch, raw)
    with pytest.raises(ConfigError) as refused:
        vllm_warmup_mode({VLLM_WARMUP_ENV: raw})
    assert refused.value.parameter == VLLM_WARMUP_ENV and refused.value.value == raw
    [problem] = vllm_setting_problems({VLLM_WARMUP_ENV: raw})
    assert str(problem) == str(refused.value)
