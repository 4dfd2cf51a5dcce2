"""net.unixbind and unix binds in ListenerSet: path checks, stale vs live, one shared socket, removal."""

from __future__ import annotations

import os
import socket
import stat
from pathlib import Path

import pytest

from numaserve.config import load_config
from numaserve.errors import ConfigError, UsageError
from numaserve.net.listeners import open_listeners, resolve_binds
from numaserve.net.unixbind import check_unix_path
from numaserve.unixaddr import parse_mode, resolve_group, unix_path


def test_paths_modes_and_groups() -> None:
    assert unix_path("unix:/run/ns.sock") == "/run/ns.sock"
    for bad, why in [("unix:run/ns.sock", "absolute"), ("unix:/" + "x" * 120, "longer than 107")]:
        with pytest.raises(ValueError, match=why):
            unix_path(bad)
    assert parse_mode("0660") == 0o660 and parse_mode("600") == 0o600
    for bad in ("0990", "66", "rw-rw----"):
        with pytest.raises(ValueError, match="octal"):
            parse_mode(bad)
    assert resolve_group("") is None and resolve_group("0") == 0
    with pytest.raises(ValueError, match="no such group"):
        resolve_group("no-such-group-xyz")


@pytest.mark.parametrize("toml, words", [
    ('[server]\nbind = ["unix:relative.sock"]\n', ["server.bind", "absolute"]),
    ('[server]\nunix_mode = "rw"\n', ["server.unix_mode", "octal"]),
    ('[server]\nunix_group = "no-such-group-xyz"\n', ["server.unix_group", "no such group"]),
])
def test_config_names_the_bad_key(tmp_path: Path, toml: str, words: list[str]) -> None:
    p = tmp_path / "c.toml"
    p.write_text(toml)
    with pytest.raises(ConfigError) as e:
        load_config(p, environ={})
    assert all(w in str(e.value) for w in words), str(e.value)


def test_stale_live_and_foreign_files(tmp_path: Path) -> None:
    path = str(tmp_path / "s.sock")
    assert check_unix_path(path) is False
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(path)
    s.close()
    assert check_unix_path(path) is True          # nobody listens: stale
    os.unlink(path)
    live = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    live.bind(path)
    live.listen(1)
    try:
        with pytest.raises(UsageError, match="another server listens on it"):
            check_unix_path(path)
    finally:
        live.close()
    other = tmp_path / "file"
    other.write_text("x")
    with pytest.raises(UsageError, match="not a socket"):
        check_unix_path(str(other))
    with pytest.raises(UsageError, match="does not exist"):
        check_unix_path(str(tmp_path / "nodir" / "s.sock"))


def test_one_shared_socket_for_every_slot_removed_at_close(tmp_path: Path) -> None:
    path = tmp_path / "s.sock"
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(path))
    stale.close()
    binds = resolve_binds(["127.0.0.1:0", f"unix:{path}"])
    ls = open_listeners(binds, [0, 1], 16, unix_mode=0o600)
    try:
        assert len(ls.shared) == 1 and stat.S_IMODE(os.lstat(path).st_mode) == 0o600
        assert [lst.family for lst in ls.for_slot(0)] == [socket.AF_INET, socket.AF_UNIX]
        assert ls.fds(0)[1] == ls.fds(1)[1] and ls.fds(0)[0] != ls.fds(1)[0]
        assert ls.addresses()[-1] == f"unix:{path}" and all(len(v) == 1 for v in ls.by_slot.values())
        c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        c.connect(str(path))
        c.close()
    finally:
        ls.close()
    assert not path.exists()
    with pytest.raises(UsageError, match="same address"):
        resolve_binds([f"unix:{path}", f"unix:{path}"])


def test_a_reload_cannot_change_the_mode_of_a_socket_already_made() -> None:
    from types import SimpleNamespace

    from numaserve.supervisor.reload import reload_blockers

    plan = SimpleNamespace(slots=[])
    unix = {"bind": ["unix:/run/ns.sock"]}
    old = load_config(None, {"server": unix}, environ={}, use_default_path=False)
    new = load_config(None, {"server": {**unix, "unix_mode": "0600"}}, environ={}, use_default_path=False)
    assert reload_blockers(old, plan, new, plan) == ["server.unix_mode changed ('0660' -> '0600')"]  # type: ignore[arg-type]
    tcp_old = load_config(None, {}, environ={}, use_default_path=False)
    tcp_new = load_config(None, {"server": {"unix_mode": "0600"}}, environ={}, use_default_path=False)
    assert reload_blockers(tcp_old, plan, tcp_new, plan) == []  # type: ignore[arg-type]
