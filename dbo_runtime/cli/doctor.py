"""``dbo-runtime doctor``: will dbo_runtime's fixes be in force with the vLLM installed here? Installs nothing; says
each feature's verdict as ``register()`` would reach it, then one ``next:`` line. Exit 0 all in force (or disabled)."""

from __future__ import annotations

import argparse
import importlib.util
import os
import platform
from collections import Counter
from importlib import metadata
from typing import Any

from dbo_runtime import __version__
from dbo_runtime.cli._common import disabled_warning, import_noise, print_json, settings_a_server_refuses, wrapped
from dbo_runtime.core.errors import PatchError
from dbo_runtime.core.switches import parse_switch, switch_problems

SCHEMA = "dbo-runtime/doctor/v3"
ENTRY_POINT_GROUP = "vllm.general_plugins"
ENTRY_POINT_VALUE = "dbo_runtime.integration.plugin:register"


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser("doctor", help="check that dbo_runtime's fixes are in force with the installed vLLM", description="Check, installing nothing, that dbo_runtime's fixes are in force with the installed vLLM. Exit 0 no problem (warnings do not fail), 1 a problem listed, 2 bad arguments.")
    p.add_argument("--json", action="store_true", help=f"print the result as JSON ({SCHEMA})")
    return p


def _vllm_import_error() -> str | None:
    """A vLLM whose package does not import (a torch ABI mismatch) looks installed by its metadata."""
    try:
        import vllm  # noqa: F401
    except Exception as exc:
        return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}".rstrip(": ")
    return None


def _deep_gemm() -> dict[str, Any]:
    """DeepGEMM as vLLM sees it (what vLLM logs for a build that fails to load goes to ``import_warnings``)."""
    from dbo_runtime.integration import doctor_probes

    try:
        ok = doctor_probes.deep_gemm_available()
    except Exception as exc:  # a broken build is reported, not a crash
        return {"available": False, "detail": f"{type(exc).__name__}: {exc}"}
    return {"available": ok, "detail": "importable" if ok else "not importable here; --json shows import_warnings"}


def _fingerprint(bound: Any, usable: bool, match: Any) -> str:
    """A patch's or reliance's fingerprint judged against the release identified."""
    from dbo_runtime.integration import releases

    if not bound.fingerprint_anchors:
        return "not bound"
    return "not in release" if not releases.part_of(bound, match.recorded) else "differs" if bound.name in match.differing or not usable else "match"


