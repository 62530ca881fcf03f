"""
The plot train.py writes into a run's folder at the end (plot.png): what a first run shows at a glance.

    python -m support.plot runs/pocket-first        # (re)draw the plot of a finished or running run

Four panels over optimiser steps, from metrics.jsonl: the training reward (the format bonus is not in
it) with the solve rate, the answer rate (completions with an <answer> block), the KL to
the reference policy, and for methods with experts the routing: the entropy H of the attention over experts
and each expert's utilisation. Each curve is drawn as it was logged, point by point: a moving average would
hide a run of six steps. matplotlib is optional: without it, one line says so and nothing else happens.
"""
import json
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
    fig, axes = plt.subplots(1, 4 if routing else 3, figsize=(16 if routing else 12, 3.4))
    ax = axes[0]
    for key, label in (("reward", "reward"), ("solve_rate", "solve rate")):
        ax.plot(*series(rows, key), marker="o", label=label)
    ax.set_title("training reward (no format bonus)")
    ax.legend()
    axes[1].plot(*series(rows, "answer_rate"), marker="o")
    axes[1].set_title("answer rate (an <answer> block)")
    axes[1].set_ylim(-0.02, 1.02)
    axes[2].plot(*series(rows, "kl"), marker="o")
    axes[2].set_title("KL to the reference policy")
    if routing:
        draw_routing(axes[3], rows, folder)
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


def draw_routing(ax, rows, folder):
    """Each expert's utilisation (mean attention mass) and the entropy H, over steps."""
    steps = [r["step"] for r in rows if r.get("utilization")]
    used = [r["utilization"] for r in rows if r.get("utilization")]
    names = next((r["utilization_names"] for r in rows if r.get("utilization_names")), None)
    names = names or expert_names(folder, len(used[0]))
    for i in range(len(used[0])):
        label = names[i] if names else f"expert {i}"
        ax.plot(steps, [u[i] for u in used], marker=".", label=label)
    ax.plot(*series(rows, "entropy"), marker="o", color="black", label="entropy H (nats)")
    ax.set_title("routing over experts")
    ax.legend(fontsize=7)


if __name__ == "__main__":
    for run in sys.argv[1:] or ["."]:
        print(plot_run(run))
