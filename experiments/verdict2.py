"""
The second collaboration verdict, stage by stage: the testbed the corrected screen chose (gcd, 2 numbers from 1 to
100, where Qwen2.5-Coder-1.5B's last-token state holds the answer: results/screen), answer-only completions, and
the router's learning rate chosen by a pilot before the verdict is pre-registered.

    # the pilot: `ours` with the strong expert alone at three router learning rates, and `single`, per seed
    OMP_NUM_THREADS=1 taskset -c 0 python experiments/verdict2.py --pilot --seeds 0
    OMP_NUM_THREADS=1 taskset -c 1 python experiments/verdict2.py --pilot --seeds 1
    python experiments/verdict2.py --pilot --analyse        # results/verdict2/pilot/table.md from the records

    # the verdict (amendment 2 of results/verdict2/preregistration.md), from a frozen clone at its commit: one pinned
    # worker per core takes the plan's unfinished runs (a stopped run resumes from its last step's checkpoint),
    # each finished run's record is archived and committed in the main checkout; start it again after any stop;
    # once the outcome is fixed (futility), a seed with no archived run is not started (not_needed)
    python experiments/verdict2.py --verdict --cores 0 --out /work/runs/verdict2-campaign \
        --records /work/main/results/verdict2/runs --commit-into /work/main
    python experiments/verdict2.py --verdict --status --out ... --records ...   # archived, running, left
    python experiments/verdict2.py --verdict --analyse      # table.md, headline.md, README.md's quote of it

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
import fcntl
import itertools
import json
import os
import subprocess
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "experiments"))

from lib.stats import holm, mean_std, paired_comparison, sign_flip_ci, sign_flip_p  # noqa: E402
from verdict import costs, cpu_capability, load, read_timing, run_once  # noqa: E402

RESULTS = os.path.join(ROOT, "results", "verdict2")
TASK = ["--task", "gcd", "--task-config", '{"min_numbers": 2, "max_numbers": 2, "min_value": 1, "max_value": 100}']
STRONG = "pocket:qwen2.5-coder-1.5b-instruct"
PROMPT = ["--system-prompt", "direct", "--worked-example", "--response-prefix", "<think></think>\n<answer>",
          "--context-position", "before", "--max-new-tokens", "8", "--reward", "exact"]
HYPER = ["--batch-size", "4", "--grad-accum", "1", "--group-size", "8", "--lr", "1e-3", "--steps", "30",
         "--save-every", "10", "--dataset-size", "2000", "--dynamic-sampling", "1", "--keep-activations"]
ANCHOR, NORM = ["--context-anchor", "newline"], ["--state-norm", "standardize", "--expert-depth", "1.0"]
PILOT_LRS = ("1e-4", "3e-4", "1e-3")

# The verdict, as amendment 2 of results/verdict2/preregistration.md fixes it (committed before its first run).
# C's slot: the ceiling's and the mechanism test's (experiments/mechanism.py): the DeepSeekZero system prompt with
# the worked example, the response pre-filled with "<think>", then C, then "</think>\n<answer>" (--context-split:
# its tokens encoded on their own, as mechanism.py encodes them), then the policy's up to 8 tokens.
VERDICT_PROMPT = ["--system-prompt", "DeepSeekZero", "--worked-example", "--response-prefix",
                  "<think></think>\n<answer>", "--context-split", "</think>\n<answer>", "--context-position", "after",
                  "--max-new-tokens", "8", "--reward", "exact"]
VERDICT_STEPS, VERDICT_SEEDS, VERDICT_ROUTER_LR = 300, tuple(range(6)), "3e-4"
VERDICT_HYPER = [*HYPER[:HYPER.index("--steps")], "--steps", str(VERDICT_STEPS), "--save-every", "1",
                 *HYPER[HYPER.index("--dataset-size"):]]
# (name, arm, comparator, endpoint): exact = the arm's exact solve rate - the comparator's; shuffle = the arm's with
# its C - with shuffled C. One-sided exact sign-flip over the 6 seeds, Holm over the two.
VERDICT_FAMILY = (("H1a", "ours_strong", "single", "exact"), ("H2", "ours_strong", None, "shuffle"))


def verdict_arms():
    """name -> train.py flags of the verdict's two arms (amendment 2)."""
    return {"single": ["--method", "single", "--team", "pocket"],
            "ours_strong": ["--method", "ours", "--team", "pocket", "--experts", STRONG, *ANCHOR, *NORM,
                            "--router-lr", VERDICT_ROUTER_LR]}


