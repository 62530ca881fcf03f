"""
Turn a folder of runs into the paper's table, its Spearman rho and its figures.

    python evaluate.py --summarize runs/ --out results/     # table.md, spearman.json, PNG figures (calls this file)

Paper: Table 1 (mean +- std over 3 seeds), §4.3 (Spearman rho between the reward and routing-entropy series of
each run, then averaged: -0.48), Fig. 4 (utilisation per expert, entropy and reward over steps), Fig. 5 (with vs
without context tokens), Fig. 6 (accuracy vs number of latents m).

Choices the paper leaves open:
  1. std is the sample standard deviation (ddof = 1) across seeds.
  2. Each method is compared with `single` by an exact permutation test over seeds (the table's last column),
     which says plainly how little 3 seeds can show: p >= 0.1.
  3. Beside rho(reward, H), every run also gets rho(step, H) and the partial rho(reward, H | step): the routing
     entropy of a randomly initialised adapter falls over training even when the reward ignores the text, so
     a negative rho(reward, H) alone can be a shared drift (the random-reward control, train.py --reward random).
  4. Paired columns (evaluate.py --paired): each seed's with-C score minus its C = 0 / shuffled-C score on the
     same items, mean +- std over seeds, and in how many seeds the sign test gave p < 0.05.
  5. The last column compares each method with `single` item by item: a seed's runs share their validation
     items, so the difference is taken per item, averaged, and given a two-level bootstrap interval.

Try it on CPU:  python -m pytest tests/test_baselines.py -q -k "summarize or plot"
"""
import glob
import json
import os
import sys

import numpy as np

from support.harness.checkpoint import read_log
from lib.stats import (MIN_SEEDS_FOR_BOOTSTRAP, hierarchical_bootstrap_ci, mean_std,
                               partial_spearman, permutation_p, spearman)

# ----------------------------------------------------------------------------------------------------------
# Reading runs (the statistics are in lib/stats.py)


def read_json(path):
    with open(path) as f:
        return json.load(f)


def read_metrics(run):
    """metrics.jsonl's records as --resume reads them (a torn last line left out; a bad line: ValueError)."""
    return [record for record, _ in read_log(os.path.join(run, "metrics.jsonl"), flag="--summarize")]


def load_runs(folders):
    """Every run under the folders, read once: {"dir", "cfg", "metrics", "finished", and "eval",
    "eval_no_context", "eval_paired" where evaluate.py wrote them}. A run's folder holds config.json and
    metrics.jsonl together (a tiny run's base_model/config.json is a model's). A run is finished when its
    training reached its last step; runs still training stay out of rho and the curves."""
    runs = []
    for folder in folders:
        for cfg_path in sorted(glob.glob(os.path.join(glob.escape(folder), "**", "config.json"), recursive=True)):
            d = os.path.dirname(cfg_path)
            if not os.path.isfile(os.path.join(d, "metrics.jsonl")):
                continue
            run = {"dir": d, "cfg": read_json(cfg_path), "metrics": read_metrics(d)}
            run["finished"] = bool(run["metrics"]) and run["metrics"][-1]["step"] >= run["cfg"].get("steps", 0)
            for name in ("eval", "eval_no_context", "eval_paired"):
                if os.path.exists(os.path.join(d, f"{name}.json")):
                    run[name] = read_json(os.path.join(d, f"{name}.json"))
            runs.append(run)
    return runs


def method_key(cfg):
    """A table row: the method, the team when it is not the usual one (e.g. `ours (pocket-naive)`), the
    random-reward control and the channel options that are not the paper's."""
    return (cfg["method"] + ("" if cfg["team"] in ("default", "pocket", "tiny") else f" ({cfg['team']})")
            + (" [random reward]" if cfg.get("reward") == "random" else "")
            + (" [state-norm]" if cfg.get("state_norm", "none") != "none" else "")
            + (f" [depth {cfg['expert_depth']:g}]" if cfg.get("expert_depth", 1.0) != 1.0 else "")
            + (f" [{cfg['context_anchor']} anchor]" if cfg.get("context_anchor", "zero") != "zero" else ""))


