"""Pure tier (a bash subprocess): ``scripts/slurm/zeppelin_env.sh`` under a fake Slurm job.

The script is sourced with a made-up allocation (a stand-in ``scontrol``, ``SLURM_*``
variables, no other environment) for every cluster file, and each variable it exports is held
to what its reader accepts:

* ``NCCL_IB_HCA``: NCCL's exact-match form, ``=`` then comma-separated device names (optionally
  ``:port``), or ``^=`` to exclude; without ``=`` NCCL matches prefixes (mlx5_1 takes mlx5_10);
* ``NCCL_SOCKET_IFNAME``: NCCL's syntax (optional ``^`` to exclude, ``=`` for exact names);
* ``GLOO_SOCKET_IFNAME``: interface names only, comma-separated (gloo has no ``^``/``=``), at
  most 15 characters each (Linux's limit);
* ``UCX_NET_DEVICES``: ``device:port`` entries; GID index and traffic class: integers.

DGX H100's compute NICs are those of its user guide's network-module table (GPU 0..7 ->
mlx5_0, 3, 4, 5, 6, 9, 10, 11). Settings of the submitting shell win over the cluster file, and
settings NCCL or gloo would misread stop the script with the line to change.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.pure

ROOT = Path(__file__).resolve().parents[1]
CLUSTERS = sorted(p.stem for p in (ROOT / "configs/clusters").glob("*.yaml"))
DGX_H100_COMPUTE = "=mlx5_0,mlx5_3,mlx5_4,mlx5_5,mlx5_6,mlx5_9,mlx5_10,mlx5_11"

DEVICE = r"[A-Za-z0-9_]+(:\d+)?"
HCA = re.compile(rf"^\^?={DEVICE}(,{DEVICE})*$")
NCCL_IFNAME = re.compile(r"^\^?=?[A-Za-z0-9_.\-]+(,[A-Za-z0-9_.\-]+)*$")
GLOO_IFNAME = re.compile(r"^[A-Za-z0-9_.\-:@]{1,15}(,[A-Za-z0-9_.\-:@]{1,15})*$")
UCX_DEVICES = re.compile(r"^[A-Za-z0-9_]+:\d+(,[A-Za-z0-9_]+:\d+)*$")


def source_env(tmp_path: Path, cluster: str, **preset: str) -> subprocess.CompletedProcess:
    """Source the script as the sbatch files do, in a fake two-node allocation; print the
    environment it leaves, NUL-separated."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    scontrol = bin_dir / "scontrol"
    scontrol.write_text("#!/bin/sh\necho node-a\necho node-b\n")
    scontrol.chmod(0o755)
    env = {
        "PATH": f"{bin_dir}:/usr/bin:/bin",
        "HOME": str(tmp_path),
        "SLURM_JOB_NODELIST": "node-[a-b]",
        "SLURM_NNODES": "2",
        "SLURM_SUBMIT_DIR": str(ROOT),
        "DATA_PREFIX": "/lustre/data/wiki_text_document",
        "RUN_DIR": str(tmp_path / "run"),
        "CLUSTER": cluster,
        **preset,
    }
    script = ROOT / "scripts/slurm/zeppelin_env.sh"
    return subprocess.run(
        ["bash", "-c", f"set -euo pipefail; source '{script}'; env -0"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def exported(done: subprocess.CompletedProcess) -> dict[str, str]:
    assert done.returncode == 0, done.stderr
    return dict(item.split("=", 1) for item in done.stdout.split("\0") if "=" in item)


@pytest.mark.parametrize("cluster", CLUSTERS)
def test_every_cluster_exports_settings_nccl_and_gloo_accept(tmp_path, cluster) -> None:
    done = source_env(tmp_path, cluster)
    env = exported(done)
    assert env["MASTER_ADDR"] == "node-a" and env["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"
    assert NCCL_IFNAME.match(env["NCCL_SOCKET_IFNAME"]), env["NCCL_SOCKET_IFNAME"]
    if "GLOO_SOCKET_IFNAME" in env:
        assert GLOO_IFNAME.match(env["GLOO_SOCKET_IFNAME"]), env["GLOO_SOCKET_IFNAME"]
    if "NCCL_IB_HCA" in env:
        assert HCA.match(env["NCCL_IB_HCA"]), env["NCCL_IB_HCA"]
    else:
        assert "NCCL_IB_HCA is not set" in done.stderr  # said, not silently guessed
    if "UCX_NET_DEVICES" in env:
        assert UCX_DEVICES.match(env["UCX_NET_DEVICES"]), env["UCX_NET_DEVICES"]
    for name in ("NCCL_IB_GID_INDEX", "UCX_IB_GID_INDEX", "NCCL_IB_TC"):
        if name in env:
            assert env[name].isdigit(), (name, env[name])
    if cluster == "dgx-h100":
        assert env["NCCL_IB_HCA"] == DGX_H100_COMPUTE
        assert env["UCX_NET_DEVICES"] == ",".join(f"{d}:1" for d in DGX_H100_COMPUTE[1:].split(","))


def test_the_submitting_shell_wins_over_the_cluster_file(tmp_path) -> None:
    env = exported(
        source_env(tmp_path, "dgx-h100", NCCL_IB_HCA="=mlx5_7", NCCL_SOCKET_IFNAME="=eth0,eth1")
    )
    assert env["NCCL_IB_HCA"] == "=mlx5_7" and env["UCX_NET_DEVICES"] == "mlx5_7:1"
    # Named interfaces: gloo takes the same ones, without NCCL's '='.
    assert env["NCCL_SOCKET_IFNAME"] == "=eth0,eth1" and env["GLOO_SOCKET_IFNAME"] == "eth0,eth1"


@pytest.mark.parametrize(
    ("preset", "needle"),
    [
        ({"GLOO_SOCKET_IFNAME": "^lo,docker0"}, "gloo takes interface names only"),
        ({"NCCL_IB_HCA": "mlx5_0,mlx5_1"}, "leading '='"),
        ({"CLUSTER": "no-such-cluster"}, "no cluster file"),
    ],
)
def test_settings_nccl_or_gloo_would_misread_stop_with_one_line(tmp_path, preset, needle):
    done = source_env(tmp_path, preset.pop("CLUSTER", "dgx-h100"), **preset)
    assert done.returncode == 2
    assert needle in done.stderr and len(done.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("cluster", CLUSTERS)
def test_the_env_section_never_becomes_a_megatron_flag(cluster) -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location("yaml_to_args", ROOT / "scripts/yaml_to_args.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    argv = tool.to_argv(tool.load_flags([str(ROOT / f"configs/clusters/{cluster}.yaml")]))
    assert not [a for a in argv if "env" in a.lower() or "NCCL" in a or "mlx5" in a]
    assert os.path.basename(spec.origin) == "yaml_to_args.py"


def test_the_megatron_command_line_keeps_what_the_user_set_and_adds_extra_args(tmp_path) -> None:
    default = exported(source_env(tmp_path, "dgx-h100"))
    args = default["ZEPPELIN_TRAIN_ARGS"].split()
    # Each part has its default, the split and validation among them.
    assert args[args.index("--split") + 1] == "998,1,1" and "--eval-iters" in args
    assert args[:2] == ["--spec", "megatron_zeppelin.megatron.spec"]
    assert "--lr" in args and "--data-path" in args and default["EXTRA_ARGS"] == ""
    # A part replaced (or emptied) before sbatch, and flags added after everything.
    env = exported(
        source_env(
            tmp_path,
            "dgx-h100",
            SPEC_ARGS="--spec megatron_zeppelin.megatron.spec local",
            LR_ARGS="--lr 1e-4",
            OPTIMIZER_ARGS="",
            DATA_ARGS="--data-path /data/a --split 90,5,5",
            EXTRA_ARGS="--seed 7 --moe-token-dispatcher-type alltoall",
        )
    )
    args = env["ZEPPELIN_TRAIN_ARGS"].split()
    assert args[:3] == ["--spec", "megatron_zeppelin.megatron.spec", "local"]
    assert args[args.index("--lr") + 1] == "1e-4" and "--lr-decay-style" not in args
    assert "--weight-decay" not in args and args[args.index("--split") + 1] == "90,5,5"
    pretrain = env["ZEPPELIN_PRETRAIN"]
    assert pretrain.endswith(" --seed 7 --moe-token-dispatcher-type alltoall")
    assert env["ZEPPELIN_TRAIN_ARGS"] in pretrain
    # The whole training command line set by the user is used as it is.
    mine = "--micro-batch-size 1 --global-batch-size 64 --lr 2e-4 --data-path /data/mine"
    env = exported(
        source_env(tmp_path, "dgx-h100", ZEPPELIN_TRAIN_ARGS=mine, EXTRA_ARGS="--seed 3")
    )
    assert env["ZEPPELIN_TRAIN_ARGS"] == mine
    assert env["ZEPPELIN_PRETRAIN"].endswith(f" {mine} --seed 3")
