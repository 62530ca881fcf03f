"""
Evaluate runs and turn a folder of runs into the paper's table and figures.

    python evaluate.py --run runs/arith-pocket-ours-s0 --n 200        # validation score of one run
    python evaluate.py --run runs/arith-pocket-ours-s0 --no-context   # the same policy fed zero context (Fig. 5)
    python evaluate.py --untrained --task chain_sum --team pocket      # the policy before training
    python evaluate.py --summarize runs/ --out results/               # table.md, spearman.json, PNG figures

Paper: Table 1 (mean +- std over 3 seeds), §4.3 (Spearman rho between the reward and routing-entropy series of
each run, then averaged: -0.48), Fig. 4 (utilisation per expert, entropy and reward over steps), Fig. 5 (with vs
without context tokens), Fig. 6 (accuracy vs number of latents m).

Choices the paper leaves open:
  1. Validation decodes greedily (one completion per item), with the training prompt and generation budget.
  2. Accuracy is the mean reasoning-gym score (partial credit: reasoning-gym's score_answer is not binary); the exact-solve rate (score == 1)
     is reported beside it.
  3. "Without C" feeds zero tokens at the positions of C: exactly what the reference policy sees.
  4. std is the sample standard deviation (ddof = 1) across seeds.
  5. Each method is compared with `single` by an exact permutation test over seeds (the table's last column),
     which says plainly how little 3 seeds can show: p >= 0.1.
"""
import glob
import itertools
import json
import os
import sys
from types import SimpleNamespace

import numpy as np
import torch

# ----------------------------------------------------------------------------------------------------------
# Scoring a policy on the validation split


def load_policy(args, lora_state=None, method_state=None, untrained=False, device="cpu"):
    """The policy and the context builder g of a run (its config `args`), with the trained weights loaded,
    in eval mode. Returns (policy, tokenizer, method, eos_ids)."""
    from baselines import METHODS
    from experts import load_model
    from grpo import eos_token_ids
    from lora import apply_lora, load_lora_state_dict
    from train import frozen_dtype
    device = torch.device(device)
    dtype = frozen_dtype(getattr(args, "dtype", "auto"), device)
    team = args.team_models
    policy, tok = load_model(team["policy"], device, dtype)
    method = METHODS["single" if untrained else args.method](team, policy.config.hidden_size, args, device, dtype)
    if lora_state is not None:
        apply_lora(policy, args.lora_rank, args.lora_alpha)
        load_lora_state_dict(policy, lora_state)
    if method_state is not None:
        method.load_state_dict(method_state)
    policy.eval(), method.eval()
    return policy, tok, method, eos_token_ids(policy, tok)  # the same stop tokens as in training


def answer_bridge(response_prefix):
    """Text between the prompt and the gold answer when its log-prob is measured: the answer tag, after closing
    the reasoning block when the response was pre-filled with one."""
    return "</think>\n<answer>" if "<think>" in response_prefix else "<answer>"


def gold_logprobs(policy, tok, prompts, golds, C, args, device):
    """log pi(gold answer + "</answer>" | prompt + answer_bridge, C), summed over the answer's tokens, per item:
    sees a change in how likely the right answer is even where greedy accuracy does not move. Uses the
    training's own scoring pass (grpo.completion_logprobs), so positions are those of the rollout."""
    from grpo import completion_logprobs, encode_prompts
    ids, mask = encode_prompts(tok, [p + answer_bridge(args.response_prefix) for p in prompts], device)
    tok.padding_side = "right"  # completions start right after the prompt's last column
    ans = tok([f"{g}</answer>" for g in golds], return_tensors="pt", padding=True, add_special_tokens=False)
    comp, comp_mask = ans["input_ids"].to(device), ans["attention_mask"].bool().to(device)
    logp = completion_logprobs(policy, ids, mask, C, comp, comp_mask, 1.0, args.context_position)  # (B, T)
    return torch.where(comp_mask, logp, torch.zeros_like(logp)).sum(-1).tolist()


