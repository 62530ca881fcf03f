"""
The figures of runs (matplotlib is optional: without it, one line says so and nothing else happens).

    python -m support.harness.plot runs/pocket-first        # (re)draw the plot of a finished or running run
    python evaluate.py --summarize runs/ --out results/     # the figures over a folder of runs (plot_runs)

plot_run, the plot train.py writes into a run's folder at the end (plot.png): what a first run shows at a glance.
Panels over optimiser steps, from metrics.jsonl: the training reward (the format bonus is not in it)
with the solve rate (drawn on top of each other when the reward is exact: the dashed line is the
solve rate) and the validation score before and after training (validation.json, the stars); the
answer rate (completions with an <answer> block); the KL to the reference policy; and for methods
with experts, each expert's utilisation beside 1/n (uniform routing) on 0..1 and the entropy H of
the attention over experts beside log n (its largest value) on 0..log n. Each curve is drawn as it was logged, point
by point: a moving average would hide a run of six steps.

plot_runs, the paper's figures over a folder of runs (read by support/harness/report.load_runs, which also makes
the table): Fig. 4 (utilisation per expert, entropy and reward over steps), Fig. 5 (with vs without context tokens),
Fig. 6 (accuracy vs number of latents m), and the training reward, the probes of C, the conductor's and RLAE's
signals per method; mean and band over seeds.

Try it on CPU:  python -m pytest tests/test_plot.py tests/test_baselines.py -q -k plot
"""
import json
import math
import os
import sys

import numpy as np

from support.harness.report import load_runs, method_key
from lib.stats import mean_std


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


# ----------------------------------------------------------------------------------------------------------
# The figures over a folder of runs (evaluate.py --summarize)


def plot_runs(folders, out):
    """Every figure for a folder of runs, read once: fig4_<task>_<team>.png (routing of `ours`), fig5.png (with
    vs without C), reward_<task>.png (training reward of every method), probes_<task>_<team>.png (what C
    does over training), conductor_<task>_<team>.png (parse rate, flat groups, reward, the first worker's
    share), rlae_weights_<task>_<team>.png (the agent's weights, task reward against coins), fig6.png (score
    vs m). Returns the paths written."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: pip install matplotlib to draw the figures", file=sys.stderr)
        return []
    os.makedirs(out, exist_ok=True)
    runs = load_runs(folders)
    written = []
    for draw in (fig4, fig5, reward_curves, probe_curves, conductor_curves, rlae_weight_curves, fig6):
        for name, fig in draw(runs, plt):
            path = os.path.join(out, name)
            fig.tight_layout(), fig.savefig(path, dpi=110), plt.close(fig)
            written.append(path)
    return written


def by_key(runs, key, keep=lambda run: True):
    groups = {}
    for run in runs:
        if keep(run):
            groups.setdefault(key(run), []).append(run)
    return sorted(groups.items())


def band(ax, x, Y, label=None, color=None, spread="std", style="-"):
    """Mean over seeds (rows of Y) and a band: +- std, or min-max."""
    mu = Y.mean(0)
    lo, hi = (mu - Y.std(0), mu + Y.std(0)) if spread == "std" else (Y.min(0), Y.max(0))
    ax.plot(x, mu, style, label=label, color=color)
    ax.fill_between(x, lo, hi, alpha=0.15, color=color)


def seed_series(runs, key, T):
    """(seeds, T) array of one metric; a list-valued metric gives (seeds, T, k), NaN where a step has none (a
    conductor step where no workflow parsed has no worker usage)."""
    k = next((len(m[key]) for run in runs for m in run["metrics"] if isinstance(m.get(key), list)), None)
    blank = np.nan if k is None else [np.nan] * k
    return np.array([[blank if r.get(key) is None else r[key] for r in run["metrics"][:T]] for run in runs],
                    dtype=float)


def fig4(runs, plt):
    """Paper Fig. 4: utilisation per expert (mean and band across seeds), entropy and reward of `ours` runs; the
    same for the conductor (each workflow's share of steps per worker) and RLAE (the ensemble weights)."""
    for (task, team, key), group in by_key(runs, lambda r: (r["cfg"]["task"], r["cfg"]["team"], method_key(r["cfg"])),
                                           lambda r: r["cfg"]["method"] in ("ours", "conductor", "rlae")
                                           and r["finished"] and any("utilization" in m for m in r["metrics"])):
        method = group[0]["cfg"]["method"]
        variant = key.partition("[")[1] + key.partition("[")[2]               # e.g. "[state-norm]", or ""
        T = min(len(r["metrics"]) for r in group)
        steps = np.arange(1, T + 1)
        U = seed_series(group, "utilization", T)                                   # (seeds, T, n)
        # conductor and RLAE log their own members (workers, ensemble members) by name
        names = next((m["utilization_names"] for m in group[0]["metrics"] if "utilization_names" in m),
                     group[0]["cfg"]["team_models"]["experts"] if method == "ours" else
                     [f"member {i}" for i in range(U.shape[-1])])
        fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(7, 7), sharex=True)
        for i, name in enumerate(names):
            band(ax1, steps, U[:, :, i], label=name)
        ax1.set_ylabel("utilisation u_i (Eq. 15)")
        ax1.set_title(f"{method} {variant} on {task} ({team} team, {len(group)} seed{'s' * (len(group) > 1)}; "
                      f"uniform routing: H = log {len(names)} = {np.log(len(names)):.4f})", fontsize=9)
        ax1.legend(fontsize=8)
        for key, ax, color in (("reward", ax2, "tab:green"), ("entropy", ax2.twinx(), "tab:purple")):
            band(ax, steps, seed_series(group, key, T), color=color)
            ax.set_ylabel("training reward" if key == "reward" else "routing entropy H", color=color)
            ax.ticklabel_format(axis="y", useOffset=False)
        ax2.set_xlabel("step")
        slug = "".join(c if c.isalnum() else "-" for c in variant).strip("-")
        yield f"fig4_{task}_{team}{'' if method == 'ours' else '_' + method}{'_' + slug if slug else ''}.png", fig


