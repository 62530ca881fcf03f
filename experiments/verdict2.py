"""
The second collaboration verdict, stage by stage: the testbed the corrected screen chose (gcd, 2 numbers from 1 to
100, where Qwen2.5-Coder-1.5B's last-token state holds the answer: results/screen), answer-only completions, and
the router's learning rate chosen by a pilot before the verdict is pre-registered.

    # the pilot: `ours` with the strong expert alone at three router learning rates, and `single`, per seed
    OMP_NUM_THREADS=1 taskset -c 0 python experiments/verdict2.py --pilot --seeds 0
    OMP_NUM_THREADS=1 taskset -c 1 python experiments/verdict2.py --pilot --seeds 1
    python experiments/verdict2.py --pilot --analyse        # results/verdict2/pilot/table.md from the records

What changed against the first verdict (experiments/verdict.py, lcm, 48-token completions):
  testbed   gcd-2n-to100, chosen by the probe of the expert the arms read (results/screen/table.md)
  format    answer-only: reasoning-gym's "direct" system prompt with the worked example (121 prompt tokens
            against the first verdict's 223), the response pre-filled up to "<answer>" (--response-prefix); the
            policy writes the number and "</answer>" within 8 tokens, and the scorers read prefix + completion
            (rewards.responses). Reward: exact (--reward exact: gcd's scorer pays 0.5 for any other number,
            e.g. "12" for 2; that partial credit pays nothing here), no format bonus
  budget    G 8 x 4 prompts x 30 steps = 960 completions a run, four times the first verdict's 240
  router    --router-lr from the pilot (the paper's Listing 1: 1e-4; the first verdict ran 1e-3)
Everything else is the first verdict's protocol: LoRA lr 1e-3, --dynamic-sampling 1 (flat groups re-drawn once;
since the collapse-trap fix they keep their KL term), C in front of the prompt, anchored at the newline
embedding, standardised states at depth 1.0, 100 validation items scored with C, with C = the anchor and with
shuffled C (evaluate.py --paired).
"""
import argparse
import os
import subprocess
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "experiments"))

from verdict import costs, load, run_once  # noqa: E402

RESULTS = os.path.join(ROOT, "results", "verdict2")
TASK = ["--task", "gcd", "--task-config", '{"min_numbers": 2, "max_numbers": 2, "min_value": 1, "max_value": 100}']
STRONG = "pocket:qwen2.5-coder-1.5b-instruct"
PROMPT = ["--system-prompt", "direct", "--worked-example", "--response-prefix", "<think></think>\n<answer>",
          "--context-position", "before", "--max-new-tokens", "8", "--reward", "exact"]
HYPER = ["--batch-size", "4", "--grad-accum", "1", "--group-size", "8", "--lr", "1e-3", "--steps", "30",
         "--save-every", "10", "--dataset-size", "2000", "--dynamic-sampling", "1", "--keep-activations"]
ANCHOR, NORM = ["--context-anchor", "newline"], ["--state-norm", "standardize", "--expert-depth", "1.0"]
PILOT_LRS = ("1e-4", "3e-4", "1e-3")


def pilot_arms():
    """name -> train.py flags: `single`, and `ours` reading the strong expert alone at each router lr."""
    arms = {"single": ["--method", "single", "--team", "pocket"]}
    for lr in PILOT_LRS:
        arms[f"ours_strong_lr{lr}"] = ["--method", "ours", "--team", "pocket", "--experts", STRONG, *ANCHOR,
                                       *NORM, "--router-lr", lr]
    return arms


def exact(rec, cond="with_C"):
    """Exact solve rate (%) of a run's evaluation under a condition (with_C, zero_C = the anchor, shuffled_C)."""
    ev = rec["eval"]
    if "conditions" not in ev:  # a run without context tokens (`single`): scored once
        return 100 * ev["solve_rate"] if cond == "with_C" else float("nan")
    c = ev["conditions"].get(cond, {})
    return 100 * c["solve_rate"] if "solve_rate" in c else float("nan")


def gold(rec, cond="with_C"):
    c = rec["eval"].get("conditions", {}).get(cond, {})
    return c.get("gold_logprob", float("nan"))


def c_drift(rec):
    """C's rms over a token embedding's (rms), at the first and the last step: how fast g_phi moved C."""
    m = [x for x in rec["metrics"] if x.get("c_rms") is not None and x.get("embed_rms")]
    return (m[0]["c_rms"] / m[0]["embed_rms"], m[-1]["c_rms"] / m[-1]["embed_rms"]) if m else (np.nan, np.nan)


def num(x, fmt="+.0f"):
    """x formatted, or "–" where it does not exist (a condition `single` has no C for)."""
    return "–" if x is None or np.isnan(x) else format(x, fmt)


