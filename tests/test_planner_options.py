"""One path from settings to planner options: ``--zeppelin-*`` flags in training and the
``zeppelin plan`` flags give the same ``PlannerOptions`` (tier: pure)."""

from __future__ import annotations

import argparse
import itertools
from dataclasses import replace

import pytest

from megatron_zeppelin.commands import plan as plan_command
from megatron_zeppelin.config import NEVER_SPLIT, ZeppelinConfig
from megatron_zeppelin.planner.cost.costmodel import CostModel
from megatron_zeppelin.planner.cost.models import get_model
from megatron_zeppelin.planner.cost.thresholds import tier_thresholds
from megatron_zeppelin.topology.presets import get_topology

pytestmark = pytest.mark.pure

COST = CostModel.default(get_model("llama-7b"), get_topology("dgx-h100", num_nodes=4))
AUTO = tier_thresholds(COST)  # (4940, 49768)
VALUES = ("auto", "off", "500", "20000", "100000")


def _cli(intra: str, inter: str, **flags: object) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    plan_command.add_planner_arguments(parser)
    args = parser.parse_args(["--intra-threshold", intra, "--inter-threshold", inter])
    for key, value in flags.items():
        setattr(args, key, value)
    return args


@pytest.mark.parametrize("intra, inter", list(itertools.product(VALUES, VALUES)))
def test_training_flags_and_the_plan_command_give_the_same_options(intra, inter) -> None:
    config = ZeppelinConfig(intra_threshold=intra, inter_threshold=inter)
    try:
        config.validate()
    except ValueError:
        with pytest.raises(ValueError, match="below"):
            plan_command.planner_options(_cli(intra, inter), COST)
        return
    ours = config.planner_options(COST)
    assert plan_command.planner_options(_cli(intra, inter), COST) == ours
    if ours.thresholds != "auto" and ours.allow_split:
        low, high = ours.thresholds
        assert low <= high
        # A token count given on the command line is kept as given.
        for given, got in ((intra, low), (inter, high)):
            if given.isdigit():
                assert got == int(given)
        # An automatic threshold keeps the cost model's value unless it must move for the
        # explicit one; 'off' is the one "never" constant.
        if intra == "auto" and low != AUTO[0]:
            assert low == high == int(inter)
        if inter == "auto" and high != AUTO[1]:
            assert high == low == int(intra)
        if inter == "off":
            assert high == NEVER_SPLIT


def test_both_off_turns_balance_splitting_off_and_switches_travel() -> None:
    config = ZeppelinConfig(intra_threshold="off", inter_threshold="off", routing=False)
    options = config.planner_options(COST)
    assert not options.allow_split and not options.routing and options.remap
    cli = plan_command.planner_options(_cli("off", "off", no_routing=True), COST)
    assert cli == options
    cli = plan_command.planner_options(
        _cli("auto", "auto", no_remap=True, no_split=True, linear_layout="even"), COST
    )
    assert (cli.remap, cli.allow_split, cli.linear_layout) == (False, False, "even")


def test_explicit_inter_below_the_automatic_intra_pulls_intra_down() -> None:
    # The user's 1000 stays; the automatic intra threshold (4940) comes down to it.
    options = ZeppelinConfig(inter_threshold="1000").planner_options(COST)
    assert options.thresholds == (1000, 1000)
    options = ZeppelinConfig(intra_threshold="60000").planner_options(COST)
    assert options.thresholds == (60000, 60000)


def test_the_two_d_switch_reaches_the_planner_from_the_training_flag() -> None:
    parser = argparse.ArgumentParser()
    ZeppelinConfig.add_arguments(parser)
    on = ZeppelinConfig.from_args(parser.parse_args(["--zeppelin"]))
    off = ZeppelinConfig.from_args(parser.parse_args(["--zeppelin", "--zeppelin-no-two-d"]))
    assert on.planner_options(COST).two_d and not off.planner_options(COST).two_d
    # The plan command's --no-2d wins over the config it builds.
    assert not on.planner_options(COST, two_d=False).two_d


def test_the_pool_switch_reaches_the_planner_from_the_training_flag_and_the_cli() -> None:
    parser = argparse.ArgumentParser()
    ZeppelinConfig.add_arguments(parser)
    on = ZeppelinConfig.from_args(parser.parse_args(["--zeppelin"]))
    off = ZeppelinConfig.from_args(parser.parse_args(["--zeppelin", "--zeppelin-no-pool"]))
    assert on.planner_options(COST).pool and not off.planner_options(COST).pool
    # Every threshold path keeps it.
    assert not replace(off, intra_threshold="off", inter_threshold="off").planner_options(COST).pool
    assert not replace(off, inter_threshold="1000").planner_options(COST).pool
    assert not on.planner_options(COST, pool=False).pool
    assert plan_command.planner_options(_cli("auto", "auto"), COST).pool
    assert not plan_command.planner_options(_cli("auto", "auto", no_pool=True), COST).pool