def zero_c_score(run):
    """The score with C = 0: from evaluate.py --no-context, or from the zero_C condition of --paired."""
    if "eval_no_context" in run:
        return run["eval_no_context"]["score"]
    return run.get("eval_paired", {}).get("conditions", {}).get("zero_C", {}).get("score")


def fig5(runs, plt):
    """Paper Fig. 5: validation score with C and with C = 0, per method; bar = mean over seeds, dots = seeds."""
    pairs = {k: [(r["eval"]["score"], zero_c_score(r)) for r in g]
             for k, g in by_key(runs, lambda r: method_key(r["cfg"]), lambda r: "eval" in r and zero_c_score(r) is not None)}
    if not pairs:
        return
    keys = sorted(pairs)
    fig, ax = plt.subplots(figsize=(max(5, len(keys) * 1.4), 4))
    for j, (label, dx) in enumerate((("with C", -0.2), ("C = 0", 0.2))):
        vals = [100 * np.array([p[j] for p in pairs[k]]) for k in keys]
        ax.bar(np.arange(len(keys)) + dx, [v.mean() for v in vals], 0.4, label=label, alpha=0.8)
        for x, v in enumerate(vals):
            ax.plot(np.full(len(v), x + dx), v, "k.", ms=4)
    ax.set_xticks(np.arange(len(keys)), [f"{k}\n({len(pairs[k])} seed{'s' * (len(pairs[k]) > 1)})" for k in keys],
                  fontsize=8)
    ax.set_ylabel("validation score (%)"), ax.set_title("Fig. 5: with vs without context tokens (dots: seeds)")
    ax.set_ylim(0, 1.3 * max(100 * max(p) for v in pairs.values() for p in v) + 1)  # room for the legend
    ax.legend(loc="upper center", ncol=2)
    yield "fig5.png", fig


