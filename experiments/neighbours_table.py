"""
The table of experiments/neighbours_learning.py, from the archived run records alone (RESULTS/runs: config.json,
metrics.jsonl, eval.json, timing.json of every run and control): RESULTS/table.md, table.json and the plots.

    python experiments/neighbours_learning.py --analyse                  # results/neighbours/gcd
    python experiments/neighbours_learning.py --analyse --testbed lcm    # results/neighbours
    python experiments/neighbours_learning.py --analyse --results DIR    # any folder the driver wrote

What is computed (all on the same items: a seed's runs are scored on the seed's validation items):
  1. each method minus each of its controls (comparisons): per seed, the difference of mean scores (of exact solve
     rates, when the runs were trained on --reward exact: partial credit counts 0); mean +- sd
     over seeds; the exact two-sided sign-flip p over seeds (lib/stats.sign_flip_p: 2 seeds give p in
     {0.5, 1}, 3 seeds p >= 0.25, so a "no" from 3 seeds is weak and a "yes" impossible below 0.25); item by item,
     the two-level bootstrap interval (seeds, then items: stats.hierarchical_bootstrap_ci, descriptive below
     stats.MIN_SEEDS_FOR_BOOTSTRAP seeds), the items better and worse, and per seed stats.paired_comparison
     (bootstrap interval over items, sign test) in table.json; against the verdict's `single` too, for the seeds
     whose record (--single) was scored on the same items with the same prompt;
  2. the conductor over training: parse rate, workflow length, reward, solve rate, the share of flat groups and
     each worker's share of the workflow steps, at step 1 and at the end (the mean over the last LAST steps);
  3. RLAE's agent weights (alpha / sum alpha, exactly uniform before the first update) at the end minus uniform,
     per member, and the conductor's worker choice (each worker's share of the sampled workflow steps) at the end
     minus at step 1, each trained on the task's reward and on coins, and their per-seed difference with its
     sign-flip p: a choice that moves under coins too is not learning; RLAE's per item type in table.json;
  4. cost: seconds per step (metrics.jsonl), each run's training and evaluation wall time (timing.json: each
     process's, its model loading included; a control's loading apart, shared by the controls of its process),
     and the whole experiment;
  5. support/harness/plot.py's plots: fig4_* (worker shares, drawn member weights; band over seeds), conductor_* (parse
     rate, steps, reward), rlae_weights_* (the agent's weights, task reward against coins), reward_*; none, and one
     line saying why, without matplotlib.
"""
import json
import os

import numpy as np

from lib.files import whole_write
from support.harness.config import fail
from support.harness.plot import plot_runs
from lib.stats import hierarchical_bootstrap_ci, holm, mean_std, paired_comparison, sign_flip_p

LAST = 3  # "at the end" of a training: the mean over its last 3 steps
# the conductor's metrics over training; zero_std_fraction is the share of groups whose G rewards are all equal:
# their advantage is 0, so they give GRPO no gradient
CONDUCTOR_CURVES = ("parse_rate", "mean_steps", "reward", "solve_rate", "zero_std_fraction")
# the fields two runs' configs share when their evaluations score the same items with the same prompt
SAME_ITEMS = ("task", "task_config", "system_prompt", "worked_example", "response_prefix", "context_position",
              "max_new_tokens")


def protocol(cfg, keys):
    """The fields of a config that must agree; the task config compared as data, not as text."""
    out = {k: cfg.get(k) for k in keys}
    out["task_config"] = json.loads(out["task_config"] or "{}")
    return out




def load(runs_dir):
    """{part: {seed: {"cfg", "eval", "metrics", "timing"}}} for every folder PART-sSEED with an eval.json."""
    out = {}
    for name in sorted(os.listdir(runs_dir)) if os.path.isdir(runs_dir) else []:
        d = os.path.join(runs_dir, name)
        if not os.path.exists(os.path.join(d, "eval.json")):
            continue
        part, seed = name.rsplit("-s", 1)
        read = lambda f: json.load(open(os.path.join(d, f))) if os.path.exists(os.path.join(d, f)) else {}  # noqa
        metrics = os.path.join(d, "metrics.jsonl")
        out.setdefault(part, {})[int(seed)] = {
            "cfg": read("config.json"), "eval": read("eval.json"), "timing": read("timing.json"),
            "metrics": [json.loads(x) for x in open(metrics) if x.strip()] if os.path.exists(metrics) else []}
    return out


