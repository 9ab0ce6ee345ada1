"""``dbo-runtime sms``: SMs per GPU and the DBO split vLLM 0.33.0 would apply.

Why this exists: under ``--enable-dbo`` vLLM silently lowers DeepGEMM's SM
count to ``total - VLLM_DBO_COMM_SMS`` (20 on CUDA) with DeepEP high-throughput,
and leaves it alone with low-latency / NIXL -- the split that decides whether
the DSA indexer schedule crashes. Operators need to see it before starting a
server, also on a laptop (``--total-sms``). The split is computed by
``dbo_runtime.core.budget.compute_budget``, the same policy the plugin uses.

SM counts: CUDA's ``multi_processor_count`` where torch sees the device (what
vLLM partitions); NVML ``multiprocessorCount`` (``nvmlDeviceGetAttributes_v2``)
for MIG instances; NVML cores / cores-per-SM as a cross-check (16896 / 128 =
132 on an H200), and as the count when CUDA cannot see the GPU. This module
imports no vLLM: it must run on machines that have only the driver and torch.

Flags (values are validated with one ``ConfigError`` line, exit 2):
``--all2all-backend`` (default ``deepep_high_throughput``; the backends vLLM
accepts with DBO on the platform), ``--comm-sms`` (default
``$VLLM_DBO_COMM_SMS``, else 20 on CUDA / 64 on ROCm), ``--platform``
(``cuda``/``rocm``), ``--no-expert-parallel``, ``--max-sms-used N|none``
(default: what the backend's vLLM 0.33.0 all2all manager returns),
``--no-deep-gemm`` (default: DeepGEMM assumed present, as on a DBO server),
``--total-sms N`` (skip the hardware; one embedded device with N SMs --
"NVIDIA H200 (embedded profile)" for 132 on CUDA), ``--json``.
No GPU through NVML or CUDA and no ``--total-sms``: one line on stderr, exit 3
(with ``--json`` also an error document on stdout, see ``cli.main``). The table
shows the knobs vLLM really turns, including the DeepEP high-throughput
manager's clamp of the comm share to 20, and warns on a valid but poor split.

JSON schema (``--json``), stable; keys are never removed within ``schema`` v1::

    {
      "schema": "dbo-runtime/sms/v1",
      "source": "hardware" | "--total-sms",
      "settings": {
        "platform": "cuda" | "rocm", "all2all_backend": str, "enable_dbo": true,
        "expert_parallel": bool, "comm_sms": int,
        "comm_sms_source": "--comm-sms" | "VLLM_DBO_COMM_SMS" | "default",
        "max_sms_used": int | null, "max_sms_used_source": "--max-sms-used" | "vllm-0.33.0-manager",
        "deep_gemm": bool
      },
      "nvml": {"available": bool | null, "detail": str, "driver_version": str | null},
      "cuda": {"available": bool | null, "detail": str, "torch_version": str | null},
      "plugin": {"disabled_by_env": bool},   # DBO_RUNTIME_DISABLE as the plugin reads it
      "warnings": [str],                     # a mistyped DBO_RUNTIME_* switch, the line shown on stderr
                                             # (core.switches.switch_problems), DBO_RUNTIME_DISABLE in
                                             # force in doctor's words, and a setting a server refuses at
                                             # engine start (_common.settings_a_server_refuses, as doctor
                                             # checks it); per-device ones are below
      "devices": [{
        "label": str,                      # "0", "0 MIG 1", "cuda:0", "profile"
        "kind": "gpu" | "mig" | "cuda" | "profile",
        "nvml_index": int | null, "cuda_index": int | null, "mig_slot": int | null,
        "name": str, "uuid": str | null, "compute_capability": "9.0" | null,
        "sms": int | null,                 # the count the split is computed on
        "sms_source": "cuda" | "nvml-mig-attributes" | "nvml-cores" | "--total-sms" | null,
        "sms_cuda": int | null, "sms_nvml_mig_attributes": int | null,
        "sms_nvml_cores": int | null, "nvml_gpu_cores": int | null, "cores_per_sm": int | null,
        "sms_consistent": bool | null,     # all available counts agree
        "mig_enabled": bool | null,
        "sm_clock_mhz": int | null, "max_sm_clock_mhz": int | null,
        "utilization_gpu_pct": int | null, "utilization_memory_pct": int | null,
        "budget": null | {
          "total": int, "comm": int, "compute": int, "partitioned": bool,
          "comm_knob": bool, "compute_knob": bool, "rocm_override": bool,
          "env_comm_sms": int, "max_sms_used": int | null, "expert_parallel": bool,
          "describe": str,
          "deepep_sms": int | null         # what DeepEP gets after vLLM's HT clamp to 20; null: no DeepEP knob
        },
        "note": str,                       # why budget is null, or ""
        "warnings": [str]                  # a valid but poor split: compute < comm, comm SMs left idle
      }]
    }
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from dbo_runtime.cli._common import (
    EXIT_NO_DEVICE,
    EXIT_OK,
    CliError,
    disabled_warning,
    print_json,
    print_table,
    warn_refused_settings,
    warn_switch_problems,
)
from dbo_runtime.cli._inputs import (
    COMM_ENV,
    Input,
    budget_for,
    comm_input,
    deepep_sms,
    parse_int,
    parse_total,
    shadowed_comm_env,
    split_warnings,
)
from dbo_runtime.core.budget import (
    ALL2ALL_BACKENDS,
    BACKEND_MAX_SMS_USED,
    DBO_BACKENDS,
    H200_SMS,
    PLATFORMS,
    SMBudget,
)
from dbo_runtime.core.errors import ConfigError, did_you_mean
from dbo_runtime.core.switches import parse_switch, switch_problems

SCHEMA = "dbo-runtime/sms/v1"
DEFAULT_BACKEND = "deepep_high_throughput"
H200_PROFILE_NAME = "NVIDIA H200 (embedded profile)"

#: Backends vLLM 0.33.0 accepts together with DBO (``config/vllm.py:2180-2203``).
DBO_BACKENDS_BY_PLATFORM: dict[str, tuple[str, ...]] = {
    "cuda": DBO_BACKENDS,
    "rocm": (*DBO_BACKENDS, "allgather_reducescatter"),
}


@dataclass(frozen=True, slots=True)
class Settings:
    platform: str
    all2all_backend: str
    expert_parallel: bool
    comm_sms: int
    comm_sms_source: str
    max_sms_used: int | None
    max_sms_used_source: str
    deep_gemm: bool
    total_sms: int | None


@dataclass(slots=True)
class DeviceRow:
    label: str
    kind: str
    nvml_index: int | None
    cuda_index: int | None
    mig_slot: int | None
    name: str
    uuid: str | None = None
    compute_capability: str | None = None
    sms: int | None = None
    sms_source: str | None = None
    sms_cuda: int | None = None
    sms_nvml_mig_attributes: int | None = None
    sms_nvml_cores: int | None = None
    nvml_gpu_cores: int | None = None
    cores_per_sm: int | None = None
    sms_consistent: bool | None = None
    mig_enabled: bool | None = None
    sm_clock_mhz: int | None = None
    max_sm_clock_mhz: int | None = None
    utilization_gpu_pct: int | None = None
    utilization_memory_pct: int | None = None
    budget: dict[str, Any] | None = None
    note: str = ""
    warnings: list[str] = field(default_factory=list)


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "sms",
        help="SMs per GPU and the DBO compute/comm split vLLM would apply",
        description="SMs per GPU (CUDA, NVML, MIG), clocks, utilisation and the DBO SM split of vLLM 0.33.0.",
    )
    p.add_argument(
        "--json", action="store_true", help=f"machine-readable output (JSON, schema {SCHEMA}; a mistyped switch's warning in \"warnings\")"
    )
    p.add_argument(
        "--total-sms",
        metavar="N",
        help="skip the hardware and use one N-SM device (132: the H200 profile, SM90; any other N: an unknown architecture)",
    )
    p.add_argument(
        "--all2all-backend",
        metavar="NAME",
        default=DEFAULT_BACKEND,
        help=f"all2all backend (default {DEFAULT_BACKEND}; CUDA+DBO allows {', '.join(DBO_BACKENDS)})",
    )
    p.add_argument("--comm-sms", metavar="N", help="VLLM_DBO_COMM_SMS (default: $VLLM_DBO_COMM_SMS, else 20 CUDA / 64 ROCm)")
    p.add_argument("--platform", metavar="NAME", default="cuda", help="cuda or rocm (default cuda)")
    p.add_argument("--no-expert-parallel", action="store_true", help="as without --enable-expert-parallel")
    p.add_argument("--max-sms-used", metavar="N|none", help="override the all2all manager's max_sms_used()")
    p.add_argument("--no-deep-gemm", action="store_true", help="as if DeepGEMM were not installed (compute knob untouched)")
    return p


def settings_from_args(args: argparse.Namespace) -> Settings:
    """Validate every flag before touching the hardware, naming the flag on error."""
    platform = args.platform
    if platform not in PLATFORMS:
        raise ConfigError("--platform", platform, PLATFORMS)
    backend = args.all2all_backend
    allowed_backends = DBO_BACKENDS_BY_PLATFORM[platform]
    if backend not in allowed_backends:
        known = "a vLLM backend without DBO support" if backend in ALL2ALL_BACKENDS else "not a vLLM backend"
        raise ConfigError(
            "--all2all-backend",
            backend,
            f"{', '.join(allowed_backends)} (the backends vLLM allows with DBO on {platform}; {backend!r} is {known})"
            + did_you_mean(str(backend), allowed_backends),  # never a backend the same check refuses
        )
    comm = comm_input(args.comm_sms, platform)
    if args.max_sms_used is None:
        max_sms, max_source = BACKEND_MAX_SMS_USED.get(backend), "vllm-0.33.0-manager"
    elif args.max_sms_used == "none":
        max_sms, max_source = None, "--max-sms-used"
    else:
        max_sms = parse_int(args.max_sms_used, "--max-sms-used", 0, also="'none'")
        max_source = "--max-sms-used"
    settings = Settings(
        platform=platform,
        all2all_backend=backend,
        expert_parallel=not args.no_expert_parallel,
        comm_sms=int(comm.value or 0),
        comm_sms_source=comm.source,
        max_sms_used=max_sms,
        max_sms_used_source=max_source,
        deep_gemm=not args.no_deep_gemm,
        total_sms=None,
    )
    if args.total_sms is None:
        return settings
    total = parse_total(args.total_sms, lambda sms: _apply_budget(_profile_rows(sms, platform)[0], settings))
    return replace(settings, total_sms=total)


def budget_json(budget: SMBudget) -> dict[str, Any]:
    r = budget.reason
    return {
        "total": budget.total,
        "comm": budget.comm,
        "compute": budget.compute,
        "partitioned": budget.partitioned,
        "comm_knob": budget.comm_knob,
        "compute_knob": budget.compute_knob,
        "rocm_override": r.rocm_override,
        "env_comm_sms": r.env_comm_sms,
        "max_sms_used": r.max_sms_used,
        "expert_parallel": r.expert_parallel,
        "describe": budget.describe(),
        "deepep_sms": deepep_sms(budget),
    }


def _apply_budget(row: DeviceRow, s: Settings) -> None:
    if row.kind == "gpu" and row.mig_enabled:
        row.note = "MIG enabled: DBO runs on the MIG instances"
        return
    if row.sms is None:
        row.note = "SM count unknown (CUDA cannot see this GPU and NVML gives no count)"
        return
    total_source = "--total-sms" if row.sms_source == "--total-sms" else "hardware"
    budget = budget_for(
        total=Input(row.sms, total_source, str(row.sms_source)),
        comm=Input(s.comm_sms, s.comm_sms_source, f"vLLM's {COMM_ENV} default on {s.platform.upper()}"),
        max_sms_used=Input(s.max_sms_used, s.max_sms_used_source),
        platform=s.platform,
        all2all_backend=s.all2all_backend,
        expert_parallel=s.expert_parallel,
        deep_gemm=s.deep_gemm,
        device=row.cuda_index if row.cuda_index is not None else (row.nvml_index or 0),
        where=f"device {row.label}",
        sm_major=_major(row.compute_capability),
    )
    row.budget = budget_json(budget)
    row.warnings = split_warnings(budget)


def _major(cc: str | None) -> int | None:
    """``"9.0"`` -> 9; None for a ``--total-sms`` profile, whose architecture is not known."""
    try:
        return int(cc.split(".", 1)[0]) if cc else None
    except ValueError:
        return None


def _profile_rows(total: int, platform: str) -> list[DeviceRow]:
    h200 = total == H200_SMS and platform == "cuda"  # 132 SMs on ROCm is no H200
    name = H200_PROFILE_NAME if h200 else f"GPU with {total} SMs (--total-sms)"
    return [
        DeviceRow(
            label="profile", kind="profile", nvml_index=None, cuda_index=None, mig_slot=None, name=name, sms=total,
            sms_source="--total-sms", compute_capability="9.0" if h200 else None,
        )
    ]  # fmt: skip


def _cc(cc: tuple[int, int] | None) -> str | None:
    return None if cc is None else f"{cc[0]}.{cc[1]}"


def _agree(*counts: int | None) -> bool | None:
    known = {c for c in counts if c is not None}
    if len([c for c in counts if c is not None]) < 2:
        return None
    return len(known) == 1


def _hardware_rows() -> tuple[list[DeviceRow], dict[str, Any], dict[str, Any]]:
    from dbo_runtime.adapters import cuda_devices, nvml

    snap: nvml.NvmlSnapshot | None
    try:
        found = nvml.query()
        snap = found
        nvml_info: dict[str, Any] = {"available": True, "detail": f"{len(found.gpus)} GPU(s)", "driver_version": found.driver_version}
    except nvml.NvmlUnavailable as exc:
        snap = None
        nvml_info = {"available": False, "detail": str(exc), "driver_version": None}
    scan = cuda_devices.scan()
    cuda_info: dict[str, Any] = {"available": bool(scan.devices), "detail": scan.reason, "torch_version": scan.torch_version}

    by_uuid = {cuda_devices.normalize_uuid(d.uuid): d for d in scan.devices if d.uuid}
    by_index_ok = (
        snap is not None
        and not by_uuid
        and len(scan.devices) == len(snap.gpus)
        and not os.environ.get("CUDA_VISIBLE_DEVICES")
    )
    used: set[int] = set()

    def match(uuid: str | None, nvml_index: int | None) -> cuda_devices.CudaDevice | None:
        found = by_uuid.get(cuda_devices.normalize_uuid(uuid)) if uuid else None
        if found is None and by_index_ok and nvml_index is not None:
            found = scan.devices[nvml_index]
        if found is not None:
            used.add(found.index)
        return found

    rows: list[DeviceRow] = []
    for g in snap.gpus if snap is not None else ():
        cd = None if g.mig_enabled else match(g.uuid, g.index)
        row = DeviceRow(
            label=str(g.index),
            kind="gpu",
            nvml_index=g.index,
            cuda_index=None if cd is None else cd.index,
            mig_slot=None,
            name=g.name or (cd.name if cd else "unknown NVIDIA GPU"),
            uuid=g.uuid,
            compute_capability=_cc(g.compute_capability),
            sms_cuda=None if cd is None else cd.multi_processor_count,
            sms_nvml_mig_attributes=g.attributes_multiprocessor_count,
            sms_nvml_cores=g.sms_from_cores,
            nvml_gpu_cores=g.num_gpu_cores,
            cores_per_sm=g.cores_per_sm,
            mig_enabled=g.mig_enabled,
            sm_clock_mhz=g.sm_clock_mhz,
            max_sm_clock_mhz=g.max_sm_clock_mhz,
            utilization_gpu_pct=g.utilization_gpu_pct,
            utilization_memory_pct=g.utilization_memory_pct,
        )
        if row.sms_cuda is not None:
            row.sms, row.sms_source = row.sms_cuda, "cuda"
        elif row.sms_nvml_cores is not None:
            row.sms, row.sms_source = row.sms_nvml_cores, "nvml-cores"
        row.sms_consistent = _agree(row.sms_cuda, row.sms_nvml_cores, row.sms_nvml_mig_attributes)
        rows.append(row)
        for m in g.mig_devices:
            mcd = match(m.uuid, None)
            mrow = DeviceRow(
                label=f"{g.index} MIG {m.slot}",
                kind="mig",
                nvml_index=g.index,
                cuda_index=None if mcd is None else mcd.index,
                mig_slot=m.slot,
                name=m.name or f"{row.name} MIG",
                uuid=m.uuid,
                compute_capability=row.compute_capability,
                sms_cuda=None if mcd is None else mcd.multi_processor_count,
                sms_nvml_mig_attributes=m.multiprocessor_count,
                mig_enabled=True,
                sm_clock_mhz=m.sm_clock_mhz,
                max_sm_clock_mhz=m.max_sm_clock_mhz,
            )
            if mrow.sms_cuda is not None:
                mrow.sms, mrow.sms_source = mrow.sms_cuda, "cuda"
            elif mrow.sms_nvml_mig_attributes is not None:
                mrow.sms, mrow.sms_source = mrow.sms_nvml_mig_attributes, "nvml-mig-attributes"
            mrow.sms_consistent = _agree(mrow.sms_cuda, mrow.sms_nvml_mig_attributes)
            rows.append(mrow)
    for d in scan.devices:
        if d.index in used:
            continue
        rows.append(
            DeviceRow(
                label=f"cuda:{d.index}",
                kind="cuda",
                nvml_index=None,
                cuda_index=d.index,
                mig_slot=None,
                name=d.name,
                uuid=d.uuid,
                compute_capability=_cc(d.compute_capability),
                sms=d.multi_processor_count,
                sms_source="cuda",
                sms_cuda=d.multi_processor_count,
            )
        )
    return rows, nvml_info, cuda_info


def collect(s: Settings) -> dict[str, Any]:
    """The ``--json`` document (see the module docstring); raises ``CliError`` when no GPU is visible."""
    if s.total_sms is not None:
        rows = _profile_rows(s.total_sms, s.platform)
        not_probed = "not probed (--total-sms)"
        nvml_info: dict[str, Any] = {"available": None, "detail": not_probed, "driver_version": None}
        cuda_info: dict[str, Any] = {"available": None, "detail": not_probed, "torch_version": None}
        source = "--total-sms"
    else:
        rows, nvml_info, cuda_info = _hardware_rows()
        source = "hardware"
        if not rows:
            raise CliError(
                f"no GPU visible (NVML: {nvml_info['detail']}; CUDA: {cuda_info['detail']}); "
                "pass --total-sms N to compute the split for an N-SM GPU (132 = H200)",
                EXIT_NO_DEVICE,
            )
    for row in rows:
        _apply_budget(row, s)
    settings = asdict(s)
    settings.pop("total_sms")
    settings["enable_dbo"] = True
    return {
        "schema": SCHEMA,
        "source": source,
        "settings": {k: settings[k] for k in _SETTINGS_ORDER},
        "nvml": nvml_info,
        "cuda": cuda_info,
        "devices": [asdict(r) for r in rows],
        "plugin": {"disabled_by_env": parse_switch("DBO_RUNTIME_DISABLE")},
        # a script reading stdout gets what stderr showed, and DBO_RUNTIME_DISABLE in force in doctor's words
        "warnings": switch_problems() + [w for w in (disabled_warning(),) if w is not None],
    }


_SETTINGS_ORDER = (
    "platform",
    "all2all_backend",
    "enable_dbo",
    "expert_parallel",
    "comm_sms",
    "comm_sms_source",
    "max_sms_used",
    "max_sms_used_source",
    "deep_gemm",
)


def _dash(value: object) -> str:
    return "-" if value is None else str(value)


def _check_cell(d: dict[str, Any]) -> str:
    parts = []
    if d["nvml_gpu_cores"] is not None and d["cores_per_sm"]:
        parts.append(f"{d['nvml_gpu_cores']} cores / {d['cores_per_sm']} = {_dash(d['sms_nvml_cores'])}")
    if d["sms_nvml_mig_attributes"] is not None:
        parts.append(f"MIG attributes {d['sms_nvml_mig_attributes']}")
    if d["sms_consistent"] is not None:
        parts.append("ok" if d["sms_consistent"] else "MISMATCH")
    return ", ".join(parts) or "-"


def _split_cell(d: dict[str, Any]) -> str:
    b = d["budget"]
    if b is None:
        return d["note"] or "-"
    return f"{b['total']}/{b['comm']}/{b['compute']}"


def _knobs_cell(d: dict[str, Any]) -> str:
    b = d["budget"]
    if b is None:
        return "-"
    knobs = []
    if b["compute_knob"]:
        knobs.append(f"DeepGEMM set_num_sms({b['compute']})")
    if b["comm_knob"]:
        if b["deepep_sms"] is None:
            knobs.append(f"all2all set_num_sms({b['comm']}) (a no-op for this backend)")
        elif b["deepep_sms"] != b["comm"]:
            knobs.append(f"all2all set_num_sms({b['comm']}) -> DeepEP {b['deepep_sms']} (HT clamp)")
        else:
            knobs.append(f"all2all set_num_sms({b['comm']})")
    if b["rocm_override"]:
        knobs.append("ROCm HT override: comm 0")
    return ", ".join(knobs) or "none (no partition)"


def render(doc: dict[str, Any]) -> None:
    columns = ["GPU", "Name", "SMs", "SM source", "NVML check", "MIG", "SM clock MHz (cur/max)", "Util %", "DBO total/comm/compute", "Knobs vLLM turns"]
    rows = []
    for d in doc["devices"]:
        mig = "-" if d["mig_enabled"] is None else ("on" if d["mig_enabled"] else "off")
        clock = "-" if d["sm_clock_mhz"] is None and d["max_sm_clock_mhz"] is None else f"{_dash(d['sm_clock_mhz'])}/{_dash(d['max_sm_clock_mhz'])}"
        rows.append(
            [d["label"], d["name"], _dash(d["sms"]), _dash(d["sms_source"]), _check_cell(d), mig, clock, _dash(d["utilization_gpu_pct"]), _split_cell(d), _knobs_cell(d)]
        )
    s = doc["settings"]
    max_used = "none" if s["max_sms_used"] is None else s["max_sms_used"]
    caption = [
        f"all2all_backend={s['all2all_backend']} platform={s['platform']} expert_parallel={'on' if s['expert_parallel'] else 'off'} "
        f"comm_sms={s['comm_sms']} ({s['comm_sms_source']}) max_sms_used={max_used} ({s['max_sms_used_source']}) "
        f"deep_gemm={'assumed present' if s['deep_gemm'] else 'absent'}",
        f"NVML: {doc['nvml']['detail']}" + (f" (driver {doc['nvml']['driver_version']})" if doc["nvml"]["driver_version"] else ""),
        f"CUDA: {doc['cuda']['detail']}" + (f" (torch {doc['cuda']['torch_version']})" if doc["cuda"]["torch_version"] else ""),
    ]
    caption.extend(f"warning: device {d['label']}: {w}" for d in doc["devices"] for w in d["warnings"])
    disabled = disabled_warning()
    if disabled is not None:
        caption.append(f"WARNING (not a failure): {disabled}")
    print_table("dbo-runtime sms: DBO SM split of vLLM 0.33.0 (--enable-dbo)", columns, rows, caption)


def run(args: argparse.Namespace) -> int:
    warn_switch_problems("sms")
    settings = settings_from_args(args)
    refused = warn_refused_settings("sms")  # warned, not refused: sms only computes the split
    shadowed = shadowed_comm_env(args.comm_sms)
    if shadowed is not None:
        print(f"dbo-runtime sms: warning: {shadowed}", file=sys.stderr)
        refused.append(shadowed)
    doc = collect(settings)
    doc["warnings"] += refused
    if args.json:
        print_json(doc)
    else:
        render(doc)
    return EXIT_OK