def verdict_plan():
    """[(run name, train.py flags)] in the order workers take them: seed by seed, both arms of a seed together, so
    that whatever has finished when the campaign stops is a set of paired seeds."""
    return [(f"{arm}-s{seed}", [*TASK, *VERDICT_PROMPT, *VERDICT_HYPER, *flags, "--seed", str(seed)])
            for seed in VERDICT_SEEDS for arm, flags in verdict_arms().items()]


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


def run_rows(runs, window):
    """Markdown rows, one per archived run: exact with C / with the anchor / with shuffled C, C − shuffled (exact,
    gold log-prob), C's drift, the reward over the first and last `window` steps, the flat groups."""
    L = ["| run | exact with C | C = anchor | shuffled C | C − shuffled | gold log-prob C − shuffled (nats) | "
         f"C rms / token rms, first → last step | reward, first {window} → last {window} steps | flat groups |",
         "|---|---|---|---|---|---|---|---|---|"]
    for arm in sorted(runs):
        for seed, rec in sorted(runs[arm].items()):
            r = [m["reward"] for m in rec["metrics"]]
            flat = np.mean([m.get("zero_std_fraction", np.nan) for m in rec["metrics"]])
            d0, d1 = c_drift(rec)
            L.append(f"| {arm}-s{seed} | {exact(rec):.0f} | {num(exact(rec, 'zero_C'), '.0f')} | "
                     f"{num(exact(rec, 'shuffled_C'), '.0f')} | {num(exact(rec) - exact(rec, 'shuffled_C'))} | "
                     f"{num(gold(rec) - gold(rec, 'shuffled_C'), '+.2f')} | {num(d0, '.2f')} → {num(d1, '.2f')} | "
                     f"{np.mean(r[:window]):.2f} → {np.mean(r[-window:]):.2f} | {flat:.2f} |")
    return L


def pilot_table(runs):
    """Markdown: every pilot run, and each router lr's mean over seeds against `single` of the same seed."""
    L = run_rows(runs, window=5)
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


def item_exact(rec, cond="with_C"):
    """Per item, 1.0 where the run's greedy answer under `cond` scored full marks, else 0.0 (None: no such
    condition, e.g. `single` has no C to shuffle)."""
    items = rec["eval"].get("per_item", {}).get(cond)
    if not items or "n/a" in items:
        return None
    return [float(x == 1) for x in items["score"]]


def verdict_rows(runs):
    """The family's rows: per seed the endpoint, its mean ± sd, the one-sided exact sign-flip p over seeds and the
    Holm-adjusted p over the family; with the item-level paired comparison (items' seed means) as exploratory."""
    rows = []
    for name, arm, comparator, endpoint in VERDICT_FAMILY:
        per_seed, items = {}, []
        for seed, rec in sorted(runs.get(arm, {}).items()):
            a = item_exact(rec)
            b = item_exact(rec, "shuffled_C") if endpoint == "shuffle" else (
                item_exact(runs[comparator][seed]) if seed in runs.get(comparator, {}) else None)
            if a is None or b is None:
                continue
            assert len(a) == len(b), f"{name}: seed {seed}'s two sides were scored on different items"
            per_seed[seed] = 100 * (np.mean(a) - np.mean(b))
            items.append((a, b))
        d = list(per_seed.values())
        row = {"name": name, "arm": arm, "comparator": comparator or "shuffled C", "per_seed": per_seed,
               "p": sign_flip_p(d, "greater") if len(d) > 1 else float("nan")}
        if d:
            row["mean"], row["sd"] = mean_std(d)
            row["ci"] = sign_flip_ci(d) if len(d) > 1 else None
            row["items"] = paired_comparison(np.mean([x for x, _ in items], 0), np.mean([y for _, y in items], 0))
        rows.append(row)
    if all(np.isfinite(r["p"]) for r in rows):
        for r, p in zip(rows, holm([r["p"] for r in rows])):
            r["p_holm"] = p
    return rows