def scores(rec, exact=False):
    """Per item: the task's score, or with exact 1 for full marks and 0 for anything less (the exact solve rate's
    items: reasoning-gym's partial credit pays gcd 0.5 for any other number)."""
    s = np.asarray(rec["eval"]["per_item"]["with_C"]["score"], dtype=float)
    return (s == 1).astype(float) if exact else s


def is_exact(runs):
    """Whether the runs were trained on the exact reward: then every comparison is on the exact solve rate."""
    return any(r["cfg"].get("reward") == "exact" for recs in runs.values() for r in recs.values())


def compare(runs, a, b, label, exact=False):
    """a minus b, seed by seed on the same items: the seed-level exact test and the item-level interval."""
    seeds = sorted(set(runs[a]) & set(runs[b]))
    sa, sb = ({s: scores(runs[x][s], exact) for s in seeds} for x in (a, b))
    for s in seeds:
        if len(sa[s]) != len(sb[s]):
            fail(f"{a} and {b} of seed {s} were scored on {len(sa[s])} and {len(sb[s])} items: not the same items")
    item = [sa[s] - sb[s] for s in seeds]                                   # per seed: (n,)
    diffs = [float(d.mean()) for d in item]
    return {"label": label, "a": a, "b": b, "seeds": seeds, "diffs": diffs,
            "mean": mean_std(diffs)[0], "sd": mean_std(diffs)[1],
            "better_seeds": sum(d > 0 for d in diffs), "worse_seeds": sum(d < 0 for d in diffs),
            "p": sign_flip_p(diffs) if len(seeds) > 1 else None, "items_ci95": hierarchical_bootstrap_ci(item),
            "items_better": int(sum((d > 0).sum() for d in item)),
            "items_worse": int(sum((d < 0).sum() for d in item)),
            "per_seed": {s: paired_comparison(sa[s], sb[s]) for s in seeds}}


def comparisons(runs):
    """(method, a, b, label) for every pair the records allow: each method against its controls."""
    alone = lambda prefix: sorted(p for p in runs if p.startswith(prefix))  # noqa: E731
    rows = [("conductor", "conductor", "conductor_example", "conductor − the worked example's workflow")]
    rows += [("conductor", "conductor", p, f"conductor − {p[len('conductor_alone_'):]} alone")
             for p in alone("conductor_alone_")]
    rows += [("conductor", "conductor", "conductor_random", "conductor − conductor trained on coins"),
             ("conductor", "conductor", "single", "conductor − single (the verdict's)"),
             ("rlae", "rlae", "rlae_uniform", "rlae − the uniform mixture")]
    rows += [("rlae", "rlae", p, f"rlae − {p[len('rlae_alone_'):]} alone") for p in alone("rlae_alone_")]
    rows += [("rlae", "rlae", "rlae_random", "rlae − rlae trained on coins"),
             ("rlae", "rlae_random", "rlae_uniform", "rlae on coins − the uniform mixture"),
             ("rlae", "rlae", "single", "rlae − single (the verdict's)")]
    return [r for r in rows if set(runs.get(r[1], {})) & set(runs.get(r[2], {}))]  # a seed both have


def start_and_end(metrics, key):
    """(the value at step 1, the mean over the last LAST steps that logged it); lists element by element."""
    vals = [m[key] for m in metrics if m.get(key) is not None]
    start = metrics[0].get(key) if metrics else None
    return start, (np.mean(vals[-LAST:], axis=0).tolist() if vals else None)


def conductor_training(recs):
    """{metric: {"start": [per seed], "end": [per seed]}}, and the workers' names."""
    out = {}
    for key in (*CONDUCTOR_CURVES, "utilization"):
        pairs = [start_and_end(recs[s]["metrics"], key) for s in sorted(recs)]
        out[key] = {"start": [p[0] for p in pairs], "end": [p[1] for p in pairs]}
    out["names"] = next((m["utilization_names"] for r in recs.values() for m in r["metrics"]
                         if "utilization_names" in m), [])
    return out


