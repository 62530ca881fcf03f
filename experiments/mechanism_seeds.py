"""
The mechanism test over seeds (issue 33, stage 4): several runs of experiments/mechanism.py that share their items
(--data-seed), read together. For every evaluated step, C - shuffled C and C - anchor on the exact score and on the
gold answer's log-prob, tested two ways, as pre-registered in results/mechanism-gcd/README.md:

- over items: per item, the mean over seeds of its paired difference; one-sided sign-flip test over the items
  (H1: mean > 0). On the exact score each item's seed-mean is a multiple of 1/k (k seeds), so the test is exact
  (the distribution of the flipped sum counted on that lattice); on log-probs it is a Monte Carlo estimate
  (200,000 flips, fixed seed; its standard error is below 0.001 at p = 0.05).
- over seeds: each seed's mean difference and the exact one-sided sign-flip p (lib.stats.sign_flip_p; with 3
  seeds it cannot fall below 1/8).

    python experiments/mechanism_seeds.py results/mechanism-gcd/partial-grpo-scratch-300-s{0,1,2}.json \\
        --out results/mechanism-gcd/powered
"""
import argparse
import json
import os
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from lib.stats import sign_flip_p  # noqa: E402

MC_FLIPS = 200_000


def lattice_sign_flip_p(diffs, k):
    """One-sided (H1: mean > 0) exact sign-flip p for differences that are multiples of 1/k: with the values as
    integers v_i = k d_i, the flipped sum's distribution is the convolution of the two-point laws {+v_i, -v_i}
    (probability 1/2 each), counted exactly; p = P[flipped sum >= observed sum]."""
    v = np.rint(np.asarray(diffs, dtype=float) * k).astype(int)
    if not np.allclose(v, np.asarray(diffs, dtype=float) * k, atol=1e-6):
        raise ValueError("differences are not multiples of 1/k")
    v = np.abs(v[v != 0])
    total = int(v.sum())
    dist = np.zeros(2 * total + 1)   # index s + total holds P[sum = s]
    dist[total] = 1.0
    for x in v:
        dist = 0.5 * (np.roll(dist, x) + np.roll(dist, -x))   # no wrap-around: |partial sums| <= total
    observed = int(np.rint(np.asarray(diffs, dtype=float) * k).sum())
    return float(min(1.0, dist[observed + total:].sum()))


def mc_sign_flip_p(diffs, n=MC_FLIPS, seed=0):
    """One-sided Monte Carlo sign-flip p: the share of random flips whose sum is at least the observed one, with
    the observed flip counted ((1 + hits) / (1 + n), never 0)."""
    d = np.asarray(diffs, dtype=float)
    rng = np.random.default_rng(seed)
    hits = 0
    for start in range(0, n, 20_000):
        m = min(20_000, n - start)
        signs = rng.integers(0, 2, (m, len(d))) * 2 - 1
        hits += int(((signs * d).sum(1) >= d.sum() - 1e-9).sum())
    return (1 + hits) / (1 + n)


def compare(runs, step, arm, score):
    """C - arm at one step: per-seed means, per-item seed-means, and the two tests."""
    key = "per_item_exact" if score == "exact" else "per_item_logprob"
    per_seed = []
    for r in runs:
        point = next(p for p in r["curve"] if p["step"] == step)
        per_seed.append(np.asarray(point["C"][key], float) - np.asarray(point[arm][key], float))
    per_seed = np.stack(per_seed)                                       # (seeds, items)
    item_mean = per_seed.mean(0)
    item_p = lattice_sign_flip_p(item_mean, len(runs)) if score == "exact" else mc_sign_flip_p(item_mean)
    seed_means = per_seed.mean(1)
    return {"mean": float(item_mean.mean()), "per_seed": [float(x) for x in seed_means],
            "item_p": item_p, "seed_p": sign_flip_p(seed_means, "greater"),
            "seeds_above_0": int((seed_means > 0).sum()), "items": int(per_seed.shape[1])}


def analyse(paths):
    runs = [json.load(open(p)) for p in paths]
    seeds = [r["config"]["seed"] for r in runs]
    data = {r["config"].get("data_seed", r["config"]["seed"]) for r in runs}
    if len(data) != 1:
        raise SystemExit(f"error: the runs do not share their items (data seeds {sorted(data)})")
    steps = sorted(set.intersection(*[{p["step"] for p in r["curve"]} for r in runs]))
    rows = []
    for step in steps:
        row = {"step": step}
        for arm in ("shuffled", "anchor"):
            for score in ("exact", "logprob"):
                row[f"C - {arm} {score}"] = compare(runs, step, arm, score)
        row["exact"] = {arm: [next(p for p in r["curve"] if p["step"] == step)[arm]["exact"] for r in runs]
                        for arm in ("C", "anchor", "shuffled")}
        rows.append(row)
    last = rows[-1]["C - shuffled exact"]
    verdict = ("opened" if last["item_p"] < 0.05 and last["seeds_above_0"] >= 2 else
               "not opened" if last["mean"] <= 0 else "unclear")
    return {"paths": paths, "seeds": seeds, "steps": steps, "rows": rows, "decision_at_last_step": verdict}


def markdown(res):
    L = ["# Stage 4, the powered test: C − shuffled C over seeds (experiments/mechanism_seeds.py)", "",
         f"Seeds {res['seeds']}, the same items (one data seed); runs: "
         + ", ".join(os.path.basename(p) for p in res["paths"]) + ".",
         "Item test: one-sided sign flip over the items' seed-mean differences (exact on the exact score, Monte "
         "Carlo on log-probs); seed test: exact one-sided sign flip over the seeds' means.", "",
         "| step | exact C / anchor / shuffled (per seed, %) | C − shuffled exact (points), per seed | item p | "
         "seed p | C − shuffled log-prob (nats), per seed | item p | seed p | C − anchor exact (points) | item p |",
         "|---|---|---|---|---|---|---|---|---|---|"]
    for row in res["rows"]:
        e, lp, ea = row["C - shuffled exact"], row["C - shuffled logprob"], row["C - anchor exact"]
        ex = " / ".join(",".join(f"{100 * v:.0f}" for v in row["exact"][a]) for a in ("C", "anchor", "shuffled"))
        L.append(f"| {row['step']} | {ex} | {100 * e['mean']:+.1f} ({', '.join(f'{100 * v:+.0f}' for v in e['per_seed'])})"
                 f" | {e['item_p']:.3g} | {e['seed_p']:.3g} | {lp['mean']:+.2f} "
                 f"({', '.join(f'{v:+.2f}' for v in lp['per_seed'])}) | {lp['item_p']:.3g} | {lp['seed_p']:.3g} | "
                 f"{100 * ea['mean']:+.1f} | {ea['item_p']:.3g} |")
    L += ["", f"Pre-registered decision at step {res['steps'][-1]}: **{res['decision_at_last_step']}** (opened: item p "
          "< 0.05 and C − shuffled > 0 in at least 2 seeds; not opened: mean ≤ 0; else unclear).", ""]
    return "\n".join(L)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("records", nargs="+", help="partial-NAME.json records of experiments/mechanism.py, one per seed")
    ap.add_argument("--out", required=True, help="writes OUT.json and OUT.md")
    a = ap.parse_args(argv)
    for p in a.records:
        if not os.path.isfile(p):
            ap.exit(2, f"error: no such record: {p}\n")
    res = analyse(a.records)
    with open(a.out + ".json", "w") as f:
        json.dump(res, f, indent=1)
    with open(a.out + ".md", "w") as f:
        f.write(markdown(res))
    print(markdown(res))


if __name__ == "__main__":
    main()