def best_possible_p(observed, n):
    """The smallest one-sided sign-flip p (sign_flip_p's "greater") that n seeds can still give when only the
    differences `observed` are known, whatever the other n - k turn out to be. Flipping the signs of a set S of the
    observed seeds alone leaves the sum at least the observed one exactly when the sum over S is <= 0, whatever the
    others are, so p >= #{S : sum over S <= 0} / 2^n; large positive missing differences reach the bound (then every
    flip that takes one of them lowers the sum). With all n known it is the p itself."""
    d = np.asarray(observed, dtype=float)
    subsets = np.array(list(itertools.product((0.0, 1.0), repeat=len(d))))
    return float(np.sum(subsets @ d <= 1e-9)) / 2 ** n


def futility(rows):
    """Per test of the family, the best p its pre-registered seeds can still give (best_possible_p) and the Holm p
    those give together. Holm's adjusted p never falls when a p rises, so a test whose best Holm p is >= 0.05
    cannot pass whatever the runs left give, and more runs never change that (each adds sets to the count)."""
    best = [best_possible_p(list(r["per_seed"].values()), len(VERDICT_SEEDS)) for r in rows]
    return {r["name"]: (p, q) for r, p, q in zip(rows, best, holm(best))}


def verdict_outcome(rows, runs):
    """"shown" when every test of the family has Holm p < 0.05 on all pre-registered seeds, "not shown" otherwise;
    until every run of the plan is archived, "incomplete" (a partial table is no claim), or "not shown (fixed ...)"
    once no result of the runs left can make every test pass (futility)."""
    done = sum(len(v) for v in runs.values())
    total = len(verdict_plan())
    if done < total or any(len(r["per_seed"]) < len(VERDICT_SEEDS) for r in rows):
        if any(q >= 0.05 for _, q in futility(rows).values()):
            return f"not shown (fixed with {done} of {total} runs in)"
        return f"incomplete: {done} of {total} runs archived"
    return "shown" if all(r["p_holm"] < 0.05 for r in rows) else "not shown"


def verdict_markdown(runs, records):
    rows = verdict_rows(runs)
    fut = futility(rows)
    L = ["# The second verdict (experiments/verdict2.py --verdict --analyse)", "",
         f"**{verdict_outcome(rows, runs)}.** Pre-registered in preregistration.md (amendment 2): exact solve rates "
         "on the same 100 validation items per seed; per seed one difference in points; p: exact one-sided "
         "sign-flip over the seeds archived, Holm over the family; the interval is the same test's by inversion; "
         f"best p: the smallest p the {len(VERDICT_SEEDS)} pre-registered seeds can still give, whatever the runs "
         "left give (p itself once all are in), and the Holm p of those; the item-level comparison (the items' seed "
         "means, bootstrap interval, sign test) is exploratory.", "",
         f"| test | seeds | per seed (points) | mean ± sd | 95 % interval | p | Holm p | best p, {len(VERDICT_SEEDS)} "
         "seeds (Holm) | items: mean [95 %], better / worse, p (exploratory) |", "|---" * 9 + "|"]
    for r in rows:
        n = len(r["per_seed"])
        seeds = ", ".join(f"{v:+.0f}" for v in r["per_seed"].values()) or "–"
        mean = f"{r['mean']:+.1f} ± {r['sd']:.1f}" if n else "–"
        ci = f"[{r['ci'][0]:+.1f}, {r['ci'][1]:+.1f}]" if n > 1 and r["ci"] else "–"
        it = r.get("items")
        items = (f"{100 * it['diff']:+.1f} [{100 * it['ci95'][0]:+.1f}, {100 * it['ci95'][1]:+.1f}], "
                 f"{it['better']} / {it['worse']}, {it['p_sign']:.3g}") if it else "–"
        p = f"{r['p']:.3g}" if n > 1 else "–"
        L.append(f"| {r['name']}: `{r['arm']}` − {r['comparator']} | {n} | {seeds} | {mean} | {ci} | {p} | "
                 f"{r['p_holm']:.3g} |" if "p_holm" in r else f"| {r['name']}: `{r['arm']}` − {r['comparator']} | "
                 f"{n} | {seeds} | {mean} | {ci} | {p} | – |")
        L[-1] += " {:.3g} ({:.3g}) | {} |".format(*fut[r["name"]], items)
    L += ["", *instruction_sets(runs), "", *run_rows(runs, window=10)]
    return "\n".join(L) + "\n\n## Wall time\n\n" + step_costs(records)