def derangement(n, seed=0):
    """A seeded permutation with no fixed point (n >= 2): item k gets another item's C."""
    rng = np.random.default_rng(seed)
    while True:
        perm = rng.permutation(n)
        if n < 2 or not (perm == np.arange(n)).any():
            return perm


CONDITIONS = ("with_C", "zero_C", "shuffled_C")


@torch.no_grad()
def evaluate(args, n, batch_size=16, lora_state=None, method_state=None, no_context=False, untrained=False,
             device="cpu", conditions=None):
    """Score the policy described by `args` (a run's config) on n validation items, greedy. Returns a dict.

    `conditions` (a subset of CONDITIONS) scores the *same* items several ways and keeps every item's score
    and gold-answer log-prob, for paired comparisons: with_C (C as trained), zero_C (zero tokens at C's
    positions, what the reference policy sees) and shuffled_C (each item gets the C of another item, a seeded
    derangement over the n items: the same distribution of C, no information about this item)."""
    import rewards
    from grpo import completion_mask, encode_prompts, sample
    from train import policy_prompts
    device = torch.device(device)
    items = rewards.load_entries(args.task, "val", n, args.seed, args.data_path, getattr(args, "task_config", None))
    items = [items[i] for i in range(min(n, len(items)))]
    policy, tok, method, eos_ids = load_policy(args, lora_state, method_state, untrained, device)
    conditions = conditions or ("zero_C" if no_context else "with_C",)
    # g(x) for every item first (shuffled C needs another item's), then the same items under each condition
    ctxs = [method([it["question"] for it in items[s:s + batch_size]], [it["answer"] for it in items[s:s + batch_size]])
            for s in range(0, len(items), batch_size)]
    hints = [h for c in ctxs for h in c["hints"]]
    C_all = None if ctxs[0]["C"] is None else torch.cat([c["C"] for c in ctxs])         # (n, m, D)
    perm = torch.as_tensor(derangement(len(items), args.seed), device=device)
    per_item, status = {}, {}
    for cond in conditions:
        if C_all is None and cond != "with_C":
            continue  # no context tokens: nothing to zero or shuffle
        C_cond = None if C_all is None else {"with_C": C_all, "zero_C": torch.zeros_like(C_all),
                                             "shuffled_C": C_all[perm]}[cond]
        scores, logps = [], []
        for s in range(0, len(items), batch_size):
            batch = items[s:s + batch_size]
            C = None if C_cond is None else C_cond[s:s + len(batch)]
            prompts = policy_prompts(tok, [it["question"] for it in batch], hints[s:s + len(batch)], args)
            ids, mask = encode_prompts(tok, prompts, device)
            comp = sample(policy, ids, mask, C, 1, args.max_new_tokens, 1.0, eos_ids, tok.pad_token_id,
                          args.context_position, greedy=True)
            comp = comp.masked_fill(~completion_mask(comp, eos_ids), tok.pad_token_id)
            r, counts = rewards.score_batch(batch, tok.batch_decode(comp, skip_special_tokens=True))
            scores += r
            if len(conditions) > 1:
                logps += gold_logprobs(policy, tok, prompts, [it["answer"] for it in batch], C, args, device)
            for k, v in counts.items():
                status[k] = status.get(k, 0) + v
        per_item[cond] = {"score": scores, "gold_logprob": logps}
    first = per_item[conditions[0]]["score"]
    sources = [it.get("metadata", {}).get("source_dataset", args.task) for it in items]
    result = summary(np.array(first), sources)
    result.update({"task": args.task, "method": "untrained" if untrained else args.method, "n": len(items),
                   "no_context": no_context, "scorer_status": status})
    result["per_item"] = per_item  # every item's score, in item order: runs of one seed share items (paired)
    if len(conditions) > 1:
        result["conditions"] = {c: {**summary(np.array(v["score"]), sources, per_dataset=False),
                                    "gold_logprob": float(np.mean(v["gold_logprob"]))} for c, v in per_item.items()}
        result["paired"] = paired_comparisons(per_item)
    return result