def reward_curves(runs, plt):
    """Training reward over steps for every method (5-step moving average; mean and min-max band over seeds)."""
    for task, group in by_key(runs, lambda r: r["cfg"]["task"], lambda r: r["finished"]):
        fig, ax = plt.subplots(figsize=(7, 4))
        for key, seeds in by_key(group, lambda r: method_key(r["cfg"])):
            T = min(len(r["metrics"]) for r in seeds)
            k = min(5, T)
            Y = np.array([np.convolve(y, np.ones(k) / k, mode="valid") for y in seed_series(seeds, "reward", T)])
            band(ax, np.arange(k, T + 1), Y, label=f"{key} ({len(Y)})", spread="minmax")
        ax.set_xlabel("step"), ax.set_ylabel("training reward (5-step moving average)")
        ax.set_title(f"{task}: training reward per method (line: mean over seeds, band: min-max)", fontsize=9)
        ax.legend(fontsize=7)
        yield f"reward_{task}.png", fig


def probe_curves(runs, plt):
    """What C does over training, per method with C: its rms against the token embeddings', the share of its
    energy that varies across prompts, the gradient norm of each parameter group, per-head routing entropy."""
    for (task, team), group in by_key(runs, lambda r: (r["cfg"]["task"], r["cfg"]["team"]),
                                      lambda r: r["finished"] and "c_rms" in r["metrics"][-1]):
        fig, axes = plt.subplots(2, 2, figsize=(10, 7), sharex=True)
        for (meth, seeds), color in zip(by_key(group, lambda r: method_key(r["cfg"])), plt.cm.tab10.colors):
            T = min(len(r["metrics"]) for r in seeds)
            steps = np.arange(1, T + 1)
            band(axes[0, 0], steps, seed_series(seeds, "c_rms", T) / seed_series(seeds, "embed_rms", T), meth,
                 color=color)
            band(axes[0, 1], steps, seed_series(seeds, "c_varying", T), meth, color=color)
            for key, style in (("grad_norm_g_phi", "-"), ("grad_norm_lora", ":")):
                if key in seeds[0]["metrics"][-1]:
                    axes[1, 0].plot(steps, np.nanmean(seed_series(seeds, key, T), 0), style, color=color,
                                    label=f"{meth}: {key[10:]}")
            if "entropy_heads" in seeds[0]["metrics"][-1]:
                E = seed_series(seeds, "entropy_heads", T).mean(0)                  # (T, heads)
                axes[1, 1].plot(steps, E, color=color, alpha=0.5, lw=0.8)
                axes[1, 1].plot(steps, np.nanmean(seed_series(seeds, "entropy", T), 0), color=color, lw=2, label=meth)
        titles = ["rms(C) / rms(token embeddings)", "share of C's energy that varies across prompts",
                  "gradient norm before clipping (solid: g_phi, dotted: LoRA)",
                  "routing entropy: head mean of A (thick) and each head (thin)"]
        for ax, title in zip(axes.flat, titles):
            ax.set_title(title, fontsize=9), ax.legend(fontsize=7)
        axes[1, 0].set_yscale("log"), axes[1, 0].set_xlabel("step"), axes[1, 1].set_xlabel("step")
        yield f"probes_{task}_{team}.png", fig