def verdict_headline(rows, runs):
    """The README's second verdict, as lines of markdown (results/verdict2/headline.md; the README quotes it whole
    and a test holds them equal): while incomplete, the count of runs and "not shown", nothing more, because a
    partial table is no claim; once complete, the outcome, then each test of the family with its 95 % interval over
    seeds, the seeds that went each way and the Holm-adjusted p, then what the outcome can and cannot say
    (verdict_reading)."""
    done, total = sum(len(v) for v in runs.values()), len(verdict_plan())
    design = (f"pre-registered, amendment 2: `single` and `ours_strong` × {len(VERDICT_SEEDS)} seeds on gcd, H1a and "
              "H2, one-sided exact sign-flip tests over seeds, Holm over 2")
    outcome = verdict_outcome(rows, runs)
    if outcome.startswith("incomplete"):
        return [f"**The second verdict is running** ({design}): {done} of {total} runs archived; a partial table "
                "is no claim.", f"Until all {total} are in, that RL shapes collaboration here is **not shown**."]
    what = {"H1a": "`ours_strong` − `single`", "H2": "`ours_strong` with its C − shuffled C"}
    if outcome.startswith("not shown (fixed"):
        return fixed_headline(rows, runs, done, total, design, what)
    L = [f"**Second verdict: {outcome}** ({design}; {done} of {total} runs; 95 % intervals over seeds)."]
    for r in rows:
        d = list(r["per_seed"].values())
        better, worse = sum(x > 0 for x in d), sum(x < 0 for x in d)
        L.append(f"- {r['name']}, {what[r['name']]}: {r['mean']:+.1f} points [{r['ci'][0]:+.1f}, {r['ci'][1]:+.1f}], "
                 f"{better} / {worse} seeds, Holm p = {r['p_holm']:.3g}")
    return L + ["", verdict_reading(rows)]  # the blank line ends the list


def fixed_headline(rows, runs, done, total, design, what):
    """The headline once the outcome is fixed before every run is in (futility): the outcome, each test's mean over
    the seeds run with every seed's value, and the best p its 6 seeds could still give, then what that can say."""
    n, fut = 2 ** len(VERDICT_SEEDS), futility(rows)
    L = [f"**Second verdict: not shown, fixed with {done} of {total} runs in** ({design}): whatever the runs left "
         "give, the family cannot pass."]
    for r in rows:
        d = list(r["per_seed"].values())
        p, q = fut[r["name"]]
        L.append(f"- {r['name']}, {what[r['name']]}: {r['mean']:+.1f} points over {len(d)} seeds "
                 f"({', '.join(f'{x:+.0f}' for x in d)}); the best p {len(VERDICT_SEEDS)} seeds can give: "
                 f"{round(p * n)}/{n} = {p:.3g}, Holm {q:.3g}")
    spread = ", ".join(f"{r['name']} sd {r['sd']:.1f}" for r in rows)
    return L + ["", "What it can say: the pre-registered tests cannot reach Holm p < 0.05, so the runs left were "
                    "not needed for the outcome; the means are descriptive. What it cannot: that the expert's C "
                    f"does not help (seeds this far apart, {spread} points, are as consistent with no effect as "
                    "with the means above), the routing question (several experts, H3, was cut), and beyond one "
                    "testbed (gcd), one expert (Qwen2.5-Coder-1.5B) and a 135M policy on a CPU. " + c_unused(runs)]


