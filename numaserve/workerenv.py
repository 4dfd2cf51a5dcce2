"""Per-slot worker environment: thread pools sized to the slot, GPU visibility,
identity variables, and operator-defined variables with templating.

Why: numpy/BLAS, OpenMP, numexpr and PyTorch start one thread per *machine*
CPU by default, so a worker pinned to 8 CPUs of a 64-CPU box runs 64 threads
fighting over 8 cores; and an inference worker must see only its own node's
GPUs.  Pure: takes the slot plan, the machine's GPUs, the ``[env]`` config and
the inherited environment; returns the variables to set.

Precedence (lowest first): numaserve defaults (thread pools, GPU visibility)
< ``[env] vars`` < ``[env.node."N"]`` < ``[env.slot."S"]``.  A thread-pool
or GPU variable already set by the operator — in the supervisor's own
environment or in ``[env]`` — is never overridden.

Templates: ``{slot} {node} {index} {cpus} {ncpus} {gpus} {generation}``.
"""

from __future__ import annotations

import re
from typing import Iterable, Mapping, Sequence

from numaserve.cpulist import format_list

THREAD_POOL_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "NUMEXPR_NUM_THREADS",
                    "VECLIB_MAXIMUM_THREADS", "BLIS_NUM_THREADS")
# vendor id -> (visibility variable, extra variables)
GPU_VENDORS = {
    "0x10de": ("CUDA_VISIBLE_DEVICES", {"CUDA_DEVICE_ORDER": "PCI_BUS_ID"}),
    "0x1002": ("ROCR_VISIBLE_DEVICES", {}),
    "0x8086": ("ZE_AFFINITY_MASK", {}),
}
PLACEHOLDERS = ("slot", "node", "index", "cpus", "ncpus", "gpus", "generation")
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def _template(text: str, values: Mapping[str, str]) -> str:
    return text.format(**values)


def check_env_config(env: object) -> list[tuple[str, object, str]]:
    """Problems in an ``[env]`` section as (key, value, expected) for config errors."""
    out: list[tuple[str, object, str]] = []
    dummy = {p: "0" for p in PLACEHOLDERS}

    def check_table(key: str, table: Mapping[str, str]) -> None:
        for name, value in table.items():
            if not _NAME.match(name):
                out.append((key, name, "environment variable names: letters, digits, underscore"))
                return
            try:
                _template(value, dummy)
            except (KeyError, IndexError, ValueError) as e:
                out.append((f"{key}.{name}", value,
                            f"a value with placeholders among {' '.join('{' + p + '}' for p in PLACEHOLDERS)} ({e})"))
                return

    check_table("vars", getattr(env, "vars", {}))
    for kind in ("node", "slot"):
        for ident, table in getattr(env, kind, {}).items():
            if not str(ident).isdigit():
                out.append((f"{kind}.{ident}", ident, f"a {kind} number as the table name, e.g. [env.{kind}.\"0\"]"))
                continue
            check_table(f"{kind}.{ident}", table)
    return out


def gpu_indices(slot_gpus: Sequence[str], all_gpus: Iterable[object]) -> dict[str, list[int]]:
    """Visibility variable -> indices of the slot's GPUs among the vendor's GPUs in
    PCI bus order (the order CUDA uses with CUDA_DEVICE_ORDER=PCI_BUS_ID)."""
    by_vendor: dict[str, list[str]] = {}
    for g in all_gpus:
        vendor = (getattr(g, "vendor", None) or "").lower()
        if vendor in GPU_VENDORS:
            by_vendor.setdefault(vendor, []).append(getattr(g, "pci"))
    out: dict[str, list[int]] = {}
    for vendor, pcis in by_vendor.items():
        order = sorted(pcis)
        idx = [order.index(p) for p in slot_gpus if p in order]
        var = GPU_VENDORS[vendor][0]
        out[var] = idx
    return out


def slot_env(
    *,
    slot: int,
    node: int,
    index: int,
    cpus: Sequence[int],
    gpus: Sequence[str],
    all_gpus: Iterable[object],
    env_cfg: object,
    inherited: Mapping[str, str],
    generation: int = 0,
) -> dict[str, str]:
    """The variables numaserve sets for one slot (on top of ``inherited``)."""
    cpu_list = format_list(cpus)
    values = {
        "slot": str(slot), "node": str(node), "index": str(index), "cpus": cpu_list,
        "ncpus": str(len(cpus)), "gpus": ",".join(gpus), "generation": str(generation),
    }
    operator: dict[str, str] = {}
    for name, value in getattr(env_cfg, "vars", {}).items():
        operator[name] = _template(value, values)
    for name, value in getattr(env_cfg, "node", {}).get(str(node), {}).items():
        operator[name] = _template(value, values)
    for name, value in getattr(env_cfg, "slot", {}).get(str(slot), {}).items():
        operator[name] = _template(value, values)
    out: dict[str, str] = {}
    if getattr(env_cfg, "thread_pools", True) and cpus:
        for var in THREAD_POOL_VARS:
            if var not in inherited and var not in operator:
                out[var] = str(len(cpus))
    if getattr(env_cfg, "gpu_visibility", True):
        gpus_list = list(all_gpus)
        if gpus_list:
            for var, idx in gpu_indices(gpus, gpus_list).items():
                if var not in inherited and var not in operator:
                    out[var] = ",".join(map(str, idx))
                    vendor_extra = next(extra for v, (vv, extra) in GPU_VENDORS.items() if vv == var)
                    for k, v in vendor_extra.items():
                        if k not in inherited and k not in operator:
                            out[k] = v
    out.update(operator)
    out.update(
        NUMASERVE_SLOT=str(slot),
        NUMASERVE_NODE=str(node),
        NUMASERVE_CPUS=cpu_list,
        NUMASERVE_GPUS=",".join(gpus),
        NUMASERVE_GENERATION=str(generation),
    )
    return out
