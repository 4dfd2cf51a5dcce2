"""The reference model app (numaserve.apps.model) under the real supervisor: weights made by
``numaserve model init``, loaded by the preload hook in the node's template, served by forked
workers through the OpenAI clients; the weights shared by the workers; a corrupt file -> exit 3."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from tests.integration.harness import REPO, Running, numaserve_argv

pytest.importorskip("safetensors")
pytest.importorskip("numpy")
openai = pytest.importorskip("openai")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

APP = ["--nodes", "0", "--bind", "127.0.0.1:0", "--app", "numaserve.apps.model:app",
       "--preload", "numaserve.apps.model:load"]


def init(path: Path, size: str = "32MB") -> None:
    r = subprocess.run(numaserve_argv("model", "init", str(path), "--size", size, "--seed", "5"),
                       capture_output=True, text=True, timeout=180, cwd=str(REPO))
    assert r.returncode == 0, r.stderr


@pytest.fixture(scope="module")
def weights(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("weights") / "ref.safetensors"
    init(path)
    return path


def all_forked(st: dict[str, Any]) -> bool:
    return bool(st["slots"]) and all(s["state"] == "ready" and (s["start"] or {}).get("mode") == "fork"
                                     for s in st["slots"])


@pytest.fixture(scope="module")
def served(weights: Path) -> Iterator[Running]:
    with Running([*APP, "--workers-per-node", "2"], env={"NUMASERVE_MODEL": str(weights)}) as sup:
        sup.wait_for(all_forked, 120, "both slots forked from the template")
        sup.wait_ready(60)
        yield sup


def test_openai_clients_chat_stream_completions_embeddings(served: Running) -> None:
    base = f"http://127.0.0.1:{served.port}/v1"
    client = openai.OpenAI(base_url=base, api_key="unused", max_retries=0, timeout=60)
    assert [m.id for m in client.models.list().data] == ["ref"]
    stream = client.chat.completions.create(model="ref", stream=True, max_tokens=12,
                                            stream_options={"include_usage": True},
                                            messages=[{"role": "user", "content": "which node am I on?"}])
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].usage.completion_tokens == 12 and len(text.split()) == 12
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    # greedy decoding over the same weights: every worker gives the same reply, streamed or not
    for _ in range(4):
        reply = client.chat.completions.create(model="ref", max_tokens=12,
                                               messages=[{"role": "user", "content": "which node am I on?"}])
        assert reply.choices[0].message.content == text
    comp = client.completions.create(model="ref", prompt="the memory of a node", max_tokens=6, n=2)
    assert len(comp.choices) == 2 and comp.usage.completion_tokens == 12
    emb = httpx.post(f"{base}/embeddings", json={"model": "ref", "input": ["a", "the node"]}, timeout=60)
    assert emb.status_code == 200
    vectors = [d["embedding"] for d in emb.json()["data"]]
    assert len(vectors) == 2 and len(vectors[0]) == len(vectors[1]) > 0
    assert abs(sum(x * x for x in vectors[0]) - 1.0) < 1e-3


def _smaps(pid: int) -> dict[str, int]:
    kb: dict[str, int] = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        parts = line.split()
        if len(parts) >= 2 and parts[1].isdigit():
            kb[parts[0].rstrip(":")] = int(parts[1]) * 1024
    return kb


def test_forked_workers_share_the_templates_weights(served: Running, weights: Path) -> None:
    """Each worker maps the weights as pages shared with its template, not its own copy."""
    size = weights.stat().st_size
    st = served.status()
    (t,) = st["templates"]["nodes"]
    pids = [s["pid"] for s in st["slots"]]
    with httpx.Client(timeout=60) as c:  # every worker runs the whole network at least once
        for _ in range(8):
            assert c.post(f"http://127.0.0.1:{served.port}/v1/completions",
                          json={"prompt": "the node", "max_tokens": 4}).status_code == 200
    template = _smaps(t["pid"])
    workers = [_smaps(pid) for pid in pids]
    for w in workers:
        private = w["Private_Clean"] + w["Private_Dirty"]
        shared = w["Shared_Clean"] + w["Shared_Dirty"]
        # a worker of its own would hold the weights privately (private >= size) on top of its ~15 MB
        assert shared > size and private < size, (w, size)
    # template + 2 workers: PSS well under two copies of the weights above what the 3 processes cost bare
    tree_pss = template["Pss"] + sum(w["Pss"] for w in workers)
    bare = sum((m["Pss"] - m["Pss_Anon"]) + 20 * 2**20 for m in [template, *workers])
    assert tree_pss < 1.5 * size + bare, (tree_pss, size, bare)


def _anon_pages_by_node(pid: int, min_pages: int) -> tuple[dict[str, int], list[str]]:
    """Pages per node of the anonymous mappings of at least ``min_pages`` (numa_maps), and their policies."""
    pages: dict[str, int] = {}
    policies = []
    for line in Path(f"/proc/{pid}/numa_maps").read_text().splitlines():
        m = re.search(r"\banon=(\d+)", line)
        if m and int(m.group(1)) >= min_pages and " file=" not in line:
            policies.append(line.split()[1])
            for node, count in re.findall(r"\bN(\d+)=(\d+)", line):
                pages[node] = pages.get(node, 0) + int(count)
    return pages, policies


def test_template_holds_the_weights_in_its_own_memory_on_its_node(served: Running, weights: Path) -> None:
    """numa_maps: the weights are anonymous pages of the template (not the file's page cache), allocated
    under its node binding; the file is not mapped at all."""
    (t,) = served.status()["templates"]["nodes"]
    pages, policies = _anon_pages_by_node(t["pid"], 256)  # mappings of 1 MiB and more
    weight_pages = weights.stat().st_size // 4096
    on_node = sum(pages.get(str(n), 0) for n in t["memory_nodes"])
    assert on_node >= 0.8 * weight_pages and on_node >= 0.95 * sum(pages.values()), (pages, t["memory_nodes"])
    if t["mempolicy"] == "bind":
        assert policies and all(p.startswith("bind") for p in policies), policies
    assert str(weights) not in Path(f"/proc/{t['pid']}/maps").read_text()


def test_corrupt_weights_exit_3_with_one_line_naming_file_and_fault(weights: Path, tmp_path: Path) -> None:
    raw = bytearray(weights.read_bytes())
    header_len = int.from_bytes(raw[:8], "little")
    offsets = json.loads(raw[8:8 + header_len])["layers.3.w2"]["data_offsets"]
    raw[8 + header_len + offsets[0] + 4096] ^= 0x01
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(bytes(raw))
    sup = Running([*APP, "--workers-per-node", "2"], env={"NUMASERVE_MODEL": str(bad)}, expect_ready=False)
    try:
        rc = sup.wait_exit(180)
        err = sup.stderr_path.read_text()
        line = [x for x in err.splitlines() if x.startswith("numaserve: error:")]
        assert rc == 3 and len(line) == 1, err[-3000:]
        assert line[0].startswith("numaserve: error: no slot could start:")
        assert f"model weights {bad}: tensor 'layers.3.w2' fails its checksum" in line[0]
    finally:
        sup.close()


def test_missing_weights_file_exit_3(tmp_path: Path) -> None:
    gone = tmp_path / "nowhere.safetensors"
    sup = Running([*APP, "--workers-per-node", "1"], env={"NUMASERVE_MODEL": str(gone)}, expect_ready=False)
    try:
        rc = sup.wait_exit(180)
        err = sup.stderr_path.read_text()
        assert rc == 3 and f"model weights {gone}: no such file" in err, err[-3000:]
    finally:
        sup.close()


def test_a_slowed_model_load_longer_than_the_heartbeat_timeout_serves_without_a_kill(weights: Path) -> None:
    """The template sleeps 8 s before loading the weights (heartbeat_timeout 3 s, no ready deadline): the
    slots say ``loading`` meanwhile, nothing is killed, then both workers serve the model."""
    from tests.integration.harness import FAST_CONFIG

    assert "ready_timeout = 30.0" in FAST_CONFIG
    config = FAST_CONFIG.replace("ready_timeout = 30.0", "ready_timeout = 0")
    args = ["--nodes", "0", "--bind", "127.0.0.1:0", "--workers-per-node", "2", "--app", "slowmodel:app",
            "--preload", "slowmodel:load"]
    with Running(args, config=config, env={"NUMASERVE_MODEL": str(weights), "SLOWMODEL_S": "8"},
                 expect_ready=False) as sup:
        seen = sup.wait_for(lambda s: s["slots"] and any(x["state"] == "loading" for x in s["slots"]), 60,
                            "a slot reported loading")
        assert all(x["state"] in ("loading", "starting") for x in seen["slots"]), seen["slots"]
        st = sup.wait_ready(120)
        assert all(x["restarts"] == 0 for x in st["slots"]), st["slots"]
        assert all((x["start"] or {}).get("mode") == "fork" for x in st["slots"]), st["slots"]
        r = httpx.post(f"http://127.0.0.1:{sup.port}/v1/completions",
                       json={"model": "ref", "prompt": "a slow load", "max_tokens": 4}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text
        events = [e.get("event") for e in sup.events()]
        assert not {"hang", "kill", "template_hung", "zygote_hung"} & set(events), events