def c_unused(runs, arm="ours_strong"):
    """A sentence: in how many of the arm's seeds every item scored the same with its C, with C = the anchor and with
    shuffled C (the greedy answers' scores, item by item): there the trained policy's score is the same whichever C,
    so its difference from `single` is not the expert's information reaching the answer."""
    seeds = [s for s, rec in runs.get(arm, {}).items() if item_exact(rec, "shuffled_C") is not None]
    same = [s for s in seeds if item_exact(runs[arm][s]) == item_exact(runs[arm][s], "zero_C")
            == item_exact(runs[arm][s], "shuffled_C")]
    return (f"In {len(same)} of {len(seeds)} seeds `{arm}` scored every item the same with its C, with the anchor "
            "and with another item's C (a reading chosen after the data were in): there its difference from `single` does "
            "not pass through C at evaluation.")


def verdict_reading(rows):
    """What the family's outcome can and cannot say, as the pre-registration (amendment 2) reads each case."""
    passed = {r["name"] for r in rows if r["p_holm"] < 0.05}
    can = {frozenset({"H1a", "H2"}): "RL shapes collaboration here: the policy trained with the strong expert's C "
                                     "scores more than the policy trained alone (H1a) and reads its own item's C, "
                                     "not any C (H2)",
           frozenset({"H1a"}): "`ours_strong` beats the policy alone, but reading its own item's C is not shown: "
                               "the gain may be the trainable interface, not the expert (H1b, the soft prompt that "
                               "would tell them apart, was cut)",
           frozenset({"H2"}): "the policy reads its own item's C, but gains nothing shown over the policy alone",
           frozenset(): "neither test is shown (each interval above holds the effects these 6 seeds "
                        "cannot exclude)"}[frozenset(passed)]
    return (f"What it can say: {can}. What it cannot: the routing question (several experts, H3, was cut), and "
            "beyond one testbed (gcd), one expert (Qwen2.5-Coder-1.5B) and a 135M policy on a CPU.")


def instruction_sets(runs):
    """Markdown: the instruction set each seed's two arms ran on (timing.json's "cpu"), and the seeds whose arms ran
    on different ones. The pre-registered device was an AVX-512 CPU; a machine replaced between sessions may have
    another, where float sums run in another order: such a seed's pair is still the same items and draws, but not
    the same arithmetic (provenance.txt says when and why)."""
    arms = [a for a in verdict_arms() if a in runs]
    seeds = sorted({s for a in arms for s in runs[a]})
    sets = {s: {a: runs[a][s].get("cpu", "?") for a in arms if s in runs[a]} for s in seeds}
    row = " · ".join(f"s{s}: " + ", ".join(f"`{a}` {c}" for a, c in v.items()) for s, v in sets.items())
    mixed = [s for s, v in sets.items() if len(v) == len(verdict_arms()) and len(set(v.values())) > 1]
    return [f"Instruction sets (each run's timing.json): {row or 'no runs'}.",
            f"Seeds whose two arms ran on different instruction sets: {', '.join(map(str, mixed)) or 'none'} "
            "(pre-registered: AVX-512; an exploratory reading only, the family's tests take every seed)."]


HEADLINE_BEGIN = "<!-- results/verdict2/headline.md, whole"
HEADLINE_END = "<!-- end of results/verdict2/headline.md -->"


def quoted_headline(text):
    """The lines of a README's text between its second-verdict markers, and where they start and end."""
    lines = text.split("\n")
    begin = [i for i, x in enumerate(lines) if x.startswith(HEADLINE_BEGIN)]
    end = [i for i, x in enumerate(lines) if x == HEADLINE_END]
    if len(begin) != 1 or len(end) != 1 or end[0] <= begin[0]:
        raise ValueError(f"expected one line starting {HEADLINE_BEGIN!r}, then one {HEADLINE_END!r}")
    return lines[begin[0] + 1:end[0]], begin[0] + 1, end[0]


def quote_headline(readme, headline):
    """Put headline.md's lines between the README's second-verdict markers, in place of what is there. Raises
    ValueError (and writes nothing) when the markers are missing."""
    with open(readme) as f:
        text = f.read()
    try:
        _, a, b = quoted_headline(text)
    except ValueError as e:
        raise ValueError(f"{readme}: {e}") from None
    lines = text.split("\n")
    with open(readme + ".tmp", "w") as f:  # written whole, then renamed: never a half-written README
        f.write("\n".join(lines[:a] + list(headline) + lines[b:]))
    os.replace(readme + ".tmp", readme)