def summary(scores, sources, per_dataset=True):
    out = {"score": float(scores.mean()), "solve_rate": float((scores == 1).mean())}
    if per_dataset:
        out["per_dataset"] = {s: {"score": float(scores[[x == s for x in sources]].mean()),
                                  "solve_rate": float((scores[[x == s for x in sources]] == 1).mean()),
                                  "n": sources.count(s)} for s in sorted(set(sources))}
    return out


# ----------------------------------------------------------------------------------------------------------
# Paired statistics: the same items under two conditions


def sign_test_p(wins, losses):
    """Exact two-sided sign test (McNemar's exact test for binary outcomes): under H0 each of the wins + losses
    discordant items goes either way with probability 1/2; ties carry no information and are dropped.
    p = min(1, 2 P[Binomial(k, 1/2) <= min(wins, losses)])."""
    from math import comb
    k = wins + losses
    if k == 0:
        return 1.0
    return min(1.0, 2 * sum(comb(k, j) for j in range(min(wins, losses) + 1)) / 2 ** k)


def paired_bootstrap_ci(diffs, level=0.95, n_boot=10_000, seed=0):
    """Percentile bootstrap interval of mean(diffs), resampling items (the pairs stay together)."""
    d = np.asarray(diffs, dtype=float)
    means = d[np.random.default_rng(seed).integers(0, len(d), (n_boot, len(d)))].mean(1)
    return [float(np.quantile(means, (1 - level) / 2)), float(np.quantile(means, (1 + level) / 2))]


def paired_comparison(a, b):
    """a, b: one value per item, same items. Mean difference a - b, its 95 % bootstrap interval, the sign
    test's p over the items that differ, and how many went each way."""
    d = np.asarray(a, dtype=float) - np.asarray(b, dtype=float)
    wins, losses = int((d > 0).sum()), int((d < 0).sum())
    return {"diff": float(d.mean()), "ci95": paired_bootstrap_ci(d), "p_sign": sign_test_p(wins, losses),
            "better": wins, "worse": losses, "n": len(d)}


def paired_comparisons(per_item):
    """with_C against each other condition, for the task score and the gold answer's log-prob."""
    out = {}
    for other in ("zero_C", "shuffled_C"):
        if "with_C" in per_item and other in per_item:
            out[f"with_C - {other}"] = {k: paired_comparison(per_item["with_C"][k], per_item[other][k])
                                        for k in ("score", "gold_logprob")}
    return out


def paired_table(result):
    """The paired evaluation as Markdown: one row per condition, then the paired differences."""
    lines = ["| condition | score | solved | gold answer log-prob |", "|---|---|---|---|"]
    for c, v in result["conditions"].items():
        lines.append(f"| {c} | {100 * v['score']:.1f} | {100 * v['solve_rate']:.1f} | {v['gold_logprob']:.3f} |")
    lines += ["", "| paired difference | score (points) [95 % CI] | sign test p (better/worse) | "
              "gold log-prob [95 % CI] | sign test p |", "|---|---|---|---|---|"]
    for name, v in result["paired"].items():
        s, g = v["score"], v["gold_logprob"]
        lines.append(f"| {name} | {100 * s['diff']:+.1f} [{100 * s['ci95'][0]:+.1f}, {100 * s['ci95'][1]:+.1f}] | "
                     f"{s['p_sign']:.3g} ({s['better']}/{s['worse']}) | {g['diff']:+.3f} [{g['ci95'][0]:+.3f}, "
                     f"{g['ci95'][1]:+.3f}] | {g['p_sign']:.3g} |")
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------------------------------------
# Statistics over runs


def ranks(x):
    """Ranks 1..n with ties given their average rank (as scipy.stats.rankdata)."""
    x = np.asarray(x, dtype=float)
    order = np.argsort(x, kind="mergesort")
    r = np.empty(len(x))
    r[order] = np.arange(1, len(x) + 1)
    for v in np.unique(x):
        tie = x == v
        r[tie] = r[tie].mean()
    return r


