"""``[cmd]``: when an external ``server.cmd`` worker counts as serving.

A process that is alive has not necessarily loaded its app, let alone
accepted a connection (``--cmd "sleep 300"`` is alive for five minutes).  So
the supervisor probes the slot itself, through the slot's own listener, the
way a client would:

* ``"tcp"`` (default): a probe connection routed to this slot is *accepted*
  by the new worker's process tree (the kernel says who holds the accepted
  socket).  Protocol-agnostic; proves the server reached its accept loop.
* ``"http:/path"``: the same, then ``GET /path`` must answer 2xx or 3xx
  within ``cmdprobe.PROBE_TIMEOUT`` (2 s) (a health route that says 503 is not ready).
* ``"alive"``: the old behaviour: alive for 1 s after exec.

Pure: parsing and validation; the probing itself is ``supervisor.probe``.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ReadySpec", "parse_ready", "HOST_PORT_PLACEHOLDERS", "host_port_placeholders"]

#: Placeholders that hand the child an address to bind itself.
HOST_PORT_PLACEHOLDERS = ("host", "port")


@dataclass(frozen=True)
class ReadySpec:
    kind: str          # "tcp" | "http" | "alive"
    path: str = "/"


def parse_ready(text: str) -> ReadySpec:
    """``"tcp"`` | ``"alive"`` | ``"http:/path"`` → ReadySpec; ValueError says what is expected."""
    t = text.strip()
    if t in ("tcp", "alive"):
        return ReadySpec(t)
    if t.startswith("http:"):
        path = t[5:] or "/"
        if not path.startswith("/") or any(c in path for c in " \r\n\t"):
            raise ValueError(f"the path after http: must start with / and have no spaces (got {path!r})")
        return ReadySpec("http", path)
    raise ValueError('"tcp", "alive" or "http:/PATH" (e.g. "http:/healthz")')


def host_port_placeholders(template: str) -> list[str]:
    """The ``{host}``/``{port}`` placeholders a command template uses."""
    import string

    found = []
    try:
        for _lit, name, _spec, _conv in string.Formatter().parse(template):
            if name in HOST_PORT_PLACEHOLDERS and name not in found:
                found.append(name)
    except ValueError:
        return found
    return found