def step_costs(records, pause=5.0):
    """Markdown: each archived run's training time as the sum of its steps' own seconds (metrics.jsonl: every
    process of a resumed run, each step once), its evaluation's, and the total in core-hours (one thread a run).
    timing.json's train_seconds is the last process's wall time alone, short for a run resumed after a stop. A
    step that took more than `pause` times the run's median was a SIGSTOP pause (provenance.txt logs each) and
    counts at the median."""
    L = ["| run | steps s (sum of the steps) | paused steps (counted at the median) | last process s | eval s | "
         "load average after (1, 5, 15 min) | CPU |", "|---|---|---|---|---|---|---|"]
    total = 0.0
    for name in sorted(os.listdir(records)) if os.path.isdir(records) else []:
        path, t = os.path.join(records, name, "metrics.jsonl"), read_timing(os.path.join(records, name))
        if not os.path.exists(path):
            continue
        seconds = np.array([json.loads(line)["seconds"] for line in open(path) if line.strip()])
        median = float(np.median(seconds))
        paused = seconds > pause * median
        train = float(np.where(paused, median, seconds).sum())
        total += train + t.get("eval_seconds", 0.0)
        load = ", ".join(f"{x:.1f}" for x in t["load_average_after"]) if "load_average_after" in t else "–"
        last, ev = (f"{t[k]:.0f}" if k in t else "–" for k in ("train_seconds", "eval_seconds"))
        L.append(f"| {name} | {train:.0f} | {int(paused.sum())} | {last} | {ev} | {load} | {t.get('cpu', '–')} |")
    L += ["", f"Total: {total / 3600:.2f} core-hours over {len(L) - 2} runs (steps and evaluations; each "
          "process's start and model loading, about a minute, not counted)."]
    return "\n".join(L) + "\n"


# --------------------------------------------------------------------------------------------------
# The campaign: one worker per pinned core takes the plan's unfinished runs one at a time, resumes any that a stop
# interrupted, archives each finished run's record and commits it.


def finished(records, name):
    """Whether a run's record is archived whole (its evaluation is the last thing written)."""
    d = os.path.join(records, name)
    return os.path.exists(os.path.join(d, "eval_paired.json" if name.startswith("ours") else "eval.json"))


def claim(out, name):
    """Take a run for this process: OUT/NAME.claim created exclusively with our pid. A claim whose process is gone
    (a stop, a kill) is taken over. Returns whether the run is ours. Workers started together all find a stopped
    campaign's claims dead; without a lock two of them could both take one over (each removing the other's fresh
    claim), so the read, removal and creation happen under one lock on OUT/.claims.lock."""
    path = os.path.join(out, name + ".claim")
    lock_fd = os.open(os.path.join(out, ".claims.lock"), os.O_CREAT | os.O_WRONLY | os.O_NOFOLLOW, 0o644)
    with os.fdopen(lock_fd, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        pid = claim_pid(path)
        if pid is not None:
            if pid and alive(pid):
                return False
            os.unlink(path)  # its process is gone: the run is resumed from its last checkpoint
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_NOFOLLOW, 0o644)
        with os.fdopen(fd, "w") as f:
            f.write(str(os.getpid()))
        return True


def claim_pid(path):
    """The pid a claim file holds: None without the file, 0 when it cannot be read as one."""
    try:
        with open(path) as f:
            return int(f.read().strip() or 0)
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return 0


def alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def commit_record(repo, records, name, label="verdict2"):
    """git add + commit of one run's record in `repo` (the main checkout, not the frozen clone), only those paths;
    a failure (a busy index, no repo) is printed and left for the next run's commit, which adds the whole folder."""
    rel = os.path.relpath(records, repo)
    for attempt in range(5):
        add = subprocess.run(["git", "add", "--", rel], cwd=repo, capture_output=True, text=True)
        done = add.returncode == 0 and subprocess.run(
            ["git", "commit", "-q", "-m", f"{label}: record of {name} (experiments/{label}.py)", "--",
             rel], cwd=repo, capture_output=True, text=True).returncode == 0
        if done:
            return True
        time.sleep(5 * (attempt + 1))
    print(f"  (could not commit {name}'s record in {repo}: commit it by hand)", flush=True)
    return False


