"""The Megatron-LM patch stays a small, well-formed diff that only hands over to the plugin.

The patch inserts, in ``pretrain_gpt.py``'s ``__main__`` block, a hand-over to
``megatron_zeppelin.pretrain_gpt.main`` when ``--zeppelin`` is given; that entry point passes
Megatron the hooks in the calling convention of the installed release. Its context lines (a blank
line and the "Register startup timestamps" comment of the ``__main__`` block) read the same in
core_v0.16.1 and in the 0.19 releases (core_v0.19.0 and the core_r0.19.0 branch), so one patch
serves both: it applies at line 333 of the first and, offset, at line 502 of the second.

Tier: pure (parses ``patches/pretrain_gpt_zeppelin.patch``; a Megatron-LM checkout is used only
where ``MEGATRON_LM_DIR`` names one).
"""

from __future__ import annotations

import ast
import re
import subprocess
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.pure

ROOT = Path(__file__).resolve().parents[1]
PATCH = ROOT / "patches" / "pretrain_gpt_zeppelin.patch"
HUNK = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")
HOOKS = (
    "train_valid_test_datasets_provider",
    "forward_step",
    "model_provider",
    "extra_args_provider",
)


def _hunks(text: str) -> list[dict]:
    """Parse a unified diff of one file; assert every hunk's line counts match its header."""
    lines = text.splitlines()
    assert lines[0] == "--- a/pretrain_gpt.py", lines[0]
    assert lines[1] == "+++ b/pretrain_gpt.py", lines[1]
    hunks, i = [], 2
    while i < len(lines):
        match = HUNK.match(lines[i])
        assert match, f"line {i + 1} should start a hunk: {lines[i]!r}"
        old_start, old_len, new_start, new_len = (
            int(g) if g is not None else 1 for g in match.groups()
        )
        body, i = [], i + 1
        while i < len(lines) and not lines[i].startswith("@@"):
            body.append(lines[i])
            i += 1
        assert all(line[:1] in (" ", "+", "-") for line in body), "unexpected line marker"
        old = sum(line[:1] in (" ", "-") for line in body)
        new = sum(line[:1] in (" ", "+") for line in body)
        assert (old, new) == (old_len, new_len), f"hunk at -{old_start}: counts do not match"
        hunks.append({"old_start": old_start, "new_start": new_start, "body": body})
    return hunks


def test_patch_is_a_well_formed_diff_of_pretrain_gpt():
    hunks = _hunks(PATCH.read_text())
    assert hunks
    starts = [h["old_start"] for h in hunks]
    assert starts == sorted(starts)


def test_patch_is_small_and_only_adds_the_hand_over():
    body = [line for h in _hunks(PATCH.read_text()) for line in h["body"]]
    added = [line[1:] for line in body if line.startswith("+")]
    removed = [line[1:] for line in body if line.startswith("-")]
    assert len(added) <= 20 and len(removed) <= 4
    added_text = "\n".join(added)
    assert "from megatron_zeppelin.pretrain_gpt import main as zeppelin_main" in added_text
    assert 'if "--zeppelin" in sys.argv[1:]:' in added_text
    # The entry point it hands over to passes Megatron every hook.
    entry = (ROOT / "megatron_zeppelin" / "pretrain_gpt.py").read_text()
    for hook in HOOKS:
        assert f"hooks.{hook}" in entry, hook
    # Without --zeppelin every removed upstream expression is still what runs.
    for line in removed:
        expression = line.strip().split("=", 1)[-1].rstrip(",").strip()
        assert expression in added_text, f"upstream behaviour lost: {line.strip()}"


def test_added_block_is_valid_python():
    hunk = _hunks(PATCH.read_text())[0]
    block = [line[1:] for line in hunk["body"] if line.startswith("+")]
    ast.parse(textwrap.dedent("\n".join(block)))