def collect(folders, out):
    """Read every run once: the evaluations per (row, task), and rho per run and per row."""
    cells, zero_c, paired, rhos, rho_method = {}, {}, {}, {}, {}
    for run in load_runs(folders):
        cfg = run["cfg"]
        key = (method_key(cfg), cfg["task"])
        for name, into in (("eval", cells), ("eval_no_context", zero_c), ("eval_paired", paired)):
            if name in run:
                into.setdefault(key, []).append(run[name]["paired"] if name == "eval_paired"
                                                else {**run[name], "seed": cfg.get("seed")})
        m = [r for r in run["metrics"] if "entropy" in r]
        if len(m) >= 3 and run["finished"]:
            reward, H, step = ([r[k] for r in m] for k in ("reward", "entropy", "step"))
            rhos[run["dir"]] = {"reward_H": spearman(reward, H), "step_H": spearman(step, H),
                                "reward_H_given_step": partial_spearman(reward, H, step)}
            rho_method.setdefault(key[0], []).append(rhos[run["dir"]])
    for path in glob.glob(os.path.join(glob.escape(out), "untrained-*.json")):
        ev = read_json(path)
        cells.setdefault(("untrained", ev["task"]), []).append(ev)
    return cells, zero_c, paired, rhos, rho_method


def mean_cell(evs, k):
    """mean +- std over seeds, in %."""
    if not evs:
        return "–"
    m, s = mean_std([e[k] for e in evs])
    return f"{100 * m:.1f}" if len(evs) == 1 else f"{100 * m:.1f} ± {100 * s:.1f}"


def seeds_vs_single(evs, single):
    """Mean minus single's mean, with the exact permutation p over seeds."""
    a, b = [e["score"] for e in evs], [e["score"] for e in single]
    return f"{100 * (np.mean(a) - np.mean(b)):+.1f} (p = {permutation_p(a, b):.2f})" if len(a) > 1 else "–"


def paired_cell(pairs, other):
    """Mean over seeds of each seed's with-C minus `other` difference on the same items (points), and in how
    many seeds the sign test gave p < 0.05."""
    if any("n/a" in p.get(f"with_C - {other}", {}) for p in pairs):
        return "n/a (C is the same for every prompt)"
    ps = [p[f"with_C - {other}"]["score"] for p in pairs if f"with_C - {other}" in p]
    if not ps:
        return "–"
    m, sd = mean_std([100 * p["diff"] for p in ps])
    return (f"{m:+.1f}" + (f" ± {sd:.1f}" if len(ps) > 1 else "")
            + f" (p < 0.05 in {sum(p['p_sign'] < 0.05 for p in ps)}/{len(ps)})")


def items_vs_single(evs, single):
    """Mean over seeds of the score minus single's on the same items (a seed's runs share their validation
    items), with a 95 % interval from a two-level bootstrap (seeds, then items): a paired comparison."""
    runs = {e["seed"]: e["per_item"]["with_C"]["score"] for e in evs if "per_item" in e}
    base = {e["seed"]: e["per_item"]["with_C"]["score"] for e in single if "per_item" in e}
    return same_items_cell(runs, base)[0]


def same_items_cell(runs, base):
    """({seed: per-item scores}, the same for the other row) -> ("+mean [lo, hi]" in points, or "–"; the number of
    seeds both have with the same items). The interval: two-level bootstrap over seeds, then items; with fewer than
    stats.MIN_SEEDS_FOR_BOOTSTRAP seeds it covers badly (tests/test_stats.py measures it) and the cell ends in
    " (descriptive)": the exact seed-level test is then the figure to read."""
    seeds = [s for s in sorted(set(runs) & set(base)) if len(runs[s]) == len(base[s])]
    if not seeds:
        return "–", 0
    diffs = [np.subtract(runs[s], base[s]) for s in seeds]
    lo, hi = hierarchical_bootstrap_ci(diffs)
    cell = f"{100 * np.mean([d.mean() for d in diffs]):+.1f} [{100 * lo:+.1f}, {100 * hi:+.1f}]"
    return cell + (" (descriptive)" if len(seeds) < MIN_SEEDS_FOR_BOOTSTRAP else ""), len(seeds)


