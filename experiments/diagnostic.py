"""
Why the co-trained policy stops reading C: a diagnostic at the paper's LoRA learning rate, pre-registered in
results/diagnostic/preregistration.md before its first run. Not a verdict: two seeds an arm (a third where an arm's
two disagree), no test that could reach significance, a reading of which mechanism the records agree with.

The second verdict's `ours_strong` arm (experiments/verdict2.py, amendment 2: gcd, C in the ceiling's slot, 300
steps, router lr 3e-4, LoRA lr 1e-3 on every linear map) with one change per arm:
  paper_lr       LoRA at lr 1e-4, the paper's Listing 1 (10x lower than the verdict's)
  frozen_policy  --freeze-policy: g_phi alone trains (the mechanism test's setting, on the verdict's items)
Same seeds, items and step-1 draws as the verdict's runs, so each run pairs with its archived twin
(results/verdict2/runs/ours_strong-sK). Each run is evaluated (paired: with C, C = the anchor, shuffled C; 100
items) at steps 100, 200 and 300: it trains to 100, is evaluated, resumes to 200 (--steps may change on --resume:
it changes no step's maths, the lr is constant), and so on.

    # from a frozen clone at the pre-registration's commit, one pinned worker per core; start it again after any stop
    python experiments/diagnostic.py --cores 1 --out /work/runs/diagnostic \
        --records /work/main/results/diagnostic/runs --commit-into /work/main
    python experiments/diagnostic.py --status --out /work/runs/diagnostic   # archived, running, left
    python experiments/diagnostic.py --analyse     # results/diagnostic/table.md and curves.png from the records
"""
import argparse
import json
import os
import shutil
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "experiments"))

from lib.stats import sign_flip_p  # noqa: E402
from support.harness.checks import finished_run  # noqa: E402
from verdict import cpu_capability, read_timing  # noqa: E402
from pocket import run  # noqa: E402
from verdict2 import (TASK, VERDICT_HYPER, VERDICT_PROMPT, alive, claim, claim_pid, commit_record,  # noqa: E402
                      start_workers, verdict_arms, worker_problem)

RESULTS = os.path.join(ROOT, "results", "diagnostic")
TWINS = os.path.join(ROOT, "results", "verdict2", "runs")
CHECKPOINTS = (100, 200, 300)
SEEDS, THIRD_SEED = (0, 1), 2
BUDGET_HOURS = 14.0  # the issue's budget for every run of the diagnostic, third seeds included
N_EVAL = 100


def arms():
    """name -> train.py flags: the verdict's `ours_strong` with one change each."""
    twin = verdict_arms()["ours_strong"]
    return {"paper_lr": [*twin, "--lr", "1e-4"],  # argparse keeps the last value: 1e-3 of VERDICT_HYPER gives way
            "frozen_policy": [*twin, "--freeze-policy"]}


def flags(arm, seed, steps):
    hyper = list(VERDICT_HYPER)
    hyper[hyper.index("--steps") + 1] = str(steps)
    return [*TASK, *VERDICT_PROMPT, *hyper, *arms()[arm], "--seed", str(seed)]


def plan(records):
    """[(run name, arm, seed)] in the order workers take them: seed by seed, both arms of a seed together; then seed
    2 of an arm whose two seeds disagree (third_seed_arms), while the budget allows."""
    names = [(f"{arm}-s{seed}", arm, seed) for seed in SEEDS for arm in arms()]
    return names + [(f"{arm}-s{THIRD_SEED}", arm, THIRD_SEED) for arm in third_seed_arms(records)]


# --------------------------------------------------------------------------------------------------
# The runs: train to each checkpoint, evaluate there, archive and commit what is done.


