"""The warm-template lines of ``numaserve status`` (pure: status JSON in, text out)."""

from __future__ import annotations

from typing import Any, Callable


def _mb(n: int | None) -> str:
    return "-" if not n else f"{n / 1048576:.1f}M"


def template_lines(data: dict[str, Any], width: int, wrap: Callable[[list[str], int], list[str]]) -> list[str]:
    """One line per node template, plus which slots were forked and which exec'd (and why)."""
    tm = data.get("templates") or {}
    out: list[str] = []
    if tm.get("disabled_reason"):
        out += wrap([f"worker start {tm.get('start')}:", str(tm["disabled_reason"])], width)
    slots = data.get("slots") or []
    for t in tm.get("nodes") or []:
        mem = t.get("memory") or {}
        forked = [str(s["slot"]) for s in slots
                  if (s.get("start") or {}).get("mode") == "fork" and s["start"].get("template_pid") == t["pid"]]
        parts = [f"node {t['node']} template", f"pid {t['pid'] or '-'}", f"gen {t['generation'] or '-'}",
                 t["state"], f"forks {t['forks']}"]
        if t.get("import_s") is not None:
            parts.append(f"import {t['import_s']:.2f}s")
        if t.get("preload_s"):
            parts.append(f"preload {t['preload_s']:.2f}s")
        if mem:
            parts.append(f"pss {_mb(mem.get('pss_bytes'))} shared {_mb(mem.get('shared_bytes'))} "
                         f"private {_mb(mem.get('private_bytes'))}")
        parts.append("workers " + (",".join(forked) if forked else "-"))
        if t.get("restart_in_s") is not None:
            parts.append(f"restart in {t['restart_in_s']:.1f}s ({t.get('last_exit') or '?'})")
        elif t["state"] != "ready" and t.get("reason"):
            parts.append(str(t["reason"]))
        if t.get("started_by"):
            parts.append(f"started by {t['started_by']}")
        out += wrap(parts, width)
        z = t.get("zygote")
        if z and (z.get("pid") or z.get("state") != "none"):
            zm = z.get("memory") or {}
            zp = [f"node {t['node']} zygote", f"pid {z.get('pid') or '-'}", str(z.get("state")),
                  f"templates {z.get('templates_forked', 0)}"]
            if zm:
                zp.append(f"pss {_mb(zm.get('pss_bytes'))} private {_mb(zm.get('private_bytes'))}")
            if z.get("last_exit"):
                zp.append(f"last exit {z['last_exit']}")
            out += wrap(zp, width)
    if tm.get("nodes"):
        execd = [str(s["slot"]) for s in slots if (s.get("start") or {}).get("mode") == "exec"]
        if execd:
            out += wrap([f"exec'd (not forked): slots {','.join(execd)}"], width)
    return out
