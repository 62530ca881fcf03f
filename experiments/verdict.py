"""
The collaboration verdict, as pre-registered in results/preregistration.md: every arm x every seed on the testbed
the screen chose, paired evaluation on the same items, and the pre-registered analysis (one-sided exact sign-flip
tests over seeds, Holm over the declared family). Everything not in the family is printed as exploratory.

    # run (resumable; one process per core with disjoint --seeds, each pinned):
    OMP_NUM_THREADS=1 taskset -c 0 python experiments/verdict.py --task TASK --task-config JSON --expert-depth D \
        --seeds 0 2 4 6
    OMP_NUM_THREADS=1 taskset -c 1 python experiments/verdict.py ... --seeds 1 3 5 7
    # analyse only (reads the archived records in results/verdict/runs):
    python experiments/verdict.py --analyse

Arms (ARMS below; all on the pocket protocol of experiments/pocket.py: G 4, 4 prompts a step, 15 steps, lr 1e-3,
the speedrun's levers, C in front of the prompt, --context-anchor newline wherever there are context tokens):
  single            the policy alone (LoRA), no context tokens
  bare_anchor       m newline tokens in front of the prompt, nothing trained in g (what the anchor alone does)
  soft_prompt       m free trainable tokens, anchored (the interface without experts)
  identical         ours with the policy's own frozen base as the only expert
  ours              ours, team pocket-strong (Gemma-3-270M, SmolLM2, MiniLM, --strong-expert), standardised states
                    at the screen's depth
  ours_strong_only  ours with --strong-expert as the only expert
  ours_cf           ours + the channel-forcing term, weight 1 (grpo.channel_forcing_loss)
  random            ours trained on a fair coin per completion (no format bonus): the control for routing

Every run and evaluation of the queue keeps the experts' pooled states in OUT/expert-states (train.py
--expert-cache): the four arms of a seed that read Qwen2.5-Coder-1.5B share its states of the seed's 256
calibration prompts and 100 validation items (and of the training prompts they have in common), computed once. A state read back is the tensor computed first; computed again
in another batch it could differ in its last bits, as the in-memory cache already allows within a run.
"""
import argparse
import json
import os
import subprocess
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "experiments"))

from pocket import archive, run  # noqa: E402
from lib.stats import holm, mean_std, sign_flip_ci, sign_flip_p  # noqa: E402

RESULTS = os.path.join(ROOT, "results", "verdict")
# the testbed the screen chose and every verdict run trained on (given to this script as --task / --task-config);
# the int8 and neighbours experiments run on it too, so that their runs pair item by item with the verdict's
TESTBED_TASK, TESTBED_CONFIG = "lcm", '{"min_numbers": 2, "max_numbers": 2, "min_value": 2, "max_value": 20}'
PROMPT = ["--worked-example", "--response-prefix", "<think>", "--context-position", "before", "--max-new-tokens", "48"]
HYPER = ["--batch-size", "4", "--grad-accum", "1", "--group-size", "4", "--lr", "1e-3", "--router-lr", "1e-3",
         "--steps", "15", "--save-every", "5", "--dataset-size", "2000"]
ANCHOR, NORM = ["--context-anchor", "newline"], ["--state-norm", "standardize"]
# pocket.py's levers without the bfloat16 rollout (amendment 1 of the pre-registration: on a CPU without bf16
# instructions it is three times slower, and the screen's `single` ran with a float32 rollout)
LEVERS = ["--format-bonus", "0.1", "--dynamic-sampling", "1"]
# exact speed-ups (the same numbers bit for bit, results/performance.md), from the batch of 2026-11-25 10:53 UTC
# on: the MLPs' activations kept for the backward pass (~10 % less training time, ~1.1 GB more memory a run)
EXACT = ["--keep-activations"]