def segment(out, arm, seed, steps, log):
    """Train the run to `steps` (resuming where it stopped) and evaluate it there, paired, unless done. Returns the
    (training, evaluation) seconds this call spent."""
    kept = os.path.join(out, f"eval_paired-{steps}.json")
    if os.path.exists(kept):
        return 0.0, 0.0
    train = 0.0
    if not finished_run(out, steps, 0):
        resume = ["--resume"] if os.path.exists(os.path.join(out, "config.json")) else []
        train = run(["train.py", *flags(arm, seed, steps), "--out", out, *resume,
                     "--expert-cache", os.path.join(os.path.dirname(out), "expert-states")], log)
    evaluation = run(["evaluate.py", "--run", out, "--n", str(N_EVAL), "--paired"], log)
    with open(os.path.join(out, "eval_paired.json")) as f:
        assert json.load(f)["step"] == steps, f"{out}: evaluated another step than {steps}"
    shutil.copy2(os.path.join(out, "eval_paired.json"), kept + ".tmp")
    os.replace(kept + ".tmp", kept)  # written last: the segment is done
    return train, evaluation


def one_run(out, records, name, arm, seed, log, commit_into):
    for steps in CHECKPOINTS:
        train, evaluation = segment(out, arm, seed, steps, log)
        if not (train or evaluation):
            continue
        timing = read_timing(out)
        timing["train_seconds"] = timing.get("train_seconds", 0) + train
        timing[f"eval_seconds_{steps}"] = evaluation
        timing["cpu"] = cpu_capability()
        timing["load_average_after"] = os.getloadavg()
        with open(os.path.join(out, "timing.json"), "w") as f:
            json.dump(timing, f)
        archive(out, os.path.join(records, name))
        if commit_into:
            commit_record(commit_into, records, f"{name} at step {steps}", label="diagnostic")


def archive(run_dir, dest):
    """The small records (config, per-step metrics, timing, the paired evaluation at each checkpoint) into results/."""
    os.makedirs(dest, exist_ok=True)
    for name in os.listdir(run_dir):
        if name in ("config.json", "metrics.jsonl", "timing.json") or name.startswith("eval_paired-"):
            shutil.copy2(os.path.join(run_dir, name), dest)


def finished(records, name):
    return os.path.exists(os.path.join(records, name, f"eval_paired-{CHECKPOINTS[-1]}.json"))


def worker(a, records):
    log = os.path.join(a.out, f"log-core{a.core}.txt")
    while True:
        todo = [(n, arm, seed) for n, arm, seed in plan(records) if not finished(records, n)]
        took = next(((n, arm, seed) for n, arm, seed in todo if claim(a.out, n)), None)
        if took is None:
            return
        name, arm, seed = took
        try:
            one_run(os.path.join(a.out, name), records, name, arm, seed, log, a.commit_into)
        finally:
            os.unlink(os.path.join(a.out, name + ".claim"))


def campaign(a, records):
    return max(start_workers(__file__, a, records, []))


def status(records, out):
    lines = []
    for name, _, _ in plan(records):
        done = [s for s in CHECKPOINTS if os.path.exists(os.path.join(records, name, f"eval_paired-{s}.json"))]
        pid = claim_pid(os.path.join(out, name + ".claim"))
        metrics = os.path.join(out, name, "metrics.jsonl")
        steps = sum(1 for line in open(metrics) if line.strip()) if os.path.exists(metrics) else 0
        state = ("archived" if finished(records, name) else "running" if pid and alive(pid) else
                 "stopped (resumes at its last checkpoint)" if steps else "not started")
        lines.append(f"{name}: {state}; step {steps} of {CHECKPOINTS[-1]}; evaluated at {done or 'none'}")
    lines.append(f"core-hours so far: {spent_hours(records):.2f} of {BUDGET_HOURS}")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------
# The reading: per run the measures the pre-registration names, beside the archived twin.


def run_names(records):
    """The run folders in `records`, sorted; none before the first record."""
    return sorted(os.listdir(records)) if os.path.isdir(records) else []


def verdict_runs():
    """The second verdict's `ours_strong` run folders (lr 1e-3): the twins, and the co-trained runs beside P's."""
    return [os.path.join(TWINS, n) for n in sorted(os.listdir(TWINS)) if n.startswith("ours_strong-s")]


def column(metrics, key):
    """One metric over a run's steps, NaN where a step did not log it."""
    return np.array([x.get(key) if x.get(key) is not None else np.nan for x in metrics], dtype=float)


