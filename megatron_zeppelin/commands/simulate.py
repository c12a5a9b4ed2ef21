"""``zeppelin simulate`` (one builder) and ``zeppelin compare`` (Zeppelin against every baseline).

Examples::

    zeppelin simulate --topology zeppelin-A --nodes 4 --dist prolong --tokens 524288 --steps 4
    zeppelin simulate --plan plan.json --model llama-7b
    zeppelin compare --topology zeppelin-C --nodes 4 --dist wikipedia --tokens 1048576 \\
        --capacity 32768 --model llama-7b --steps 5 --plot compare.png --json compare.json

Every builder plans the same batches (``--steps`` batches drawn with seeds ``seed, seed+1, ...``)
and the simulator times them. Speedups are ratios of mean step times. ``compare`` prices every
system twice: with the same cost model for all ("same kernel": the method alone), and "as
deployed", each system with the attention curve of the kernel it runs
(``planner/baselines/kernel_curves.py``: Zeppelin the fastest kernel the calibration measured, TE
ring CP and Megatron's dynamic CP TransformerEngine's fused attention, or its stand-in). Without a
calibration the two coincide. TE ring CP, the all-gather CP and hybrid DP run, in each column,
at the static CP size that is fastest on each batch (``compare_static.py``): "vs TE" is against
the best static TE ring CP; the rows marked "(rule)" keep each at its default rule.
``compare_batches`` and ``summarize`` are the library form, used by ``scripts/compare_sweep.py``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Sequence
from types import SimpleNamespace

from tqdm import tqdm

from megatron_zeppelin.commands.compare_static import (
    RULE_SUFFIX,
    StaticChoice,
    best_static,
    cp_label,
    mean_step,
    rule_name,
)
from megatron_zeppelin.commands.plan import (
    add_input_arguments,
    add_planner_arguments,
    capacity_for,
    cost_sources_line,
    planner_options,
    read_batches,
    read_cost_model,
    read_topology,
    summary_lines,
    zeppelin_plan,
)
from megatron_zeppelin.fileio import format_bytes
from megatron_zeppelin.planner.baselines.baselines import BASELINES, build_baseline
from megatron_zeppelin.planner.baselines.kernel_curves import Deployment, deployed
from megatron_zeppelin.planner.cost.calibration import load_calibration
from megatron_zeppelin.planner.plan.plan import Plan
from megatron_zeppelin.planner.search.partition import collector_paused
from megatron_zeppelin.planner.simulate.simulator import simulate_rounds
from megatron_zeppelin.viz import plot_comparison

ZEPPELIN = "zeppelin"
TE_RING_CP = "te-ring-cp"
MEGATRON = "megatron-dynamic-cp"


def builder_names() -> tuple[str, ...]:
    return (ZEPPELIN, *BASELINES)


def build_plans(
    name: str,
    lengths: list[int],
    *,
    topology,
    cost_model,
    capacity: int,
    options=None,
    cp_size: int | None = None,
) -> list:
    """The plans (one per round) of builder ``name`` for one batch; ``cp_size``: a static CP
    baseline's size (default: its rule, ``baselines.rule_cp_size``)."""
    if name == ZEPPELIN:
        return [
            zeppelin_plan(
                lengths,
                topology=topology,
                cost_model=cost_model,
                capacity=capacity,
                options=options,
            )
        ]

    return build_baseline(
        name, lengths, topology=topology, capacity=capacity, cost_model=cost_model, cp_size=cp_size
    )


