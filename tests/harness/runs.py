"""What benches, the e2e pool and the GPU-session tools do with real-engine runs beyond ``harness.launch``
(not the wheel's): a run's record assembled again from its folder, the facts it carries of a comparison, and
engines killed on SIGTERM."""

from __future__ import annotations

import dataclasses
import json
import signal
from pathlib import Path
from typing import Any

from dbo_runtime.harness.compare import Comparison
from dbo_runtime.harness.launch import kill_all, load_ranks
from dbo_runtime.harness.prompts import PromptSpec
from tests.harness.engine_runner import E2ESpec, describe


def kill_on_sigterm() -> None:
    """Make SIGTERM kill every engine this process started before it exits."""

    def handler(signum: int, frame: Any) -> None:
        kill_all()
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, handler)


def reassemble(run: Path) -> dict[str, Any] | None:
    """A run directory's record, assembled again from its spec, rank results and logs (a later
    ``assemble`` may know more; a killed run has no ``record.json``). A job directory without
    ``spec.json`` returns its record as written; None when there is neither."""
    spec_path, record_path = run / "spec.json", run / "record.json"
    stored = json.loads(record_path.read_text()) if record_path.exists() else None
    if not spec_path.exists():
        return stored
    known = {f.name for f in dataclasses.fields(E2ESpec)}
    raw = {key: value for key, value in json.loads(spec_path.read_text()).items() if key in known}  # older runs' too
    raw["prompts"] = PromptSpec(**raw["prompts"])
    spec = E2ESpec(**raw)  # any run's spec.json, the e2e runs' fields included
    why = "wrote no result" if stored is not None else "stopped before it wrote a result (the session's time limit killed it)"
    ranks = load_ranks(run, spec.dp, lambda rank: why)
    logs = [path.read_text(errors="replace") for path in sorted(run.glob("rank*.log"))]
    record = spec.record(ranks, logs, wall_s=float(stored["wall_s"]) if stored else float("nan"))
    if stored is not None:
        # ``describe`` also reads the launching process's environment: what the run was given.
        record.update({key: stored[key] for key in [*describe(spec), "plugin"] if key in stored})
        if not record["ok"] and stored.get("error"):
            record["error"] = stored["error"]  # it names the exit codes, which only the launcher saw
    else:
        record["stopped_by_session_limit"] = True
    return record


def record_facts(comparison: Comparison, reference: str, reference_requests: int) -> dict[str, Any]:
    """The keys a run record carries for its comparison with ``reference``."""
    return {
        "reference": reference,
        "agreement": comparison.agreement,
        "prefix_agreement": comparison.prefix_agreement,
        "exact_requests": comparison.exact_requests,
        "agreement_se": comparison.agreement_se,
        "requests_compared": comparison.requests,
        "max_abs_dlogprob": comparison.max_abs_dlogprob,
        "mean_abs_dlogprob": comparison.mean_abs_dlogprob,
        "tokens_identical_to": reference if comparison.exact_requests == comparison.requests == reference_requests else None,
    }


__all__ = ["kill_on_sigterm", "reassemble", "record_facts"]
