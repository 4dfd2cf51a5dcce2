"""One typed schema for every option, loaded from TOML, environment and flags.

Precedence (lowest first): built-in defaults < config file (``--config``, else
``/etc/numaserve/numaserve.toml`` when present) < ``NUMASERVE_<SECTION>_<KEY>``
environment variables < command-line flags.  Every error names the source
(file, variable or flag), the key, the bad value and what was expected.

``config/numaserve.toml`` documents every option; a test keeps it in step
with this schema.
"""

from __future__ import annotations

import ipaddress

import math
import os
import re
import tomllib
import types
import typing
from pathlib import Path
from typing import Any, Literal, Mapping

import msgspec

from numaserve.cmdready import parse_ready
from numaserve.cpulist import parse_node_spec
from numaserve.errors import ConfigError
from numaserve.retiredkeys import retired
from numaserve.loops.admission import AdmissionSettings
from numaserve.loops.leak import LeakConfig
from numaserve.loops.supervisor_limits import LimitsSettings
from numaserve.unixaddr import is_unix_bind, parse_mode, resolve_group, unix_path
from numaserve.workerenv import check_env_config

DEFAULT_CONFIG_PATH = "/etc/numaserve/numaserve.toml"
ENV_PREFIX = "NUMASERVE_"

# Command-line flags whose name is not ``--<key>``, so errors name the real flag.
FLAG_NAMES: dict[tuple[str, str], str] = {
    ("log", "level"): "--log-level",
    ("log", "format"): "--log-format",
    ("placement", "topology_file"): "--declared",
    ("placement", "sysfs_root"): "--root",
    ("worker", "start"): "--worker-start",
    ("server", "keepalive_timeout"): "--timeout-keep-alive",
}