def load_run(d):
    """{"metrics": [...], "eval": {steps: eval_paired}, "timing": {...}} of a run folder (archived or a twin)."""
    metrics = [json.loads(line) for line in open(os.path.join(d, "metrics.jsonl")) if line.strip()]
    evals = {}
    for s in CHECKPOINTS:
        for name in (f"eval_paired-{s}.json", "eval_paired.json"):
            path = os.path.join(d, name)
            if os.path.exists(path):
                with open(path) as f:
                    e = json.load(f)
                if e.get("step") == s:
                    evals[s] = e
                    break
    return {"metrics": metrics, "eval": evals, "timing": read_timing(d)}


def measures(rec):
    """The pre-registered measures of one run: flat fraction of first draws (steps 1-25, 200-300), g_phi's
    gradient norm median (same windows), completions that carried a learning signal, and at each evaluated step
    C - shuffled and C - anchor (exact, points; gold log-prob, nats)."""
    m = rec["metrics"]
    flat, g, signal = (column(m, k) for k in ("zero_std_fraction", "grad_norm_g_phi", "trained_group_fraction"))
    out = {"steps": len(m), "flat_early": float(np.nanmean(flat[:25])),
           "flat_late": float(np.nanmean(flat[199:300])) if len(m) >= 300 else np.nan,
           "g_early": float(np.nanmedian(g[:25])),
           "g_late": float(np.nanmedian(g[199:300])) if len(m) >= 300 else np.nan,
           "signal": int(round(np.nansum(signal * 32))),
           "answer_late": float(np.nanmean(column(m, "answer_rate")[-25:])),
           "c_rms_last": float(m[-1]["c_rms"] / m[-1]["embed_rms"]) if m and m[-1].get("embed_rms") else np.nan}
    for s, e in rec["eval"].items():
        c = e["conditions"]
        for other, key in (("shuffled_C", "shuffled"), ("zero_C", "anchor")):
            out[f"{key}_{s}"] = 100 * (c["with_C"]["solve_rate"] - c[other]["solve_rate"])
            out[f"{key}_gold_{s}"] = c["with_C"]["gold_logprob"] - c[other]["gold_logprob"]
            item = e.get("paired", {}).get(f"with_C - {other}", {}).get("score")
            if item:  # over the 100 items of this one run: evaluate.py's interval and exact sign test
                out[f"{key}_items_{s}"] = (100 * item["ci95"][0], 100 * item["ci95"][1], item["better"],
                                           item["worse"], item["p_sign"])
        out[f"exact_{s}"] = 100 * c["with_C"]["solve_rate"]
    return out


def predictions(arm, mine, twin):
    """The pre-registration's predictions for one run, each True / False / None (not yet measurable), in its own
    words (results/diagnostic/preregistration.md, 'Predictions')."""
    late = mine.get("flat_late", np.nan)

    def known(x):
        return x is not None and np.isfinite(x)
    p = {"flat fraction of first draws, steps 200-300, <= 0.70": late <= 0.70 if known(late) else None,
         "g_phi gradient median, steps 200-300, >= 0.1": mine["g_late"] >= 0.1 if known(mine.get("g_late")) else None}
    if "shuffled_300" in mine:
        if arm == "paper_lr":
            p["C - shuffled at step 300 > the twin's"] = bool(mine["shuffled_300"] > twin.get("shuffled_300", 0))
        else:
            p["C - shuffled at step 300 > 0"] = bool(mine["shuffled_300"] > 0)
        if arm == "paper_lr" and "shuffled_100" in mine:
            p["C - shuffled grows from step 100 to 300"] = mine["shuffled_300"] > mine["shuffled_100"]
    return p


def starvation(mine):
    """Hypothesis S's sign in a frozen_policy run: flat 200-300 >= 0.90 and C - shuffled at 300 <= 0."""
    if not np.isfinite(mine.get("flat_late", np.nan)) or "shuffled_300" not in mine:
        return None
    return mine["flat_late"] >= 0.90 and mine["shuffled_300"] <= 0


def third_seed_arms(records):
    """Arms whose two seeds disagree on any prediction (both measured), while the core-hours spent and one more run
    at the arm's measured cost stay within BUDGET_HOURS."""
    if not all(finished(records, f"{arm}-s{seed}") for arm in arms() for seed in SEEDS):
        return []  # decided only once every first-round run is in
    picked, spent = [], spent_hours(records)
    for arm in arms():
        verdicts = [predictions(arm, measures(load_run(os.path.join(records, f"{arm}-s{seed}"))), twin_measures(seed))
                    for seed in SEEDS]
        if verdicts[0] != verdicts[1]:
            cost = max(run_hours(os.path.join(records, f"{arm}-s{s}")) for s in SEEDS)
            if spent + cost <= BUDGET_HOURS:
                picked.append(arm)
                spent += cost
    return picked