def _targets(usable: bool, match: Any) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(patches, guard targets), each probed for its target and fingerprinted."""
    from dbo_runtime.integration import doctor_probes, plugin
    from dbo_runtime.integration.guard import guard_patches

    def probe(patch: Any) -> tuple[str, str]:
        if not usable:
            return ("skipped" if patch.optional or patch.lazy else "missing"), "vLLM not importable"
        status = doctor_probes.probe_target(patch)
        return status.state, status.detail

    patches = []
    for p in plugin.all_patches():
        fingerprint = _fingerprint(p, usable, match)
        state, detail = probe(p) if fingerprint != "not in release" else ("skipped", f"not part of {match.label}")
        patches.append({
            "name": p.name, "feature": p.feature, "target": p.target, "state": state, "fingerprint": fingerprint,
            "lazy": p.lazy, "optional": p.optional, "detail": detail, "upstream_pr": p.upstream_pr,
        })  # fmt: skip
    guard = [{"name": g.name, "target": g.target, "state": s, "detail": d} for g in guard_patches() for s, d in [probe(g)]]
    return patches, guard


def _environment_problems() -> list[str]:
    """Every switch and setting a server reads, checked the way the runtime reads it."""
    from dbo_runtime.cli._split import comm_sms_problem

    problems = switch_problems()
    if importlib.util.find_spec("torch") is None:
        problems.append("torch is not installed: vLLM and the plugin cannot run here")
    problems += [str(exc) for exc in settings_a_server_refuses()]
    problems += [str(exc) for exc in (comm_sms_problem(),) if exc is not None]
    plugins = os.environ.get("VLLM_PLUGINS")
    if plugins is not None and "dbo_runtime" not in [p.strip() for p in plugins.split(",")]:
        problems.append(f"VLLM_PLUGINS={plugins!r} does not list dbo_runtime: vLLM will not load the plugin")
    return problems


def collect() -> dict[str, Any]:
    """The ``--json`` document; what vLLM and torch log on import goes to ``import_warnings``."""
    with import_noise() as noise:
        doc = _collect()
    return {**doc, "import_warnings": list(dict.fromkeys(noise))}


def _collect() -> dict[str, Any]:
    from dbo_runtime.adapters import nvml
    from dbo_runtime.integration import plugin, releases
    from dbo_runtime.integration.catalog import all_reliances

    version = releases.installed_version()
    import_error = _vllm_import_error() if version is not None else None
    usable = version is not None and not import_error
    match: Any = None
    entry_point = any(ep.value == ENTRY_POINT_VALUE for ep in metadata.entry_points(group=ENTRY_POINT_GROUP))
    disabled = parse_switch("DBO_RUNTIME_DISABLE")
    patches: list[dict[str, Any]] = []
    guard: list[dict[str, Any]] = []
    relied_on: list[dict[str, Any]] = []
    features: list[dict[str, Any]] = []
    problems = ["vLLM is not installed"] if version is None else [f"vLLM {version} is installed but does not import ({import_error})"] if import_error else []
    problems += [] if entry_point else [f"entry point {ENTRY_POINT_GROUP}:{ENTRY_POINT_VALUE} is not registered (is dbo-runtime pip-installed?)"]
    try:
        match = releases.identify()
        patches, guard = _targets(usable, match)
        relied_on = [{"name": r.name, "feature": r.feature, "anchors": list(r.anchors), "fingerprint": _fingerprint(r, usable, match)} for r in all_reliances()]
        states = plugin.feature_states(match=match) if usable else {}
        features = [
            {"name": n, "summary": s.feature.summary, "verdict": s.verdict, "in_force": s.in_force, "applies": s.applies, "state": s.describe(), "detail": s.detail}
            for n, s in states.items()
        ]
    except (ImportError, PatchError) as exc:  # vLLM broken at a feature's import, or no readable fingerprint record
        problems.append(f"patch list unavailable: {type(exc).__name__}: {exc}")
    if usable and not disabled:
        refused = "a --enable-dbo model that needs it is refused at engine start"
        problems += [f"{f['name']} ({f['summary']}): {f['state']}; {refused}" for f in features if not f["in_force"] and f["applies"]]
        problems += [f"guard target missing: {g['target']}: {g['detail']}" for g in guard if g["state"] == "missing"]
        problems += [f"patch target missing: {p['target']} ({p['name']}): {p['detail']}" for p in patches if p["state"] == "missing"]
    problems += _environment_problems()
    warnings_ = [w for w in (disabled_warning(),) if w]
    unresolved = ("the feature is marked broken and the worker refuses a DBO model that needs it", "the worker runs without this optional patch")
    warnings_ += [
        f"{p['name']}: target not checked here ({p['detail']}); if it does not resolve in a worker, {unresolved[p['optional']]}"
        for p in patches if usable and p["state"] == "skipped" and p["fingerprint"] != "not in release"
    ]  # fmt: skip
    return {
        "schema": SCHEMA, "ok": not problems, "problems": problems, "warnings": warnings_,
        "next": _next(problems, usable, entry_point, features, disabled, releases.SUPPORTED),
        "dbo_runtime_version": __version__, "python": platform.python_version(),
        "vllm": {
            "version": version, "release": match and match.release, "supported": list(releases.SUPPORTED),
            "verified": match.describe() if match else "not identified (the patch list does not import here)",
        },
        "plugin": {"entry_point": entry_point, "disabled_by_env": disabled, "strict": parse_switch("DBO_RUNTIME_STRICT")},
        "features": features, "guard": guard, "patches": patches, "relied_on": relied_on,
        "deep_gemm": _deep_gemm() if usable else {"available": False, "detail": "vLLM not importable"},
        "nvml": dict(zip(("available", "detail"), nvml.availability(), strict=True)),
    }


def _next(problems: list[str], usable: bool, entry_point: bool, features: list[dict[str, Any]], disabled: bool, supported: tuple[str, ...]) -> str:
    releases = " or ".join(supported) or "a verified release"
    if not usable:
        return f"install vLLM {releases} (with its torch) next to dbo_runtime, then run dbo-runtime doctor again"
    if not entry_point:
        return "pip install dbo-runtime into this environment (vLLM finds the plugin by its entry point)"
    if not disabled and any(not f["in_force"] and f["applies"] for f in features):
        return f"install vLLM {releases}, whose code dbo_runtime verified; or run DSA models without --enable-dbo"
    if problems:
        return "fix the settings listed under problems, then run dbo-runtime doctor again"
    if disabled:
        return "unset DBO_RUNTIME_DISABLE to let dbo_runtime fix DBO; then dbo-runtime simulate"
    return "dbo-runtime simulate (dbo_runtime's logic), then dbo-runtime verify with your engine arguments on the GPUs"


def render(doc: dict[str, Any]) -> None:
    out = [
        f"dbo-runtime doctor: dbo_runtime {doc['dbo_runtime_version']}, Python {doc['python']}",
        wrapped(f"vLLM: {doc['vllm']['version'] or 'not installed'}; verified: {doc['vllm']['verified']}"),
        "features:" if doc["features"] else "features: not checked (vLLM not importable)",
    ]
    out += [wrapped(f"  {f['name']}: {'disabled by DBO_RUNTIME_DISABLE' if doc['plugin']['disabled_by_env'] else f['state']}", "    ") for f in doc["features"]]
    states = Counter("not in this release" if p["fingerprint"] == "not in release" else "not checked here" if p["state"] == "skipped" else p["state"] for p in doc["patches"])
    differs = [p["name"] for p in [*doc["patches"], *doc["relied_on"]] if p["fingerprint"] == "differs"]
    fingerprints = f"fingerprints differ: {len(differs)}" if differs else "fingerprints match"
    checked = ", ".join(f"{n} {s}" for s, n in sorted(states.items()))
    out += [
        wrapped(f"patch targets: {checked}; {fingerprints} (--json lists each)" if checked else "patch targets: not checked"),
        wrapped("guard targets: " + (", ".join(f"{g['name']} {g['state']}" for g in doc["guard"]) or "not checked")),
        f"entry point {ENTRY_POINT_GROUP}: {'registered' if doc['plugin']['entry_point'] else 'MISSING'}",
        *(wrapped(f"{name}: {'available' if doc[key]['available'] else 'unavailable'} ({doc[key]['detail']})") for name, key in (("DeepGEMM", "deep_gemm"), ("NVML", "nvml"))),
    ]
    for title, lines in (("problems", doc["problems"]), ("warnings (not failures)", doc["warnings"])):
        if lines:
            out.append(f"{title}:")
            out += [wrapped(f"  - {line}", "    ") for line in lines]
    print("\n".join([*out, "NOT OK" if not doc["ok"] else "WARNINGS" if doc["warnings"] else "OK", wrapped(f"next: {doc['next']}")]))


def run(args: argparse.Namespace) -> int:
    doc = collect()
    print_json(doc) if args.json else render(doc)
    return 0 if doc["ok"] else 1