class _Section(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    pass


class ServerConfig(_Section):
    """What the workers serve and how the listeners are made."""

    bind: list[str] = msgspec.field(default_factory=lambda: ["0.0.0.0:8000"])
    backlog: int = 2048
    app: str = ""
    cmd: str = ""
    app_dir: str = ""
    http: Literal["auto", "httptools", "h11"] = "auto"
    loop: Literal["auto", "uvloop", "asyncio"] = "auto"
    graceful_timeout: float = 30.0
    lb_grace: float = 5.0
    keepalive_timeout: float = 5.0
    max_header_bytes: int = 65536
    max_body_bytes: int = 16 * 1024 * 1024
    max_connections: int = 0
    read_timeout: float = 30.0
    access_log: bool = False
    proxy_headers: bool = False
    forwarded_allow_ips: list[str] = msgspec.field(default_factory=lambda: ["127.0.0.1"])
    steering: Literal["hash", "numa"] = "hash"
    concentrate: bool = True
    takeover: bool = False
    access_log_format: str = ""
    root_path: str = ""
    unix_mode: str = "0660"
    unix_group: str = ""


class PlacementConfig(_Section):
    """Which nodes get workers, how many, and how they are bound."""

    nodes: str = "all"
    workers_per_node: int | Literal["auto"] = 1
    mempolicy: Literal["bind", "preferred", "interleave", "local"] = "bind"
    cpu_split: Literal["split", "shared"] = "split"
    reserve_irq_cpus: int = 0
    topology_file: str = ""
    sysfs_root: str = "/"
    locality_interval: float = 10.0
    repair: Literal["off", "migrate", "recycle"] = "off"
    repair_threshold: float = 0.9
    repair_hold: int = 3
    slots: Literal["node", "core", "l3", "gpu"] = "node"


class SupervisorConfig(_Section):
    """Lifecycle timings of the supervision loop."""

    runtime_dir: str = ""
    heartbeat_interval: float = 1.0
    heartbeat_timeout: float = 10.0
    ready_timeout: float = 0.0   # 0: loading has no wall-clock deadline (a stalled load is still killed)
    stop_timeout: float = 5.0
    abort_grace: float = 3.0
    backoff_initial: float = 0.1
    backoff_max: float = 30.0
    backoff_reset_after: float = 60.0
    crash_loop_limit: int = 5
    crash_loop_window: float = 60.0
    failed_retry_interval: float = 300.0
    verify_interval: float = 30.0


class LogConfig(_Section):
    """How the supervisor and workers log."""

    level: Literal["debug", "info", "warning", "error"] = "info"
    format: Literal["auto", "json", "console"] = "auto"


class EnvConfig(_Section):
    """Environment each worker starts with (templated per slot)."""

    thread_pools: bool = True
    gpu_visibility: bool = True
    vars: dict[str, str] = msgspec.field(default_factory=dict)
    node: dict[str, dict[str, str]] = msgspec.field(default_factory=dict)
    slot: dict[str, dict[str, str]] = msgspec.field(default_factory=dict)


class OpsConfig(_Section):
    """Who may operate the supervisor, and how operations are recorded."""

    readonly_group: str = ""
    audit_log: str = ""
    tcp_endpoint: str = ""
    curve_secret_key: str = ""
    curve_authorized_keys: str = ""
    reload_parallel: int = 1
    rate_limit: float = 50.0
    rate_burst: int = 100


class AdminConfig(_Section):
    """The ``[admin]`` config section.

    ``bind``: HOST:PORT of the admin HTTP endpoint; loopback by default (the
    metrics show the deployment's shape, keep them off public interfaces);
    "" disables it.  Port 0 picks a free port (shown in ``numaserve status``
    as ``supervisor.admin``).
    """

    bind: str = "127.0.0.1:9180"


class IrqSettings(_Section):
    """The ``[irq]`` config section.

    ``policy``: "shared" spreads queue IRQs over the NIC node's usable CPUs;
    "reserved" only over the CPUs ``placement.reserve_irq_cpus`` keeps away
    from workers.  ``interfaces`` empty = every physical NIC with a known
    node.  ``irqbalance``: "refuse" to apply while irqbalance runs (it would
    overwrite us within ~10 s) or just "warn".  ``state_file`` "" =
    ``<supervisor.runtime_dir or /var/lib/numaserve>/irq-saved.json``.
    """

    apply_at_start: bool = False
    policy: Literal["shared", "reserved"] = "shared"
    interfaces: list[str] = msgspec.field(default_factory=list)
    irqbalance: Literal["refuse", "warn"] = "refuse"
    rps: bool = False
    xps: bool = False
    state_file: str = ""


class AllocatorConfig(_Section):
    """``[allocator]``."""

    malloc_arena_max: int = 2
    jemalloc: bool = False
    gc_freeze: bool = True


#: Hard cap for ``framing.max_frame_bytes``: keeps every length prefix a
#: sniffer could mistake for HTTP invalid: a method's first byte (>= 0x41,
#: i.e. >= 1 GiB) and the LF/CR of an empty line before the request line
#: (0x0A/0x0D, >= 160 MiB).
MAX_FRAME_LIMIT = 128 * 1024 * 1024


class FramingConfig(_Section):
    """``[framing]``: the length-prefixed protocol on the HTTP port."""

    enabled: bool = True
    max_frame_bytes: int = 1024 * 1024
    max_pipeline: int = 64
    idle_timeout: float = 60.0


class CacheConfig(_Section):
    """``[cache]``."""

    enabled: bool = False
    ttl: float = 60.0
    max_entries: int = 10000
    max_bytes: int = 64 * 1024 * 1024
    deterministic_paths: list[str] = msgspec.field(default_factory=list)
    key_headers: list[str] = msgspec.field(default_factory=lambda: ["authorization", "accept"])


class TlsConfig(_Section):
    """``[tls]``: empty ``certfile`` = plain TCP."""

    certfile: str = ""
    keyfile: str = ""
    ca_certs: str = ""
    ciphers: str = ""

    @property
    def enabled(self) -> bool:
        return bool(self.certfile)


class CmdConfig(_Section):
    """The ``[cmd]`` config section (external ``server.cmd`` workers)."""

    ready: str = "tcp"
    allow_host_port: bool = False


class WorkerConfig(_Section):
    """How worker processes are started (a warm template per node, or a fresh interpreter each)."""

    start: Literal["fork", "exec"] = "fork"
    preload: str = ""
    max_requests: int = 0
    max_requests_jitter: int = 0
    max_lifetime: float = 0.0


class Config(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    server: ServerConfig = msgspec.field(default_factory=ServerConfig)
    placement: PlacementConfig = msgspec.field(default_factory=PlacementConfig)
    supervisor: SupervisorConfig = msgspec.field(default_factory=SupervisorConfig)
    env: EnvConfig = msgspec.field(default_factory=EnvConfig)
    admin: AdminConfig = msgspec.field(default_factory=AdminConfig)
    ops: OpsConfig = msgspec.field(default_factory=OpsConfig)
    irq: IrqSettings = msgspec.field(default_factory=IrqSettings)
    admission: AdmissionSettings = msgspec.field(default_factory=AdmissionSettings)
    limits: LimitsSettings = msgspec.field(default_factory=LimitsSettings)
    leak: LeakConfig = msgspec.field(default_factory=LeakConfig)
    log: LogConfig = msgspec.field(default_factory=LogConfig)
    framing: FramingConfig = msgspec.field(default_factory=FramingConfig)
    cache: CacheConfig = msgspec.field(default_factory=CacheConfig)
    tls: TlsConfig = msgspec.field(default_factory=TlsConfig)
    allocator: AllocatorConfig = msgspec.field(default_factory=AllocatorConfig)
    cmd: CmdConfig = msgspec.field(default_factory=CmdConfig)
    worker: WorkerConfig = msgspec.field(default_factory=WorkerConfig)

    def to_dict(self) -> dict[str, Any]:
        return msgspec.to_builtins(self)


SECTIONS: dict[str, type[_Section]] = {f.name: f.type for f in msgspec.structs.fields(Config)}


def _field_types(section: str) -> dict[str, Any]:
    return {f.name: f.type for f in msgspec.structs.fields(SECTIONS[section])}


# --- value checks msgspec types cannot express --------------------------------

_POSITIVE = {
    ("framing", "max_frame_bytes"), ("framing", "max_pipeline"),
    ("cache", "max_entries"), ("cache", "max_bytes"),
    ("ops", "reload_parallel"), ("ops", "rate_limit"), ("ops", "rate_burst"),
    ("server", "backlog"), ("server", "max_header_bytes"), ("server", "max_body_bytes"),
    ("supervisor", "heartbeat_interval"), ("supervisor", "heartbeat_timeout"),
    ("supervisor", "backoff_initial"),
    ("supervisor", "backoff_max"), ("supervisor", "crash_loop_limit"),
    ("supervisor", "crash_loop_window"), ("supervisor", "stop_timeout"),
    ("supervisor", "failed_retry_interval"),
    ("placement", "repair_hold"),
}
_NON_NEGATIVE = {
    ("framing", "idle_timeout"), ("cache", "ttl"), ("allocator", "malloc_arena_max"),
    ("server", "graceful_timeout"), ("server", "lb_grace"), ("server", "keepalive_timeout"), ("server", "max_connections"),
    ("server", "read_timeout"), ("placement", "reserve_irq_cpus"), ("supervisor", "abort_grace"),
    ("supervisor", "backoff_reset_after"), ("supervisor", "verify_interval"),
    ("placement", "locality_interval"), ("supervisor", "ready_timeout"),
}
_NON_NEGATIVE |= {("worker", "max_requests"), ("worker", "max_requests_jitter"), ("worker", "max_lifetime")}
_APP_RE = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*(\(\))?$")
_PRELOAD_RE = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")


def parse_bind(text: str) -> tuple[str, int]:
    """Parse HOST:PORT / [V6]:PORT / :PORT into (host, port); ValueError with a reason."""
    s = text.strip()
    if s.startswith("["):
        host, sep, rest = s[1:].partition("]")
        if not sep or not rest.startswith(":"):
            raise ValueError("expected [IPV6]:PORT")
        port_s = rest[1:]
    else:
        host, sep, port_s = s.rpartition(":")
        if not sep:
            raise ValueError("expected HOST:PORT")
        if ":" in host:
            raise ValueError("IPv6 addresses need brackets: [::1]:8000")
    if not host:
        host = "0.0.0.0"
    if not port_s.isdigit() or not 0 <= int(port_s) <= 65535:
        raise ValueError(f"port {port_s!r} is not a number in 0-65535")
    return host, int(port_s)


def _bad(origin: Mapping[tuple[str, str], str], section: str, key: str, value: Any, expected: str) -> ConfigError:
    """One error line: ``SOURCE: section.key = VALUE: expected WHAT`` (value in TOML syntax)."""
    src = origin.get((section, key), "default")
    return ConfigError(f"{src}: {section}.{key} = {_toml_value(value)}: expected {expected}")


def _non_finite(value: Any) -> tuple[str, float] | None:
    """The first NaN/infinity inside ``value`` (a number, list, map or nested section) as (path, value)."""
    if isinstance(value, float):
        return None if math.isfinite(value) else ("", value)
    if isinstance(value, msgspec.Struct):
        items: Any = ((f.name, getattr(value, f.name)) for f in msgspec.structs.fields(value))
    elif isinstance(value, dict):
        items = value.items()
    elif isinstance(value, (list, tuple)):
        items = ((f"[{i}]", v) for i, v in enumerate(value))
    else:
        return None
    for k, v in items:
        found = _non_finite(v)
        if found is not None:
            sep = "" if str(k).startswith("[") else "."
            return f"{sep}{k}{found[0]}", found[1]
    return None


def _check_values(cfg: Config, origin: Mapping[tuple[str, str], str]) -> None:
    def bad(section: str, key: str, value: Any, expected: str) -> ConfigError:
        return _bad(origin, section, key, value, expected)

    # every number must be finite: TOML and float() accept nan and inf, and a
    # NaN timeout or rate never compares true, so it would silently never fire
    for section in SECTIONS:
        body = getattr(cfg, section)
        for f in msgspec.structs.fields(body):
            found = _non_finite(getattr(body, f.name))
            if found is not None:
                path, value = found
                if path:
                    src = origin.get((section, f.name), "default")
                    raise ConfigError(f"{src}: {section}.{f.name}{path} = {_toml_value(value)}: expected a finite number")
                raise bad(section, f.name, value, "a finite number")
    for section, key in _POSITIVE:
        v = getattr(getattr(cfg, section), key)
        if v <= 0:
            raise bad(section, key, v, ("an integer" if isinstance(v, int) else "a number") + " > 0")
    for section, key in _NON_NEGATIVE:
        v = getattr(getattr(cfg, section), key)
        if v < 0:
            raise bad(section, key, v, ("an integer" if isinstance(v, int) else "a number") + " >= 0")
    if cfg.framing.max_frame_bytes > MAX_FRAME_LIMIT:
        raise bad("framing", "max_frame_bytes", cfg.framing.max_frame_bytes,
                  f"at most {MAX_FRAME_LIMIT} ({MAX_FRAME_LIMIT >> 20} MiB)")
    for p in cfg.cache.deterministic_paths:
        if not p.startswith("/"):
            raise bad("cache", "deterministic_paths", p, "paths starting with / (a trailing * matches a prefix)")
    if not 0.0 < cfg.placement.repair_threshold <= 1.0:
        raise bad("placement", "repair_threshold", cfg.placement.repair_threshold,
                  "a share of anonymous memory in (0, 1], e.g. 0.9")
    if cfg.placement.repair != "off" and not cfg.placement.locality_interval:
        raise bad("placement", "repair", cfg.placement.repair,
                  '"off" while placement.locality_interval = 0 (repair acts on the locality samples)')
    wpn = cfg.placement.workers_per_node
    if wpn != "auto" and wpn < 1:
        raise bad("placement", "workers_per_node", wpn, 'an integer >= 1 or "auto"')
    if not cfg.server.bind:
        raise bad("server", "bind", cfg.server.bind, "at least one HOST:PORT")
    for b in cfg.server.bind:
        if b.strip().startswith("unix:"):
            continue   # checked with the other serving habits (_check_serving_habits)
        try:
            parse_bind(b)
        except ValueError as e:
            why = "" if str(e).startswith("expected HOST:PORT") else f" ({e})"
            raise bad("server", "bind", b, f"HOST:PORT, [IPV6]:PORT, :PORT or unix:/PATH{why}") from None
    if cfg.admin.bind:
        try:
            parse_bind(cfg.admin.bind)
        except ValueError as e:
            raise bad("admin", "bind", cfg.admin.bind, f'HOST:PORT, [IPV6]:PORT, or "" to disable ({e})') from None
    for ip in cfg.server.forwarded_allow_ips:
        if ip != "*":
            try:
                ipaddress.ip_network(ip, strict=False)
            except ValueError:
                raise bad("server", "forwarded_allow_ips", ip, 'IP addresses or CIDR ranges, or "*"') from None
    if cfg.server.app and cfg.server.cmd:
        raise bad("server", "cmd", cfg.server.cmd, "either server.app or server.cmd, not both")
    if cfg.server.app and not _APP_RE.match(cfg.server.app):
        raise bad("server", "app", cfg.server.app, "module:attribute, e.g. myapp.main:app")
    if cfg.worker.preload and not _PRELOAD_RE.match(cfg.worker.preload):
        raise bad("worker", "preload", cfg.worker.preload, "module:function, e.g. myapp.model:load_weights")
    if cfg.worker.preload and cfg.server.cmd:
        raise bad("worker", "preload", cfg.worker.preload,
                  "server.app set (an external server.cmd imports nothing numaserve could preload)")
    if cfg.supervisor.heartbeat_timeout <= cfg.supervisor.heartbeat_interval:
        raise bad("supervisor", "heartbeat_timeout", cfg.supervisor.heartbeat_timeout,
                  f"more than supervisor.heartbeat_interval ({cfg.supervisor.heartbeat_interval})")
    try:
        parse_ready(cfg.cmd.ready)
    except ValueError as e:
        raise bad("cmd", "ready", cfg.cmd.ready, str(e)) from None
    for key, value, why in check_env_config(cfg.env):
        raise bad("env", key, value, why)
    ops = cfg.ops
    if ops.tcp_endpoint:
        rest = ops.tcp_endpoint[len("tcp://"):] if ops.tcp_endpoint.startswith("tcp://") else None
        try:
            if rest is None:
                raise ValueError("expected tcp://HOST:PORT")
            parse_bind("0.0.0.0" + rest[1:] if rest.startswith("*:") else rest)
        except ValueError as e:
            raise bad("ops", "tcp_endpoint", ops.tcp_endpoint, f"tcp://HOST:PORT (* for every address; {e})") from None
        if not ops.curve_secret_key or not ops.curve_authorized_keys:
            raise bad("ops", "tcp_endpoint", ops.tcp_endpoint,
                      "ops.curve_secret_key and ops.curve_authorized_keys set too (remote control is CURVE-only)")
    try:
        parse_node_spec(cfg.placement.nodes)
    except ValueError as e:
        raise bad("placement", "nodes", cfg.placement.nodes, f'"all" or a node list like 0,2-3 ({e})') from None
    _check_serving_habits(cfg, bad)


def _check_serving_habits(cfg: Config, bad: typing.Callable[[str, str, Any, str], ConfigError]) -> None:
    """The uvicorn/gunicorn-style keys: access log format, root path, recycling limits."""
    from numaserve.accesslog import compile_format  # local: the worker's formatter, imported on demand

    if cfg.server.access_log_format:
        try:
            compile_format(cfg.server.access_log_format)
        except ValueError as e:
            raise bad("server", "access_log_format", cfg.server.access_log_format, str(e)) from None
    rp = cfg.server.root_path
    if rp and (not rp.startswith("/") or rp.endswith("/") or not rp.isascii() or any(c in rp for c in " ?#")):
        raise bad("server", "root_path", rp, '"" or a path like "/api" (leading /, no trailing /, no query)')
    for b in cfg.server.bind:
        if is_unix_bind(b):
            try:
                unix_path(b)
            except ValueError as e:
                raise bad("server", "bind", b, f"unix:/PATH ({e})") from None
    try:
        parse_mode(cfg.server.unix_mode)
    except ValueError as e:
        raise bad("server", "unix_mode", cfg.server.unix_mode, str(e)[len("expected "):]) from None
    try:
        resolve_group(cfg.server.unix_group)
    except ValueError as e:
        raise bad("server", "unix_group", cfg.server.unix_group, f'an existing group name or gid, or "" ({e})') from None
    if cfg.worker.max_requests_jitter and not cfg.worker.max_requests:
        raise bad("worker", "max_requests_jitter", cfg.worker.max_requests_jitter, "worker.max_requests set too")


# --- loading ------------------------------------------------------------------


_TYPE_WORDS = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}


def _describe_type(t: Any) -> str:
    """What a value of schema type ``t`` looks like, in operator words."""
    origin, args = typing.get_origin(t), typing.get_args(t)
    if t in _TYPE_WORDS:
        return _TYPE_WORDS[t]
    if origin is typing.Literal:
        return "one of " + ", ".join(f'"{a}"' if isinstance(a, str) else str(a) for a in args)
    if origin is list:
        inner = _describe_type(args[0]) if args else "values"
        return "a list of " + {"a string": "strings", "an integer": "integers", "a number": "numbers"}.get(inner, inner)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe_type(a) for a in args)
    return getattr(t, "__name__", None) or str(t).replace("typing.", "")