def twin_measures(seed):
    d = os.path.join(TWINS, f"ours_strong-s{seed}")
    return measures(load_run(d)) if os.path.isdir(d) else {}


def run_hours(d):
    t = read_timing(d)
    return (t.get("train_seconds", 0) + sum(v for k, v in t.items() if k.startswith("eval_seconds_"))) / 3600


def spent_hours(records):
    return sum(run_hours(os.path.join(records, n)) for n in run_names(records))


def fmt(x, f="+.0f"):
    return "–" if x is None or (isinstance(x, float) and not np.isfinite(x)) else format(x, f)


def over_seeds(records):
    """Per arm, C − shuffled at step 300 (exact, points) over its finished seeds: P minus its twin, F itself; the
    mean, the values and the exact one-sided sign-flip p (H1: > 0). Descriptive: the pre-registration names no test
    over seeds (with 2 seeds the p cannot go below 1/4, with 3 below 1/8)."""
    lines = []
    for arm, what in (("paper_lr", "P − its twin"), ("frozen_policy", "F")):
        done = sorted(int(n.rsplit("-s", 1)[1]) for n in run_names(records)
                      if n.startswith(arm + "-s") and finished(records, n))
        if not done:
            continue
        d = []
        for seed in done:
            m = measures(load_run(os.path.join(records, f"{arm}-s{seed}")))
            d.append(m["shuffled_300"] - (twin_measures(seed).get("shuffled_300", 0) if arm == "paper_lr" else 0))
        lines.append(f"{what}, C − shuffled at step 300 over seeds {', '.join(map(str, done))}: mean "
                     f"{np.mean(d):+.1f} points ({', '.join(f'{x:+.0f}' for x in d)}), one-sided sign-flip p = "
                     f"{sign_flip_p(d, 'greater'):.3g}")
    return lines


def flat_onset(rec, level=0.90, k=25):
    """Exploratory, chosen after the data: the first step at which the k-step mean of the flat share of first-draw
    groups reaches `level` (None if it never does)."""
    hit = np.nonzero(rolling(column(rec["metrics"], "zero_std_fraction"), k, np.nanmean)[k - 1:] >= level)[0]
    return int(hit[0]) + k if len(hit) else None


def onsets(records):
    """Exploratory lines: per run (the diagnostic's and every `ours_strong` run of the verdict), the step at which
    its first draws went flat (flat_onset) beside its C − shuffled at step 300."""
    runs = [(f"verdict `{os.path.basename(d)}` (lr 1e-3)", d) for d in verdict_runs()]
    runs += [(n, os.path.join(records, n)) for n in run_names(records) if finished(records, n)]
    lines = []
    for name, d in runs:
        rec = load_run(d)
        onset, m = flat_onset(rec), measures(rec)
        lines.append(f"| {name} | {onset if onset else 'never'} | {fmt(m.get('shuffled_300'))} |")
    return lines


def onset_split(records, levels=(0.80, 0.85, 0.90, 0.95), windows=(10, 25, 50)):
    """Exploratory: how robust the onsets table's pattern is. Over the co-trained runs (the verdict's `ours_strong`
    and P), in how many of the (level, window) settings of flat_onset every run that read C at step 300 (C −
    shuffled > 0) went flat later than every run that did not ("never" counts as after step 300)."""
    runs = verdict_runs() + [os.path.join(records, n) for n in run_names(records)
                             if n.startswith("paper_lr-s") and finished(records, n)]
    recs = [load_run(d) for d in runs]
    read = [measures(r).get("shuffled_300", 0) > 0 for r in recs]
    clean = []
    for level in levels:
        for k in windows:
            at = [flat_onset(r, level, k) or np.inf for r in recs]
            yes, no = [t for t, r in zip(at, read) if r], [t for t, r in zip(at, read) if not r]
            if yes and no and min(yes) > max(no):
                clean.append(f"{level:.2f}/{k}")
    return (f"Of the {len(recs)} co-trained runs, {sum(read)} read C at step 300; they all went flat later than "
            f"every other in {len(clean)} of {len(levels) * len(windows)} settings (flat level / window, steps): "
            f"{', '.join(clean) or 'none'}.")


