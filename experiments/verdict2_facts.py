"""
Every figure the second verdict's prose states beyond its table, recomputed from the archived records
(results/verdict2/runs/): when each test's outcome became fixed, single's answer rate around its collapses, what C
did against the anchor and against another item's C, each arm's cost by table.md's own rule, and the smallest
p that 5 seeds can give. tests/test_verdict2.py holds results/verdict2/README.md's sentences to these numbers.

    python experiments/verdict2_facts.py
"""
import json
import os
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "experiments"))

from verdict2 import VERDICT_SEEDS, best_possible_p, load, read_timing  # noqa: E402

RECORDS = os.path.join(ROOT, "results", "verdict2", "runs")
# The order in which the campaign archived its records (git log of results/verdict2/runs, commits 68fd284 ...
# 9fb09e2): the outcome's history is read in this order.
ARCHIVED = ("single-s0", "ours_strong-s0", "single-s1", "ours_strong-s1", "single-s2", "ours_strong-s2",
            "single-s3", "single-s4", "ours_strong-s3", "ours_strong-s4")


def exact(rec, cond="with_C"):
    c = rec["eval"].get("conditions", {}).get(cond)
    return 100 * (c or rec["eval"])["solve_rate"]


def best_p_after(k, runs):
    """{test: best one-sided p over the 6 seeds} once the first k records are in (H1a: seeds with both arms;
    H2: ours_strong's seeds)."""
    have = set(ARCHIVED[:k])
    seeds = lambda arm: [s for s in VERDICT_SEEDS if f"{arm}-s{s}" in have]  # noqa: E731
    h1a = [exact(runs["ours_strong"][s]) - exact(runs["single"][s]) for s in seeds("ours_strong")
           if s in seeds("single")]
    h2 = [exact(runs["ours_strong"][s]) - exact(runs["ours_strong"][s], "shuffled_C") for s in seeds("ours_strong")]
    n = len(VERDICT_SEEDS)
    return {"H1a": best_possible_p(h1a, n), "H2": best_possible_p(h2, n)}


def first_record_fixing(test, runs, alpha=0.05):
    """The number of records after which `test` alone (unadjusted) could no longer reach p < alpha."""
    return next(k for k in range(1, len(ARCHIVED) + 1) if best_p_after(k, runs)[test] >= alpha)


def answer_rates(rec):
    return np.array([m["answer_rate"] for m in rec["metrics"]])


def collapse_facts(runs):
    """single-s0: its KL spike, the steps right after it with answer rate < 0.5, the steps 21-289 below 1, and the
    first step of its final collapse; single-s1: its steps with answer rate < 0.5 and its last step's rate."""
    m0 = runs["single"][0]["metrics"]
    kl = np.array([m["kl"] for m in m0])
    a0, a1 = answer_rates(runs["single"][0]), answer_rates(runs["single"][1])
    spike = int(np.argmax(kl))
    low = [i + 1 for i in range(spike, spike + 10) if a0[i] < 0.5]
    zero = next(i + 1 for i in range(len(a0)) if np.all(a0[i:] == 0))
    return {"spike_step": spike + 1, "spike_kl": float(kl[spike]), "low_steps": low,
            "low_rates": (float(a0[low[0] - 1:low[-1]].min()), float(a0[low[0] - 1:low[-1]].max())),
            "below_one_21_289": int(np.sum(a0[20:289] < 1)), "zero_from": zero,
            "s1_low_steps": [i + 1 for i in range(len(a1)) if a1[i] < 0.3], "s1_last": float(a1[-1])}


def c_against(runs, seeds=None):
    """Per ours_strong seed: (gold log-prob C − anchor in nats, its sign-test p, C − shuffled's p)."""
    out = {}
    for s, rec in sorted(runs["ours_strong"].items()):
        p = rec["eval"]["paired"]
        out[s] = (p["with_C - zero_C"]["gold_logprob"]["diff"], p["with_C - zero_C"]["gold_logprob"]["p_sign"],
                  p["with_C - shuffled_C"]["gold_logprob"]["p_sign"])
    return out


def arm_hours(records=RECORDS, pause=5.0):
    """{arm: (min, max)} core-hours a run by table.md's rule (verdict2.step_costs: the steps' own seconds, a step
    over `pause` x the median counted at the median, plus the evaluation), and the raw maximum with pauses."""
    per = {}
    for name in sorted(os.listdir(records)):
        sec = np.array([json.loads(line)["seconds"] for line in open(os.path.join(records, name, "metrics.jsonl"))])
        med, ev = float(np.median(sec)), read_timing(os.path.join(records, name)).get("eval_seconds", 0.0)
        arm = name.rsplit("-s", 1)[0]
        per.setdefault(arm, []).append(((np.where(sec > pause * med, med, sec).sum() + ev) / 3600,
                                        (sec.sum() + ev) / 3600))
    return {arm: (min(x for x, _ in v), max(x for x, _ in v), max(y for _, y in v)) for arm, v in per.items()}


def main():
    runs = load(RECORDS)
    for k in (4, 9):
        print(f"after {k} records ({ARCHIVED[k - 1]}): best p over 6 seeds", best_p_after(k, runs))
    print("H2 alone fixed after record", first_record_fixing("H2", runs),
          "| H1a alone fixed after record", first_record_fixing("H1a", runs))
    print("single collapses:", collapse_facts(runs))
    print("ours_strong, gold log-prob C − anchor (nats, p) and C − shuffled p:",
          {s: (round(d, 2), f"{p:.2g}", f"{q:.2g}") for s, (d, p, q) in c_against(runs).items()})
    print("core-hours a run (min, max by table.md's rule, max with pauses):",
          {a: tuple(round(x, 2) for x in v) for a, v in arm_hours().items()})
    print("smallest p over 5 seeds: one-sided 1/32 =", 1 / 32, "two-sided 2/32 =", 2 / 32)


if __name__ == "__main__":
    main()
