"""Charts for plans and comparisons (matplotlib, an optional extra: ``pip install .[viz]``).

matplotlib is imported only when a chart is drawn, with the non-interactive Agg backend, so
importing this module does not need it and a machine without a display can still write PNG files.
"""

from __future__ import annotations

from collections import defaultdict

from megatron_zeppelin.planner.plan.schedule import ring_schedule
from megatron_zeppelin.planner.simulate.simulator import remap_matrix, two_d_forward_messages


def _pyplot():
    try:
        # lazy: matplotlib is optional (the viz extra), needed only for --plot.
        import matplotlib
    except ImportError:
        raise ValueError(
            "charts need matplotlib: pip install 'megatron-zeppelin[viz]' or drop --plot"
        ) from None
    matplotlib.use("Agg")
    # lazy: pyplot only after the backend is chosen.
    import matplotlib.pyplot as plt

    return plt


def rank_bytes(plan, cost_model) -> dict[str, list[int]]:
    """Bytes each rank sends per layer (forward), by link class: ring K/V (2-D documents' head
    all-to-alls included) and remapping."""
    topo = plan.topology
    sent: dict[str, list[int]] = defaultdict(lambda: [0] * plan.world_size)
    kv = cost_model.model.kv_bytes_per_token()
    # Flat rings, then the 2-D documents' head all-to-alls and rings across nodes.
    messages = [(step, kv) for step in ring_schedule(plan)]
    messages += two_d_forward_messages(plan, cost_model)
    for step, per_token in messages:
        for msg in step:
            kind = "nvlink" if topo.same_node(msg.src, msg.dst) else "nic"
            sent[kind][msg.src] += msg.num_tokens * per_token
    per_token = cost_model.remap_bytes(1)
    for (src, _dst), n in remap_matrix(plan).items():
        sent["remap"][src] += n * per_token
    for kind in ("nvlink", "nic", "remap"):
        sent[kind]  # every class present, zeros included
    return dict(sent)


def plot_plan_load(plan, result, cost_model, path: str) -> None:
    """Per rank: attention and linear compute (stacked), exposed communication and idle time,
    and the bytes it sends per layer by link class."""
    plt = _pyplot()
    ranks = list(range(plan.world_size))
    ms = 1e3
    linear = [r.linear_s * ms for r in result.per_rank]
    attention = [r.attention_s * ms for r in result.per_rank]
    exposed = [r.comm_exposed_s * ms for r in result.per_rank]
    idle = [r.idle_s * ms for r in result.per_rank]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(max(6, 0.25 * len(ranks) + 3), 7), sharex=True)
    top.bar(ranks, linear, label="linear", color="#4c72b0")
    top.bar(ranks, attention, bottom=linear, label="attention", color="#dd8452")
    base = [a + b for a, b in zip(linear, attention)]
    top.bar(ranks, exposed, bottom=base, label="exposed comm", color="#c44e52")
    base = [a + b for a, b in zip(base, exposed)]
    top.bar(ranks, idle, bottom=base, label="idle", color="#cccccc")
    top.axhline(result.lower_bound_s * ms, color="black", linestyle="--", label="lower bound")
    top.set_ylabel("ms per step")
    top.set_title(
        f"{plan.name}: step {result.step_time_s * ms:.1f} ms, efficiency {result.efficiency:.2f}"
    )
    top.set_ylim(0, 1.3 * max(max(base) + max(idle), result.lower_bound_s * ms))  # room for legend
    top.legend(fontsize="small", ncol=5, loc="upper left")
    sent = rank_bytes(plan, cost_model)
    width = 0.28
    for i, (kind, color) in enumerate(
        (("nvlink", "#55a868"), ("nic", "#8172b3"), ("remap", "#937860"))
    ):
        bottom.bar(
            [r + (i - 1) * width for r in ranks],
            [b / 1e6 for b in sent[kind]],
            width=width,
            label=kind,
            color=color,
        )
    bottom.set_ylabel("MB sent per layer (fwd)")
    bottom.set_xlabel("rank")
    bottom.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_comparison(rows: list[dict], path: str) -> None:
    """Mean step time per builder with the batch's lower bound and the speedup over TE CP."""
    plt = _pyplot()
    rows = [r for r in rows if "error" not in r]
    if not rows:
        raise ValueError("no builder could plan these batches: nothing to chart")
    names = [r["builder"] for r in rows]
    steps = [r["step_time_s"] * 1e3 for r in rows]
    fig, ax = plt.subplots(figsize=(1.3 * len(rows) + 2, 4))
    colors = ["#dd8452" if n == "zeppelin" else "#4c72b0" for n in names]
    bars = ax.bar(names, steps, color=colors)
    ax.axhline(rows[0]["lower_bound_s"] * 1e3, color="black", linestyle="--", label="lower bound")
    for bar, row in zip(bars, rows):
        if row.get("speedup_vs_te"):
            ax.annotate(
                f"{row['speedup_vs_te']:.2f}x",
                (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                ha="center",
                va="bottom",
                fontsize="small",
            )
    ax.set_ylabel("step time, ms (speedup over te-ring-cp)")
    ax.tick_params(axis="x", rotation=20)
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