def not_needed(records):
    """The plan's runs the outcome no longer needs: once it is fixed before every run is in (futility), each run of
    a seed none of whose runs is archived (a seed with one arm archived is finished, to give that arm its pair).
    Not a pre-registered rule: adopted on 2026-11-28 after 9 of 12 runs, when the outcome became fixed
    (results/verdict2/README.md)."""
    runs = load(records)
    if not verdict_outcome(verdict_rows(runs), runs).startswith("not shown (fixed"):
        return set()
    seeds = {seed for arm in runs.values() for seed in arm}
    return {name for name, _ in verdict_plan() if int(name.rsplit("-s", 1)[1]) not in seeds}


def worker(a, records):
    """Run the plan's unfinished runs one after another until none is left that no other worker holds (or that
    the outcome still needs: not_needed)."""
    log = os.path.join(a.out, f"log-core{a.core}.txt")
    for name, flags in verdict_plan():
        if finished(records, name) or name in not_needed(records) or not claim(a.out, name):
            continue
        try:
            run_once(os.path.join(a.out, name), [*flags, "--expert-cache", os.path.join(a.out, "expert-states")],
                     a.n_eval, name.startswith("ours"), log, records)
            if a.commit_into:
                commit_record(a.commit_into, records, name)
        finally:
            os.unlink(os.path.join(a.out, name + ".claim"))


def worker_problem(core):
    """Why this process cannot be a worker, or None. The pre-registered runs use one thread on one core (another
    thread count sums in another order); the campaign starts its workers so, but one started by hand may not be."""
    pinned, threads = os.sched_getaffinity(0), os.environ.get("OMP_NUM_THREADS")
    if pinned != {core} or threads != "1":
        return (f"a worker must run on core {core} alone with OMP_NUM_THREADS=1 (it runs on cores "
                f"{sorted(pinned)} with OMP_NUM_THREADS={threads}): start the campaign, which pins its workers, or "
                f"OMP_NUM_THREADS=1 taskset -c {core} ...")
    return None


def frozen_clone_problem():
    """Why this checkout cannot run the verdict (it must be a clone at a commit, its tracked files unchanged), or
    None."""
    status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                            capture_output=True, text=True)
    if status.returncode != 0:
        return f"{ROOT} is not a git checkout: run the verdict from a clone at the pre-registered commit"
    if status.stdout.strip():
        return (f"{ROOT} has changed tracked files: the verdict runs from a clean clone at the pre-registered "
                "commit (git clone; git checkout COMMIT)")
    return None


def campaign(a, records):
    """Start one pinned worker per --cores entry, wait for them, then write the table."""
    codes = start_workers(__file__, a, records, ["--verdict", "--n-eval", str(a.n_eval)])
    print(status(records, a.out))
    return max(codes)


def start_workers(script, a, records, flags):
    """From a frozen clone (refused otherwise): one `script --worker` per core of a.cores, pinned there with one
    thread, the start logged in records' provenance.txt; returns their exit codes once all have ended."""
    problem = frozen_clone_problem()
    if problem:
        sys.exit(f"error: {problem}")
    os.makedirs(a.out, exist_ok=True)
    os.makedirs(records, exist_ok=True)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    with open(os.path.join(os.path.dirname(records), "provenance.txt"), "a") as f:
        f.write(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}: campaign started at commit {commit} on "
                f"cores {a.cores} ({cpu_capability()}), runs in {a.out}\n")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    procs = [subprocess.Popen(["taskset", "-c", str(core), sys.executable, os.path.abspath(script), *flags,
                               "--worker", "--core", str(core), "--out", a.out, "--records", records,
                               *(["--commit-into", a.commit_into] if a.commit_into else [])], env=env)
             for core in a.cores]
    return [p.wait() for p in procs]