def arms(strong, depth):
    """name -> train.py flags (beyond the task, prompt, protocol and seed)."""
    ours = ["--method", "ours", "--team", "pocket-strong", *ANCHOR, *NORM, "--expert-depth", str(depth)]
    return {
        "single": ["--method", "single", "--team", "pocket", *LEVERS],
        "bare_anchor": ["--method", "bare_anchor", "--team", "pocket", *ANCHOR, *LEVERS],
        "soft_prompt": ["--method", "soft_prompt", "--team", "pocket", *ANCHOR, *LEVERS],
        "identical": ["--method", "identical", "--team", "pocket", *ANCHOR, *NORM, "--expert-depth", str(depth),
                      *LEVERS],
        "ours": ours + LEVERS,
        "ours_strong_only": ["--method", "ours", "--team", "pocket", "--experts", strong, *ANCHOR, *NORM,
                             "--expert-depth", str(depth), *LEVERS],
        "ours_cf": ours + LEVERS + ["--channel-weight", "1"],
        "random": ours + LEVERS + ["--reward", "random", "--format-bonus", "0"],
    }


SEEDS = tuple(range(8))  # pre-registered: every arm runs seeds 0-7; fewer and the verdict is incomplete
# The pre-registered family: (name, arm, comparator, endpoint). Endpoints, per seed (the same 100 items):
#   score    mean score of `arm` minus that of `comparator` (greedy, the task's scorer, with C as trained)
#   shuffle  mean over items of `arm`'s with-C score minus its shuffled-C score (comparator unused)
#   strong   `arm`'s utilisation of the strong expert (mean of the last 3 steps) minus that of `comparator`
FAMILY = [("H1a", "ours", "single", "score"), ("H1b", "ours", "soft_prompt", "score"),
          ("H2", "ours", None, "shuffle"), ("H3", "ours", "random", "strong"),
          ("H1a-cf", "ours_cf", "single", "score"), ("H1b-cf", "ours_cf", "soft_prompt", "score"),
          ("H2-cf", "ours_cf", None, "shuffle"), ("H3-cf", "ours_cf", "random", "strong")]
EXPLORATORY = [(f"{a} − single", a, "single", "score") for a in ("bare_anchor", "soft_prompt", "identical",
                                                                  "ours_strong_only", "random")] + \
              [("soft_prompt − bare_anchor", "soft_prompt", "bare_anchor", "score"),
               ("ours_strong_only: with C − shuffled C", "ours_strong_only", None, "shuffle")]


def load(runs_dir):
    """{arm: {seed: {"eval": eval.json or eval_paired.json, "metrics": [...], "cfg": ...}}} from archived runs."""
    out = {}
    for name in sorted(os.listdir(runs_dir)) if os.path.isdir(runs_dir) else []:
        d = os.path.join(runs_dir, name)
        arm, seed = name.rsplit("-s", 1)
        paired = os.path.join(d, "eval_paired.json")
        path = paired if os.path.exists(paired) else os.path.join(d, "eval.json")
        if not os.path.exists(path):
            continue
        rec = {"eval": json.load(open(path)), "cfg": json.load(open(os.path.join(d, "config.json"))),
               "metrics": [json.loads(line) for line in open(os.path.join(d, "metrics.jsonl"))],
               "cpu": read_timing(d).get("cpu", "?")}
        out.setdefault(arm, {})[int(seed)] = rec
    return out


def cpu_capability():
    """The instruction set torch's CPU kernels use on this machine (AVX2, AVX512, ...). Float sums run in
    another order on another one, so a seed's run is not the same run there: recorded with every run."""
    import torch
    return torch.backends.cpu.get_cpu_capability()


def read_timing(run_dir):
    """A run's wall times so far ({"train_seconds", "eval_seconds", ...}), {} before its first process."""
    path = os.path.join(run_dir, "timing.json")
    return json.load(open(path)) if os.path.exists(path) else {}