def pilot_table(runs):
    """Markdown: every pilot run, and each router lr's mean over seeds against `single` of the same seed."""
    L = ["| run | exact with C | C = anchor | shuffled C | C − shuffled | gold log-prob C − shuffled (nats) | "
         "C rms / token rms, first → last step | reward, first 5 → last 5 steps | flat groups |",
         "|---|---|---|---|---|---|---|---|---|"]
    for arm in sorted(runs):
        for seed, rec in sorted(runs[arm].items()):
            r = [m["reward"] for m in rec["metrics"]]
            flat = np.mean([m.get("zero_std_fraction", np.nan) for m in rec["metrics"]])
            d0, d1 = c_drift(rec)
            L.append(f"| {arm}-s{seed} | {exact(rec):.0f} | {num(exact(rec, 'zero_C'), '.0f')} | "
                     f"{num(exact(rec, 'shuffled_C'), '.0f')} | {num(exact(rec) - exact(rec, 'shuffled_C'))} | "
                     f"{num(gold(rec) - gold(rec, 'shuffled_C'), '+.2f')} | {num(d0, '.2f')} → {num(d1, '.2f')} | "
                     f"{np.mean(r[:5]):.2f} → {np.mean(r[-5:]):.2f} | {flat:.2f} |")
    L += ["", "| router lr | seeds | exact with C − single (points), per seed | mean | C − shuffled (points), mean |",
          "|---|---|---|---|---|"]
    single = runs.get("single", {})
    for lr in PILOT_LRS:
        arm = runs.get(f"ours_strong_lr{lr}", {})
        seeds = sorted(s for s in arm if s in single)
        d = [exact(arm[s]) - exact(single[s]) for s in seeds]
        sh = [exact(arm[s]) - exact(arm[s], "shuffled_C") for s in seeds]
        L.append(f"| {lr} | {seeds} | {', '.join(f'{x:+.0f}' for x in d) or '–'} | "
                 f"{num(np.mean(d) if d else None, '+.1f')} | {num(np.mean(sh) if sh else None, '+.1f')} |")
    choice, why = pilot_choice(runs)
    L += ["", f"**The pre-registered rule's choice: {choice}** ({why})."]
    return "\n".join(L) + "\n"


def pilot_choice(runs, seeds=(0, 1)):
    """The router lr the pilot's written rule picks (README.md): the largest mean over the seeds of (`ours`
    exact with C − `single` exact, same seed); within 2 points of each other, the smaller lr. And whether
    anything moved at all: "no movement" when every lr and seed has C − shuffled C within ±1 point exact and
    ±0.05 nats, and `ours` within ±2 points of `single`. (None, why) until every run of the pilot is in."""
    single = runs.get("single", {})
    arms = {lr: runs.get(f"ours_strong_lr{lr}", {}) for lr in PILOT_LRS}
    if any(s not in single or s not in arms[lr] for lr in PILOT_LRS for s in seeds):
        return None, "incomplete: not every run of the pilot is archived"
    gain = {lr: np.mean([exact(arms[lr][s]) - exact(single[s]) for s in seeds]) for lr in PILOT_LRS}
    still = all(abs(exact(r) - exact(r, "shuffled_C")) <= 1 and abs(gold(r) - gold(r, "shuffled_C")) <= 0.05
                and abs(exact(r) - exact(single[s])) <= 2 for lr in PILOT_LRS for s, r in arms[lr].items())
    if still:
        return "no movement", "every lr and seed within the rule's bounds: the smallest verdict runs"
    best = max(gain.values())
    pick = min((lr for lr in PILOT_LRS if best - gain[lr] <= 2), key=float)
    return pick, ", ".join(f"{lr}: {gain[lr]:+.1f}" for lr in PILOT_LRS) + " points over `single`, mean of seeds"


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pilot", action="store_true", help="the router-lr pilot (the only stage so far)")
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1], help="seeds (the pilot: 0 and 1)")
    p.add_argument("--arms", nargs="+", default=None, help="a subset of the arms (default: all)")
    p.add_argument("--n-eval", type=int, default=100, help="validation items per run")
    p.add_argument("--out", default=os.path.join(ROOT, "runs", "verdict2"), help="folder for the runs")
    p.add_argument("--analyse", action="store_true", help="only read the archived records and write table.md")
    a = p.parse_args()
    if not a.pilot:
        p.error("only --pilot exists so far: the verdict's arms are pre-registered after the pilot")
    table, results = pilot_arms(), os.path.join(RESULTS, "pilot")
    unknown = set(a.arms or []) - set(table)
    if unknown:
        p.error(f"--arms: unknown {sorted(unknown)}; arms: {', '.join(table)}")
    if not a.analyse:
        os.makedirs(a.out, exist_ok=True)
        log = os.path.join(a.out, f"log-s{'-'.join(map(str, a.seeds))}.txt")
        for seed in a.seeds:
            for arm in a.arms or table:
                run_once(os.path.join(a.out, f"{arm}-s{seed}"),
                         [*TASK, *PROMPT, *HYPER, *table[arm], "--seed", str(seed),
                          "--expert-cache", os.path.join(a.out, f"expert-states-s{seed}")],
                         a.n_eval, arm != "single", log, os.path.join(results, "runs"))
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
        os.makedirs(results, exist_ok=True)
        with open(os.path.join(results, "provenance.txt"), "a") as f:
            f.write(f"seeds {a.seeds} arms {a.arms or 'all'} ran at commit {commit.strip()}\n")
    runs = load(os.path.join(results, "runs"))
    md = ("# The router-lr pilot (experiments/verdict2.py --pilot --analyse)\n\nExact solve rates in % on the "
          "same 100 validation items per seed; C = anchor: the newline embedding in C's place.\n\n"
          + pilot_table(runs) + "\n## Wall time\n\n" + costs(os.path.join(results, "runs")))
    os.makedirs(results, exist_ok=True)
    with open(os.path.join(results, "table.md"), "w") as f:
        f.write(md)
    print(md)


if __name__ == "__main__":
    main()