def status(records, out):
    """Which runs of the plan are archived, in progress (claimed by a live process), left or not needed."""
    done, running, left, unneeded = [], [], [], []
    skip = not_needed(records)
    for name, _ in verdict_plan():
        pid = claim_pid(os.path.join(out, name + ".claim"))
        (done if finished(records, name) else running if pid and alive(pid) else unneeded if name in skip
         else left).append(name)
    lines = [f"verdict2: {len(done)} of {len(verdict_plan())} runs archived; in progress: "
             f"{', '.join(running) or 'none'}; left: {', '.join(left) or 'none'}"
             + (f"; not needed (the outcome is fixed, futility): {', '.join(unneeded)}" if unneeded else "")]
    for name in running + left:
        progress = run_progress(os.path.join(out, name), "" if name in running else " (stopped: resumes there)")
        lines += [f"  {name}: {progress}"] if progress else []
    return "\n".join(lines)


def run_progress(run_dir, note="", recent=20):
    """A started run's last finished step and, from its last `recent` steps' seconds, the hours of steps left
    (evaluation not counted); None before its first step."""
    path = os.path.join(run_dir, "metrics.jsonl")
    seconds = [json.loads(line)["seconds"] for line in open(path) if line.strip()] if os.path.exists(path) else []
    if not seconds:
        return None
    rate = float(np.median(seconds[-recent:]))
    left = (VERDICT_STEPS - len(seconds)) * rate / 3600
    return (f"step {len(seconds)} of {VERDICT_STEPS}{note}, {rate:.0f} s a step lately (median of the last "
            f"{min(recent, len(seconds))}): ~{left:.1f} h of steps left")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pilot", action="store_true", help="the router-lr pilot")
    p.add_argument("--verdict", action="store_true", help="the verdict (amendment 2): start or resume its campaign")
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1], help="the pilot's seeds (0 and 1)")
    p.add_argument("--arms", nargs="+", default=None, help="a subset of the pilot's arms (default: all)")
    p.add_argument("--n-eval", type=int, default=100, help="validation items per run")
    p.add_argument("--out", default=None, help="folder for the runs (default runs/verdict2, the verdict's "
                   "runs/verdict2-campaign)")
    p.add_argument("--analyse", action="store_true", help="only read the archived records and write table.md")
    p.add_argument("--status", action="store_true", help="the verdict: which runs are archived, running, left")
    p.add_argument("--cores", nargs="+", type=int, default=[0, 1], help="the verdict: one pinned worker per core")
    p.add_argument("--records", default=os.path.join(RESULTS, "runs"), help="the verdict: where each finished "
                   "run's record goes (results/verdict2/runs of a checkout)")
    p.add_argument("--commit-into", default=None, help="the verdict: a git checkout (the main one, not the frozen "
                   "clone) in which each finished run's record is committed; --records should lie inside it")
    p.add_argument("--readme", default=os.path.join(ROOT, "README.md"), help="the verdict: --analyse also puts "
                   "headline.md between this README's second-verdict markers ('' leaves it)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # one core's loop (campaign starts it)
    p.add_argument("--core", type=int, default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.pilot == a.verdict:
        p.error("give --pilot or --verdict")
    if a.verdict:
        a.out = a.out or os.path.join(ROOT, "runs", "verdict2-campaign")
        records = os.path.abspath(a.records)
        if a.status:
            print(status(records, a.out))
        elif a.worker:
            problem = worker_problem(a.core)
            if problem:
                print(f"error: {problem}", file=sys.stderr)
                sys.exit(2)
            worker(a, records)
        elif not a.analyse:
            campaign(a, records)
        if a.analyse or not (a.status or a.worker):
            runs = load(records)
            md = verdict_markdown(runs, records)
            with open(os.path.join(os.path.dirname(records), "table.md"), "w") as f:
                f.write(md)
            headline = verdict_headline(verdict_rows(runs), runs)
            with open(os.path.join(os.path.dirname(records), "headline.md"), "w") as f:  # README.md quotes it
                f.write("\n".join(headline) + "\n")
            if a.readme:
                quote_headline(a.readme, headline)
            print(md)
        return
    a.out = a.out or os.path.join(ROOT, "runs", "verdict2")
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