def conductor_curves(runs, plt):
    """The conductor's training signal over steps, per seed: the share of sampled workflows that parse, the share
    of groups whose G rewards are all equal (no gradient), the training reward (0 unparsed, 0.5 wrong, 1 right)
    and the first worker's share of the workflow steps; runs trained on coins (--reward random) dashed. Runs
    stopped early are drawn too."""
    for (task, team), group in by_key(runs, lambda r: (r["cfg"]["task"], r["cfg"]["team"]),
                                      lambda r: r["cfg"]["method"] == "conductor" and r["metrics"]):
        first = next((m["utilization_names"][0] for r in group for m in r["metrics"] if "utilization_names" in m), "")
        fig, axes = plt.subplots(1, 4, figsize=(15, 3.2), sharex=True)
        for run in group:  # one colour per seed: its task-trained run solid, its coin-trained run dashed
            steps = [m["step"] for m in run["metrics"]]
            coins, seed = run["cfg"].get("reward") == "random", run["cfg"].get("seed", 0)
            style = dict(marker="o", ms=3, ls="--" if coins else "-", color=plt.cm.tab10.colors[seed % 10],
                         label=f"seed {seed}{' (coins)' if coins else ''}")
            for ax, key in zip(axes, ("parse_rate", "zero_std_fraction", "reward")):
                ax.plot(steps, [m.get(key, np.nan) for m in run["metrics"]], **style)
            axes[3].plot(steps, [m["utilization"][0] if m.get("utilization") else np.nan for m in run["metrics"]],
                         **style)
        for ax, title in zip(axes, ("workflows that parse", "groups with equal rewards", "training reward",
                                    f"share of steps: {first}")):
            ax.set_title(title, fontsize=9), ax.set_xlabel("step")
        axes[3].legend(fontsize=6, loc="center left", bbox_to_anchor=(1.02, 0.5))  # one legend, beside the plots
        for ax in (axes[0], axes[1], axes[3]):
            ax.set_ylim(-0.05, 1.05)
        yield f"conductor_{task}_{team}.png", fig


def rlae_weight_curves(runs, plt):
    """RLAE's agent over steps: each member's mean weight alpha / sum(alpha) (logged as agent_weights; mean and
    band over seeds), trained on the task's reward (solid; --reward exact too) and on coins (--reward random,
    dashed). An agent that learns moves its weights away from uniform (dotted), and not the way coins move them."""
    for (task, team), group in by_key(runs, lambda r: (r["cfg"]["task"], r["cfg"]["team"]),
                                      lambda r: r["cfg"]["method"] == "rlae" and r["finished"]
                                      and any("agent_weights" in m for m in r["metrics"])):
        names = next(m["utilization_names"] for r in group for m in r["metrics"] if "utilization_names" in m)
        fig, ax = plt.subplots(figsize=(7, 4))
        for coins, style, what in ((False, "-", "task reward"), (True, "--", "coins")):  # exact is the task's too
            seeds = [r for r in group if (r["cfg"].get("reward") == "random") == coins]
            if seeds:
                T = min(len(r["metrics"]) for r in seeds)
                W = seed_series(seeds, "agent_weights", T)                              # (seeds, T, K)
                for k, (name, color) in enumerate(zip(names, plt.cm.tab10.colors)):
                    band(ax, np.arange(1, T + 1), W[:, :, k], f"{name}, {what} ({len(seeds)})",
                         color=color, style=style)
        ax.axhline(1 / len(names), color="grey", ls=":", lw=1)
        ax.set_xlabel("step"), ax.set_ylabel("agent's mean weight")
        ax.set_title(f"RLAE on {task} ({team} team): the agent's weights, task reward against coins", fontsize=9)
        ax.legend(fontsize=7)
        yield f"rlae_weights_{task}_{team}.png", fig


def fig6(runs, plt):
    """Paper Fig. 6: validation score vs the number of latents m."""
    by_m = {m: [r["eval"]["score"] for r in g]
            for m, g in by_key(runs, lambda r: r["cfg"]["num_latents"], lambda r: r["cfg"]["method"] == "ours"
                               and "eval" in r)}
    if len(by_m) < 2:
        return
    ms = sorted(by_m)
    stats = [mean_std(by_m[m]) for m in ms]
    fig, ax = plt.subplots(figsize=(5, 4))
    ax.errorbar(ms, [100 * s[0] for s in stats], yerr=[100 * s[1] for s in stats], marker="o", capsize=3)
    ax.set_xlabel("number of latents m"), ax.set_ylabel("validation score (%)"), ax.set_title("Fig. 6")
    yield "fig6.png", fig


if __name__ == "__main__":
    for run in sys.argv[1:] or ["."]:
        print(plot_run(run))
