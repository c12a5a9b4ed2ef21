"""Plans shared from one rank per node (``megatron/plans/shared_plans.py``, ``comm/plan_share.py``):
ranks that receive the plan train exactly as one process does, the CPU job trains the same with
plans shared or each rank planning its own, and a planner process that dies fails every rank's
micro-batches with one line naming it, never a hang. Tier: dist (gloo processes, each starting
planner processes); 2 emulated nodes x 2 GPUs, so ranks 0 and 2 plan and ranks 1 and 3 receive.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from megatron_zeppelin.job.check import CheckOptions, run_check
from megatron_zeppelin.launch.ranks import run_distributed

pytestmark = pytest.mark.dist

TIMEOUT = 120  # seconds any plan may take on a loaded CI machine


def test_ranks_that_receive_the_plan_train_as_one_process() -> None:
    """The check with the plan made by its owner's planner process (rank 0, the first of node 0)
    and received by the others: loss and every gradient equal the single-process reference."""
    report = run_check(
        CheckOptions(tensor_parallels=(1,), sequence_parallel=False, share_plans=True)
    )
    run = report["runs"]["tp1"]
    assert report["passed"], (run["loss_rel_error"], run["max_grad_rel_error"])
    # Only the first rank of each node ran a planner process; ranks 1 and 3 planned nothing.
    assert run["planner_processes"] == [1, 0, 1, 0]
    assert all(n > 0 for n in run["plan"]["tiers"].values())


def _train_and_fail(rank: int, world_size: int, run_dir: str) -> dict:
    from megatron_zeppelin.job.train_cpu import build_parser, train

    common = [
        "--run-dir", run_dir, "--quiet", "--dataset-tokens", "30000", "--tokens-per-step",
        "2048", "--micro-batches", "2", "--zeppelin-capacity", "1024",
        "--zeppelin-max-document-length", "1024", "--zeppelin-intra-threshold", "96",
        "--zeppelin-inter-threshold", "384", "--steps", "3",
    ]  # fmt: skip
    shared = train(build_parser().parse_args(common))
    alone = train(build_parser().parse_args([*common, "--zeppelin-no-share-plans"]))
    return {"shared": shared, "alone": alone, "fault": _kill_a_planner(rank)}


def _kill_a_planner(rank: int) -> dict:
    """Four micro-batches planned by ranks 0, 2, 0, 2; rank 0's planner process is killed
    before it answers: every rank's answers, and how long they took."""
    import torch.distributed as dist

    from megatron_zeppelin.comm.plan_share import PlanShare
    from megatron_zeppelin.config import ZeppelinConfig
    from megatron_zeppelin.megatron.plans.plan_workers import PlanRecipe
    from megatron_zeppelin.megatron.plans.shared_plans import SharedPlanner
    from megatron_zeppelin.planner.baselines.distributions import sample_lengths
    from megatron_zeppelin.planner.cost.costmodel import CostModel
    from megatron_zeppelin.planner.cost.models import get_model
    from megatron_zeppelin.topology.model import Topology

    topology = Topology(num_nodes=2, gpus_per_node=2, nics_per_node=2)
    config = ZeppelinConfig(capacity=1 << 20)
    cost = CostModel.default(get_model("tiny"), topology)
    recipe = PlanRecipe(topology, cost, config, config.planner_options(cost))
    share = PlanShare.create(topology, [range(4)], timeout_s=TIMEOUT)
    planner = SharedPlanner(recipe, 1, share, lambda seconds: None)
    try:
        planner.wait_ready()
        batches = [list(sample_lengths("wlbllm", num_tokens=1 << 16, seed=s)) for s in range(4)]
        pids = planner.pids
        if rank == 0:
            os.kill(pids[0], signal.SIGKILL)
        dist.barrier()
        start = time.monotonic()
        futures = [planner.submit(lengths) for lengths in batches]
        answers = []
        for future in futures:
            try:
                answers.append(("plan", len(future.result(timeout=TIMEOUT).sequences)))
            except RuntimeError as exc:
                answers.append(("error", str(exc)))
        return {"answers": answers, "seconds": time.monotonic() - start, "pids": pids}
    finally:
        planner.close()


def test_shared_plans_train_alike_and_a_dead_planner_is_named_on_every_rank(tmp_path) -> None:
    results = run_distributed(_train_and_fail, 4, timeout_s=600, args=(str(tmp_path),))
    digests = [[p["digest"] for p in r["plans"]] for r in results[0]["alone"]["steps"]]
    for result in results:
        shared, alone = result["shared"], result["alone"]
        # The same plans, the same losses, to the last bit.
        assert [[p["digest"] for p in r["plans"]] for r in shared["steps"]] == digests
        assert [r["loss"] for r in shared["steps"]] == [r["loss"] for r in alone["steps"]]
        assert shared["summary"]["planning"]["num_plans"] == 6
    # Ranks 1 and 3 made no plan of their own when plans were shared.
    planned = [r["shared"]["summary"]["planning"]["planning_s"] for r in results]
    assert planned[1] == planned[3] == 0.0 and planned[0] > 0 and planned[2] > 0

    pid = results[0]["fault"]["pids"][0]
    for rank, result in enumerate(results):
        fault = result["fault"]
        assert fault["pids"] == ([pid] if rank == 0 else [] if rank % 2 else fault["pids"])
        kinds = [kind for kind, _ in fault["answers"]]
        # Rank 0's micro-batches fail alike everywhere; rank 2's still arrive.
        assert kinds == ["error", "plan", "error", "plan"], fault["answers"]
        for kind, message in fault["answers"]:
            if kind == "error":
                assert "\n" not in message
                assert message.startswith("on Zeppelin rank 0, planner process 0")
                assert f"pid {pid}" in message and "killed by signal 9" in message
        assert fault["seconds"] < TIMEOUT
