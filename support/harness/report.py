"""
Turn a folder of runs into the paper's table and its Spearman rho (the figures: support/harness/plot.plot_runs,
from the same load_runs).

    python evaluate.py --summarize runs/ --out results/     # table.md, spearman.json, PNG figures (calls this file)

Paper: Table 1 (mean +- std over 3 seeds), §4.3 (Spearman rho between the reward and routing-entropy series of
each run, then averaged: -0.48).

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

Try it on CPU:  python -m pytest tests/test_baselines.py -q -k summarize
"""
import glob
import json
import os

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
