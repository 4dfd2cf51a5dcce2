# numaserve container image: Debian 12 (bookworm), its Python 3.11, numaserve in
# a venv, running as an unprivileged numeric user.  deploy/kubernetes/ runs it.
#
#   docker build -t registry.example.com/numaserve:0.1.0 .
#   docker run --rm -p 8000:8000 -p 9180:9180 -e NUMASERVE_ADMIN_BIND=0.0.0.0:9180 \
#       --cap-add SYS_NICE registry.example.com/numaserve:0.1.0
#
# Your app: build FROM this image, COPY it into /app and point numaserve at it
# (NUMASERVE_SERVER_APP=pkg.module:app or server.app in the ConfigMap's
# numaserve.toml).  Without an app the embedded demo serves.
#
# Why --cap-add SYS_NICE (Kubernetes: capabilities.add [SYS_NICE]): the default
# seccomp profile of Docker and containerd allows set_mempolicy/mbind only to
# containers holding CAP_SYS_NICE, and numaserve binds each worker's memory
# with set_mempolicy before the worker starts.  The kernel itself needs no
# capability for that (the user stays unprivileged; the capability only opens
# the seccomp filter).

FROM debian:12-slim AS build
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv \
    && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/numaserve
COPY setup.cfg pyproject.toml README.md constraints.txt /src/
COPY numaserve /src/numaserve
# constraints.txt: the exact versions the test suite ran with (scripts/constraints)
RUN /opt/numaserve/bin/pip install --no-cache-dir --disable-pip-version-check -c /src/constraints.txt /src

FROM debian:12-slim
LABEL org.opencontainers.image.title="numaserve" \
      org.opencontainers.image.description="NUMA-aware serving supervisor for Python ASGI and inference apps" \
      org.opencontainers.image.licenses="Apache-2.0"
# python3: the interpreter the venv was built for (3.11 on bookworm);
# tini: PID 1 that reaps orphans and passes SIGTERM to the supervisor only
# (never -g: workers must not get SIGTERM directly, or lb_grace is lost);
# libjemalloc2: the optional [allocator] jemalloc = true.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 tini libjemalloc2 \
    && rm -rf /var/lib/apt/lists/*
COPY --from=build /opt/numaserve /opt/numaserve
# Numeric uid/gid so Kubernetes can verify runAsNonRoot; matches the
# DaemonSet's runAsUser/runAsGroup.
RUN groupadd --system --gid 10001 numaserve \
    && useradd --system --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent \
       --shell /usr/sbin/nologin numaserve \
    && install -d -o 10001 -g 10001 -m 0700 /run/numaserve
ENV PATH=/opt/numaserve/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    RUNTIME_DIRECTORY=/run/numaserve/rt
# (the runtime dir is a subdirectory numaserve creates 0700 itself, so an
# emptyDir mounted at /run/numaserve works with a read-only root file system)
USER 10001:10001
# Derived images COPY their app here and set server.app_dir = "/app".
WORKDIR /app
# 8000: the app (server.bind); 9180: /metrics, /healthz, /readyz (admin.bind)
EXPOSE 8000 9180
STOPSIGNAL SIGTERM
# Reads /etc/numaserve/numaserve.toml when present (the ConfigMap).
ENTRYPOINT ["/usr/bin/tini", "--", "numaserve", "start"]