def moved_against_coins(runs, method):
    """Per member or worker: how far its weight moved by the end of training, per seed, trained on the task's
    reward (METHOD) and on coins (METHOD_random), and their difference over the seeds that have both, with its
    sign-flip p. RLAE: the agent's mean weights at the end minus uniform (exactly uniform before the first update).
    Conductor: each worker's share of the sampled workflows' steps at the end minus at step 1 (the untrained
    policy's own choice)."""
    key = {"rlae": "agent_weights", "conductor": "utilization"}[method]
    moved, names = {}, []
    for part in (method, f"{method}_random"):
        for s, r in sorted(runs.get(part, {}).items()):
            start, end = start_and_end(r["metrics"], key)
            names = next((m["utilization_names"] for m in r["metrics"] if "utilization_names" in m), names)
            if end is not None:
                moved.setdefault(part, {})[s] = np.subtract(end, 1 / len(end) if method == "rlae" else start)
    task, coins = moved.get(method, {}), moved.get(f"{method}_random", {})
    seeds = sorted(set(task) & set(coins))
    rows = []
    for k, name in enumerate(names if task or coins else []):
        diffs = [float(task[s][k] - coins[s][k]) for s in seeds]
        rows.append({"member": name, "task": {s: float(v[k]) for s, v in task.items()},
                     "coins": {s: float(v[k]) for s, v in coins.items()}, "seeds": seeds, "diffs": diffs,
                     "p": sign_flip_p(diffs) if len(seeds) > 1 else None})
    return rows


PREREGISTERED_SEEDS = 6  # results/neighbours/gcd/preregistration.md: seeds 0-5
# (test, family, how its per-seed value is made); the strong worker is the first of the workers ("Model 0")
PREREGISTERED = [("C1", "conductor", "conductor − the worked example's workflow"),
                 ("C2", "conductor", "the strong worker's share of workflow steps moved: task − coins"),
                 ("R1", "rlae", "rlae − the uniform mixture"),
                 ("R2", "rlae", "the agent's weight on the strong worker moved: task − coins")]


def preregistered(rows, choice, weights):
    """The pre-registered tests: per seed values, the exact one-sided sign-flip p (H1: mean > 0), Holm within
    each method's family of two, and the decision ("shown" needs all PREREGISTERED_SEEDS seeds and Holm p < 0.05)."""
    label = {r["label"]: r for _, r in rows}
    diffs = {"C1": label.get(PREREGISTERED[0][2], {}).get("diffs", []),
             "C2": choice[0]["diffs"] if choice else [],
             "R1": label.get(PREREGISTERED[2][2], {}).get("diffs", []),
             "R2": weights[0]["diffs"] if weights else []}
    out = []
    for family in ("conductor", "rlae"):
        tests = [(t, what) for t, f, what in PREREGISTERED if f == family]
        p = [sign_flip_p(diffs[t], "greater") if len(diffs[t]) > 1 else 1.0 for t, _ in tests]
        for (t, what), p1, ph in zip(tests, p, holm(p)):
            n = len(diffs[t])
            decision = ("shown" if ph < 0.05 else "not shown") if n >= PREREGISTERED_SEEDS else \
                f"incomplete ({n} of {PREREGISTERED_SEEDS} seeds)"
            out.append({"test": t, "what": what, "diffs": diffs[t], "p_one_sided": p1, "p_holm": ph,
                        "decision": decision})
    return out


def end_by_source(metrics):
    """{item type: the agent's weights over the last LAST steps that logged it} (RLAE, per item type)."""
    rows = [m["agent_weights_by_source"] for m in metrics if m.get("agent_weights_by_source")][-LAST:]
    return {s: np.mean([r[s] for r in rows if s in r], axis=0).tolist() for s in sorted({s for r in rows for s in r})}


def cost(runs):
    """Per part: seconds per step (metrics.jsonl) and mean wall time per seed (timing.json); the total."""
    rows = {}
    for part, recs in sorted(runs.items()):
        if part == "single":
            continue
        steps = [m["seconds"] for r in recs.values() for m in r["metrics"] if "seconds" in m]
        t = {k: [r["timing"].get(k, 0.0) for r in recs.values()] for k in ("train_seconds", "eval_seconds",
                                                                            "load_seconds")}
        rows[part] = {"seeds": len(recs), "seconds_per_step": float(np.mean(steps)) if steps else None,
                      **{k: float(np.mean(v)) for k, v in t.items()},
                      "total_seconds": float(sum(sum(v) for v in t.values()))}
    return rows, sum(r["total_seconds"] for r in rows.values())


def mean_sd(values, scale=1.0, signed=False):
    """"mean ± sd" of the values that exist; "–" when none does."""
    v = [scale * x for x in values if x is not None]
    if not v:
        return "–"
    digits, (m, sd) = 1 if scale == 100 else 3, mean_std(v)
    return f"{m:{'+' if signed else ''}.{digits}f}" + (f" ± {sd:.{digits}f}" if len(v) > 1 else "")