def items(t):
    """'[+7, +25], 20 / 4, p 0.0015' from measures' (ci low, ci high, better, worse, p) over one run's items."""
    return "–" if t is None else f"[{t[0]:+.0f}, {t[1]:+.0f}], {t[2]} / {t[3]}, p {t[4]:.2g}"


def table(records):
    L = ["# The diagnostic (experiments/diagnostic.py --analyse)", "",
         "Per run beside its archived twin (the verdict's `ours_strong` of the same seed, LoRA lr 1e-3; evaluated at "
         "step 300 only). flat: the share of first-draw groups with equal rewards; g_phi: median gradient norm; "
         "signal: completions in groups that carried a learning signal; C − shuffled / C − anchor: exact solve "
         "rate with its C minus with another item's C / with the anchor, points on the same 100 items (gold "
         "log-prob difference in nats in brackets).", "",
         "| run | steps | flat 1–25 → 200–300 | g_phi 1–25 → 200–300 | signal | "
         "exact with C 100 / 200 / 300 | C − shuffled 100 / 200 / 300 | C − anchor 100 / 200 / 300 | "
         "C rms / token | C − shuffled at 300 over its items: 95 % interval, better / worse, sign p |",
         "|---" * 10 + "|"]
    done = run_names(records)
    rows = [(n, measures(load_run(os.path.join(records, n)))) for n in done]
    seeds = sorted({int(n.rsplit("-s", 1)[1]) for n in done})
    rows += [(f"twin ours_strong-s{s}", twin_measures(s)) for s in seeds]

    def three(m, key):
        return " / ".join(fmt(m.get(f"{key}_{s}")) + (f" ({m[f'{key}_gold_{s}']:+.2f})" if f"{key}_gold_{s}" in m
                                                       else "") for s in CHECKPOINTS)
    for n, m in rows:
        L.append(f"| {n} | {m.get('steps', 0)} | {fmt(m.get('flat_early'), '.2f')} → {fmt(m.get('flat_late'), '.2f')}"
                 f" | {fmt(m.get('g_early'), '.3f')} → {fmt(m.get('g_late'), '.4f')} | {m.get('signal', '–')} | "
                 + " / ".join(fmt(m.get(f"exact_{s}"), ".0f") for s in CHECKPOINTS)
                 + f" | {three(m, 'shuffled')} | {three(m, 'anchor')} | {fmt(m.get('c_rms_last'), '.2f')} | "
                 + f"{items(m.get('shuffled_items_300'))} |")
    L += ["", "## The predictions, in the pre-registration's words", "",
          "| run | prediction | outcome |", "|---|---|---|"]
    for n, m in rows:
        if n.startswith("twin"):
            continue
        arm, seed = n.rsplit("-s", 1)
        for what, ok in predictions(arm, m, twin_measures(int(seed))).items():
            L.append(f"| {n} | {what} | {'–' if ok is None else 'met' if ok else 'not met'} |")
        if arm == "frozen_policy":
            s = starvation(m)
            L.append(f"| {n} | S: flat 200–300 >= 0.90 and C − shuffled at 300 <= 0 | "
                     f"{'–' if s is None else 'met' if s else 'not met'} |")
    L += ["", "## Over seeds (descriptive: the pre-registration names no test over seeds)", ""]
    L += [f"- {line}" for line in over_seeds(records)]
    L += ["", "## Exploratory (chosen after the data): when the first draws went flat", "",
          "The first step at which the 25-step mean of the flat share reaches 0.90, beside C − shuffled at step 300.",
          "", "| run | flat from step | C − shuffled at 300 |", "|---|---|---|", *onsets(records), "",
          onset_split(records)]
    L += ["", f"Core-hours (steps and evaluations of the archived records): {spent_hours(records):.2f} of "
          f"{BUDGET_HOURS}; third-seed arms by the rule: {', '.join(third_seed_arms(records)) or 'none'}."]
    return "\n".join(L) + "\n"