def spearman(a, b):
    """Spearman rho = Pearson correlation of the ranks. NaN when either series is constant."""
    ra, rb = ranks(a), ranks(b)
    ra, rb = ra - ra.mean(), rb - rb.mean()
    denom = np.sqrt((ra ** 2).sum() * (rb ** 2).sum())
    return float((ra * rb).sum() / denom) if denom > 0 else float("nan")


def mean_std(values):
    """(mean, sample std with ddof = 1; 0 for a single value)."""
    v = np.asarray(values, dtype=float)
    return float(v.mean()), float(v.std(ddof=1)) if len(v) > 1 else 0.0


def permutation_p(a, b):
    """Exact two-sided permutation test of mean(a) - mean(b): the share of all ways to split the pooled values
    into groups of len(a) and len(b) whose mean difference is at least as large in size as the observed one.
    With 3 seeds against 3 there are only 20 splits, so p can never fall below 2/20 = 0.1."""
    pooled, k = np.asarray(list(a) + list(b), dtype=float), len(a)
    observed = abs(np.mean(a) - np.mean(b))
    diffs = []
    for idx in itertools.combinations(range(len(pooled)), k):
        inside = np.zeros(len(pooled), bool)
        inside[list(idx)] = True
        diffs.append(abs(pooled[inside].mean() - pooled[~inside].mean()))
    return float(np.mean(np.asarray(diffs) >= observed - 1e-12))


