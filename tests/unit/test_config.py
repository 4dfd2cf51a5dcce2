"""Config loading: precedence, every error kind, and the documented example file."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Any

import msgspec
import pytest

from numaserve.config import Config, ConfigError, config_to_toml, load_config
from numaserve.errors import UsageError

EXAMPLE = Path(__file__).resolve().parents[2] / "config" / "numaserve.toml"


def write(tmp_path: Path, text: str | bytes, name: str = "numaserve.toml") -> Path:
    p = tmp_path / name
    if isinstance(text, bytes):
        p.write_bytes(text)
    else:
        p.write_text(text)
    return p


def load(path: Path | None = None, overrides: dict[str, dict[str, Any]] | None = None,
         env: dict[str, str] | None = None) -> Config:
    return load_config(path, overrides, env or {}, use_default_path=False)


# --- precedence --------------------------------------------------------------------


def test_defaults_without_any_source() -> None:
    assert load() == Config()


def test_file_env_flag_precedence(tmp_path: Path) -> None:
    p = write(tmp_path, "[server]\nbacklog = 100\nkeepalive_timeout = 7.5\n[placement]\nmempolicy = 'preferred'\n")
    cfg = load(p)
    assert (cfg.server.backlog, cfg.server.keepalive_timeout, cfg.placement.mempolicy) == (100, 7.5, "preferred")
    env = {"NUMASERVE_SERVER_BACKLOG": "200", "NUMASERVE_PLACEMENT_MEMPOLICY": "interleave"}
    cfg = load(p, env=env)
    assert (cfg.server.backlog, cfg.server.keepalive_timeout, cfg.placement.mempolicy) == (200, 7.5, "interleave")
    cfg = load(p, {"server": {"backlog": 300}}, env=env)
    assert (cfg.server.backlog, cfg.placement.mempolicy) == (300, "interleave")


def test_unset_flags_do_not_mask_file_values(tmp_path: Path) -> None:
    p = write(tmp_path, "[placement]\nnodes = '0'\nworkers_per_node = 'auto'\n")
    cfg = load(p, {"placement": {"nodes": None, "workers_per_node": None}})
    assert cfg.placement.nodes == "0" and cfg.placement.workers_per_node == "auto"


def test_environment_value_parsing() -> None:
    cfg = load(env={
        "NUMASERVE_SERVER_BIND": "0.0.0.0:8000, [::1]:9000",
        "NUMASERVE_SERVER_ACCESS_LOG": "yes",
        "NUMASERVE_SERVER_READ_TIMEOUT": "2.5",
        "NUMASERVE_PLACEMENT_WORKERS_PER_NODE": "3",
        "NUMASERVE_PLACEMENT_MEMPOLICY": "interleave",
        "NUMASERVE_LOG_FORMAT": "json",
        "NUMASERVE_CONFIG": "/not/a/section",  # the --config envvar, not a setting
        "OTHER_SERVER_BACKLOG": "1",
    })
    assert cfg.server.bind == ["0.0.0.0:8000", "[::1]:9000"]
    assert cfg.server.access_log is True
    assert cfg.server.read_timeout == 2.5
    assert cfg.placement.workers_per_node == 3
    assert cfg.placement.mempolicy == "interleave"
    assert cfg.log.format == "json"
    assert load(env={"NUMASERVE_PLACEMENT_WORKERS_PER_NODE": "auto"}).placement.workers_per_node == "auto"
    assert load(env={"NUMASERVE_SERVER_ACCESS_LOG": "off"}).server.access_log is False


def test_config_to_toml_round_trips(tmp_path: Path) -> None:
    cfg = load(env={"NUMASERVE_SERVER_BIND": "[::]:81", "NUMASERVE_SERVER_APP": 'pkg.mod:app',
                    "NUMASERVE_PLACEMENT_WORKERS_PER_NODE": "auto"})
    text = config_to_toml(cfg)
    assert load(write(tmp_path, text)) == cfg


# --- errors: each names source, key, value and what was expected --------------------

FILE_ERRORS = [
    # (toml text, fragments the one-line message must contain)
    ("[bogus]\nx = 1\n", ["unknown section [bogus]", "expected one of ", "placement, server, supervisor"]),
    ("[server]\nbogus = 1\n", ["unknown key server.bogus = 1", "expected one of", "backlog"]),
    ("[server]\nbacklog = 'many'\n", ['server.backlog = "many"', "expected an integer"]),
    ("[server]\nbacklog = 1.5\n", ["server.backlog = 1.5", "expected an integer"]),
    ("[server]\naccess_log = 'yes'\n", ['server.access_log = "yes"', "expected true or false"]),
    ("[server]\nbind = '0.0.0.0:80'\n", ['server.bind = "0.0.0.0:80"', "expected a list of strings"]),
    ("[server]\nbind = ['nope']\n", ['server.bind = "nope"', "expected HOST:PORT"]),
    ("[server]\nbind = ['::1:80']\n", ['server.bind = "::1:80"', "IPv6 addresses need brackets"]),
    ("[server]\nbind = ['h:99999']\n", ['server.bind = "h:99999"', "0-65535"]),
    ("[server]\napp = 'a:b'\ncmd = 'run'\n", ['server.cmd = "run"', "either server.app or server.cmd, not both"]),
    ("[server]\napp = 'not an app'\n", ['server.app = "not an app"', "module:attribute"]),
    ("[placement]\nmempolicy = 'strict'\n",
     ['placement.mempolicy = "strict"', 'expected one of "bind", "preferred", "interleave", "local"']),
    ("[placement]\nworkers_per_node = 'many'\n", ['placement.workers_per_node = "many"', 'an integer >= 1 or "auto"']),
    ("[placement]\nworkers_per_node = 0\n", ["placement.workers_per_node = 0", 'an integer >= 1 or "auto"']),
    ("[placement]\nnodes = '0-'\n", ['placement.nodes = "0-"', '"all" or a node list']),
    ("[placement]\nreserve_irq_cpus = -1\n", ["placement.reserve_irq_cpus = -1", "an integer >= 0"]),
    ("[log]\nlevel = 'loud'\n", ['log.level = "loud"', 'expected one of "debug"']),
    ("[supervisor]\nheartbeat_interval = 5.0\nheartbeat_timeout = 2.0\n",
     ["supervisor.heartbeat_timeout = 2.0", "more than supervisor.heartbeat_interval"]),
    ("server = 1\n", ["server = 1", "expected a table [server]"]),
    ("[server\n", ["invalid TOML", "line 1"]),
]


@pytest.mark.parametrize("text,fragments", FILE_ERRORS, ids=[t.splitlines()[0] + "|" + f[0] for t, f in FILE_ERRORS])
def test_file_errors_name_source_key_value_expected(tmp_path: Path, text: str, fragments: list[str]) -> None:
    p = write(tmp_path, text)
    with pytest.raises(ConfigError) as e:
        load(p)
    msg = str(e.value)
    assert msg.startswith(f"{p}: "), msg
    assert "\n" not in msg
    for f in fragments:
        assert f in msg, msg
    assert isinstance(e.value, UsageError) and e.value.exit_code == 2


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"nope\.toml: config file not found$"):
        load(tmp_path / "nope.toml")


def test_directory_instead_of_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=re.escape(f"{tmp_path}: cannot read config file")):
        load(tmp_path)


def test_non_utf8_file(tmp_path: Path) -> None:
    p = write(tmp_path, b"[server]\napp = '\xff'\n")
    with pytest.raises(ConfigError) as e:
        load(p)
    assert str(e.value) == f"{p}: not UTF-8 text: invalid start byte at line 2 (byte 16): expected a UTF-8 TOML file"


ENV_ERRORS = [
    ({"NUMASERVE_SERVER_BACKLOG": "x"}, ['server.backlog = "x"', "expected an integer"]),
    ({"NUMASERVE_SERVER_BOGUS": "1"}, ['unknown key server.bogus = "1"', "expected one of"]),
    ({"NUMASERVE_SERVER_ACCESS_LOG": "maybe"}, ['server.access_log = "maybe"', "true or false"]),
    ({"NUMASERVE_PLACEMENT_WORKERS_PER_NODE": "x"}, ['placement.workers_per_node = "x"', '"auto"']),
    ({"NUMASERVE_PLACEMENT_MEMPOLICY": "hard"}, ['placement.mempolicy = "hard"', '"bind"']),
    ({"NUMASERVE_SERVER_BIND": "a:1,b"}, ['server.bind = "b"', "HOST:PORT"]),
]


@pytest.mark.parametrize("env,fragments", ENV_ERRORS, ids=[next(iter(e)) for e, _ in ENV_ERRORS])
def test_environment_errors_name_the_variable(env: dict[str, str], fragments: list[str]) -> None:
    with pytest.raises(ConfigError) as e:
        load(env=env)
    msg = str(e.value)
    assert msg.startswith(f"environment {next(iter(env))}: "), msg
    for f in fragments:
        assert f in msg, msg


def test_environment_beats_file_in_error_source(tmp_path: Path) -> None:
    p = write(tmp_path, "[server]\nbacklog = 10\n")
    with pytest.raises(ConfigError, match=r"^environment NUMASERVE_SERVER_BACKLOG: "):
        load(p, env={"NUMASERVE_SERVER_BACKLOG": "-5"})


@pytest.mark.parametrize(
    "overrides,prefix,fragment",
    [
        ({"placement": {"nodes": "x"}}, "flag --nodes: ", 'placement.nodes = "x"'),
        ({"placement": {"workers_per_node": 0}}, "flag --workers-per-node: ", "workers_per_node = 0"),
        ({"placement": {"workers_per_node": "x"}}, "flag --workers-per-node: ", '"x"'),
        ({"log": {"level": "loud"}}, "flag --log-level: ", 'log.level = "loud"'),
        ({"placement": {"sysfs_root": 5}}, "flag --root: ", "expected a string"),
        ({"placement": {"topology_file": 5}}, "flag --declared: ", "expected a string"),
        ({"server": {"backlog": 0}}, "flag --backlog: ", "server.backlog = 0: expected an integer > 0"),
    ],
)
def test_flag_errors_name_the_flag(overrides: dict[str, dict[str, Any]], prefix: str, fragment: str) -> None:
    with pytest.raises(ConfigError) as e:
        load(overrides=overrides)
    assert str(e.value).startswith(prefix), str(e.value)
    assert fragment in str(e.value)


# --- the documented example ----------------------------------------------------------

_SECTION_RE = re.compile(r"^#?\s*\[(\w+)\]\s*$")
_KEY_RE = re.compile(r"^#?\s*(\w+)\s*=\s*(.+)$")


def _documented(text: str) -> dict[str, dict[str, tuple[Any, bool, bool]]]:
    """section → key → (value, live?, commented?) from the example file.

    Keys may be live (``key = v``) or commented out (``# key = v``).  A key is
    commented when a prose comment precedes it in its block (lines up to the
    previous blank line), so related keys may share one comment.
    """
    out: dict[str, dict[str, tuple[Any, bool, bool]]] = {}
    section = None
    block_comment = False
    for line in text.splitlines():
        s = line.strip()
        if not s:
            block_comment = False
            continue
        m = _SECTION_RE.match(s)
        if m:
            section = m.group(1)
            out.setdefault(section, {})
            block_comment = False
            continue
        m = _KEY_RE.match(s)
        value = None
        if m and section is not None:
            try:
                value = tomllib.loads(f"v = {m.group(2)}")["v"]
            except tomllib.TOMLDecodeError:
                value = None  # prose that happens to contain "="
        if m and value is not None and section is not None:
            out[section][m.group(1)] = (value, not s.startswith("#"), block_comment)
        elif s.startswith("#"):
            block_comment = True
    return out


def test_example_config_loads_cleanly() -> None:
    cfg = load(EXAMPLE)
    assert cfg == Config()


def test_example_config_documents_every_option_with_its_default() -> None:
    documented = _documented(EXAMPLE.read_text())
    defaults = Config().to_dict()
    for sf in msgspec.structs.fields(Config):
        assert sf.name in documented, f"section [{sf.name}] missing from {EXAMPLE}"
        for f in msgspec.structs.fields(sf.type):
            assert f.name in documented[sf.name], f"{sf.name}.{f.name} missing from {EXAMPLE}"
            value, _live, commented = documented[sf.name][f.name]
            assert value == defaults[sf.name][f.name], f"{sf.name}.{f.name}: example shows {value!r}"
            assert commented, f"{sf.name}.{f.name} has no comment above it in {EXAMPLE}"


def test_example_config_names_each_key_once_commented_out_with_a_short_comment() -> None:
    """config/numaserve.toml: a one-line header per section, every key once as ``# key = default``
    under one or two lines of comment (issue 33 item 5)."""
    seen: list[str] = []
    section = ""
    block: list[str] = []
    lines = EXAMPLE.read_text().splitlines()
    for i, line in enumerate(lines):
        m = _SECTION_RE.match(line.strip())
        if m and not line.startswith("#"):
            section = m.group(1)
            assert lines[i + 1].startswith("# ") and not lines[i + 2].strip(), f"[{section}]: one-line header"
            block = []
            continue
        key = re.match(r"^# (\w+) = ", line)
        if key and section and key.group(1) in {f.name for f in msgspec.structs.fields(
                type(getattr(Config(), section)))}:
            seen.append(f"{section}.{key.group(1)}")
            assert 1 <= len(block) <= 2, f"{section}.{key.group(1)}: {len(block)} comment lines"
            block = []
        elif line.startswith("#"):
            block.append(line)
        elif not line.strip():
            block = []
        else:
            raise AssertionError(f"line {i + 1} is live, not commented out: {line!r}")
    schema = [f"{sf.name}.{f.name}" for sf in msgspec.structs.fields(Config) for f in msgspec.structs.fields(sf.type)]
    assert sorted(seen) == sorted(schema)          # each key once, none missing, none unknown


def test_example_config_has_no_unknown_options() -> None:
    documented = _documented(EXAMPLE.read_text())
    defaults = Config().to_dict()
    for section, keys in documented.items():
        assert section in defaults, section
        assert set(keys) <= set(defaults[section]), set(keys) - set(defaults[section])


def test_example_explains_bind_default_and_auto_rule() -> None:
    text = EXAMPLE.read_text()
    assert "preferred" in text and "OOM" in text and "remote" in text
    assert "physical cores" in text and "GPUs" in text


@pytest.mark.parametrize("text, fragment", [
    ("[server]\ngraceful_timeout = nan\n", "server.graceful_timeout = nan: expected a finite number"),
    ("[ops]\nrate_limit = inf\n", "ops.rate_limit = inf: expected a finite number"),
    ("[supervisor]\nbackoff_initial = -inf\n", "supervisor.backoff_initial = -inf: expected a finite number"),
    ("[placement]\nlocality_interval = nan\n", "placement.locality_interval = nan: expected a finite number"),
])
def test_nan_and_infinities_are_refused_with_the_key(tmp_path: Path, text: str, fragment: str) -> None:
    p = write(tmp_path, text)
    with pytest.raises(ConfigError) as e:
        load_config(p, environ={})
    assert fragment in str(e.value) and str(p) in str(e.value)
    assert e.value.exit_code == 2


def test_every_float_option_is_checked_for_finiteness(tmp_path: Path) -> None:
    """A generic check over the schema: no float field can slip through as NaN."""
    import msgspec

    from numaserve.config import SECTIONS

    for section, struct in SECTIONS.items():
        for f in msgspec.structs.fields(struct):
            if f.type is not float:
                continue
            with pytest.raises(ConfigError, match=rf"{section}\.{f.name} = nan: expected a finite number"):
                load_config(None, {section: {f.name: float("nan")}}, environ={}, use_default_path=False)


def test_finite_check_names_the_environment_variable() -> None:
    with pytest.raises(ConfigError, match="environment NUMASERVE_SERVER_READ_TIMEOUT: server.read_timeout = inf"):
        load_config(None, environ={"NUMASERVE_SERVER_READ_TIMEOUT": "inf"}, use_default_path=False)


def test_tcp_endpoint_must_parse(tmp_path: Path) -> None:
    p = write(tmp_path, '[ops]\ntcp_endpoint = "tcp://nohost"\ncurve_secret_key = "a"\ncurve_authorized_keys = "b"\n')
    with pytest.raises(ConfigError, match="ops.tcp_endpoint"):
        load_config(p, environ={})
    p = write(tmp_path, '[ops]\ntcp_endpoint = "tcp://*:7071"\ncurve_secret_key = "a"\ncurve_authorized_keys = "b"\n')
    assert load_config(p, environ={}).ops.tcp_endpoint == "tcp://*:7071"


def test_a_retired_key_or_section_says_why_and_what_instead(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from numaserve import retiredkeys

    monkeypatch.setattr(retiredkeys, "RETIRED", {"server.old_knob": "set server.backlog instead",
                                                 "oldtable": "its limiter was removed"})
    with pytest.raises(ConfigError, match=r"numaserve.toml.*server\.old_knob was removed: set server\.backlog instead"):
        load(write(tmp_path, "[server]\nold_knob = 3\n"))
    with pytest.raises(ConfigError, match=r"section \[oldtable\] was removed: its limiter was removed"):
        load(write(tmp_path, "[oldtable]\nx = 1\n"))
    with pytest.raises(ConfigError, match=r"NUMASERVE_SERVER_OLD_KNOB: server\.old_knob was removed"):
        load(None, env={"NUMASERVE_SERVER_OLD_KNOB": "3"})


# issue 33 item 5: keys cut to fixed constants; an old config naming one fails with the reason
CUT_KEYS = [
    ("leak", "grace_requests", "leak.threshold_bytes_per_1000, leak.window_requests"),
    ("leak", "uss_interval_s", "numaserve.loops.leak.LeakSettings"),
    ("leak", "budget_memtotal_fraction", "set leak.budget_bytes"),
    ("supervisor", "backoff_jitter", "±20 %"),
    ("supervisor", "unresponsive_after", "2 heartbeat intervals"),
    ("ops", "drain_timeout", "use server.graceful_timeout"),
    ("ops", "max_connections", "16 ops clients"),
    ("ops", "idle_timeout", "30 s"),
    ("admin", "enabled", 'admin.bind = ""'),
    ("admin", "max_connections", "64 admin HTTP connections"),
    ("admin", "idle_timeout", "5 s"),
    ("cmd", "probe_timeout", "2 s per readiness probe"),
    ("cmd", "probe_interval", "0.25 s"),
    ("cache", "max_entry_bytes", "1 MiB"),
]


@pytest.mark.parametrize("section, key, sentence", CUT_KEYS)
def test_a_cut_key_fails_with_its_sentence(tmp_path: Path, section: str, key: str, sentence: str) -> None:
    with pytest.raises(ConfigError) as e:
        load(write(tmp_path, f"[{section}]\n{key} = 1\n"))
    assert f"{section}.{key} was removed: " in str(e.value) and sentence in str(e.value), str(e.value)


def test_every_retired_key_is_gone_from_the_schema() -> None:
    from numaserve.retiredkeys import RETIRED

    cfg = Config()
    for name in RETIRED:
        section, _, key = name.partition(".")
        if key and hasattr(cfg, section):
            assert key not in {f.name for f in msgspec.structs.fields(type(getattr(cfg, section)))}, name
