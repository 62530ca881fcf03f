"""
Does a policy trained with the int8 sampler learn as one trained with the float32 sampler? `single` on the
verdict's testbed with the verdict's flags, run again with `--rollout-dtype int8 --tis-cap 2`, on seeds whose
float32 run is archived in results/verdict/runs: the same seed draws the same training prompts and is scored on
the same 100 validation items, so the two runs pair item by item.

    OMP_NUM_THREADS=1 taskset -c 0 python experiments/int8_learning.py --seeds 2 4     # ~7 min a seed (AVX-512)
    OMP_NUM_THREADS=1 taskset -c 1 python experiments/int8_learning.py --seeds 6 7
    python experiments/int8_learning.py --analyse     # results/int8/runs -> results/int8/table.md

What it can and cannot say: the two samplers draw other tokens from the first step on, so two runs of one seed
differ as two seeds of one sampler can; a difference is measured per seed (item by item: the paired mean and the
items that went each way) and over seeds (the exact sign-flip test; with fewer than 6 seeds no 95 % interval over
seeds exists, stats.sign_flip_ci). Speed: the median seconds of a training step (metrics.jsonl), each run's own;
the float32 runs ran in another session beside other jobs (their timing.json has the load average).
"""
import argparse
import json
import os
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "experiments"))

from pocket import archive, run  # noqa: E402
from lib.stats import mean_std, paired_comparison, sign_flip_ci, sign_flip_p  # noqa: E402
from verdict import EXACT, HYPER, PROMPT, TESTBED_CONFIG, TESTBED_TASK, arms, cpu_capability, read_timing  # noqa: E402

RESULTS = os.path.join(ROOT, "results", "int8")
FLOAT32 = os.path.join(ROOT, "results", "verdict", "runs")  # the verdict's `single` runs: the float32 sampler
TASK = ["--task", TESTBED_TASK, "--task-config", TESTBED_CONFIG]
INT8 = ["--rollout-dtype", "int8", "--tis-cap", "2"]


def record(run_dir):
    """One run's figures: per-item scores, median step seconds, the sampler's gap (int8 runs only)."""
    ev = json.load(open(os.path.join(run_dir, "eval.json")))
    steps = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    # a step that trained no completion (every group flat) logs no sampler gap: the mean is over the steps that do
    mean = (lambda k: float(np.mean([s[k] for s in steps if k in s])) if any(k in s for s in steps) else None)
    return {"items": ev["per_item"]["with_C"]["score"], "score": 100 * ev["score"],
            "step_seconds": float(np.median([s["seconds"] for s in steps])), "gap": mean("rollout_logp_gap"),
            "clipped": mean("is_weight_clipped_fraction"), "cpu": read_timing(run_dir).get("cpu", "?")}


def analyse(results=RESULTS, float32=FLOAT32):
    """Markdown: per seed, float32 against int8 on the same items; then over seeds."""
    seeds = sorted(int(n.rsplit("-s", 1)[1]) for n in os.listdir(os.path.join(results, "runs")))
    L = ["# The int8 sampler against the float32 one (experiments/int8_learning.py)", "",
         "`single` on lcm with the verdict's flags; the float32 runs are the verdict's, the int8 runs add "
         "`--rollout-dtype int8 --tis-cap 2`. Scores in %, greedy, float32 evaluation, the same 100 items per seed; "
         "item-level: the paired mean difference with its 95 % bootstrap interval over items and the items that "
         "went each way; gap: mean |log π_old − log μ| per token (nats); clipped: importance weights at the cap.", "",
         "| seed | float32 | int8 | int8 − float32 (items) | better / worse items | s/step float32 | s/step int8 "
         "| gap | clipped | CPU |", "|---|---|---|---|---|---|---|---|---|---|"]
    diffs, speed = [], []
    for s in seeds:
        f, q = record(os.path.join(float32, f"single-s{s}")), record(os.path.join(results, "runs", f"single_int8-s{s}"))
        c = paired_comparison(q["items"], f["items"])
        diffs.append(q["score"] - f["score"])
        speed.append(f["step_seconds"] / q["step_seconds"])
        L.append(f"| {s} | {f['score']:.1f} | {q['score']:.1f} | {100 * c['diff']:+.1f} [{100 * c['ci95'][0]:+.1f}, "
                 f"{100 * c['ci95'][1]:+.1f}] | {c['better']} / {c['worse']} | {f['step_seconds']:.1f} | "
                 f"{q['step_seconds']:.1f} | {q['gap']:.3f} | {100 * q['clipped']:.1f} % | {f['cpu']} / {q['cpu']} |")
    m, sd = mean_std(diffs)
    ci = sign_flip_ci(diffs)
    ci = f", 95 % interval [{ci[0]:+.1f}, {ci[1]:+.1f}]" if ci else " (no 95 % interval over fewer than 6 seeds)"
    L += ["", f"Over {len(seeds)} seeds: int8 − float32 {m:+.1f} ± {sd:.1f} points{ci}; "
          f"{sum(d > 0 for d in diffs)} / {sum(d < 0 for d in diffs)} seeds better / worse; exact sign-flip p = "
          f"{sign_flip_p(diffs):.3g} (two-sided). A step's median time, float32 / int8: "
          f"{', '.join(f'{x:.2f}×' for x in speed)} (median {np.median(speed):.2f}×)."]
    return "\n".join(L) + "\n"


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", nargs="+", type=int, default=[2, 4, 6, 7], help="seeds with an archived float32 "
                   "`single` run on the same CPU kind (default: the verdict's AVX-512 ones)")
    p.add_argument("--out", default=os.path.join(ROOT, "runs", "int8"), help="folder for the runs")
    p.add_argument("--analyse", action="store_true", help="only read results/int8/runs and write table.md")
    a = p.parse_args()
    missing = [s for s in a.seeds if not os.path.exists(os.path.join(FLOAT32, f"single-s{s}", "eval.json"))]
    if missing:
        p.error(f"--seeds: no archived float32 `single` run for seed(s) {missing} in {FLOAT32}")
    if not a.analyse:
        os.makedirs(a.out, exist_ok=True)
        for seed in a.seeds:
            out = os.path.join(a.out, f"single_int8-s{seed}")
            if os.path.exists(os.path.join(out, "eval.json")):
                continue
            timing = read_timing(out)
            if not os.path.exists(os.path.join(out, "lora_peft", "adapter_config.json")):  # not trained to the end
                resume = ["--resume"] if os.path.exists(os.path.join(out, "config.json")) else []
                timing["train_seconds"] = timing.get("train_seconds", 0) + run(
                    ["train.py", *TASK, *PROMPT, *HYPER, *arms("", 1.0)["single"], *EXACT, *INT8, "--seed",
                     str(seed), "--out", out, *resume], os.path.join(a.out, "log.txt"))
            timing["eval_seconds"] = run(["evaluate.py", "--run", out, "--n", "100"], os.path.join(a.out, "log.txt"))
            timing["load_average_after"], timing["cpu"] = os.getloadavg(), cpu_capability()
            with open(os.path.join(out, "timing.json"), "w") as f:
                json.dump(timing, f)
            archive(out, os.path.join(RESULTS, "runs"))
    if not os.path.isdir(os.path.join(RESULTS, "runs")):
        p.error(f"nothing to analyse: {os.path.join(RESULTS, 'runs')} does not exist (run some seeds first)")
    md = analyse()
    with open(os.path.join(RESULTS, "table.md"), "w") as f:
        f.write(md)
    print(md)


if __name__ == "__main__":
    main()
