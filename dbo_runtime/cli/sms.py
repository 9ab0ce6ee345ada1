"""``dbo-runtime sms``: SMs per GPU and the DBO compute/comm split vLLM applies under ``--enable-dbo``.

The split decides whether the DSA indexer schedule crashes: an operator sees it before starting a server, also
without a GPU (``--total-sms``). Counts from CUDA, NVML (MIG attributes, cores per SM); imports no vLLM."""

from __future__ import annotations

import argparse
import os
from dataclasses import asdict, dataclass, field
from typing import Any

from dbo_runtime.cli import _common
from dbo_runtime.cli._common import EXIT_NO_DEVICE, CliError, int_in, print_json, print_table, warn, wrapped
from dbo_runtime.cli._split import budget_for, comm_sms, deepep_sms, split_warnings
from dbo_runtime.core.budget import BACKEND_MAX_SMS_USED, PLATFORMS, SMBudget, parse_comm_sms
from dbo_runtime.core.cli_support import DBO_BACKENDS, H200_SMS
from dbo_runtime.core.errors import ConfigError
from dbo_runtime.core.switches import parse_switch, switch_problems

SCHEMA = "dbo-runtime/sms/v1"
H200_PROFILE_NAME = "NVIDIA H200 (embedded profile)"
BACKENDS = {"cuda": DBO_BACKENDS, "rocm": (*DBO_BACKENDS, "allgather_reducescatter")}
"""The all2all backends vLLM accepts together with DBO, per platform."""


@dataclass(slots=True)
class DeviceRow:
    label: str
    kind: str  # gpu | mig | cuda | profile
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
    budget: dict[str, Any] | None = None
    note: str = ""
    warnings: list[str] = field(default_factory=list)


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    description = "SMs per GPU (CUDA, NVML, MIG) and the DBO compute/comm split vLLM applies under --enable-dbo."
    p = subparsers.add_parser("sms", help="SMs per GPU and the DBO compute/comm split vLLM would apply", description=description)
    p.add_argument("--json", action="store_true", help=f"print the result as JSON ({SCHEMA})")
    p.add_argument("--total-sms", type=int_in(2, 1024), metavar="N", help="skip the hardware: one N-SM device (132: the H200 profile, SM90)")
    backends = sorted({b for v in BACKENDS.values() for b in v})
    p.add_argument("--all2all-backend", default="deepep_high_throughput", choices=backends, help="the all2all backend (default deepep_high_throughput; allgather_reducescatter needs --platform rocm)")
    p.add_argument("--comm-sms", type=int, metavar="N", help="VLLM_DBO_COMM_SMS (default: $VLLM_DBO_COMM_SMS, else 20 CUDA / 64 ROCm)")
    p.add_argument("--platform", default="cuda", choices=PLATFORMS, help="cuda (default) or rocm")
    return p


def budget_json(budget: SMBudget) -> dict[str, Any]:
    r = budget.reason
    return {
        "total": budget.total, "comm": budget.comm, "compute": budget.compute, "partitioned": budget.partitioned,
        "comm_knob": budget.comm_knob, "compute_knob": budget.compute_knob, "rocm_override": r.rocm_override,
        "env_comm_sms": r.env_comm_sms, "max_sms_used": r.max_sms_used, "expert_parallel": r.expert_parallel,
        "describe": budget.describe(), "deepep_sms": deepep_sms(budget),
    }  # fmt: skip


def _agree(*counts: int | None) -> bool | None:
    known = [c for c in counts if c is not None]
    return None if len(known) < 2 else len(set(known)) == 1


def _cc(capability: tuple[int, int] | None) -> str | None:
    return None if capability is None else "{}.{}".format(*capability)


