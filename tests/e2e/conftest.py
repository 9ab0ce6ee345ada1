"""Real vLLM engine tests (issues 8 and 9): GPU machines with vLLM 0.33 installed.

Markers: ``e2e`` (one GPU) and ``e2e_dp2`` (two GPUs, data parallel 2). ``make test`` deselects
both (CI has no GPU; a skip is not coverage). Without vLLM/CUDA/enough GPUs they skip, and under
``DBO_REQUIRE_GPU=1`` they fail instead.

Every test names the runs it needs (``@pytest.mark.runs(...)`` with labels from ``plan.py``);
the first test that asks for records starts all runs of the selected tests at once
(``tests/e2e/pool.py``), bounded by ``DBO_E2E_MAX_ENGINES`` engines (default 12). Each run's
record lands in ``DBO_E2E_OUT`` (default ``tests/e2e/.out``); with ``DBO_E2E_RECORD_DIR``
set, the records (requests stripped, comparisons added by the tests) are also written there as
``<date>-real-engine-<label>.json`` (``tools/gpu/collect_records.py`` turns a session's runs into ``docs/records``).

With ``DBO_E2E_REPLAY=<dir>`` (a session's run directory, e.g. an extracted ``e2e.tgz``'s
``e2e-out``) no engine starts: the tests judge that session's recorded runs again
(``pool.replay_all``), on any machine. Use it after correcting a criterion; it proves nothing
new about the engine.
"""

from __future__ import annotations

import datetime
import json
import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dbo_runtime.core.errors import ConfigError
from tests.e2e import plan
from tests.harness.machine import engine_missing
from tests.load_format import put_on_pythonpath
from tests.require_gpu import require_gpu

OUT = Path(os.environ.get("DBO_E2E_OUT", Path(__file__).parent / ".out"))
REPLAY = os.environ.get("DBO_E2E_REPLAY") or None



@pytest.hookimpl(trylast=True)  # after -m/-k deselection: only the selected items need the engine settings
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if REPLAY is not None:
        root = Path(REPLAY)
        if not root.is_dir() or not any((d / "spec.json").exists() or (d / "record.json").exists() for d in root.iterdir() if d.is_dir()):
            raise pytest.UsageError(
                f"DBO_E2E_REPLAY={REPLAY}: {'not a directory' if not root.is_dir() else 'holds no runs'} "
                "(expected a session's run directory: <dir>/<label>/spec.json or record.json, e.g. an extracted e2e.tgz's e2e-out)"
            )
        return  # recorded runs are judged again: no engine, no GPU needed
    try:
        require = require_gpu()  # 1/true/yes/on, as every project switch; anything else is refused
    except ConfigError as exc:
        raise pytest.UsageError(str(exc)) from None
    if any(item.get_closest_marker(m) is not None for item in items for m in ("e2e", "e2e_dp2")):
        problems = plan.env_problems()
        if problems:
            raise pytest.UsageError("; ".join(problems))
        put_on_pythonpath()  # the engines these runs start can load --load-format dbo_runtime_random
    for item in items:
        if item.get_closest_marker("e2e_dp2") is not None:
            need = 2
        elif item.get_closest_marker("e2e") is not None:
            need = 1
        else:
            continue
        problem = engine_missing(need)
        if problem is None:
            continue
        if require:
            item.stash[_PROBLEM] = problem  # fails in the autouse fixture below: not a skip
        else:
            item.add_marker(pytest.mark.skip(reason=problem))


_PROBLEM = pytest.StashKey[str]()


@pytest.fixture(autouse=True)
def _fail_when_gpu_required(request: pytest.FixtureRequest) -> None:
    problem = request.node.stash.get(_PROBLEM, None)
    if problem is not None:
        pytest.fail(f"DBO_REQUIRE_GPU=1 but {problem}", pytrace=False)


class Records:
    """Runs the requested plan once per session and keeps the records (plus test annotations)."""

    def __init__(self, labels: list[str]) -> None:
        self.labels = labels
        self.records: dict[str, dict[str, Any]] | None = None
        self.extra: dict[str, dict[str, Any]] = {}

    def _run(self) -> dict[str, dict[str, Any]]:
        if self.records is None and REPLAY is not None:
            from tests.e2e.pool import replay_all

            self.records = replay_all(Path(REPLAY), self.labels)
        if self.records is None:
            import torch

            from tests.e2e.jobs import all_jobs
            from tests.e2e.pool import run_all

            specs = plan.all_specs()
            gpus = list(range(torch.cuda.device_count()))
            jobs = all_jobs(OUT, gpus)
            todo = [specs[label] for label in self.labels if label in specs]
            todo.sort(key=lambda spec: spec.timeout_s)  # short-timeout runs are the hangs: start them first
            extra = [(label, *jobs[label]) for label in self.labels if label in jobs]
            OUT.mkdir(parents=True, exist_ok=True)
            self.records = run_all(
                todo,
                OUT,
                max_engines=plan.max_engines(),
                gpus=gpus,
                progress=lambda msg: print(f"[e2e] {msg}", file=sys.stderr, flush=True),
                jobs=extra,
            )
        return self.records

    def __getitem__(self, label: str) -> dict[str, Any]:
        return self._run()[label]

    def annotate(self, label: str, **facts: Any) -> None:
        self.extra.setdefault(label, {}).update(facts)

    def add(self, label: str, record: dict[str, Any]) -> None:
        self._run()[label] = record


@pytest.fixture(scope="session")
def records(request: pytest.FixtureRequest) -> Iterator[Records]:
    labels: list[str] = []
    for item in request.session.items:
        if any(m.name == "skip" for m in item.iter_markers()):
            continue
        for marker in item.iter_markers("runs"):
            labels.extend(label for label in marker.args if label not in labels)
    store = Records(labels)
    yield store
    if store.records is not None:
        _write_records(store)


def _write_records(store: Records) -> None:
    target = os.environ.get("DBO_E2E_RECORD_DIR")
    if not target or store.records is None or REPLAY is not None:  # a replay's records exist already
        return
    root = Path(target)
    root.mkdir(parents=True, exist_ok=True)
    day = datetime.date.today().isoformat()
    for label, record in store.records.items():
        doc = {k: v for k, v in record.items() if k not in ("requests",)}
        doc.update(store.extra.get(label, {}))
        doc["date"] = day
        (root / f"{day}-real-engine-{label}.json").write_text(json.dumps(doc, indent=1, default=str) + "\n")


@pytest.fixture(scope="session")
def workdir() -> Path:
    OUT.mkdir(parents=True, exist_ok=True)
    return OUT


def clean(path: Path) -> Path:
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    return path