def p_cell(p):
    return "–" if p is None else f"{p:.3g}"


def markdown(runs, rows, cond, weights, by_source, costs, total, plots, choice=(), exact=False, tests=()):
    first = next(iter(next(iter(runs.values())).values()))
    cfg, n = first["cfg"], first["eval"]["n"]
    seeds = sorted({s for recs in runs.values() for s in recs})
    L = ["# Do the neighbours learn? Conductor and RLAE against their controls", "",
         f"Testbed `--task {cfg['task']} --task-config '{cfg['task_config']}'`, team `{cfg['team']}`, {n} validation "
         f"items per seed (the seed's, as the verdict's `single`), greedy. Training: {cfg['steps']} steps of "
         f"{cfg['batch_size']} prompts x G {cfg['group_size']}, lr {cfg['lr']:g} (LoRA) / {cfg['router_lr']:g} "
         "(RLAE's agent). Regenerate: `python experiments/neighbours_learning.py --analyse`; how every number is "
         "made: experiments/neighbours_table.py; the commit and flags of each run: provenance.txt.", ""]
    if tests:
        L += ["## The pre-registered tests (preregistration.md)", "",
              "| test | per seed | mean | one-sided p | Holm p (within the method) | decision |",
              "|---|---|---|---|---|---|"]
        L += [f"| {t['test']}: {t['what']} | {', '.join(f'{d:+.3f}' for d in t['diffs']) or '–'} | "
              f"{mean_sd(t['diffs'], signed=True)} | {t['p_one_sided']:.3g} | {t['p_holm']:.3g} | {t['decision']} |"
              for t in tests]
        L += ["", "C1 and R1 in exact solve rate (fractions of the 100 items), C2 and R2 in share / weight.", ""]
    L += [f"## {'Exact solve rates' if exact else 'Scores'} (points)", "",
          *(["Every number below is on the exact solve rate (full marks, or 0: the runs' reward).", ""]
            if exact else []), "| run | " + " | ".join(f"s{s}" for s in seeds) + " | mean ± sd |",
          "|---|" + "---|" * (len(seeds) + 1)]
    for part in sorted(runs):
        vals = [runs[part][s]["eval"]["solve_rate" if exact else "score"] if s in runs[part] else None
                for s in seeds]
        L.append(f"| {part} | " + " | ".join("–" if v is None else f"{100 * v:.1f}" for v in vals)
                 + f" | {mean_sd(vals, 100)} |")
    for method in ("conductor", "rlae"):
        L += ["", f"## {method} against its controls (a − b on the same items, points)", "",
              "| a − b | seeds | per seed | mean ± sd | seeds better / worse | sign-flip p (two-sided) "
              "| items: 95 % CI (descriptive) | items better / worse |", "|---|---|---|---|---|---|---|---|"]
        for r in (r for m, r in rows if m == method):
            lo, hi = r["items_ci95"]
            L.append(f"| {r['label']} | {len(r['seeds'])} | {', '.join(f'{100 * d:+.1f}' for d in r['diffs'])} | "
                     f"{mean_sd(r['diffs'], 100, True)} | {r['better_seeds']} / {r['worse_seeds']} | "
                     f"{p_cell(r['p'])} | [{100 * lo:+.1f}, {100 * hi:+.1f}] | {r['items_better']} / "
                     f"{r['items_worse']} |")
    if cond:
        L += ["", f"## The conductor over training (mean ± sd over seeds; end: the last {LAST} steps)", "",
              "| metric | step 1 | end |", "|---|---|---|"]
        for key in CONDUCTOR_CURVES:
            L.append(f"| {key} | {mean_sd(cond[key]['start'])} | {mean_sd(cond[key]['end'])} |")
        for k, name in enumerate(cond["names"]):
            share = [[None if v is None else v[k] for v in cond["utilization"][w]] for w in ("start", "end")]
            L.append(f"| share of workflow steps: {name} | {mean_sd(share[0])} | {mean_sd(share[1])} |")
    for rows_, title in ((choice, f"The conductor's worker choice: share of workflow steps at the end (last {LAST} "
                                  "steps) minus at step 1"),
                         (weights, f"RLAE's agent weights at the end (last {LAST} steps) minus uniform")):
        if rows_:
            L += ["", f"## {title}", "",
                  "| member | task reward | coins | task − coins, per seed | sign-flip p (two-sided) |",
                  "|---|---|---|---|---|"]
            L += [f"| {w['member']} | {mean_sd(w['task'].values(), signed=True)} | "
                  f"{mean_sd(w['coins'].values(), signed=True)} | "
                  f"{', '.join(f'{d:+.3f}' for d in w['diffs']) or '–'} | {p_cell(w['p'])} |" for w in rows_]
    types = sorted({t for part in by_source.values() for seed in part.values() for t in seed})
    if len(types) > 1:
        L += ["", "## RLAE's agent weights at the end, per item type (mean over seeds)", "",
              "| run | item type | weights |", "|---|---|---|"]
        L += [f"| {part} | {t} | {', '.join(f'{x:.3f}' for x in np.mean(ws, axis=0))} |"
              for part, recs in by_source.items() for t in types
              if (ws := [r[t] for r in recs.values() if t in r])]
    L += ["", "## Cost (wall time on the machine of the runs, mean per seed)", "",
          "| run | seeds | s / step | training s | evaluation s | loading s | all seeds, s |",
          "|---|---|---|---|---|---|---|"]
    for part, c in costs.items():
        step = "–" if c["seconds_per_step"] is None else f"{c['seconds_per_step']:.1f}"
        L.append(f"| {part} | {c['seeds']} | {step} | {c['train_seconds']:.0f} | {c['eval_seconds']:.0f} | "
                 f"{c['load_seconds']:.0f} | {c['total_seconds']:.0f} |")
    L += ["", f"The whole experiment: {total:.0f} s ({total / 3600:.2f} h) of process wall time, summed over its "
          "processes (provenance.txt says which ran at the same time).", "", "## Plots", ""]
    L += [f"![{p}]({p})" for p in plots]
    return "\n".join(L) + "\n"