def rolling(x, k, how):
    """A trailing window of k steps (fewer at the start), NaN-aware: how is np.nanmean or np.nanmedian."""
    return np.array([how(x[max(0, i - k + 1):i + 1]) for i in range(len(x))])


def curves(records, path):
    """The figure beside table.md: per seed (a column), the twin, P and F over the steps: the flat share of
    first-draw groups (25-step mean), g_phi's gradient norm (25-step median, log scale), and C − shuffled C at each
    evaluation (exact, points). Returns the path, or None (no matplotlib, or no records)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    there = run_names(records)
    seeds = sorted({int(n.rsplit("-s", 1)[1]) for n in there})
    if not seeds:
        return None
    fig, axes = plt.subplots(3, len(seeds), figsize=(4.2 * len(seeds), 8), squeeze=False, sharex=True)
    style = {"twin": ("0.45", "twin (LoRA lr 1e-3)"), "paper_lr": ("C0", "P: LoRA lr 1e-4"),
             "frozen_policy": ("C1", "F: policy frozen")}
    for j, seed in enumerate(seeds):
        runs = [("twin", os.path.join(TWINS, f"ours_strong-s{seed}"))]
        runs += [(arm, os.path.join(records, f"{arm}-s{seed}")) for arm in arms() if f"{arm}-s{seed}" in there]
        for arm, d in runs:
            if not os.path.isdir(d):
                continue
            rec = load_run(d)
            color, label = style[arm]
            metrics, steps = rec["metrics"], np.arange(1, len(rec["metrics"]) + 1)
            axes[0, j].plot(steps, rolling(column(metrics, "zero_std_fraction"), 25, np.nanmean), color=color,
                            label=label)
            axes[1, j].plot(steps, np.maximum(rolling(column(metrics, "grad_norm_g_phi"), 25, np.nanmedian), 1e-5),
                            color=color)
            m = measures(rec)
            at = [s for s in CHECKPOINTS if f"shuffled_{s}" in m]
            axes[2, j].plot(at, [m[f"shuffled_{s}"] for s in at], "o-", color=color)
        axes[0, j].set_title(f"seed {seed}")
        axes[0, j].axhline(0.70, ls=":", color="k", lw=0.8)
        axes[1, j].set_yscale("log")
        axes[1, j].axhline(0.1, ls=":", color="k", lw=0.8)
        axes[2, j].axhline(0, ls=":", color="k", lw=0.8)
        axes[2, j].set_xlabel("step")
    axes[0, 0].set_ylabel("flat first draws\n(25-step mean)")
    axes[1, 0].set_ylabel("g_phi gradient norm\n(25-step median)")
    axes[2, 0].set_ylabel("C − shuffled C\n(exact, points, 100 items)")
    axes[0, 0].legend(fontsize=7)
    fig.suptitle("The diagnostic: dotted lines are the pre-registered thresholds (flat 0.70, gradient 0.1, C − "
                 "shuffled 0)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.path.join(ROOT, "runs", "diagnostic"), help="folder for the runs")
    p.add_argument("--records", default=os.path.join(RESULTS, "runs"), help="where each run's record goes")
    p.add_argument("--cores", nargs="+", type=int, default=[1], help="one pinned worker per core")
    p.add_argument("--commit-into", default=None, help="a git checkout in which each record is committed")
    p.add_argument("--status", action="store_true", help="which runs are archived, running, left")
    p.add_argument("--analyse", action="store_true",
                   help="write results/diagnostic/table.md and curves.png from the records")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--core", type=int, default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    records = os.path.abspath(a.records)
    if a.status:
        print(status(records, a.out))
    elif a.analyse:
        md = table(records)
        with open(os.path.join(os.path.dirname(records), "table.md"), "w") as f:
            f.write(md)
        print(md)
        drawn = curves(records, os.path.join(os.path.dirname(records), "curves.png"))
        print(f"figure: {drawn}" if drawn else "figure: not drawn (no matplotlib or no records)")
    elif a.worker:
        problem = worker_problem(a.core)
        if problem:
            print(f"error: {problem}", file=sys.stderr)
            sys.exit(2)
        worker(a, records)
    else:
        sys.exit(campaign(a, records))


if __name__ == "__main__":
    main()