def _convert(raw: dict[str, Any], origin: Mapping[tuple[str, str], str]) -> Config:
    # Check the shape by hand first so errors name the right source.
    for section, body in raw.items():
        if section not in SECTIONS:
            src = next((v for (s, _), v in origin.items() if s == section), "config")
            if retired(section) is not None:
                raise ConfigError(f"{src}: section [{section}] was removed: {retired(section)}")
            raise ConfigError(
                f"{src}: unknown section [{section}]{did_you_mean(section, SECTIONS)}: "
                f"expected one of {', '.join(sorted(SECTIONS))}"
            )
        if not isinstance(body, dict):
            raise ConfigError(
                f"{origin.get((section, ''), 'config')}: {section} = {_toml_value(body)}: expected a table [{section}]"
            )
        fields = _field_types(section)
        for key in body:
            if key not in fields:
                src = origin.get((section, key), "config")
                if retired(section, key) is not None:
                    raise ConfigError(f"{src}: {section}.{key} was removed: {retired(section, key)}")
                raise ConfigError(
                    f"{src}: unknown key {section}.{key} = {_toml_value(body[key])}{did_you_mean(key, fields)}: "
                    f"expected one of {', '.join(sorted(fields))}"
                )
        for key, value in body.items():   # before conversion: some sections validate themselves
            found = _non_finite(value)
            if found is not None:
                src = origin.get((section, key), "config")
                raise ConfigError(f"{src}: {section}.{key}{found[0]} = {_toml_value(found[1])}: expected a finite number")
    try:
        cfg = msgspec.convert(raw, Config, strict=False)
    except msgspec.ValidationError as e:
        msg = str(e)
        r = re.match(r"(\w+) = (.*?): expected (.*) - at `\$\.(\w+)`$", msg)
        if r:  # a range check of a loops settings Struct (numaserve.loops.checks.SettingError)
            key, shown, expected, section = r.groups()
            value = raw.get(section, {}).get(key, shown)
            raise _bad(origin, section, key, value, expected) from None
        m = re.search(r"at `\$\.(\w+)\.(\w+)", msg)
        if m:
            section, key = m.group(1), m.group(2)
            value = raw.get(section, {}).get(key)
            ftype = _field_types(section).get(key)
            expected = _describe_type(ftype) if ftype is not None else msg.split(" - at ")[0].lower()
            if (section, key) == ("placement", "workers_per_node"):
                expected = 'an integer >= 1 or "auto"'
            raise _bad(origin, section, key, value, expected) from None
        raise ConfigError(f"config: {msg}") from None
    _check_values(cfg, origin)
    return cfg


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        text = path.read_bytes()
    except FileNotFoundError:
        raise ConfigError(f"{path}: config file not found") from None
    except OSError as e:
        raise ConfigError(f"{path}: cannot read config file: {e.strerror}") from None
    try:
        return tomllib.loads(text.decode("utf-8"))
    except UnicodeDecodeError as e:
        line = text[: e.start].count(b"\n") + 1
        raise ConfigError(
            f"{path}: not UTF-8 text: {e.reason} at line {line} (byte {e.start}): expected a UTF-8 TOML file"
        ) from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: invalid TOML: {e}") from None


