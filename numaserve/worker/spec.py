"""What the supervisor tells a worker at spawn (JSON in ``NUMASERVE_WORKER_SPEC``)."""

from __future__ import annotations

import os

import msgspec

from numaserve.config import CacheConfig, FramingConfig, ServerConfig, TlsConfig
from numaserve.loops.admission import AdmissionSettings

SPEC_ENV = "NUMASERVE_WORKER_SPEC"


class WorkerSpec(msgspec.Struct, kw_only=True, forbid_unknown_fields=False):
    slot: int
    node: int
    generation: int
    cpus: list[int]
    node_cpus: list[int] = []      # every CPU of the slot's node (for connection locality)
    mempolicy: str                 # bind | preferred | interleave | local
    memory_nodes: list[int]
    fd: int                        # inherited listener socket (supervisor keeps its own ref)
    extra_fds: list[int] = []      # more listeners of the same slot (other bind addresses)
    control: str                   # ZeroMQ endpoint of the supervisor's worker ROUTER
    server: ServerConfig = msgspec.field(default_factory=ServerConfig)  # the [server] section, as configured
    preload: str = ""              # "module:function" run once after the app is imported ([worker] preload)
    heartbeat_interval: float = 1.0
    stats_interval: float = 1.0
    admission: AdmissionSettings = msgspec.field(default_factory=AdmissionSettings)
    framing: FramingConfig = msgspec.field(default_factory=FramingConfig)
    cache: CacheConfig = msgspec.field(default_factory=CacheConfig)
    tls: TlsConfig = msgspec.field(default_factory=TlsConfig)
    gc_freeze: bool = True         # gc.freeze() right after the app is imported
    log_level: str = "info"
    log_format: str = "json"

    # The worker reads the serving options by their [server] names.
    app = property(lambda self: self.server.app, doc='"module:attr"; "" = numaserve.apps.demo:app')
    app_dir = property(lambda self: self.server.app_dir, doc="prepended to sys.path before importing app")
    http = property(lambda self: self.server.http)
    loop = property(lambda self: self.server.loop)
    graceful_timeout = property(lambda self: self.server.graceful_timeout)
    keepalive_timeout = property(lambda self: self.server.keepalive_timeout)
    max_header_bytes = property(lambda self: self.server.max_header_bytes)
    max_body_bytes = property(lambda self: self.server.max_body_bytes)
    read_timeout = property(lambda self: self.server.read_timeout)
    max_connections = property(lambda self: self.server.max_connections)
    access_log = property(lambda self: self.server.access_log)
    proxy_headers = property(lambda self: self.server.proxy_headers)
    forwarded_allow_ips = property(lambda self: self.server.forwarded_allow_ips)

    def to_env(self) -> str:
        return msgspec.json.encode(self).decode()


def spec_from_env(environ: "os._Environ[str] | dict[str, str] | None" = None) -> WorkerSpec:
    env = os.environ if environ is None else environ
    raw = env.get(SPEC_ENV)
    if not raw:
        raise RuntimeError(f"{SPEC_ENV} is not set: workers are started by `numaserve start`")
    return msgspec.json.decode(raw.encode(), type=WorkerSpec)


SERVER_KEYS = frozenset(f.name for f in msgspec.structs.fields(ServerConfig))


def flat_spec(**fields: object) -> WorkerSpec:
    """A spec from one flat keyword set: ``[server]`` keys (``read_timeout=...``) go into ``server``."""
    server = {k: fields.pop(k) for k in list(fields) if k in SERVER_KEYS}
    return WorkerSpec(server=ServerConfig(**server), **fields)  # type: ignore[arg-type]