def _hardware_rows() -> tuple[list[DeviceRow], dict[str, Any], dict[str, Any]]:
    """NVML's GPUs and MIG instances, matched to CUDA devices by UUID, then CUDA devices NVML did not list."""
    from dbo_runtime.adapters import cuda_devices, nvml

    try:
        snap: Any = nvml.query()
        nvml_info = {"available": True, "detail": f"{len(snap.gpus)} GPU(s)", "driver_version": snap.driver_version}
    except nvml.NvmlUnavailable as exc:
        snap, nvml_info = None, {"available": False, "detail": str(exc), "driver_version": None}
    scan = cuda_devices.scan()
    cuda_info = {"available": bool(scan.devices), "detail": scan.reason, "torch_version": scan.torch_version}
    by_uuid = {cuda_devices.normalize_uuid(d.uuid): d for d in scan.devices if d.uuid}
    by_index = snap is not None and not by_uuid and len(scan.devices) == len(snap.gpus) and not os.environ.get("CUDA_VISIBLE_DEVICES")
    used: set[int] = set()

    def match(uuid: str | None, index: int | None) -> Any:
        found = by_uuid.get(cuda_devices.normalize_uuid(uuid)) if uuid else None
        found = scan.devices[index] if found is None and by_index and index is not None else found
        used.update([found.index] if found is not None else [])
        return found

    def counted(row: DeviceRow, cd: Any, nvml_sms: int | None, nvml_source: str) -> DeviceRow:
        """The matched CUDA device's SM count, else NVML's; whether the counts agree."""
        if cd is not None:
            row.cuda_index, row.sms_cuda = cd.index, cd.multi_processor_count
        row.sms, row.sms_source = (row.sms_cuda, "cuda") if row.sms_cuda is not None else (nvml_sms, None if nvml_sms is None else nvml_source)
        row.sms_consistent = _agree(row.sms_cuda, row.sms_nvml_cores, row.sms_nvml_mig_attributes)
        return row

    rows: list[DeviceRow] = []
    for g in snap.gpus if snap is not None else ():
        cd = None if g.mig_enabled else match(g.uuid, g.index)
        cc, name = _cc(g.compute_capability), g.name or (cd.name if cd else "unknown NVIDIA GPU")
        row = DeviceRow(
            str(g.index), "gpu", g.index, None, None, name, uuid=g.uuid, compute_capability=cc, mig_enabled=g.mig_enabled,
            sms_nvml_mig_attributes=g.attributes_multiprocessor_count, sms_nvml_cores=g.sms_from_cores,
            nvml_gpu_cores=g.num_gpu_cores, cores_per_sm=nvml.cores_per_sm(g.compute_capability),
        )  # fmt: skip
        rows.append(counted(row, cd, g.sms_from_cores, "nvml-cores"))
        for m in g.mig_devices:
            row = DeviceRow(
                f"{g.index} MIG {m.slot}", "mig", g.index, None, m.slot, m.name or f"{name} MIG", uuid=m.uuid,
                compute_capability=cc, sms_nvml_mig_attributes=m.multiprocessor_count, mig_enabled=True,
            )  # fmt: skip
            rows.append(counted(row, match(m.uuid, None), m.multiprocessor_count, "nvml-mig-attributes"))
    rows += [
        counted(DeviceRow(f"cuda:{d.index}", "cuda", None, None, None, d.name, uuid=d.uuid,
                          compute_capability=_cc(d.compute_capability)), d, None, "cuda")
        for d in scan.devices if d.index not in used
    ]  # fmt: skip
    return rows, nvml_info, cuda_info


def _apply_budget(row: DeviceRow, args: argparse.Namespace, comm: tuple[int, str], max_sms: int | None) -> None:
    mig = row.kind == "gpu" and row.mig_enabled
    if mig or row.sms is None:
        row.note = "MIG enabled: DBO runs on the MIG instances" if mig else "SM count unknown (CUDA cannot see this GPU and NVML gives no count)"
        return
    major = int(row.compute_capability.split(".")[0]) if row.compute_capability else None
    try:
        budget = budget_for(
            total=row.sms, comm=comm, platform=args.platform, all2all_backend=args.all2all_backend, max_sms_used=max_sms,
            device=row.cuda_index if row.cuda_index is not None else (row.nvml_index or 0), sm_major=major,
        )  # fmt: skip
    except ConfigError as exc:
        raise ConfigError(exc.parameter, exc.value, f"{exc.allowed} [device {row.label}, {row.sms} SMs]") from None
    row.budget = budget_json(budget)
    row.warnings = split_warnings(budget)


def collect(args: argparse.Namespace) -> dict[str, Any]:
    """The ``--json`` document; ``CliError`` (exit 3) when no GPU is visible and no ``--total-sms`` was given."""
    if args.all2all_backend not in BACKENDS[args.platform]:
        allowed = ", ".join(repr(b) for b in BACKENDS[args.platform])
        elsewhere = [p for p, names in BACKENDS.items() if args.all2all_backend in names]
        raise ConfigError("--all2all-backend", args.all2all_backend, allowed + (f" (it needs --platform {elsewhere[0]})" if elsewhere else ""))
    comm = comm_sms(args.comm_sms, args.platform)
    max_sms = BACKEND_MAX_SMS_USED.get(args.all2all_backend)
    if args.total_sms is not None:
        h200 = args.total_sms == H200_SMS and args.platform == "cuda"
        name = H200_PROFILE_NAME if h200 else f"{'SM90 ' if args.platform == 'cuda' else ''}GPU with {args.total_sms} SMs (--total-sms)"
        rows = [DeviceRow("profile", "profile", None, None, None, name, sms=args.total_sms, sms_source="--total-sms",
                          compute_capability="9.0" if args.platform == "cuda" else None)]  # fmt: skip
        nvml_info = {"available": None, "detail": "not probed (--total-sms)", "driver_version": None}
        cuda_info = {"available": None, "detail": "not probed (--total-sms)", "torch_version": None}
    else:
        rows, nvml_info, cuda_info = _hardware_rows()
        if not rows:
            if isinstance(comm[0], str):  # a malformed share is named before the missing GPU (exit 2, not 3)
                parse_comm_sms(comm[0])
            why = f"NVML: {nvml_info['detail']}; CUDA: {cuda_info['detail']}"
            raise CliError(f"no GPU visible ({why}); pass --total-sms N to compute the split for an N-SM GPU (132 = H200)", EXIT_NO_DEVICE)
    refused: list[ConfigError] = []
    for row in rows:  # one device refusing the share leaves the others' split shown (exit 2 when none has one)
        try:
            _apply_budget(row, args, comm, max_sms)
        except ConfigError as exc:
            refused.append(exc)
            row.warnings = [f"no split: {exc}"]
    if refused and not any(r.budget for r in rows):
        raise refused[0]
    warnings = switch_problems() + [f"{p} (a server refuses it at engine start)" for p in _common.settings_a_server_refuses()]
    disabled = _common.disabled_warning()
    return {
        "schema": SCHEMA,
        "source": "--total-sms" if args.total_sms is not None else "hardware",
        "settings": {
            "platform": args.platform, "all2all_backend": args.all2all_backend, "enable_dbo": True,
            "comm_sms": comm[0], "comm_sms_source": comm[1], "max_sms_used": max_sms,
        },
        "nvml": nvml_info, "cuda": cuda_info, "vllm_release": _common.release_line(), "devices": [asdict(r) for r in rows],
        "plugin": {"disabled_by_env": parse_switch("DBO_RUNTIME_DISABLE")}, "warnings": warnings + ([disabled] if disabled else []),
    }