def compare_batches(
    batches: Sequence[list[int]],
    *,
    topology,
    cost_model,
    capacity: int,
    builders: Sequence[str] | None = None,
    options=None,
    remap: bool = True,
    on_result: Callable[[int, str, float, object], None] | None = None,
    cost_models: dict | None = None,
    cp_sizes: dict[str, int] | None = None,
) -> dict[str, list]:
    """Per builder, one ``SimResult`` per batch, or the ``ValueError`` text where it could not
    plan the batch (a baseline's capacity rule, say). ``on_result(batch, builder, seconds,
    outcome)`` is called after each builder has planned and simulated a batch. ``cost_models``
    (builder -> cost model) prices a builder with its own model, else ``cost_model``;
    ``cp_sizes`` (builder -> CP size) sets a static CP baseline's size, else its rule's."""
    builders = tuple(builders or builder_names())
    results: dict[str, list] = {name: [] for name in builders}
    for index, lengths in enumerate(batches):
        for name in builders:
            cost = (cost_models or {}).get(name, cost_model)
            start = time.perf_counter()
            try:
                with collector_paused():
                    plans = build_plans(
                        name,
                        lengths,
                        topology=topology,
                        cost_model=cost,
                        capacity=capacity,
                        options=options,
                        cp_size=(cp_sizes or {}).get(name),
                    )
                    # Baselines have no remapping to switch off; Zeppelin's follows ``remap``.
                    results[name].append(simulate_rounds(plans, cost, remap=remap))
                    # Freed while the collector is off: it would otherwise walk them all once.
                    del plans
            except ValueError as exc:
                results[name].append(str(exc))
            if on_result is not None:
                on_result(index, name, time.perf_counter() - start, results[name][-1])
    return results


def summarize(
    results: dict[str, list], choices: dict[str, StaticChoice] | None = None
) -> list[dict]:
    """One row per builder: mean step time, speedups, efficiency, bytes, rounds; with
    ``choices`` (of ``best_static``) the CP size of each static CP baseline ("rule" on the rows
    of its default rule). "vs TE" is against ``results[TE_RING_CP]`` (its best static size
    where ``best_static`` ran), "vs TE rule" against the rule's."""
    te, megatron = mean_step(results.get(TE_RING_CP, [])), mean_step(results.get(MEGATRON, []))
    te_rule = mean_step(results.get(rule_name(TE_RING_CP), []))
    rows = []
    for name, runs in results.items():
        errors = [r for r in runs if isinstance(r, str)]
        if errors:
            rows.append({"builder": name, "error": errors[0]})
            continue
        step = mean_step(runs)
        bound = sum(r.lower_bound_s for r in runs) / len(runs)
        link: dict[str, float] = {}
        for r in runs:
            for k, v in r.link_bytes.items():
                if ":" not in k:
                    link[k] = link.get(k, 0.0) + v / len(runs)
        rows.append(
            {
                "builder": name,
                "step_time_s": step,
                "lower_bound_s": bound,
                "efficiency": bound / step,
                "speedup_vs_te": te / step if te else None,
                "speedup_vs_te_rule": te_rule / step if te_rule else None,
                "cp_size": _cp_label(name, choices or {}),
                "speedup_vs_megatron": megatron / step if megatron else None,
                "mfu": sum(r.mfu for r in runs) / len(runs),
                "rounds": sum(r.num_rounds for r in runs) / len(runs),
                "link_bytes": link,
                "step_times_s": [r.step_time_s for r in runs],
            }
        )
    return rows


def _cp_label(name: str, choices: dict[str, StaticChoice]) -> str | None:
    """A static CP baseline's size: its best static one (per batch where they differ), "rule"
    for its default rule's row."""
    if name in choices:
        return cp_label(choices[name])
    return "rule" if name.endswith(RULE_SUFFIX) else None


