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
  2. Accuracy is the mean reasoning-gym score (partial credit, DESIGN §2); the exact-solve rate (score == 1)
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


@torch.no_grad()
def evaluate(args, n, batch_size=16, lora_state=None, method_state=None, no_context=False, untrained=False,
             device="cpu"):
    """Score the policy described by `args` (a run's config) on n validation items. Returns a dict."""
    import rewards
    from baselines import METHODS
    from experts import load_model
    from grpo import completion_mask, encode_prompts, eos_token_ids, sample
    from lora import apply_lora, load_lora_state_dict
    device = torch.device(device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    team = args.team_models
    items = rewards.load_entries(args.task, "val", n, args.seed, args.data_path, getattr(args, "task_config", None))
    n = min(n, len(items))
    policy, tok = load_model(team["policy"], device, dtype)
    method = METHODS["single" if untrained else args.method](team, policy.config.hidden_size, args, device, dtype)
    if lora_state is not None:
        apply_lora(policy, args.lora_rank, args.lora_alpha)
        load_lora_state_dict(policy, lora_state)
    if method_state is not None:
        method.load_state_dict(method_state)
    policy.eval(), method.eval()
    eos_ids = eos_token_ids(policy, tok)  # the same stop tokens as in training
    scores, sources, status = [], [], {}
    for start in range(0, n, batch_size):
        batch = [items[i] for i in range(start, min(n, start + batch_size))]
        questions = [it["question"] for it in batch]
        ctx = method(questions)
        C = ctx["C"] if ctx["C"] is None or not no_context else torch.zeros_like(ctx["C"])
        prompts = [rewards.build_prompt(tok, q if h is None else q + h, args.system_prompt, args.worked_example,
                                        args.response_prefix) for q, h in zip(questions, ctx["hints"])]
        ids, mask = encode_prompts(tok, prompts, device)
        comp = sample(policy, ids, mask, C, 1, args.max_new_tokens, 1.0, eos_ids, tok.pad_token_id,
                      args.context_position, greedy=True)
        comp = comp.masked_fill(~completion_mask(comp, eos_ids), tok.pad_token_id)
        r, counts = rewards.score_batch(batch, tok.batch_decode(comp, skip_special_tokens=True))
        scores += r
        sources += [it.get("metadata", {}).get("source_dataset", args.task) for it in batch]
        for k, v in counts.items():
            status[k] = status.get(k, 0) + v
    scores = np.array(scores)
    per = {s: {"score": float(scores[[x == s for x in sources]].mean()),
               "solve_rate": float((scores[[x == s for x in sources]] == 1).mean()),
               "n": sources.count(s)} for s in sorted(set(sources))}
    return {"task": args.task, "method": "untrained" if untrained else args.method, "n": int(n),
            "score": float(scores.mean()), "solve_rate": float((scores == 1).mean()),
            "no_context": no_context, "per_dataset": per, "scorer_status": status}


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


def read_metrics(run):
    with open(os.path.join(run, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def finished(cfg, metrics):
    """A run whose training reached its last step (runs still training stay out of rho and the curves)."""
    return bool(metrics) and metrics[-1]["step"] >= cfg.get("steps", 0)


def find_runs(folders):
    runs = []
    for folder in folders:
        runs += sorted(os.path.dirname(p) for p in glob.glob(os.path.join(folder, "**", "config.json"), recursive=True))
    return runs


def method_key(cfg):
    """A table row: the method, and the team when it is not the usual one (e.g. `ours (pocket-naive)`)."""
    return cfg["method"] + ("" if cfg["team"] in ("default", "pocket", "tiny") else f" ({cfg['team']})")


def summarize(folders, out):
    """Table 1-style Markdown (method x task, mean +- std over seeds; with a zero-context column when runs were
    also evaluated with C = 0, and each method's score minus single's with an exact permutation p over seeds
    when single has several seeds), Spearman rho(reward, H) per run, per method and their mean."""
    os.makedirs(out, exist_ok=True)
    cells, zero_c, rhos, rho_method = {}, {}, {}, {}
    for run in find_runs(folders):
        cfg = json.load(open(os.path.join(run, "config.json")))
        key = (method_key(cfg), cfg["task"])
        for name, into in (("eval.json", cells), ("eval_no_context.json", zero_c)):
            if os.path.exists(os.path.join(run, name)):
                into.setdefault(key, []).append(json.load(open(os.path.join(run, name))))
        m = [r for r in read_metrics(run) if "entropy" in r]
        if len(m) >= 3 and finished(cfg, m):
            rhos[run] = spearman([r["reward"] for r in m], [r["entropy"] for r in m])
            rho_method.setdefault(key[0], []).append(rhos[run])
    for path in glob.glob(os.path.join(out, "untrained-*.json")):
        ev = json.load(open(path))
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

    lines = ["| method | " + " | ".join(f"{t} {title[k, src is zero_c]}" for t, k, src in cols)
             + "".join(f" | {t} score − single's" for t in versus) + " | seeds |",
             "|---|" + "---|" * (len(cols) + len(versus)) + "---|"]
    for meth in sorted({m for m, _ in cells}):
        seeds = max(len(cells.get((meth, t), [])) for t in tasks)
        row = [cell(src.get((meth, t), []), k) for t, k, src in cols] + [delta(meth, t) for t in versus]
        lines.append(f"| {meth} | " + " | ".join(row) + f" | {seeds} |")
    table = "\n".join(lines) + "\n"
    finite = [v for v in rhos.values() if np.isfinite(v)]
    by_method = {meth: {"mean": float(np.mean(v)), "std": mean_std(v)[1], "runs": len(v)}
                 for meth, v in sorted(rho_method.items()) if np.all(np.isfinite(v))}
    rho = {"per_run": rhos, "by_method": by_method, "mean": float(np.mean(finite)) if finite else None}
    with open(os.path.join(out, "table.md"), "w") as f:
        f.write(table)
    with open(os.path.join(out, "spearman.json"), "w") as f:
        json.dump(rho, f, indent=2)
    return table, rho


# ----------------------------------------------------------------------------------------------------------
# Figures (matplotlib is optional: only this part needs it)


def plot_runs(folders, out):
    """fig4_<task>_<team>.png: utilisation per expert (mean and band across seeds), entropy and reward of
    `ours` runs; fig5.png: validation score with vs without C per method; reward_<task>.png: training reward
    of every method; fig6.png: score vs number of latents m."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: pip install matplotlib to draw the figures", file=sys.stderr)
        return []
    os.makedirs(out, exist_ok=True)
    written, by_task = [], {}
    for run in find_runs(folders):
        cfg = json.load(open(os.path.join(run, "config.json")))
        m = read_metrics(run) if cfg["method"] == "ours" else []
        if finished(cfg, m):
            by_task.setdefault((cfg["task"], cfg["team"]), []).append((cfg, m, run))
    for (task, team), runs in sorted(by_task.items()):
        T = min(len(m) for _, m, _ in runs)
        if T == 0:
            continue
        steps = np.arange(1, T + 1)
        fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(7, 7), sharex=True)
        U = np.array([[r["utilization"] for r in m[:T]] for _, m, _ in runs])  # (seeds, T, n)
        names = runs[0][0]["team_models"]["experts"]
        for i, name in enumerate(names):
            mu, sd = U[:, :, i].mean(0), U[:, :, i].std(0)
            ax1.plot(steps, mu, label=name)
            ax1.fill_between(steps, mu - sd, mu + sd, alpha=0.2)
        ax1.set_ylabel("utilisation u_i (Eq. 15)")
        ax1.set_title(f"ours on {task} ({team} team, {len(runs)} seed{'s' * (len(runs) > 1)}; "
                      f"uniform routing: H = log {len(names)} = {np.log(len(names)):.4f})", fontsize=9)
        ax1.legend(fontsize=8)
        for key, ax, color in (("reward", ax2, "tab:green"), ("entropy", ax2.twinx(), "tab:purple")):
            Y = np.array([[r[key] for r in m[:T]] for _, m, _ in runs])
            ax.plot(steps, Y.mean(0), color=color, label=key)
            ax.fill_between(steps, Y.mean(0) - Y.std(0), Y.mean(0) + Y.std(0), color=color, alpha=0.15)
            ax.set_ylabel("training reward" if key == "reward" else "routing entropy H", color=color)
            ax.ticklabel_format(axis="y", useOffset=False)
        ax2.set_xlabel("step")
        path = os.path.join(out, f"fig4_{task}_{team}.png")
        fig.tight_layout(), fig.savefig(path, dpi=110), plt.close(fig)
        written.append(path)
    # Fig. 5: validation score with C and with C = 0 (eval.json vs eval_no_context.json), per method: the bar is
    # the mean over seeds, each dot one seed
    pairs = {}
    for run in find_runs(folders):
        a, b = os.path.join(run, "eval.json"), os.path.join(run, "eval_no_context.json")
        if os.path.exists(a) and os.path.exists(b):
            key = method_key(json.load(open(os.path.join(run, "config.json"))))
            pairs.setdefault(key, []).append((json.load(open(a))["score"], json.load(open(b))["score"]))
    if pairs:
        keys = sorted(pairs)
        fig, ax = plt.subplots(figsize=(max(5, len(keys) * 1.4), 4))
        for j, (label, dx) in enumerate((("with C", -0.2), ("C = 0", 0.2))):
            vals = [100 * np.array([p[j] for p in pairs[k]]) for k in keys]
            ax.bar(np.arange(len(keys)) + dx, [v.mean() for v in vals], 0.4, label=label, alpha=0.8)
            for x, v in enumerate(vals):
                ax.plot(np.full(len(v), x + dx), v, "k.", ms=4)
        names = [f"{k}\n({len(pairs[k])} seed{'s' * (len(pairs[k]) > 1)})" for k in keys]
        ax.set_xticks(np.arange(len(keys)), names, fontsize=8)
        ax.set_ylabel("validation score (%)"), ax.set_title("Fig. 5: with vs without context tokens (dots: seeds)")
        top = max(100 * max(p) for v in pairs.values() for p in v)
        ax.set_ylim(0, 1.3 * top + 1)  # head-room: the legend covers no bar
        ax.legend(loc="upper center", ncol=2)
        path = os.path.join(out, "fig5.png")
        fig.tight_layout(), fig.savefig(path, dpi=110), plt.close(fig)
        written.append(path)
    # training reward over steps for every method (5-step moving average; mean and band across seeds)
    curves = {}
    for run in find_runs(folders):
        cfg, m = json.load(open(os.path.join(run, "config.json"))), read_metrics(run)
        if finished(cfg, m):
            curves.setdefault(cfg["task"], {}).setdefault(method_key(cfg), []).append([r["reward"] for r in m])
    for task, by_method in sorted(curves.items()):
        fig, ax = plt.subplots(figsize=(7, 4))
        for key, Y in sorted(by_method.items()):
            T = min(len(y) for y in Y)
            k = min(5, T)
            Y = np.array([np.convolve(y[:T], np.ones(k) / k, mode="valid") for y in Y])
            steps = np.arange(k, T + 1)
            ax.plot(steps, Y.mean(0), label=f"{key} ({len(Y)})")
            ax.fill_between(steps, Y.min(0), Y.max(0), alpha=0.12)
        ax.set_xlabel("step"), ax.set_ylabel(f"training reward ({k}-step moving average)")
        ax.set_title(f"{task}: training reward per method (line: mean over seeds, band: min-max)", fontsize=9)
        ax.legend(fontsize=7)
        path = os.path.join(out, f"reward_{task}.png")
        fig.tight_layout(), fig.savefig(path, dpi=110), plt.close(fig)
        written.append(path)
    by_m = {}
    for run in find_runs(folders):
        cfg, ev = json.load(open(os.path.join(run, "config.json"))), os.path.join(run, "eval.json")
        if cfg["method"] == "ours" and os.path.exists(ev):
            by_m.setdefault(cfg["num_latents"], []).append(json.load(open(ev))["score"])
    if len(by_m) > 1:
        ms = sorted(by_m)
        stats = [mean_std(by_m[m]) for m in ms]
        fig, ax = plt.subplots(figsize=(5, 4))
        ax.errorbar(ms, [100 * s[0] for s in stats], yerr=[100 * s[1] for s in stats], marker="o", capsize=3)
        ax.set_xlabel("number of latents m"), ax.set_ylabel("validation score (%)"), ax.set_title("Fig. 6")
        path = os.path.join(out, "fig6.png")
        fig.tight_layout(), fig.savefig(path, dpi=110), plt.close(fig)
        written.append(path)
    return written


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
    p.add_argument("--summarize", nargs="+", metavar="FOLDER", help="folders of runs -> table, Spearman rho, plots")
    p.add_argument("--out", default=None, help="where to write (default: the run folder, or results/)")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or mps")
    a, train_flags = p.parse_known_args(argv)
    if sum(map(bool, (a.run, a.untrained, a.summarize))) != 1:
        p.error("give exactly one of --run DIR, --untrained or --summarize FOLDER...")
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
        models = [(m, f"--run {a.run}") for m in [team["policy"]] + (team["experts"] if cfg["method"] != "single"
                                                                    else [])]
        path = os.path.join(a.out or a.run, "eval_no_context.json" if a.no_context else "eval.json")
    try:
        check_models(models)
        result = evaluate(SimpleNamespace(**cfg), a.n, a.batch_size, lora_state, method_state, a.no_context,
                          untrained=a.untrained, device=pick_device(a.device))
    except (ValueError, FileNotFoundError) as e:  # unknown task, missing data or model, no CUDA: one line
        fail(str(e))
    if step is not None:
        result["step"] = step
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(result, f, indent=2)
    os.replace(path + ".tmp", path)
    print(f"{result['method']} on {result['task']}: score {100 * result['score']:.1f} | "
          f"solved {100 * result['solve_rate']:.1f} | n {result['n']} -> {path}")


if __name__ == "__main__":
    main()
