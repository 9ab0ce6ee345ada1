"""``dbo-runtime doctor``: will the plugin work with the vLLM installed here?

Why: the plugin patches named vLLM attributes and refuses, with one log line,
to patch an unsupported vLLM; an operator who upgraded vLLM learns that only
from a log of every worker. The doctor checks the same things up front without
installing anything: the vLLM version against ``plugin.SUPPORTED_VLLM``, that
every patch target exists (``patching.probe_target``; lazy or optional targets
that cannot be imported here count as ``skipped``, not failures), that the
``vllm.general_plugins`` entry point is registered, and whether DeepGEMM and
NVML load. vLLM and the integration package are imported inside ``run`` only,
so ``dbo-runtime sms`` stays importable without vLLM.

Exit 0 when vLLM is supported, the entry point is registered and no required
(non-optional, non-lazy) patch target is missing; 1 otherwise. DeepGEMM / NVML
absence is reported but not a failure (CPU boxes lack both). A required lazy
target whose module cannot be imported here is a warning: the last line then
says WARNINGS, not OK. What vLLM and torch log while being imported is kept off
stderr (``import_warnings``), so the doctor's own lines are the only output.

JSON schema (``--json``)::

    {
      "schema": "dbo-runtime/doctor/v1",
      "ok": bool,
      "problems": [str],                 # each one fails the run (exit 1)
      "warnings": [str],                 # not failures: e.g. a required lazy target not importable here
      "dbo_runtime_version": str, "python": str,
      "vllm": {"version": str | null, "supported": bool, "supported_series": "0.33"},
      "plugin": {"entry_point": bool, "disabled_by_env": bool,
                 "load_format_entry_point": bool},  # dbo_runtime_weights: the test load format (patches nothing)
      "patches": [{"name": str, "target": str, "state": "found" | "missing" | "skipped",
                   "lazy": bool, "optional": bool, "detail": str,
                   "reason": str, "upstream_pr": str, "removal": str}],
      "deep_gemm": {"available": bool, "detail": str},
      "nvml": {"available": bool, "detail": str},
      "import_warnings": [str]           # what vLLM/torch logged while being imported (kept off stderr)
    }
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import platform
import warnings
from collections.abc import Callable, Iterator
from importlib import metadata
from typing import Any

from dbo_runtime import __version__
from dbo_runtime.cli._common import EXIT_OK, EXIT_PROBLEM, print_json, print_table
from dbo_runtime.core.switches import parse_switch

SCHEMA = "dbo-runtime/doctor/v1"
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


def _patches(vllm_installed: bool) -> list[dict[str, Any]]:
    from dbo_runtime.integration import patching, plugin

    out = []
    for patch in plugin.all_patches():  # a feature module may import vLLM: the caller handles ImportError
        if vllm_installed:
            status = patching.probe_target(patch)
            state, detail = status.state, status.detail
        else:
            state = "skipped" if patch.optional or patch.lazy else "missing"
            detail = "vLLM not installed"
        out.append(
            {
                "name": patch.name,
                "target": patch.target,
                "state": state,
                "lazy": patch.lazy,
                "optional": patch.optional,
                "detail": detail,
                "reason": patch.reason,
                "upstream_pr": patch.upstream_pr,
                "removal": patch.removal,
            }
        )
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
    """Every dbo_runtime switch and setting an operator can mistype, checked the way the runtime parses it."""
    from dbo_runtime.cli._inputs import COMM_ENV, comm_input
    from dbo_runtime.core.errors import ConfigError
    from dbo_runtime.core.switches import switch_problems

    problems = switch_problems()  # the plugin logs these same lines and reads the switches the same way
    try:  # the services import torch at module level; without it doctor still reports the rest
        from dbo_runtime.services.schedule_cache import warm_max_batch
        from dbo_runtime.services.topk_state import LAYOUT_ENV, parse_layout
    except ModuleNotFoundError as exc:
        if exc.name != "torch":
            raise
        return [*problems, "torch is not installed: vLLM and the plugin cannot run here (install vLLM 0.33.0 with its torch)"]
    checks: list[Callable[[], object]] = [lambda: parse_layout(os.environ.get(LAYOUT_ENV))]
    checks.append(lambda: warm_max_batch())
    if os.environ.get(COMM_ENV) is not None:
        # vLLM reads it with a bare int() at model load; dbo_runtime also refuses a negative count
        checks.append(lambda: comm_input(None, "cuda"))
    for check in checks:
        try:
            check()
        except ConfigError as exc:
            problems.append(str(exc))
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
    supported = plugin.version_supported(version)
    entry_point = _entry_point_registered()
    problems = []
    patch_error = ""
    try:
        patches = _patches(version is not None)
    except ImportError as exc:  # a feature module imports vLLM at module level and vLLM is absent/broken
        patches = []
        patch_error = f"patch list unavailable: {type(exc).__name__}: {exc}"
    import_error = _vllm_import_error() if version is not None else None
    if version is None:
        problems.append("vLLM not installed")
    elif import_error:
        problems.append(f"vLLM {version} is installed but does not import ({import_error}); vLLM cannot run here")
    elif not supported:
        problems.append(f"vLLM {version} is not supported (dbo_runtime supports {plugin.SUPPORTED_VLLM}.x); the plugin patches nothing")
    if not entry_point:
        problems.append(f"entry point {ENTRY_POINT_GROUP}:{ENTRY_POINT_VALUE} not registered (is dbo-runtime pip-installed?)")
    if patch_error:
        problems.append(patch_error)
    problems.extend(f"patch target missing: {p['target']} ({p['name']}): {p['detail']}" for p in patches if p["state"] == "missing")
    problems.extend(_environment_problems())
    # A required target the doctor could not import here is no failure (the module may only
    # import on a GPU box), but it is not "OK" either: where vLLM does import it and the target
    # is gone, the plugin rolls back every patch.
    warnings_ = [
        f"required patch target not checked here: {p['target']} ({p['name']}): {p['detail']}; if it is missing "
        "where vLLM imports that module, the plugin rolls back every patch"
        for p in patches
        if p["state"] == "skipped" and not p["optional"]
    ]
    return {
        "schema": SCHEMA,
        "ok": not problems,
        "problems": problems,
        "warnings": warnings_,
        "dbo_runtime_version": __version__,
        "python": platform.python_version(),
        "vllm": {"version": version, "supported": supported, "supported_series": plugin.SUPPORTED_VLLM},
        "plugin": {
            "entry_point": entry_point,
            "disabled_by_env": parse_switch("DBO_RUNTIME_DISABLE"),
            "load_format_entry_point": _entry_point_registered(WEIGHTS_ENTRY_POINT_VALUE),
        },
        "patches": patches,
        "deep_gemm": _deep_gemm(),
        "nvml": _nvml(),
    }


def render(doc: dict[str, Any]) -> None:
    v = doc["vllm"]
    vllm_line = "vLLM not installed" if v["version"] is None else f"vLLM {v['version']} ({'supported' if v['supported'] else 'NOT supported'}; plugin targets {v['supported_series']}.x)"
    rows = [
        [
            p["name"],
            p["target"],
            p["state"] + (" (warning)" if p["state"] == "skipped" and not p["optional"] else ""),
            ("lazy " if p["lazy"] else "") + ("optional" if p["optional"] else ""),
            p["detail"],
        ]
        for p in doc["patches"]
    ]
    noise = doc["import_warnings"]
    caption = [
        f"dbo_runtime {doc['dbo_runtime_version']}, Python {doc['python']}; {vllm_line}",
        f"entry point {ENTRY_POINT_GROUP}: {'registered' if doc['plugin']['entry_point'] else 'MISSING'}"
        + ("; DBO_RUNTIME_DISABLE reads as on: the plugin patches nothing" if doc["plugin"]["disabled_by_env"] else "")
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
    if not doc["ok"]:
        caption.append("PROBLEMS: " + "; ".join(doc["problems"]))
    elif doc["warnings"]:
        caption.append("WARNINGS (not failures): " + "; ".join(doc["warnings"]))
    else:
        caption.append("OK")
    print_table("dbo-runtime doctor: vLLM patch targets", ["Patch", "Target", "State", "Kind", "Detail"], rows, caption)


def run(args: argparse.Namespace) -> int:
    doc = collect()
    if args.json:
        print_json(doc)
    else:
        render(doc)
    return EXIT_OK if doc["ok"] else EXIT_PROBLEM
