"""
The plot train.py writes into a run's folder at the end (plot.png): what a first run shows at a glance.

    python -m support.harness.plot runs/pocket-first        # (re)draw the plot of a finished or running run

Panels over optimiser steps, from metrics.jsonl: the training reward (the format bonus is not in it)
with the solve rate (drawn on top of each other when the reward is exact: the dashed line is the
solve rate) and the validation score before and after training (validation.json, the stars); the
answer rate (completions with an <answer> block); the KL to the reference policy; and for methods
with experts, each expert's utilisation beside 1/n (uniform routing) on 0..1 and the entropy H of
the attention over experts beside log n (its largest value) on 0..log n. Each curve is drawn as it was logged, point
by point: a moving average would hide a run of six steps. matplotlib is optional: without it, one
line says so and nothing else happens.
"""
import json
import math
import os
import sys


def read_metrics(folder):
    with open(os.path.join(folder, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def series(rows, key):
    """(steps, values) of one metric, skipping the steps that do not have it (null or absent)."""
    pairs = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def plot_run(folder, name="plot.png"):
    """Draw folder/metrics.jsonl into folder/plot.png. Returns the path, or None (no matplotlib, no steps)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import MaxNLocator
    except ImportError:
        print("no plot: matplotlib is not installed (pip install matplotlib)", flush=True)
        return None
    rows = read_metrics(folder)
    if not rows:
        return None
    routing = any(r.get("utilization") for r in rows)
    fig, axes = plt.subplots(1, 5 if routing else 3, figsize=(20 if routing else 12, 3.4))
    ax = axes[0]
    ax.plot(*series(rows, "reward"), marker="o", lw=3, alpha=0.5, label="reward")
    ax.plot(*series(rows, "solve_rate"), marker="x", ls="--", color="black", label="solve rate")
    validation = read_validation(folder)
    if validation:
        last = rows[-1]["step"]
        for x, key, color in ((0, "before", "tab:gray"), (last, "after", "tab:red")):
            score = sum(validation[key]) / len(validation[key])
            ax.plot([x], [score], marker="*", ms=14, color=color, ls="none",
                    label=f"validation {key}: {100 * score:.1f} %")
    ax.set_title("training reward (no format bonus)")
    ax.legend(fontsize=7)
    axes[1].plot(*series(rows, "answer_rate"), marker="o")
    axes[1].set_title("answer rate (an <answer> block)")
    axes[1].set_ylim(-0.02, 1.02)
    axes[2].plot(*series(rows, "kl"), marker="o")
    axes[2].set_title("KL to the reference policy")
    if routing:
        draw_routing(axes[3], axes[4], rows, folder)
    for ax in axes:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.suptitle(os.path.basename(os.path.abspath(folder)))
    fig.tight_layout()
    path = os.path.join(folder, name)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def expert_names(folder, n):
    """The team's experts from config.json, when they are the n columns of the utilisation."""
    try:
        with open(os.path.join(folder, "config.json")) as f:
            experts = json.load(f)["team_models"]["experts"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return experts if len(experts) == n else None


def read_validation(folder):
    """validation.json's per-item scores {"before": [...], "after": [...]}, or None before the run ends."""
    try:
        with open(os.path.join(folder, "validation.json")) as f:
            v = json.load(f)
    except (OSError, ValueError):
        return None
    return v if v.get("before") and v.get("after") else None


def draw_routing(ax_use, ax_h, rows, folder):
    """Each expert's utilisation (mean attention mass) beside 1/n, and the entropy H beside log n."""
    steps = [r["step"] for r in rows if r.get("utilization")]
    used = [r["utilization"] for r in rows if r.get("utilization")]
    n = len(used[0])
    names = next((r["utilization_names"] for r in rows if r.get("utilization_names")), None)
    names = names or expert_names(folder, n)
    for i in range(n):
        ax_use.plot(steps, [u[i] for u in used], marker=".", label=names[i] if names else f"expert {i}")
    ax_use.axhline(1 / n, color="gray", ls=":", label=f"1/n = {1 / n:.3f} (uniform)")
    ax_use.set_title("utilisation of each expert")
    ax_use.legend(fontsize=7)
    ax_h.plot(*series(rows, "entropy"), marker="o", color="black", label="entropy H")
    ax_h.axhline(math.log(n), color="gray", ls=":", label=f"log n = {math.log(n):.3f} (uniform)")
    ax_h.set_title("routing entropy H (nats)")
    # each on its whole range: zoomed onto the data, a drift of 0.001 under log n would fill the panel like a swing
    ax_use.set_ylim(-0.02, 1.02)
    ax_h.set_ylim(-0.02 * math.log(n), 1.02 * math.log(n))
    ax_h.legend(fontsize=7)


if __name__ == "__main__":
    for run in sys.argv[1:] or ["."]:
        print(plot_run(run))