def _parse_env_value(section: str, key: str, text: str) -> Any:
    """Environment text → a value of the field's type; text that does not fit is kept
    as is so the schema check reports it with the variable's name."""
    ftype = _field_types(section)[key]
    origin = typing.get_origin(ftype)
    union = origin in (typing.Union, types.UnionType)
    members = set(typing.get_args(ftype)) if union else {ftype}
    if origin is list:
        return [p.strip() for p in text.split(",") if p.strip()]
    if bool in members:
        low = text.strip().lower()
        if low in ("1", "true", "yes", "on"):
            return True
        if low in ("0", "false", "no", "off"):
            return False
        return text
    if int in members or float in members:
        try:
            return int(text)
        except ValueError:
            try:
                return float(text)
            except ValueError:
                return text
    return text


def _env_overrides(environ: Mapping[str, str]) -> tuple[dict[str, dict[str, Any]], dict[tuple[str, str], str]]:
    out: dict[str, dict[str, Any]] = {}
    origin: dict[tuple[str, str], str] = {}
    for name, text in environ.items():
        if not name.startswith(ENV_PREFIX):
            continue
        rest = name[len(ENV_PREFIX):].lower()
        for section in sorted(SECTIONS, key=len, reverse=True):
            if rest.startswith(section + "_"):
                key = rest[len(section) + 1:]
                if key not in _field_types(section):
                    if retired(section, key) is not None:
                        raise ConfigError(f"environment {name}: {section}.{key} was removed: {retired(section, key)}")
                    raise ConfigError(
                        f"environment {name}: unknown key {section}.{key} = {_toml_value(text)}"
                        f"{did_you_mean(key, _field_types(section))}: expected one of "
                        f"{', '.join(sorted(_field_types(section)))}"
                    )
                out.setdefault(section, {})[key] = _parse_env_value(section, key, text)
                origin[(section, key)] = f"environment {name}"
                break
    return out, origin