def run_once(out, train_flags, n_eval, has_context, log, into):
    """One run of a queue, resumable: train (`--resume` where a run folder exists; skipped once its LoRA is
    saved), evaluate on n_eval items (paired with C / anchor / shuffled C where the arm has context tokens), record
    the wall times in OUT/timing.json and archive the small records into `into`. A run already evaluated is
    skipped."""
    if os.path.exists(os.path.join(out, "eval_paired.json" if has_context else "eval.json")):
        return
    timing = read_timing(out)
    if not os.path.exists(os.path.join(out, "lora_peft", "adapter_config.json")):
        resume = ["--resume"] if os.path.exists(os.path.join(out, "config.json")) else []
        timing["train_seconds"] = timing.get("train_seconds", 0) + run(
            ["train.py", *train_flags, "--out", out, *resume], log)
    timing["eval_seconds"] = run(["evaluate.py", "--run", out, "--n", str(n_eval),
                                  *(["--paired"] if has_context else [])], log)
    timing["load_average_after"] = os.getloadavg()  # how busy the machine was (1, 5, 15 min)
    timing["cpu"] = cpu_capability()
    with open(os.path.join(out, "timing.json"), "w") as f:
        json.dump(timing, f)
    archive(out, into)


def costs(runs_dir):
    """Markdown: every archived run's training and evaluation wall time, and the total in core-hours (one
    thread per run)."""
    L = ["| run | train s | eval s | load average after (1, 5, 15 min) | CPU | note |", "|---|---|---|---|---|---|"]
    total, untimed, part = 0.0, [], []
    for name in sorted(os.listdir(runs_dir)) if os.path.isdir(runs_dir) else []:
        t = read_timing(os.path.join(runs_dir, name))
        if not t:
            untimed.append(name)
            continue
        if "train_seconds" not in t or "eval_seconds" not in t:  # a part not recorded: the total is short of it
            part.append(name)
        total += t.get("train_seconds", 0) + t.get("eval_seconds", 0)
        load = ", ".join(f"{x:.1f}" for x in t["load_average_after"]) if "load_average_after" in t else "–"
        seconds = [f"{t[k]:.0f}" if k in t else "–" for k in ("train_seconds", "eval_seconds")]
        L.append(f"| {name} | {seconds[0]} | {seconds[1]} | {load} | {t.get('cpu', '–')} | {t.get('note', '')} |")
    L += ["", f"Total: {total / 3600:.2f} core-hours over {len(L) - 2} timed runs"
          + (f" (not counted: the unrecorded training or evaluation of {', '.join(part)})" if part else "")
          + (f"; without timing: {', '.join(untimed)}" if untimed else "") + "."]
    return "\n".join(L) + "\n"


def strong_utilisation(rec):
    """Mean utilisation of the strong expert (the last expert of the run's team) over the last 3 steps."""
    steps = [m["utilization"] for m in rec["metrics"] if m.get("utilization")][-3:]
    return float(np.mean([u[-1] for u in steps])) if steps else float("nan")


def per_seed(runs, arm, comparator, endpoint):
    """{seed: difference} over the seeds where every run the endpoint needs has a record."""
    out = {}
    for seed, rec in runs.get(arm, {}).items():
        items = rec["eval"]["per_item"]
        if endpoint == "shuffle":
            if "shuffled_C" in items and "n/a" not in items["shuffled_C"]:
                out[seed] = float(np.mean(items["with_C"]["score"]) - np.mean(items["shuffled_C"]["score"]))
            continue
        other = runs.get(comparator, {}).get(seed)
        if other is None:
            continue
        if endpoint == "score":
            a, b = items["with_C"]["score"], other["eval"]["per_item"]["with_C"]["score"]
            assert len(a) == len(b), f"{arm} and {comparator} of seed {seed} were scored on different items"
            out[seed] = float(np.mean(a) - np.mean(b))
        else:
            out[seed] = strong_utilisation(rec) - strong_utilisation(other)
    return out


