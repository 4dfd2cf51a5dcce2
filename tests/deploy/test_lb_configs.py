"""deploy/haproxy/haproxy.cfg and deploy/nginx/numaserve.conf: valid for the
real HAProxy and nginx (`haproxy -c`, `nginx -t`), with the settings a
loss-free rolling restart depends on, and the loopback rendering the
integration tests run keeps every one of them."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from numaserve.config import Config, parse_bind
from numaserve.supervisor.lbgrace import watch_window
from tests.integration.lbfleet import (
    HAPROXY,
    HAPROXY_CFG,
    NGINX,
    NGINX_CONF,
    nginx_main_conf,
    render_haproxy,
    render_nginx,
)


def directives(text: str) -> list[list[str]]:
    return [ln.split("#", 1)[0].split() for ln in text.splitlines() if ln.split("#", 1)[0].strip()]


def haproxy_section(text: str, name: str) -> list[list[str]]:
    out, inside = [], False
    for line in text.splitlines():
        body = line.split("#", 1)[0]
        if body[:1].strip():
            inside = " ".join(body.split()[:2]) == name
            continue
        if inside and body.strip():
            out.append(body.split())
    return out


@pytest.mark.skipif(HAPROXY is None, reason="haproxy not installed (scripts/install)")
def test_haproxy_accepts_the_shipped_config() -> None:
    r = subprocess.run([HAPROXY, "-c", "-f", str(HAPROXY_CFG)], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stdout + r.stderr


def test_haproxy_checks_readyz_on_the_admin_port_often_enough() -> None:
    text = HAPROXY_CFG.read_text()
    backend = haproxy_section(text, "backend numaserve")
    assert ["option", "httpchk"] in backend
    send = next(d for d in backend if d[:2] == ["http-check", "send"])
    assert send[send.index("uri") + 1] == "/readyz"
    assert ["http-check", "expect", "status", "200"] in backend
    ds = next(d for d in backend if d[:1] == ["default-server"])
    valued = {"port", "inter", "fastinter", "downinter", "fall", "rise", "slowstart"}
    opt = {ds[i]: ds[i + 1] for i in range(1, len(ds) - 1) if ds[i] in valued}
    cfg = Config()
    assert "check" in ds and int(opt["port"]) == parse_bind(cfg.admin.bind)[1]

    def seconds(v: str) -> float:
        return float(v[:-2]) / 1000 if v.endswith("ms") else float(v.rstrip("s"))

    # out of the balancer well before numaserve's default lb_grace ends: the first
    # failed check within `inter`, then (fall - 1) more `fastinter` apart, each
    # taking at most `timeout check`
    inter, fast, fall = seconds(opt["inter"]), seconds(opt.get("fastinter", opt["inter"])), int(opt["fall"])
    timeout_check = seconds(next(d for d in directives(text) if d[:2] == ["timeout", "check"])[2])
    assert inter + (fall - 1) * fast + fall * timeout_check < cfg.server.lb_grace
    assert inter < watch_window(cfg.server.lb_grace)         # numaserve sees it is being watched
    # requests in flight on a host being taken out must be allowed to finish
    assert not [d for d in directives(text) if "shutdown-sessions" in d]
    defaults = [" ".join(d) for d in haproxy_section(text, "defaults")]
    assert "option redispatch 1" in defaults and any(d.startswith("retries ") for d in defaults)


def test_the_loopback_rendering_keeps_every_behaviour_setting(tmp_path: Path) -> None:
    src = HAPROXY_CFG.read_text()
    out = render_haproxy(src, frontend_port=18000, servers=[("a", 18001, 19001), ("b", 18002, 19002)], run_dir=tmp_path)
    kept = {" ".join(d) for d in directives(out)}
    dropped = [d for d in directives(src) if " ".join(d) not in kept]
    allowed = {"log", "chroot", "user", "group", "daemon", "stats", "maxconn", "bind", "server", "frontend",
               "http-request"}
    assert all(d[0] in allowed for d in dropped), dropped
    assert "server a 127.0.0.1:18001 port 19001" in kept and "bind 127.0.0.1:18000" in kept
    strict = render_haproxy(src, frontend_port=1, servers=[("a", 2, 3)], run_dir=tmp_path, retries=False)
    assert "retries 0" in strict and "\n    retry-on" not in strict and "\n    option redispatch" not in strict


@pytest.mark.skipif(HAPROXY is None, reason="haproxy not installed (scripts/install)")
def test_haproxy_accepts_the_loopback_rendering(tmp_path: Path) -> None:
    cfg = tmp_path / "h.cfg"
    cfg.write_text(render_haproxy(HAPROXY_CFG.read_text(), frontend_port=18000, servers=[("a", 18001, 19001)],
                                  run_dir=tmp_path))
    r = subprocess.run([HAPROXY, "-c", "-f", str(cfg)], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.skipif(NGINX is None, reason="nginx not installed (scripts/install)")
@pytest.mark.parametrize("rendered", [False, True], ids=["shipped", "loopback"])
def test_nginx_accepts_the_example(tmp_path: Path, rendered: bool) -> None:
    include = NGINX_CONF
    if rendered:
        include = tmp_path / "numaserve.conf"
        include.write_text(render_nginx(NGINX_CONF.read_text(), listen_port=18000, servers=[18001, 18002]))
    (tmp_path / "nginx.conf").write_text(nginx_main_conf(tmp_path, include, foreground=False))
    r = subprocess.run([NGINX, "-t", "-p", str(tmp_path), "-c", str(tmp_path / "nginx.conf")],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr


def test_nginx_example_closes_idle_upstream_connections_before_numaserve_does() -> None:
    ds = directives(NGINX_CONF.read_text())

    def one(name: str) -> list[str]:
        (found,) = [d[1:] for d in ds if d[0] == name]
        return [w.rstrip(";") for w in found]

    assert float(one("keepalive_timeout")[0].rstrip("s")) < Config().server.keepalive_timeout
    assert one("proxy_http_version") == ["1.1"]
    assert ["proxy_set_header", "Connection", '"";'] in ds    # keep-alive to the hosts
    assert one("proxy_buffering") == ["off"]                   # token streams pass through
    assert "error" in one("proxy_next_upstream")               # refused connects go to the next host