def test_patch_applies_to_the_upstream_lines_it_quotes(tmp_path):
    """Rebuild the old file from the patch's own context and removed lines, then apply it."""
    if subprocess.run(["which", "patch"], capture_output=True).returncode:
        pytest.skip("the patch tool is not installed")
    hunks = _hunks(PATCH.read_text())
    old_lines: list[str] = []
    for h in hunks:
        # Filler keeps each hunk at the line number its header names.
        while len(old_lines) < h["old_start"] - 1:
            old_lines.append(f"# filler {len(old_lines)}")
        old_lines += [line[1:] for line in h["body"] if line[:1] in (" ", "-")]
    (tmp_path / "pretrain_gpt.py").write_text("\n".join(old_lines) + "\n")
    result = subprocess.run(
        ["patch", "-p1", "--dry-run", "-d", str(tmp_path), "-i", str(PATCH)],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_patch_applies_to_a_megatron_lm_checkout(tmp_path):
    """Where a Megatron-LM checkout is at hand (``MEGATRON_LM_DIR``): the patch script applies
    to a copy of its ``pretrain_gpt.py``, a second run is a no-op, and the result parses."""
    import os
    import shutil

    checkout = os.environ.get("MEGATRON_LM_DIR")
    if not checkout:
        pytest.skip("set MEGATRON_LM_DIR to a Megatron-LM checkout to run this")
    shutil.copy(Path(checkout) / "pretrain_gpt.py", tmp_path / "pretrain_gpt.py")
    script = str(ROOT / "scripts" / "apply_patch.sh")
    first = subprocess.run(["bash", script, str(tmp_path)], capture_output=True, text=True)
    assert first.returncode == 0, first.stderr
    second = subprocess.run(["bash", script, str(tmp_path)], capture_output=True, text=True)
    assert second.returncode == 0 and "already patched" in second.stdout
    ast.parse((tmp_path / "pretrain_gpt.py").read_text())


# --- the operations files the patched script is launched with ------------------------------


def _yaml_to_args():
    import importlib.util

    spec = importlib.util.spec_from_file_location("yaml_to_args", ROOT / "scripts/yaml_to_args.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("cluster", ["zeppelin-A", "zeppelin-B", "zeppelin-C", "dgx-h100"])
def test_cluster_configs_are_flags_the_plugin_accepts(cluster):
    import argparse

    from megatron_zeppelin.config import ZeppelinConfig
    from megatron_zeppelin.topology.presets import PRESETS

    tool = _yaml_to_args()
    argv = tool.to_argv(tool.load_flags([str(ROOT / f"configs/clusters/{cluster}.yaml")]))
    parser = argparse.ArgumentParser()
    ZeppelinConfig.add_arguments(parser)
    args = parser.parse_args(argv)  # every flag is one of ours, with a valid value
    config = ZeppelinConfig.from_args(args)
    assert config.enabled and config.topology == cluster and cluster in PRESETS


@pytest.mark.parametrize("name", ["llama-3b", "llama-7b", "llama-13b", "llama-30b"])
def test_model_configs_match_the_cost_model_presets(name):
    from megatron_zeppelin.planner.cost.models import get_model

    flags = _yaml_to_args().load_flags([str(ROOT / f"configs/models/{name}.yaml")])
    model = get_model(name)
    assert flags["num-layers"] == model.num_layers
    assert flags["hidden-size"] == model.hidden_size
    assert flags["num-attention-heads"] == model.num_heads
    assert flags["ffn-hidden-size"] == model.ffn_hidden_size
    assert flags["context-parallel-size"] == 1  # Zeppelin replaces Megatron's CP
    assert model.num_heads % flags["tensor-model-parallel-size"] == 0


def test_yaml_to_args_merges_in_order_and_maps_booleans(tmp_path):
    tool = _yaml_to_args()
    (tmp_path / "a.yaml").write_text("bf16: true\nfp16: false\nlr: 1.0e-4\nsplit: [9, 1]\n")
    (tmp_path / "b.yaml").write_text("lr: 2.0e-4\nseed: null\n")
    argv = tool.to_argv(tool.load_flags([str(tmp_path / "a.yaml"), str(tmp_path / "b.yaml")]))
    assert argv == ["--bf16", "--lr", "0.0002", "--split", "9", "1"]
    (tmp_path / "bad.yaml").write_text("- just\n- a list\n")
    with pytest.raises(ValueError, match="must be a mapping"):
        tool.load_flags([str(tmp_path / "bad.yaml")])


@pytest.mark.parametrize(
    "script",
    ["zeppelin_pretrain.sbatch", "zeppelin_torchrun.sbatch", "zeppelin_env.sh"],
)
def test_slurm_scripts_parse_and_set_the_nic_environment(script):
    path = ROOT / "scripts/slurm" / script
    assert subprocess.run(["bash", "-n", str(path)]).returncode == 0
    text = (ROOT / "scripts/slurm/zeppelin_env.sh").read_text() + path.read_text()
    for variable in (
        "NCCL_IB_HCA",
        "NCCL_SOCKET_IFNAME",
        "NCCL_NET_GDR_LEVEL",
        "NCCL_CROSS_NIC",
        "NCCL_IB_QPS_PER_CONNECTION",
        "CUDA_DEVICE_MAX_CONNECTIONS=1",
        "NCCL_IB_GID_INDEX",
        "scontrol show hostnames",
    ):
        assert variable in text, variable