def load_single(single_dir, runs):
    """The verdict's `single` of each of our seeds, where it was scored on the same items with the same prompt."""
    mine = next(iter(next(iter(runs.values())).values()))
    singles = load(single_dir).get("single", {})
    for seed in sorted({s for recs in runs.values() for s in recs} & set(singles)):
        rec = singles[seed]
        same = protocol(rec["cfg"], SAME_ITEMS) == protocol(mine["cfg"], SAME_ITEMS)
        if same and rec["eval"]["n"] == mine["eval"]["n"]:
            runs.setdefault("single", {})[seed] = rec


def analyse(results, single_dir=None):
    """RESULTS/runs (and the verdict's `single` records in single_dir) -> RESULTS/table.md, table.json and the
    plots. Returns the table's Markdown."""
    runs = load(os.path.join(results, "runs"))
    if not runs:
        fail(f"--results {results}: no archived run with an eval.json in {os.path.join(results, 'runs')}")
    testbeds = {json.dumps(protocol(r["cfg"], SAME_ITEMS + ("team",)), sort_keys=True)
                for recs in runs.values() for r in recs.values()}
    if len(testbeds) > 1:
        fail(f"--results {results}: its runs mix {len(testbeds)} testbeds or teams; keep one per --results")
    if single_dir:
        load_single(single_dir, runs)
    exact = is_exact(runs)
    rows = [(m, compare(runs, a, b, label, exact)) for m, a, b, label in comparisons(runs)]
    cond = conductor_training(runs["conductor"]) if "conductor" in runs else {}
    weights, (costs, total) = moved_against_coins(runs, "rlae"), cost(runs)
    choice = moved_against_coins(runs, "conductor")
    by_source = {part: {s: end_by_source(r["metrics"]) for s, r in runs.get(part, {}).items()}
                 for part in ("rlae", "rlae_random")}
    plots = [os.path.basename(p) for p in plot_runs([os.path.join(results, "runs")], results)]  # [] without matplotlib
    tests = preregistered(rows, choice, weights) if os.path.exists(os.path.join(results, "preregistration.md")) \
        else []
    md = markdown(runs, rows, cond, weights, by_source, costs, total, plots, choice, exact, tests)
    whole_write(os.path.join(results, "table.json"), {
        "primary": "exact solve rate" if exact else "score",
        "scores": {part: {s: r["eval"]["solve_rate" if exact else "score"] for s, r in recs.items()}
                   for part, recs in runs.items()},
        "comparisons": [{"method": m, **r} for m, r in rows], "conductor_training": cond,
        "rlae_weights_vs_coins": weights, "conductor_choice_vs_coins": choice, "preregistered": tests, "rlae_end_weights_by_source": by_source, "cost": costs,
        "total_seconds": total, "plots": plots})
    with open(os.path.join(results, "table.md"), "w") as f:
        f.write(md)
    return md