def _merge(dst: dict[str, Any], src: Mapping[str, Mapping[str, Any]]) -> None:
    for section, body in src.items():
        dst.setdefault(section, {})
        if isinstance(body, Mapping) and isinstance(dst[section], dict):
            dst[section].update(body)
        else:
            dst[section] = body


def load_config(
    path: str | os.PathLike[str] | None = None,
    overrides: Mapping[str, Mapping[str, Any]] | None = None,
    environ: Mapping[str, str] | None = None,
    *,
    use_default_path: bool = True,
) -> Config:
    """Build the effective config.

    ``path`` None means the default path when it exists.  ``overrides`` are
    command-line flags as ``{section: {key: value}}``; ``None`` values are
    ignored so unset flags do not mask file values.
    """
    raw: dict[str, Any] = {}
    origin: dict[tuple[str, str], str] = {}
    environ = os.environ if environ is None else environ
    file_path: Path | None = None
    if path is not None and str(path) != "":
        file_path = Path(path)
    elif use_default_path and Path(DEFAULT_CONFIG_PATH).is_file():
        file_path = Path(DEFAULT_CONFIG_PATH)
    if file_path is not None:
        data = _read_toml(file_path)
        for section, body in data.items():
            origin[(section, "")] = str(file_path)
            if isinstance(body, dict):
                for key in body:
                    origin[(section, key)] = str(file_path)
        _merge(raw, data)
    env, env_origin = _env_overrides(environ)
    _merge(raw, env)
    origin.update(env_origin)
    if overrides:
        flags: dict[str, dict[str, Any]] = {}
        for section, body in overrides.items():
            for key, value in body.items():
                if value is None:
                    continue
                flags.setdefault(section, {})[key] = value
                origin[(section, key)] = f"flag {FLAG_NAMES.get((section, key), '--' + key.replace('_', '-'))}"
        _merge(raw, flags)
    return _convert(raw, origin)