def format_table(rows: list[dict], deployed_rows: list[dict] | None = None) -> str:
    """The comparison as a plain-text table; with ``deployed_rows`` (the same builders priced
    as deployed) their kernel, CP size, step time and speedups in columns of their own. "CP" is
    a static CP baseline's size ("rule": its default rule's, batch by batch)."""

    def ratio(x: float | None) -> str:
        return f"{x:.2f}x" if x is not None else "-"

    def times(row: dict) -> str:
        step, cp = row.get("step_time_s"), row.get("cp_size")
        return (
            f"{cp if cp is not None else '':>8} "
            f"{step * 1e3 if step else float('nan'):9.1f} {ratio(row.get('speedup_vs_te')):>6} "
            f"{ratio(row.get('speedup_vs_megatron')):>8}"
        )

    two = deployed_rows is not None
    by_builder = {row["builder"]: row for row in deployed_rows or []}
    columns = f"{'CP':>8} {'step ms':>9} {'vs TE':>6} {'vs Mcore':>8}"
    header = f"{'builder':<26} {columns}"
    if two:
        header += f"  {'kernel':<11} {columns}"
    header += f" {'eff':>6} {'MFU':>6} {'rounds':>6}  {'NVLink/layer':>12} {'NIC/layer':>12}"
    lines = [header, "-" * len(header)]
    if two:
        width = len(columns)
        lines.insert(0, f"{'':26} {'same kernel':^{width}}  {'as deployed':^{width + 12}}".rstrip())
    for row in rows:
        if "error" in row:
            lines.append(f"{row['builder']:<26} cannot plan: {row['error']}")
            continue
        line = f"{row['builder']:<26} {times(row)}"
        if two:
            other = by_builder.get(row["builder"], {})
            line += f"  {other.get('kernel') or '-':<11} {times(other)}"
        link = row["link_bytes"]
        lines.append(
            f"{line} {row['efficiency']:6.3f} {row['mfu']:6.3f} {row['rounds']:6.2f}  "
            f"{format_bytes(link.get('nvlink', 0)):>12} {format_bytes(link.get('nic', 0)):>12}"
        )
    if any(row.get("cp_size") == "rule" for row in rows):
        lines.append(
            "CP: the fastest static CP size for each batch (one size per batch where they "
            'differ); "(rule)": the default rule, the smallest group holding the batch\'s longest '
            "document; vs TE: against TE ring CP at its best static size"
        )
    return "\n".join(lines)


def _progress(total: int, quiet: bool):
    return tqdm(
        total=total,
        file=sys.stderr,
        disable=quiet or not sys.stderr.isatty(),
        unit="plan",
        leave=False,
    )


def _reporter(bar, num_batches: int, quiet: bool) -> Callable[[int, str, float, object], None]:
    """Advance the progress bar on a terminal; elsewhere (a log, CI) write one line per builder
    and batch, so a long comparison shows where it is."""
    lines = not quiet and not sys.stderr.isatty()

    def report(batch: int, builder: str, seconds: float, outcome: object) -> None:
        bar.update()
        if lines:
            what = (
                f"efficiency {outcome.efficiency:.3f}"
                if hasattr(outcome, "efficiency")
                else "cannot plan"
            )
            print(
                f"batch {batch + 1}/{num_batches}: {builder} planned and simulated in "
                f"{seconds:.1f} s, {what}",
                file=sys.stderr,
                flush=True,
            )

    return report


# --- zeppelin compare --------------------------------------------------------------------------
def _add_compare_arguments(parser: argparse.ArgumentParser) -> None:
    add_input_arguments(parser)
    add_planner_arguments(parser)
    parser.add_argument("--steps", type=int, default=3, help="batches (one per seed)")
    parser.add_argument(
        "--builders",
        default=None,
        help="comma-separated builders (default: zeppelin and "
        "every baseline: te-ring-cp, llama3-allgather-cp, hybrid-dp, megatron-dynamic-cp, flexsp)",
    )
    parser.add_argument("--json", metavar="OUT", help="write the rows and per-step results")
    parser.add_argument("--plot", metavar="PNG", help="bar chart of step times")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


