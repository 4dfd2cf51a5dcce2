from types import SimpleNamespace as N

import pytest

from numaserve.config import ConfigError, EnvConfig, load_config
from numaserve.workerenv import slot_env

GPUS = [N(pci="0000:01:00.0", vendor="0x10de"), N(pci="0000:81:00.0", vendor="0x10de"),
        N(pci="0000:c1:00.0", vendor="0x10de"), N(pci="0000:02:00.0", vendor="0x1a03")]  # last: BMC VGA


def env(**kw):
    base = dict(slot=1, node=1, index=0, cpus=[8, 9, 10, 11], gpus=[], all_gpus=GPUS, env_cfg=EnvConfig(),
                inherited={}, generation=2)
    base.update(kw)
    return slot_env(**base)


def test_thread_pools_sized_to_slot():
    e = env()
    for v in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "NUMEXPR_NUM_THREADS"):
        assert e[v] == "4"
    assert e["NUMASERVE_CPUS"] == "8-11" and e["NUMASERVE_GENERATION"] == "2"


def test_operator_values_win_over_defaults():
    assert "OMP_NUM_THREADS" not in env(inherited={"OMP_NUM_THREADS": "16"})
    e = env(env_cfg=EnvConfig(vars={"MKL_NUM_THREADS": "1"}))
    assert e["MKL_NUM_THREADS"] == "1" and e["OMP_NUM_THREADS"] == "4"


def test_gpu_indices_follow_pci_order_of_the_vendor():
    e = env(gpus=["0000:81:00.0", "0000:c1:00.0"])
    assert e["CUDA_VISIBLE_DEVICES"] == "1,2" and e["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert env(gpus=[])["CUDA_VISIBLE_DEVICES"] == ""     # a node without GPUs sees none
    assert "CUDA_VISIBLE_DEVICES" not in env(all_gpus=[GPUS[3]])  # only a BMC VGA: nothing to hide


def test_templating_and_precedence():
    cfg = EnvConfig(vars={"A": "{slot}/{node}/{ncpus}", "B": "v"}, node={"1": {"B": "node"}}, slot={"1": {"B": "slot"}})
    e = env(env_cfg=cfg)
    assert e["A"] == "1/1/4" and e["B"] == "slot"


@pytest.mark.parametrize("toml,needle", [
    ('[env]\nvars = { A = "{nope}" }\n', "env.vars.A"),
    ('[env]\nvars = { "1BAD" = "x" }\n', "env.vars"),
    ('[env.node.x]\nA = "1"\n', "env.node.x"),
])
def test_bad_env_config_is_a_clear_error(tmp_path, toml, needle):
    p = tmp_path / "c.toml"
    p.write_text(toml)
    with pytest.raises(ConfigError, match=needle.replace(".", r"\.")):
        load_config(p, environ={})


def test_plan_shows_gpu_visibility_per_slot_on_a_fixture_tree():
    """2 nodes with one accelerator each (sysfs fixture): each slot sees only its node's NVIDIA GPU."""
    import json
    from pathlib import Path

    from click.testing import CliRunner

    from numaserve.cli import cli

    root = Path(__file__).resolve().parents[1] / "fixtures" / "sysfs" / "2node-nics"
    r = CliRunner().invoke(cli, ["plan", "--root", str(root), "--json"], env={"CUDA_VISIBLE_DEVICES": None})
    assert r.exit_code == 0, r.output
    slots = {s["node"]: s for s in json.loads(r.output)["slots"]}
    assert slots[1]["env"]["CUDA_VISIBLE_DEVICES"] == "0" and slots[1]["env"]["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert slots[0]["env"]["CUDA_VISIBLE_DEVICES"] == ""       # the node-0 accelerator is not NVIDIA
    for s in slots.values():
        assert s["env"]["OMP_NUM_THREADS"] == str(len(s["cpus"]))