def summarize(folders, out):
    """Table 1-style Markdown, one row per method (and team, and control), one column group per task: score and
    solve rate (mean +- std over seeds), the score with C = 0, the paired with-C minus C = 0 / shuffled-C
    differences, the score minus single's (over seeds, and item by item); rho(reward, H), rho(step, H) and the
    partial rho(reward, H | step) per run and per method. Writes table.md and spearman.json into `out`."""
    os.makedirs(out, exist_ok=True)
    cells, zero_c, paired, rhos, rho_method = collect(folders, out)
    tasks = sorted({t for _, t in cells})

    def single(t):
        return cells.get(("single", t), [])

    def against_single(f, t):  # a column comparing each method's runs with single's
        return lambda m: "–" if m in ("single", "untrained") else f(cells.get((m, t), []), single(t))

    cols = ([(f"{t} score", lambda m, t=t: mean_cell(cells.get((m, t), []), "score")) for t in tasks]
            + [(f"{t} solved", lambda m, t=t: mean_cell(cells.get((m, t), []), "solve_rate")) for t in tasks]
            + [(f"{t} score, C = 0", lambda m, t=t: mean_cell(zero_c.get((m, t), []), "score"))
               for t in tasks if any(k[1] == t for k in zero_c)])
    for t in tasks:
        if any(k[1] == t for k in paired):
            cols += [(f"{t} with C − C = 0 (paired)", lambda m, t=t: paired_cell(paired.get((m, t), []), "zero_C")),
                     (f"{t} with C − shuffled C (paired)",
                      lambda m, t=t: paired_cell(paired.get((m, t), []), "shuffled_C"))]
        if len(single(t)) > 1:
            cols.append((f"{t} score − single's", against_single(seeds_vs_single, t)))
        if any("per_item" in e for e in single(t)):
            cols.append((f"{t} − single's, same items [95 % CI]", against_single(items_vs_single, t)))
    lines = ["| method | " + " | ".join(name for name, _ in cols) + " | seeds |", "|---|" + "---|" * len(cols) + "---|"]
    for meth in sorted({m for m, _ in cells}):
        seeds = max(len(cells.get((meth, t), [])) for t in tasks)
        lines.append(f"| {meth} | " + " | ".join(f(meth) for _, f in cols) + f" | {seeds} |")
    table = "\n".join(lines) + "\n"

    def stats(values):
        v = [x for x in values if np.isfinite(x)]
        return {"mean": float(np.mean(v)), "std": mean_std(v)[1], "runs": len(v)} if v else None

    by_method = {meth: {k: stats([r[k] for r in v]) for k in ("reward_H", "step_H", "reward_H_given_step")}
                 for meth, v in sorted(rho_method.items())}
    finite = [r["reward_H"] for r in rhos.values() if np.isfinite(r["reward_H"])]
    rho = {"per_run": rhos, "by_method": by_method, "mean": float(np.mean(finite)) if finite else None}
    with open(os.path.join(out, "table.md"), "w") as f:
        f.write(table)
    with open(os.path.join(out, "spearman.json"), "w") as f:
        json.dump(rho, f, indent=2)
    return table, rho


# ----------------------------------------------------------------------------------------------------------
# Figures (matplotlib is optional: only this part needs it)


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


def series(runs, key, T):
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
        U = series(group, "utilization", T)                                   # (seeds, T, n)
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
            band(ax, steps, series(group, key, T), color=color)
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
            Y = np.array([np.convolve(y, np.ones(k) / k, mode="valid") for y in series(seeds, "reward", T)])
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
            band(axes[0, 0], steps, series(seeds, "c_rms", T) / series(seeds, "embed_rms", T), meth,
                 color=color)
            band(axes[0, 1], steps, series(seeds, "c_varying", T), meth, color=color)
            for key, style in (("grad_norm_g_phi", "-"), ("grad_norm_lora", ":")):
                if key in seeds[0]["metrics"][-1]:
                    axes[1, 0].plot(steps, np.nanmean(series(seeds, key, T), 0), style, color=color,
                                    label=f"{meth}: {key[10:]}")
            if "entropy_heads" in seeds[0]["metrics"][-1]:
                E = series(seeds, "entropy_heads", T).mean(0)                  # (T, heads)
                axes[1, 1].plot(steps, E, color=color, alpha=0.5, lw=0.8)
                axes[1, 1].plot(steps, np.nanmean(series(seeds, "entropy", T), 0), color=color, lw=2, label=meth)
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
                W = series(seeds, "agent_weights", T)                              # (seeds, T, K)
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


