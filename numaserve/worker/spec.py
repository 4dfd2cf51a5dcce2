"""What the supervisor tells a worker at spawn (JSON in ``NUMASERVE_WORKER_SPEC``)."""

from __future__ import annotations

import os

import msgspec

from numaserve.framing import FramingConfig
from numaserve.loops.admission import AdmissionSettings
from numaserve.loops.gradient import GradientSettings
from numaserve.worker.cache import CacheConfig
from numaserve.worker.tls import TlsConfig

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
    app: str = ""                  # "module:attr"; "" = numaserve.apps.demo:app
    app_dir: str = ""              # prepended to sys.path before importing app
    http: str = "auto"
    loop: str = "auto"
    heartbeat_interval: float = 1.0
    stats_interval: float = 1.0
    graceful_timeout: float = 30.0
    keepalive_timeout: float = 5.0
    max_header_bytes: int = 65536
    max_body_bytes: int = 16 * 1024 * 1024
    read_timeout: float = 30.0
    max_connections: int = 0
    access_log: bool = False
    admission: AdmissionSettings = msgspec.field(default_factory=AdmissionSettings)
    gradient: GradientSettings = msgspec.field(default_factory=GradientSettings)
    framing: FramingConfig = msgspec.field(default_factory=FramingConfig)
    cache: CacheConfig = msgspec.field(default_factory=CacheConfig)
    tls: TlsConfig = msgspec.field(default_factory=TlsConfig)
    gc_freeze: bool = True         # gc.freeze() right after the app is imported
    log_level: str = "info"
    log_format: str = "json"

    def to_env(self) -> str:
        return msgspec.json.encode(self).decode()


def spec_from_env(environ: "os._Environ[str] | dict[str, str] | None" = None) -> WorkerSpec:
    env = os.environ if environ is None else environ
    raw = env.get(SPEC_ENV)
    if not raw:
        raise RuntimeError(f"{SPEC_ENV} is not set: workers are started by `numaserve start`")
    return msgspec.json.decode(raw.encode(), type=WorkerSpec)