def _run_compare(args: argparse.Namespace) -> int:
    if args.steps < 1:
        raise ValueError(f"--steps must be at least 1, got {args.steps}")
    builders = builder_names()
    if args.builders:
        builders = tuple(b.strip() for b in args.builders.split(",") if b.strip())
        unknown = sorted(set(builders) - set(builder_names()))
        if unknown:
            raise ValueError(
                f"unknown builders {unknown}; choose from {', '.join(builder_names())}"
            )
    topology = read_topology(args)
    cost = read_cost_model(args, topology)
    batches = read_batches(args, args.steps)
    capacity = capacity_for(args, batches, topology)
    options = planner_options(args, cost)
    cal = load_calibration(args.cost_model) if args.cost_model else None
    deployment = deployed(cost, cal, source=args.cost_model or "")
    priced = {b: deployment.cost_model(b, cost) for b in builders}
    # Builders priced as deployed with the same figures are not planned twice.
    again = [b for b in builders if priced[b] != cost]
    total = len(batches) * (len(builders) + len(again))
    with _progress(total, args.quiet) as bar:
        report = _reporter(bar, len(batches), args.quiet)
        common = dict(
            topology=topology, capacity=capacity, options=options, remap=not args.no_remap
        )

        def run(names: Sequence[str], models: dict | None, sizes: dict | None = None) -> dict:
            return compare_batches(
                batches, cost_model=cost, builders=names, on_result=report, cost_models=models,
                cp_sizes=sizes, **common,
            )  # fmt: skip

        def best(found: dict, models: dict | None) -> tuple[dict, dict]:
            def price(name: str, size: int) -> list:
                return run((name,), models, {name: size})[name]

            return best_static(batches, found, price, topology=topology, capacity=capacity)

        results, choices = best(run(builders, None), None)
        retimed, deployed_choices = best(run(again, priced), priced) if again else ({}, {})
    rows = summarize(results, choices)
    deployed_rows = _deployed_rows(
        {**results, **retimed}, deployment, {**choices, **deployed_choices}
    )
    tokens = sum(len(b) for b in batches) / len(batches)
    print(
        f"{args.steps} batches of {sum(batches[0])} tokens (~{tokens:.0f} documents), "
        f"{cost.model.name} on {topology.world_size} GPUs ({topology.name}), "
        f"capacity {capacity} tokens/GPU"
    )
    print(cost_sources_line(cost))
    print("\n".join(_deployment_lines(deployment)))
    print(format_table(rows, deployed_rows))
    if args.json:
        payload = {
            "rows": rows,
            "as_deployed": {
                "rows": deployed_rows,
                "kernels": {b: deployment.kernel(b) for b in builders},
                "notes": {b: p.note for b, p in deployment.builders.items()},
                "unpriced": deployment.unpriced,
                "static_cp": _static_json(deployed_choices or choices),
            },
            "static_cp": _static_json(choices),
            "capacity": capacity,
            "topology": topology.to_dict(),
            "model": cost.model.name,
            "cost_sources": cost.sources,
            "results": {
                k: [r if isinstance(r, str) else r.to_dict() for r in v] for k, v in results.items()
            },
        }
        with open(args.json, "w") as f:
            json.dump(payload, f, indent=1)
    if args.plot:
        plot_comparison(rows, args.plot)
    if all("error" in row for row in rows):
        raise ValueError(
            "no builder could plan these batches (see the table): raise --capacity or add GPUs"
        )
    return 0


def _static_json(choices: dict[str, StaticChoice]) -> dict:
    """Per static CP baseline, the size kept and the step time of every size priced, per batch,
    and the sizes not priced."""
    return {
        name: {
            "cp_size_per_batch": list(c.sizes),
            "step_time_s_by_cp_size": [{str(k): v for k, v in t.items()} for t in c.step_times],
            "not_priced": list(c.skipped),
        }
        for name, c in choices.items()
    }


def _deployed_rows(
    results: dict[str, list], deployment: Deployment, choices: dict[str, StaticChoice]
) -> list[dict]:
    """``summarize`` of the builders priced as deployed, each with the kernel it runs."""
    rows = summarize(results, choices)
    for row in rows:
        row["kernel"] = deployment.kernel(row["builder"].removesuffix(RULE_SUFFIX))
    return rows


def _deployment_lines(deployment: Deployment) -> list[str]:
    """What "as deployed" prices each system with, and where each curve comes from."""
    if not deployment.builders:
        return [f"as deployed: {deployment.unpriced} (the two columns agree)"]
    by_kernel: dict[tuple[str, str], list[str]] = {}
    for builder, priced in deployment.builders.items():
        by_kernel.setdefault((priced.kernel, priced.note), []).append(builder)
    lines = ["same kernel: every system priced with the cost model above; as deployed:"]
    lines += [f"  {', '.join(b)} run {kernel}: {note}" for (kernel, note), b in by_kernel.items()]
    if deployment.unpriced:
        lines.append(f"  {deployment.unpriced}")
    return lines