def analyse(runs):
    """The family's rows (one-sided exact sign-flip p over seeds, Holm over the family) and the exploratory ones
    (two-sided, unadjusted). Returns (rows, verdict)."""
    rows = []
    for kind, tests in (("family", FAMILY), ("exploratory", EXPLORATORY)):
        for name, arm, comparator, endpoint in tests:
            d = per_seed(runs, arm, comparator, endpoint)
            vals = [d[s] for s in sorted(d)]
            p = sign_flip_p(vals, "greater" if kind == "family" else "two-sided") if len(vals) > 1 else float("nan")
            rows.append({"name": name, "kind": kind, "endpoint": endpoint, "seeds": sorted(d), "diffs": vals,
                         "mean": mean_std(vals)[0] if vals else float("nan"),
                         "sd": mean_std(vals)[1] if vals else float("nan"),
                         "better": sum(v > 0 for v in vals), "worse": sum(v < 0 for v in vals), "p": p})
    family = [r for r in rows if r["kind"] == "family"]
    # the pre-registration: a verdict needs every seed of every arm the family reads; short of that it is
    # "incomplete", never negative (with 7 seeds a real effect could still miss Holm's bar by its 8th)
    complete = all(set(SEEDS) <= set(r["seeds"]) for r in family)
    for r, p_adj in zip(family, holm([r["p"] if np.isfinite(r["p"]) else 1.0 for r in family])):
        r["p_holm"] = p_adj
    significant = {r["name"]: r["p_holm"] < 0.05 for r in family}
    shapes = any(all(significant[h + suffix] for h in ("H1a", "H1b", "H2", "H3")) for suffix in ("", "-cf"))
    verdict = (f"incomplete: not every family test has its {len(SEEDS)} pre-registered seeds" if not complete else
               "RL shapes collaboration here (every endpoint of one variant Holm p < 0.05)" if shapes else
               "not shown: no variant of ours passes all four endpoints at Holm p < 0.05")
    return rows, verdict


def one_cpu_seeds(runs):
    """The seeds whose archived arms all ran on one CPU instruction set (amendment 2 of the pre-registration)."""
    seeds = sorted({s for v in runs.values() for s in v})
    return [s for s in seeds if len({runs[a][s].get("cpu", "?") for a in runs if s in runs[a]}) == 1]