def write_json(path, obj):
    """Atomically: a reader sees the old file or the new one, never half of one."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(obj, f, indent=2)
    os.replace(path + ".tmp", path)


def read_json(path):
    with open(path) as f:
        return json.load(f)


def read_metrics(run):
    with open(os.path.join(run, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def load_runs(folders):
    """Every run under the folders, read once: {"dir", "cfg", "metrics", "finished", and "eval",
    "eval_no_context", "eval_paired" where evaluate.py wrote them}. A run is finished when its training
    reached its last step; runs still training stay out of rho and the curves."""
    runs = []
    for folder in folders:
        for cfg_path in sorted(glob.glob(os.path.join(folder, "**", "config.json"), recursive=True)):
            d = os.path.dirname(cfg_path)
            run = {"dir": d, "cfg": read_json(cfg_path),
                   "metrics": read_metrics(d) if os.path.exists(os.path.join(d, "metrics.jsonl")) else []}
            run["finished"] = bool(run["metrics"]) and run["metrics"][-1]["step"] >= run["cfg"].get("steps", 0)
            for name in ("eval", "eval_no_context", "eval_paired"):
                if os.path.exists(os.path.join(d, f"{name}.json")):
                    run[name] = read_json(os.path.join(d, f"{name}.json"))
            runs.append(run)
    return runs


def method_key(cfg):
    """A table row: the method, the team when it is not the usual one (e.g. `ours (pocket-naive)`), and the
    random-reward control."""
    return (cfg["method"] + ("" if cfg["team"] in ("default", "pocket", "tiny") else f" ({cfg['team']})")
            + (" [random reward]" if cfg.get("reward") == "random" else ""))


def partial_spearman(x, y, z):
    """Spearman correlation of x and y with z held fixed: the partial correlation of the ranks,
    (r_xy - r_xz r_yz) / sqrt((1 - r_xz^2)(1 - r_yz^2)). With z = the step, it removes the part of
    rho(reward, H) that any two series drifting over training would share."""
    rxy, rxz, ryz = spearman(x, y), spearman(x, z), spearman(y, z)
    denom = np.sqrt((1 - rxz ** 2) * (1 - ryz ** 2))
    return float((rxy - rxz * ryz) / denom) if denom > 0 else float("nan")


def summarize(folders, out):
    """Table 1-style Markdown (method x task, mean +- std over seeds; with a zero-context column when runs were
    also evaluated with C = 0, and each method's score minus single's with an exact permutation p over seeds
    when single has several seeds), Spearman rho(reward, H) per run, per method and their mean."""
    os.makedirs(out, exist_ok=True)
    cells, zero_c, rhos, rho_method, paired = {}, {}, {}, {}, {}
    for run in load_runs(folders):
        cfg = run["cfg"]
        key = (method_key(cfg), cfg["task"])
        for name, into in (("eval", cells), ("eval_no_context", zero_c), ("eval_paired", paired)):
            if name in run:
                into.setdefault(key, []).append(run[name]["paired"] if name == "eval_paired" else run[name])
        m = [r for r in run["metrics"] if "entropy" in r]
        if len(m) >= 3 and run["finished"]:
            reward, H, step = ([r[k] for r in m] for k in ("reward", "entropy", "step"))
            rhos[run["dir"]] = {"reward_H": spearman(reward, H), "step_H": spearman(step, H),
                                "reward_H_given_step": partial_spearman(reward, H, step)}
            rho_method.setdefault(key[0], []).append(rhos[run["dir"]])
    for path in glob.glob(os.path.join(out, "untrained-*.json")):
        ev = read_json(path)
        cells.setdefault(("untrained", ev["task"]), []).append(ev)

    def cell(evs, k):
        if not evs:
            return "–"
        m, s = mean_std([e[k] for e in evs])
        return f"{100 * m:.1f}" if len(evs) == 1 else f"{100 * m:.1f} ± {100 * s:.1f}"

    tasks = sorted({t for _, t in cells})
    cols = [(t, "score", cells) for t in tasks] + [(t, "solve_rate", cells) for t in tasks]
    cols += [(t, "score", zero_c) for t in tasks if any(k[1] == t for k in zero_c)]
    title = {("score", 0): "score", ("solve_rate", 0): "solved", ("score", 1): "score, C = 0"}
    versus = [t for t in tasks if len(cells.get(("single", t), [])) > 1]  # score minus single's, with p

    def delta(meth, t):
        a, b = [e["score"] for e in cells.get((meth, t), [])], [e["score"] for e in cells[("single", t)]]
        if meth in ("single", "untrained") or len(a) < 2:
            return "–"
        return f"{100 * (np.mean(a) - np.mean(b)):+.1f} (p = {permutation_p(a, b):.2f})"

    def paired_cell(meth, t, other):
        """Mean over seeds of each seed's paired difference (points), and in how many seeds p_sign < 0.05."""
        ps = [p[f"with_C - {other}"]["score"] for p in paired.get((meth, t), []) if f"with_C - {other}" in p]
        if not ps:
            return "–"
        d = [100 * p["diff"] for p in ps]
        m, sd = mean_std(d)
        return (f"{m:+.1f}" + (f" ± {sd:.1f}" if len(d) > 1 else "")
                + f" (p < 0.05 in {sum(p['p_sign'] < 0.05 for p in ps)}/{len(ps)})")

    pair_cols = [(t, o) for t in tasks for o in ("zero_C", "shuffled_C") if any(k[1] == t for k in paired)]
    pair_title = {"zero_C": "with C − C = 0 (paired)", "shuffled_C": "with C − shuffled C (paired)"}
    lines = ["| method | " + " | ".join(f"{t} {title[k, src is zero_c]}" for t, k, src in cols)
             + "".join(f" | {t} {pair_title[o]}" for t, o in pair_cols)
             + "".join(f" | {t} score − single's" for t in versus) + " | seeds |",
             "|---|" + "---|" * (len(cols) + len(pair_cols) + len(versus)) + "---|"]
    for meth in sorted({m for m, _ in cells}):
        seeds = max(len(cells.get((meth, t), [])) for t in tasks)
        row = ([cell(src.get((meth, t), []), k) for t, k, src in cols] + [paired_cell(meth, t, o) for t, o in pair_cols]
               + [delta(meth, t) for t in versus])
        lines.append(f"| {meth} | " + " | ".join(row) + f" | {seeds} |")
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
    does over training), fig6.png (score vs m). Returns the paths written."""
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
    for draw in (fig4, fig5, reward_curves, probe_curves, fig6):
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


def band(ax, x, Y, label=None, color=None, spread="std"):
    """Mean over seeds (rows of Y) and a band: +- std, or min-max."""
    mu = Y.mean(0)
    lo, hi = (mu - Y.std(0), mu + Y.std(0)) if spread == "std" else (Y.min(0), Y.max(0))
    ax.plot(x, mu, label=label, color=color)
    ax.fill_between(x, lo, hi, alpha=0.15, color=color)


def series(runs, key, T):
    """(seeds, T) array of one metric; a list-valued metric gives (seeds, T, k)."""
    return np.array([[np.nan if r.get(key) is None else r[key] for r in run["metrics"][:T]] for run in runs],
                    dtype=float)


def fig4(runs, plt):
    """Paper Fig. 4: utilisation per expert (mean and band across seeds), entropy and reward of `ours` runs."""
    for (task, team), group in by_key(runs, lambda r: (r["cfg"]["task"], r["cfg"]["team"]),
                                      lambda r: r["cfg"]["method"] == "ours" and r["finished"]):
        T = min(len(r["metrics"]) for r in group)
        steps, names = np.arange(1, T + 1), group[0]["cfg"]["team_models"]["experts"]
        fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(7, 7), sharex=True)
        U = series(group, "utilization", T)                                   # (seeds, T, n)
        for i, name in enumerate(names):
            band(ax1, steps, U[:, :, i], label=name)
        ax1.set_ylabel("utilisation u_i (Eq. 15)")
        ax1.set_title(f"ours on {task} ({team} team, {len(group)} seed{'s' * (len(group) > 1)}; "
                      f"uniform routing: H = log {len(names)} = {np.log(len(names)):.4f})", fontsize=9)
        ax1.legend(fontsize=8)
        for key, ax, color in (("reward", ax2, "tab:green"), ("entropy", ax2.twinx(), "tab:purple")):
            band(ax, steps, series(group, key, T), color=color)
            ax.set_ylabel("training reward" if key == "reward" else "routing entropy H", color=color)
            ax.ticklabel_format(axis="y", useOffset=False)
        ax2.set_xlabel("step")
        yield f"fig4_{task}_{team}.png", fig


def fig5(runs, plt):
    """Paper Fig. 5: validation score with C and with C = 0, per method; bar = mean over seeds, dots = seeds."""
    pairs = {k: [(r["eval"]["score"], r["eval_no_context"]["score"]) for r in g]
             for k, g in by_key(runs, lambda r: method_key(r["cfg"]), lambda r: "eval" in r and "eval_no_context" in r)}
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
            band(axes[0, 0], steps, series(seeds, "c_rms", T) / series(seeds, "embed_rms", T), meth, color)
            band(axes[0, 1], steps, series(seeds, "c_varying", T), meth, color)
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


# ----------------------------------------------------------------------------------------------------------


def main(argv=None):
    from experts import check_models
    from experts import pick_device, team_models
    from train import ArgumentParser, fail, parse_args
    p = ArgumentParser(description="Score runs on the validation split; summarise and plot folders of runs. "
                       "With --untrained, any train.py flag (--task, --team, --policy, --task-config, prompt and "
                       "generation flags) describes the policy to score.")
    p.add_argument("--run", help="a run folder written by train.py")
    p.add_argument("--untrained", action="store_true", help="score the policy before training, as train.py's "
                   "flags describe it (e.g. --task chain_sum --team pocket --worked-example)")
    p.add_argument("--n", type=int, default=4000, help="validation items (paper: 4000; GSM8K: its 1319 test items)")
    p.add_argument("--batch-size", type=int, default=16, help="prompts per generation batch")
    p.add_argument("--no-context", action="store_true", help="feed zero context tokens instead of C (Fig. 5)")
    p.add_argument("--paired", action="store_true", help="score the same items with C, with C = 0 and with C "
                   "shuffled across items; paired differences, sign tests and bootstrap intervals -> eval_paired.json")
    p.add_argument("--summarize", nargs="+", metavar="FOLDER", help="folders of runs -> table, Spearman rho, plots")
    p.add_argument("--out", default=None, help="where to write (default: the run folder, or results/)")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or mps")
    a, train_flags = p.parse_known_args(argv)
    if sum(map(bool, (a.run, a.untrained, a.summarize))) != 1:
        p.error("give exactly one of --run DIR, --untrained or --summarize FOLDER...")
    if a.paired and a.no_context:
        p.error("--paired already scores C = 0 beside C; drop --no-context")
    if a.paired and not a.run:
        p.error("--paired needs --run DIR (a run with context tokens)")
    if train_flags and not a.untrained:
        p.error(f"unrecognized arguments: {' '.join(train_flags)} (train.py flags go with --untrained only)")
    for flag in ("n", "batch_size"):
        if getattr(a, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(a, flag)}")
    if a.summarize:
        missing = [d for d in a.summarize if not os.path.isdir(d)]
        if missing:
            p.error(f"--summarize: no such folder {missing[0]}")
        out = a.out or "results"
        table, rho = summarize(a.summarize, out)
        print(table + f"\nSpearman rho(reward, entropy): mean {rho['mean']} over {len(rho['per_run'])} runs")
        for path in plot_runs(a.summarize, out):
            print("wrote", path)
        return
    lora_state = method_state = step = None
    if a.untrained:
        targs = parse_args([*train_flags, "--method", "single"])
        cfg = {**vars(targs), "team_models": team_models(targs)}
        models = [(cfg["team_models"]["policy"], "--policy" if targs.policy else f"--team {targs.team}")]
        path = os.path.join(a.out or "results", f"untrained-{targs.task}-{targs.team}.json")
    else:
        cfg_path, ckpt = os.path.join(a.run, "config.json"), os.path.join(a.run, "checkpoint.pt")
        if not (os.path.exists(cfg_path) and os.path.exists(ckpt)):
            fail(f"--run {a.run} has no config.json and checkpoint.pt (is it a finished train.py run?)")
        try:  # a corrupt or foreign file: say so in one line
            with open(cfg_path) as f:
                cfg = json.load(f)
            state = torch.load(ckpt, map_location="cpu", weights_only=False)
            lora_state, method_state, step = state["lora"], state["method"], int(state["step"])
            team = cfg["team_models"]
        except Exception as e:
            fail(f"--run {a.run}: unreadable config.json or checkpoint.pt ({type(e).__name__}: "
                 f"{(str(e).splitlines() or [''])[0][:160]})")
        experts = team["experts"] if cfg["method"] not in ("single", "soft_prompt", "identical") else []
        models = [(m, f"--run {a.run}") for m in [team["policy"]] + experts]
        name = "eval_paired.json" if a.paired else "eval_no_context.json" if a.no_context else "eval.json"
        path = os.path.join(a.out or a.run, name)
    try:
        check_models(models)
        result = evaluate(SimpleNamespace(**cfg), a.n, a.batch_size, lora_state, method_state, a.no_context,
                          untrained=a.untrained, device=pick_device(a.device),
                          conditions=CONDITIONS if a.paired else None)
    except (ValueError, FileNotFoundError) as e:  # unknown task, missing data or model, no CUDA: one line
        fail(str(e))
    if step is not None:
        result["step"] = step
    write_json(path, result)
    if a.paired:  # eval.json too: the with-C scores are the run's validation score
        write_json(os.path.join(os.path.dirname(path), "eval.json"),
                   {**{k: v for k, v in result.items() if k not in ("conditions", "paired", "per_item")},
                    "per_item": {"with_C": result["per_item"]["with_C"]}})
    print(f"{result['method']} on {result['task']}: score {100 * result['score']:.1f} | "
          f"solved {100 * result['solve_rate']:.1f} | n {result['n']} -> {path}")
    if "paired" in result:
        print(paired_table(result))


if __name__ == "__main__":
    main()