compare = SimpleNamespace(add_arguments=_add_compare_arguments, run=_run_compare)
"""The ``zeppelin compare`` subcommand (``add_arguments``, ``run``)."""


# --- zeppelin simulate -------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_input_arguments(parser)
    add_planner_arguments(parser)
    parser.add_argument("--builder", default=ZEPPELIN, help="zeppelin or a baseline's name")
    parser.add_argument("--plan", metavar="FILE", help="simulate a saved plan file instead")
    parser.add_argument("--steps", type=int, default=1, help="batches (one per seed)")
    parser.add_argument(
        "--routing",
        choices=("auto", "on", "off"),
        default="auto",
        help="time inter-node messages over the plan's routes (auto: when it has any)",
    )
    parser.add_argument("--json", metavar="OUT", help="write the simulation results")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    routing = {"auto": None, "on": True, "off": False}[args.routing]
    remap = not args.no_remap
    if args.steps < 1:
        raise ValueError(f"--steps must be at least 1, got {args.steps}")
    if args.plan:
        _check_plan_alone(args)
        plan = Plan.from_json(args.plan)
        cost = read_cost_model(args, plan.topology)
        result = simulate_rounds([plan], cost, routing=routing, remap=remap)
        print("\n".join(summary_lines(plan, result, cost)))
        outcomes = [result]
    else:
        if args.builder not in builder_names():
            raise ValueError(
                f"unknown builder {args.builder!r}; choose from {', '.join(builder_names())}"
            )
        topology = read_topology(args)
        cost = read_cost_model(args, topology)
        batches = read_batches(args, args.steps)
        capacity = capacity_for(args, batches, topology)
        options = planner_options(args, cost)
        outcomes = []
        with _progress(len(batches), args.quiet) as bar:
            for step, lengths in enumerate(batches):
                plans = build_plans(
                    args.builder,
                    lengths,
                    topology=topology,
                    cost_model=cost,
                    capacity=capacity,
                    options=options,
                )
                result = simulate_rounds(plans, cost, routing=routing, remap=remap)
                outcomes.append(result)
                bar.update()
                if step == 0:
                    print("\n".join(summary_lines(plans[0], result, cost)))
                    if len(plans) > 1:
                        print(f"  ({len(plans)} rounds; the lines above describe the first)")
        mean = sum(r.step_time_s for r in outcomes) / len(outcomes)
        bound = sum(r.lower_bound_s for r in outcomes) / len(outcomes)
        print(
            f"{args.builder}: mean step {mean * 1e3:.1f} ms over {len(outcomes)} batches, "
            f"efficiency {bound / mean:.3f}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump([r.to_dict() for r in outcomes], f, indent=1)
    return 0


PLAN_FIXES = (
    "lengths", "dist", "tokens", "seed", "max_length", "builder", "steps", "capacity",
    "topology", "topology_file", "nodes", "gpus_per_node", "nics_per_node", "nic_gbit",
    "nvlink_gbps", "intra_threshold", "inter_threshold", "no_routing", "no_split", "no_2d",
    "linear_layout",
)  # fmt: skip
"""Flags a saved plan already fixes (its batch, cluster, builder and placement)."""


def _check_plan_alone(args: argparse.Namespace) -> None:
    """``--plan FILE`` simulates the saved plan: refuse flags it would silently ignore."""
    defaults = argparse.ArgumentParser()
    add_arguments(defaults)
    unset = vars(defaults.parse_args([]))
    given = [
        f"--{name.replace('_', '-')}" for name in PLAN_FIXES if getattr(args, name) != unset[name]
    ]
    if given:
        raise ValueError(
            f"--plan {args.plan} simulates a saved plan, which fixes the batch, the cluster and "
            f"the placement: drop {', '.join(given)} (or drop --plan to plan a new batch)"
        )