def markdown(rows, verdict, runs):
    L = ["# The collaboration verdict (experiments/verdict.py)", "", f"**Verdict: {verdict}.**", "",
         "Pre-registered in results/preregistration.md. Differences are in points (score, shuffle) or in "
         "utilisation (strong); one per seed, on the same items; p: exact sign-flip over seeds, one-sided for the "
         "family (Holm-adjusted over its 8 tests), two-sided and unadjusted for the exploratory rows; the 95 % "
         "interval of the mean difference is the same test's, by inversion (descriptive; it needs 6 seeds).", "",
         "| test | kind | seeds | mean ± sd | 95 % interval | better / worse seeds | p | Holm p |",
         "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        scale = 100 if r["endpoint"] in ("score", "shuffle") else 1
        k = 1 if scale == 100 else 3  # decimals: a difference in points, or in utilisation
        n = len(r["seeds"])  # no seed yet: dashes; one seed: its difference, no test
        diff = (f"{scale * r['mean']:+.{k}f} ± {scale * r['sd']:.{k}f}" if n > 1 else
                f"{scale * r['mean']:+.{k}f}" if n else "–")
        ci = sign_flip_ci(r["diffs"]) if n else None
        ci = f"[{scale * ci[0]:+.{k}f}, {scale * ci[1]:+.{k}f}]" if ci else "–"
        p = f"{r['p']:.3g}" if n > 1 else "– (needs 2 seeds)" if n else "–"
        holm_p = "exploratory" if "p_holm" not in r else f"{r['p_holm']:.3g}" if n > 1 else "–"
        L.append(f"| {r['name']} | {r['kind']} | {n} | {diff} | {ci} | {r['better']} / {r['worse']} | {p} | "
                 f"{holm_p} |")
    seeds = sorted({s for v in runs.values() for s in v})
    same = one_cpu_seeds(runs)
    if len(same) < len(seeds):  # amendment 2: exploratory, the family on the seeds of one instruction set
        cells = []
        for r in (r for r in rows if r["kind"] == "family"):
            d = [v for s, v in zip(r["seeds"], r["diffs"]) if s in same]
            scale = 100 if r["endpoint"] in ("score", "shuffle") else 1
            cells.append(f"{r['name']} {scale * np.mean(d):+.{1 if scale == 100 else 3}f} ({len(d)})" if d else
                         f"{r['name']} – (0)")
        L += ["", f"Exploratory (amendment 2): seeds whose arms all ran on one instruction set: "
              f"{', '.join(map(str, same)) or 'none'}; the family's mean differences on them (seeds): "
              + "; ".join(cells) + "."]
    L += ["", "| arm | " + " | ".join(f"s{s}" for s in seeds) + " |"]
    L.append("|---|" + "---|" * len(seeds))
    cpus = sorted({r.get("cpu", "?") for v in runs.values() for r in v.values()})

    def cell(rec):  # the score, and where runs ran on more than one instruction set, which one
        score = f"{100 * rec['eval']['score']:.1f}"
        return score if len(cpus) < 2 else f"{score} ({rec.get('cpu', '?')})"
    for arm in sorted(runs):
        L.append(f"| {arm} | " + " | ".join(cell(runs[arm][s]) if s in runs[arm] else "–" for s in seeds) + " |")
    if len(cpus) > 1:  # a seed's run is another run on another instruction set (cpu_capability)
        L += ["", f"In brackets: the CPU instruction set each run ran on ({', '.join(cpus)}; from timing.json)."]
    return "\n".join(L) + "\n"


def headline(rows, verdict, runs):
    """The README's verdict, as lines of markdown written from the table (results/verdict/headline.md; a test
    holds the README to it): while incomplete, the count of runs and nothing else, because a partial table is no
    claim; once complete, the verdict, then each variant's four endpoints and the controls, with the 95 %
    interval over seeds, the seeds that went each way and the Holm-adjusted p; beneath, each arm's mean score."""
    done, total = sum(len(v) for v in runs.values()), len(arms("", 1.0)) * len(SEEDS)
    design = (f"pre-registered: {len(arms('', 1.0))} arms × {len(SEEDS)} seeds on lcm, one-sided exact sign-flip "
              "tests over seeds, Holm over 8")
    if verdict.startswith("incomplete"):
        return [f"**The verdict is running** ({design}): {done} of {total} runs archived; a partial table is no "
                "claim."]
    by = {r["name"]: r for r in rows}

    def say(name):
        r = by[name]
        k, scale = (1, 100) if r["endpoint"] in ("score", "shuffle") else (3, 1)
        if len(r["seeds"]) < 2:  # an exploratory arm without records (a complete family needs none of them)
            return "no records"
        ci = sign_flip_ci(r["diffs"])
        ci = f" [{scale * ci[0]:+.{k}f}, {scale * ci[1]:+.{k}f}]" if ci else ""
        p = f"Holm p = {r['p_holm']:.3g}" if "p_holm" in r else f"p = {r['p']:.3g}, exploratory"
        return (f"{scale * r['mean']:+.{k}f}{' points' if scale == 100 else ''}{ci}, {r['better']} / "
                f"{r['worse']} seeds, {p}")
    L = [f"**Verdict: {verdict}** ({design}; {done} of {total} runs; 95 % intervals over seeds)."]
    for arm, sfx in (("ours", ""), ("ours_cf", "-cf")):
        L.append(f"- `{arm}` − `single`: {say('H1a' + sfx)}; − `soft_prompt`: {say('H1b' + sfx)}")
        L.append(f"- `{arm}` with C − shuffled C: {say('H2' + sfx)}; strong expert's utilisation − "
                 f"`random`'s: {say('H3' + sfx)}")
    L.append(f"- exploratory: `bare_anchor` − `single`: {say('bare_anchor − single')}; `soft_prompt` − "
             f"`bare_anchor`: {say('soft_prompt − bare_anchor')}; `random` − `single`: {say('random − single')}")
    L += ["", "| arm | validation score, mean ± sd over seeds (%) | seeds |", "|---|---|---|"]
    for arm in (a for a in arms("", 1.0) if a in runs):
        m, sd = mean_std([100 * rec["eval"]["score"] for rec in runs[arm].values()])
        L.append(f"| `{arm}` | {m:.1f} ± {sd:.1f} | {len(runs[arm])} |")
    return L


def plot(runs, path):
    """Each arm's validation score (with C as trained) per seed, one line per seed across the arms, so that
    a pairing shows: the family's comparisons are within a seed. Returns the path, or None (no matplotlib)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    order = [a for a in arms("", 1.0) if a in runs]
    fig, ax = plt.subplots(figsize=(8, 3.6))
    for seed in sorted({s for v in runs.values() for s in v}):
        x = [i for i, a in enumerate(order) if seed in runs[a]]
        ax.plot(x, [100 * runs[order[i]][seed]["eval"]["score"] for i in x], "o-", alpha=0.6, label=f"seed {seed}")
    ax.set_xticks(range(len(order)), order, rotation=20)
    ax.set_ylabel("validation score (%)")
    ax.set_title("The verdict's runs: 100 items per seed, the same items for every arm of a seed")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--task", help="the testbed the screen chose (results/screen/table.md)")
    p.add_argument("--task-config", default=None, help="its reasoning-gym config, JSON")
    p.add_argument("--expert-depth", type=float, default=1.0, help="the experts' depth (amendment 1: 1.0)")
    p.add_argument("--strong-expert", default="pocket:qwen2.5-coder-1.5b-instruct", help="the screen's best expert")
    p.add_argument("--seeds", nargs="+", type=int, default=list(SEEDS), help="pre-registered: 0-7")
    p.add_argument("--arms", nargs="+", default=None, help="a subset of the arms (default: all)")
    p.add_argument("--n-eval", type=int, default=100, help="validation items per run (pre-registered: 100)")
    p.add_argument("--out", default=os.path.join(ROOT, "runs", "verdict"), help="folder for the runs")
    p.add_argument("--analyse", action="store_true", help="only read results/verdict/runs and write table.md")
    a = p.parse_args()
    if not a.analyse:
        if not a.task:
            p.error("--task is required to run (the screen's chosen testbed)")
        table = arms(a.strong_expert, a.expert_depth)
        unknown = set(a.arms or []) - set(table)
        if unknown:
            p.error(f"--arms: unknown {sorted(unknown)}; arms: {', '.join(table)}")
        task = ["--task", a.task] + (["--task-config", a.task_config] if a.task_config else [])
        os.makedirs(a.out, exist_ok=True)
        log = os.path.join(a.out, "log.txt")
        for seed in a.seeds:
            for arm in a.arms or table:
                run_once(os.path.join(a.out, f"{arm}-s{seed}"),
                         [*task, *PROMPT, *HYPER, *table[arm], *EXACT, "--seed", str(seed),
                          "--expert-cache", os.path.join(a.out, "expert-states")],
                         a.n_eval, arm != "single", log, os.path.join(RESULTS, "runs"))
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
        with open(os.path.join(RESULTS, "provenance.txt"), "a") as f:
            f.write(f"seeds {a.seeds} arms {a.arms or 'all'} ran at commit {commit.strip()}\n")
    runs = load(os.path.join(RESULTS, "runs"))
    rows, verdict = analyse(runs)
    os.makedirs(RESULTS, exist_ok=True)
    md = markdown(rows, verdict, runs)
    with open(os.path.join(RESULTS, "table.md"), "w") as f:
        f.write(md)
    with open(os.path.join(RESULTS, "headline.md"), "w") as f:  # README.md quotes it (tests/test_verdict.py)
        f.write("\n".join(headline(rows, verdict, runs)) + "\n")
    with open(os.path.join(RESULTS, "costs.md"), "w") as f:
        f.write("# The verdict's runs: wall time (experiments/verdict.py --analyse)\n\n"
                "One thread per run, pinned to one core; what else ran on the machine is in README.md's log.\n\n"
                + costs(os.path.join(RESULTS, "runs")))
    plot(runs, os.path.join(RESULTS, "scores.png"))
    print(md)


if __name__ == "__main__":
    main()