def _dash(value: object) -> str:
    return "-" if value is None else str(value)


def _knobs(b: dict[str, Any], s: dict[str, Any]) -> str:
    knobs = [f"DeepGEMM set_num_sms({b['compute']})"] if b["compute_knob"] else []
    if b["comm_knob"]:
        deepep = " (a no-op for this backend)" if b["deepep_sms"] is None else f" -> DeepEP {b['deepep_sms']} (HT clamp)"
        knobs.append(f"all2all set_num_sms({b['comm']})" + ("" if b["deepep_sms"] == b["comm"] else deepep))
    if b["rocm_override"]:
        why = "vLLM's ROCm override gives DeepEP HT no comm SMs"
        return f"vLLM calls {', '.join(knobs)} ({why})" if knobs else f"no SM partition: {why}"
    if knobs:
        return f"vLLM calls {', '.join(knobs)}"
    return f"no SM partition: comm_sms is 0 ({s['comm_sms_source']})" if s["comm_sms"] == 0 else f"no SM partition: {s['all2all_backend']} reserves no comm SMs"


def render(doc: dict[str, Any]) -> None:
    rows = []
    for d in doc["devices"]:
        check = [f"{d['nvml_gpu_cores']}/{d['cores_per_sm']} = {_dash(d['sms_nvml_cores'])}"] if d["nvml_gpu_cores"] is not None and d["cores_per_sm"] else []
        if d["sms_nvml_mig_attributes"] is not None and d["sms_source"] != "nvml-mig-attributes":
            check.append(f"MIG attributes {d['sms_nvml_mig_attributes']}")
        check += [] if d["sms_consistent"] is None else ["ok" if d["sms_consistent"] else "MISMATCH"]
        b = d["budget"]  # the knobs go to the caption, so the table stays within 100 columns
        rows.append([d["label"], d["name"].removeprefix("NVIDIA "), _dash(d["sms"]), _dash(d["sms_source"]).removesuffix("-attributes"),
                     ", ".join(check) or "-", f"{b['total']}/{b['comm']}/{b['compute']}" if b else "-"])
    s = doc["settings"]
    said: dict[tuple[str, str], list[str]] = {}  # a line per text, naming every device it holds for
    for d in doc["devices"]:
        name = f"GPU {d['label']}" if d["label"][0].isdigit() else d["label"]
        if d["budget"] or d["note"]:
            said.setdefault(("", _knobs(d["budget"], s) if d["budget"] else d["note"]), []).append(name)
        for w in d["warnings"]:
            said.setdefault(("warning: ", w), []).append(name)
    caption = [wrapped(f"{kind}{', '.join(names)}: {text}") for (kind, text), names in said.items()]
    caption += [
        wrapped(f"all2all_backend={s['all2all_backend']} platform={s['platform']} comm_sms={s['comm_sms']} ({s['comm_sms_source']})"
                + ("" if s["max_sms_used"] is None else f" max_sms_used={s['max_sms_used']}")),
        wrapped(f"NVML: {doc['nvml']['detail']}; CUDA: {doc['cuda']['detail']}"),
        f"dbo_runtime verified: {doc['vllm_release']}",
    ]
    caption += [wrapped(f"warning: {w}") for w in doc["warnings"]]
    columns = ["GPU", "Name", "SMs", "SM source", "NVML check", "total/comm/compute"]
    print_table("dbo-runtime sms: DBO SM split under --enable-dbo", columns, rows, caption)


def run(args: argparse.Namespace) -> int:
    if args.json:  # the table shows the warnings in its caption; --json's stdout is for scripts
        for problem in switch_problems():
            warn("sms", problem)
    doc = collect(args)
    print_json(doc) if args.json else render(doc)
    return 0
