"""``dbo-runtime doctor``: will the plugin work with the vLLM installed here?

Why: an operator who upgrades vLLM learns only from engine start whether dbo_runtime's fixes are in
force there. The doctor says it up front, installing nothing: every feature's verdict as
``register()`` would reach it (in force, provided by vLLM, or not in force and why: a fingerprint
that differs from vLLM 0.33.0, a missing dependency), every patch target and its fingerprint, the
guard's targets, the entry point, every setting an operator can mistype, and whether DeepGEMM and
NVML load. vLLM and the integration package are imported inside ``run`` only.

Exit 0 when every feature is in force, the guard's targets exist and the entry point is registered;
1 otherwise (a feature not in force means a DBO model that needs it is refused at engine start).
``DBO_RUNTIME_DISABLE=1`` is a deliberate choice, not a failure: one warning says what it means, exit 0.
DeepGEMM / NVML absence is reported but not a failure (CPU boxes lack both). A required lazy target
whose module cannot be imported here is a warning. What vLLM and torch log while being imported is
kept off stderr (``import_warnings``).

JSON schema (``--json``)::

    {
      "schema": "dbo-runtime/doctor/v2",
      "ok": bool,
      "problems": [str], "warnings": [str],
      "dbo_runtime_version": str, "python": str,
      "vllm": {"version": str | null, "verified_release": "0.33.0", "trusted_by": "fingerprints"},
      "plugin": {"entry_point": bool, "disabled_by_env": bool, "load_format_entry_point": bool},
      "features": [{"name": str, "summary": str, "verdict": str, "state": str, "detail": str}],
      "guard": [{"name": str, "target": str, "state": "found" | "missing" | "skipped", "detail": str}],
      "patches": [{"name": str, "feature": str, "target": str, "state": "found" | "missing" | "skipped",
                   "fingerprint": "match" | "differs" | "not bound", "lazy": bool, "optional": bool,
                   "detail": str, "reason": str, "upstream_pr": str, "removal": str}],
      "deep_gemm": {"available": bool, "detail": str},
      "nvml": {"available": bool, "detail": str},
      "import_warnings": [str]
    }
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import platform
import warnings
from collections.abc import Iterator
from importlib import metadata
from typing import Any

from dbo_runtime import __version__
from dbo_runtime.cli._common import EXIT_OK, EXIT_PROBLEM, disabled_warning, print_json, print_table
from dbo_runtime.core.switches import parse_switch

SCHEMA = "dbo-runtime/doctor/v2"
ENTRY_POINT_GROUP = "vllm.general_plugins"
ENTRY_POINT_VALUE = "dbo_runtime.integration.plugin:register"
WEIGHTS_ENTRY_POINT_VALUE = "dbo_runtime.harness.weights:register"


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "doctor",
        help="check vLLM version, patch targets, DeepGEMM and NVML",
        description="Check that the installed vLLM has every attribute dbo_runtime patches (nothing is installed).",
    )
    p.add_argument("--json", action="store_true", help=f"machine-readable output (JSON, schema {SCHEMA})")
    return p


def _entry_point_registered(value: str = ENTRY_POINT_VALUE) -> bool:
    return any(ep.value == value for ep in metadata.entry_points(group=ENTRY_POINT_GROUP))


class _Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        line = record.getMessage()
        if record.exc_info and record.exc_info[1] is not None:
            line += f" ({type(record.exc_info[1]).__name__}: {record.exc_info[1]})"
        self.lines.append(line)

    def filter(self, record: logging.LogRecord) -> bool:
        """As a filter on another handler: keep the record here, stop it there."""
        if record.levelno >= self.level:
            self.emit(record)
        return False


@contextlib.contextmanager
def _import_noise() -> Iterator[list[str]]:
    """Collect what vLLM and torch log while the doctor imports them, instead of letting it hit stderr.

    Why: on a machine without vLLM's compiled kernels or Triton (every CPU box) importing the
    patch targets logs "Failed to import from vllm._C" (vLLM has configured no handler yet, so
    Python's last-resort handler prints it) and "Triton not available" (torch's own stderr
    handler) -- before the doctor's first line, and looking like failures. They are expected
    there and are not the doctor's findings, so they are kept as ``import_warnings`` (``--json``,
    and counted in the table) rather than shown or dropped.
    """
    with contextlib.suppress(ImportError):
        import torch  # noqa: F401  (torch installs its stderr handler on import; filter it below)

    capture = _Capture()
    root = logging.getLogger()
    torch_handlers = list(logging.getLogger("torch").handlers)
    root.addHandler(capture)
    for handler in torch_handlers:
        handler.addFilter(capture)
    try:
        with warnings.catch_warnings(record=True) as caught:  # the filters in force decide what counts
            yield capture.lines
        capture.lines.extend(f"{w.category.__name__}: {w.message}" for w in caught)
    finally:
        root.removeHandler(capture)
        for handler in torch_handlers:
            handler.removeFilter(capture)


def _deep_gemm() -> dict[str, Any]:
    """DeepGEMM availability as vLLM sees it.

    vLLM's ``_has_module`` logs a full traceback when a DeepGEMM build is found
    but fails to load (the CPU wheel's vendored copy always does); the doctor
    turns that into its one-line detail instead of spilling the traceback.
    """
    from dbo_runtime.adapters import deep_gemm

    vllm_logger = logging.getLogger("vllm.utils.import_utils")
    capture = _Capture()
    propagate = vllm_logger.propagate
    vllm_logger.addHandler(capture)
    vllm_logger.propagate = False
    try:
        ok = deep_gemm.available()
    except Exception as exc:  # a broken build must be reported, not crash the doctor
        return {"available": False, "detail": f"{type(exc).__name__}: {exc}"}
    finally:
        vllm_logger.removeHandler(capture)
        vllm_logger.propagate = propagate
    if ok:
        return {"available": True, "detail": "importable"}
    # vLLM caches the probe, so a second doctor run in one process sees no log line.
    return {"available": False, "detail": "; ".join(capture.lines) or "not importable here"}


def _nvml() -> dict[str, Any]:
    from dbo_runtime.adapters import nvml

    ok, detail = nvml.availability()
    return {"available": ok, "detail": detail}


def _probe(patch: Any, vllm_installed: bool) -> tuple[str, str]:
    from dbo_runtime.integration import patching

    if not vllm_installed:
        return ("skipped" if patch.optional or patch.lazy else "missing"), "vLLM not installed"
    status = patching.probe_target(patch)
    return status.state, status.detail


def _patches(vllm_installed: bool) -> list[dict[str, Any]]:
    from dbo_runtime.integration import fingerprints, plugin
    from dbo_runtime.integration.recorded_fingerprints import FINGERPRINTS

    out = []
    for patch in plugin.all_patches():  # a feature module may import vLLM: the caller handles ImportError
        state, detail = _probe(patch, vllm_installed)
        anchors = patch.fingerprint_anchors
        if not anchors:
            print_ = "not bound"
        else:
            print_ = "match" if vllm_installed and fingerprints.fingerprint(anchors) == FINGERPRINTS.get(patch.name) else "differs"
        out.append(
            {
                "name": patch.name,
                "feature": patch.feature,
                "target": patch.target,
                "state": state,
                "fingerprint": print_,
                "lazy": patch.lazy,
                "optional": patch.optional,
                "detail": detail,
                "reason": patch.reason,
                "upstream_pr": patch.upstream_pr,
                "removal": patch.removal,
            }
        )
    return out


def _features(vllm_installed: bool) -> list[dict[str, Any]]:
    from dbo_runtime.integration import plugin

    if not vllm_installed:
        return [
            {"name": f.name, "summary": f.summary, "verdict": "not installed", "state": "not installed (vLLM not installed)", "detail": ""}
            for f in plugin.all_features()
        ]
    disabled = parse_switch("DBO_RUNTIME_DISABLE")
    return [
        {
            "name": name,
            "summary": s.feature.summary,
            "verdict": "disabled" if disabled else s.verdict,
            "state": f"disabled by DBO_RUNTIME_DISABLE (here it would be {s.describe()})" if disabled else s.describe(),
            "detail": s.detail,
        }
        for name, s in plugin.feature_states().items()
    ]


def _guard(vllm_installed: bool) -> list[dict[str, Any]]:
    from dbo_runtime.integration.guard import guard_patches

    out = []
    for patch in guard_patches():
        state, detail = _probe(patch, vllm_installed)
        out.append({"name": patch.name, "target": patch.target, "state": state, "detail": detail})
    return out


def _vllm_import_error() -> str | None:
    """A vLLM distribution whose package does not import (a torch ABI mismatch: ``undefined symbol``)
    looks installed by its metadata, and every patch target then reads as "skipped": not a failure.
    Said as the problem it is."""
    try:
        import vllm  # noqa: F401
    except Exception as exc:
        return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}".rstrip(": ")
    return None


def _environment_problems() -> list[str]:
    """Every dbo_runtime switch and setting an operator can mistype, checked the way the runtime parses it
    (the plugin's own settings only while it is enabled: ``DBO_RUNTIME_DISABLE=1`` never reads them).

    ``VLLM_DBO_COMM_SMS`` is checked by the function ``verify`` and ``tune`` run before their engines start
    (``_engine.comm_sms_problem``: this GPU, else the H200 profile, with DeepEP high-throughput, vLLM's DBO
    backend of choice), so a value every engine would refuse (an odd ``19``) is a problem here too;
    ``VLLM_DEEP_GEMM_WARMUP`` by vLLM's own choices, which the plugin's planner warm-up follows."""
    from dbo_runtime.cli._common import settings_a_server_refuses
    from dbo_runtime.cli._engine import comm_sms_problem
    from dbo_runtime.core.switches import switch_problems

    problems = switch_problems()  # the plugin logs these same lines and reads the switches the same way
    import importlib.util

    if importlib.util.find_spec("torch") is None:
        problems.append("torch is not installed: vLLM and the plugin cannot run here (install vLLM 0.33.0 with its torch)")
    problems.extend(str(exc) for exc in settings_a_server_refuses())  # what the front-end guard and vLLM refuse
    comm = comm_sms_problem([], os.environ, backend="deepep_high_throughput")
    if comm is not None:
        problems.append(str(comm))
    plugins = os.environ.get("VLLM_PLUGINS")
    if plugins is not None and "dbo_runtime" not in [p.strip() for p in plugins.split(",")]:
        problems.append(f"VLLM_PLUGINS={plugins!r} does not list dbo_runtime: vLLM will not load the plugin")
    # dbo_runtime_weights left out of VLLM_PLUGINS only drops the test load format: not a problem, and
    # vLLM then says "load format dbo_runtime_random is not supported" where it is asked for.
    return problems


def collect() -> dict[str, Any]:
    """The ``--json`` document (module docstring)."""
    with _import_noise() as noise:
        doc = _collect()
    doc["import_warnings"] = list(dict.fromkeys(noise))
    return doc


def _collect() -> dict[str, Any]:
    from dbo_runtime.integration import plugin

    version = plugin.vllm_version()
    entry_point = _entry_point_registered()
    problems: list[str] = []
    import_error = _vllm_import_error() if version is not None else None
    usable = version is not None and not import_error
    patch_error = ""
    patches: list[dict[str, Any]] = []
    features: list[dict[str, Any]] = []
    guard: list[dict[str, Any]] = []
    try:
        patches = _patches(usable)
        features = _features(usable)
        guard = _guard(usable)
    except ImportError as exc:  # a feature module imports vLLM at module level and vLLM is absent/broken
        patch_error = f"patch list unavailable: {type(exc).__name__}: {exc}"
    if version is None:
        problems.append("vLLM not installed")
    elif import_error:
        problems.append(f"vLLM {version} is installed but does not import ({import_error}); vLLM cannot run here")
    if not entry_point:
        problems.append(f"entry point {ENTRY_POINT_GROUP}:{ENTRY_POINT_VALUE} not registered (is dbo-runtime pip-installed?)")
    if patch_error:
        problems.append(patch_error)
    disabled = parse_switch("DBO_RUNTIME_DISABLE")
    if usable and not disabled:
        problems.extend(
            f"{f['name']} ({f['summary']}): {f['state']}; a --enable-dbo model that needs it is refused at engine start"
            for f in features
            if f["verdict"] not in ("verified", "provided by vLLM")
        )
        problems.extend(f"guard target missing: {g['target']}: {g['detail']}" for g in guard if g["state"] == "missing")
        problems.extend(
            f"patch target missing: {p['target']} ({p['name']}): {p['detail']}" for p in patches if p["state"] == "missing"
        )
    problems.extend(_environment_problems())
    # the whole verdict under the deliberate switch: one warning (exit 0), where every feature's own state
    # would claim refusals that the disabled plugin never makes
    disabled_line = disabled_warning()
    warnings_ = [disabled_line] if disabled_line else []
    # where vLLM does not import, every target is unchecked for that one reason, which the problem already names
    warnings_ += [
        f"required patch target not checked here: {p['target']} ({p['name']}): {p['detail']}; its module's "
        "fingerprint is read from source, but whether the target resolves is known only when a worker imports the "
        "module: if the patch does not apply there, the feature is marked broken and the worker refuses a DBO model "
        "that needs it"
        for p in patches
        if usable and p["state"] == "skipped" and not p["optional"]
    ]
    return {
        "schema": SCHEMA,
        "ok": not problems,
        "problems": problems,
        "warnings": warnings_,
        "dbo_runtime_version": __version__,
        "python": platform.python_version(),
        "vllm": {"version": version, "verified_release": plugin.VERIFIED_VLLM, "trusted_by": "fingerprints"},
        "plugin": {
            "entry_point": entry_point,
            "disabled_by_env": parse_switch("DBO_RUNTIME_DISABLE"),
            "strict": parse_switch("DBO_RUNTIME_STRICT"),
            "load_format_entry_point": _entry_point_registered(WEIGHTS_ENTRY_POINT_VALUE),
        },
        "features": features,
        "guard": guard,
        "patches": patches,
        "deep_gemm": _deep_gemm(),
        "nvml": _nvml(),
    }


def render(doc: dict[str, Any]) -> None:
    v = doc["vllm"]
    if v["version"] is None:
        vllm_line = "vLLM not installed"
    else:
        release = "the verified release" if v["version"] == v["verified_release"] else f"not the verified release {v['verified_release']}"
        vllm_line = f"vLLM {v['version']} ({release}; trusted feature by feature, by fingerprint)"
    rows = [
        [
            p["name"],
            p["target"],
            p["state"] + (" (warning)" if p["state"] == "skipped" and not p["optional"] else ""),
            p["fingerprint"],
            ("lazy " if p["lazy"] else "") + ("optional" if p["optional"] else ""),
            p["detail"],
        ]
        for p in doc["patches"]
    ]
    noise = doc["import_warnings"]
    caption = [
        f"dbo_runtime {doc['dbo_runtime_version']}, Python {doc['python']}; {vllm_line}",
        (
            f"features: none in force, {len(doc['features'])} disabled by DBO_RUNTIME_DISABLE (--json: what each would be)"
            if doc["plugin"]["disabled_by_env"]
            else "features: " + ("; ".join(f"{f['name']}: {f['state']}" for f in doc["features"]) or "none")
        ),
        "guard: " + (", ".join(f"{g['name']} {g['state']}" for g in doc["guard"]) or "not checked"),
        f"entry point {ENTRY_POINT_GROUP}: {'registered' if doc['plugin']['entry_point'] else 'MISSING'}"
        + ("; DBO_RUNTIME_STRICT is on: a fix not in force stops every engine at plugin load" if doc["plugin"].get("strict") else "")
        + (
            "; load format dbo_runtime_random: registered (entry point dbo_runtime_weights, patches nothing, also under "
            "DBO_RUNTIME_DISABLE)"
            if doc["plugin"].get("load_format_entry_point")
            else ""
        ),
        f"DeepGEMM: {'available' if doc['deep_gemm']['available'] else 'unavailable'} ({doc['deep_gemm']['detail']})",
        f"NVML: {'available' if doc['nvml']['available'] else 'unavailable'} ({doc['nvml']['detail']})",
    ]
    if noise:
        caption.append(
            f"{len(noise)} import warning(s) from vLLM/torch (expected where vLLM's compiled kernels or Triton are "
            "absent; listed under import_warnings in --json)"
        )
    if doc["problems"]:
        caption.append("PROBLEMS: " + "; ".join(doc["problems"]))
    if doc["warnings"]:
        caption.append("WARNINGS (not failures): " + "; ".join(doc["warnings"]))
    if doc["ok"] and not doc["warnings"]:
        caption.append("OK")
    print_table(
        "dbo-runtime doctor: vLLM patch targets", ["Patch", "Target", "State", "Fingerprint", "Kind", "Detail"], rows, caption
    )


def run(args: argparse.Namespace) -> int:
    doc = collect()
    if args.json:
        print_json(doc)
    else:
        render(doc)
    return EXIT_OK if doc["ok"] else EXIT_PROBLEM