def config_to_toml(cfg: Config) -> str:
    """Render a config as TOML (for ``numaserve config show``)."""
    lines: list[str] = []
    for section, body in cfg.to_dict().items():
        lines.append(f"[{section}]")
        for key, value in body.items():
            lines.append(f"{key} = {_toml_value(value)}")
        lines.append("")
    return "\n".join(lines)


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return msgspec.json.encode(v).decode()
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{k} = {_toml_value(x)}" for k, x in v.items()) + " }"
    return msgspec.json.encode(v).decode()


# --- appended for `numaserve config check` -----------------------------------


def did_you_mean(name: str, known: typing.Iterable[str]) -> str:
    """`` (did you mean backlog?)`` for a misspelled key or section; "" when nothing is close."""
    import difflib

    close = difflib.get_close_matches(name, list(known), n=1, cutoff=0.6)
    return f" (did you mean {close[0]}?)" if close else ""


def validate_data(data: Mapping[str, Any], source: str, environ: Mapping[str, str] | None = None) -> Config:
    """Check already-parsed TOML ``data`` as ``load_config`` checks a file named ``source``.

    For ``config check``, which drops a key it found bad and checks again so it
    can report every error, not only the first.
    """
    raw: dict[str, Any] = {}
    origin: dict[tuple[str, str], str] = {}
    for section, body in data.items():
        origin[(section, "")] = source
        if isinstance(body, dict):
            for key in body:
                origin[(section, key)] = source
    _merge(raw, {k: dict(v) if isinstance(v, dict) else v for k, v in data.items()})
    env, env_origin = _env_overrides(os.environ if environ is None else environ)
    _merge(raw, env)
    origin.update(env_origin)
    return _convert(raw, origin)


def read_config_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A config file's TOML data, or ConfigError naming the file (and the line, for syntax errors)."""
    return _read_toml(Path(path))
