"""
The pocket reproduction: the paper's Table 1 and Fig. 4 in miniature, on a 2-core CPU, from nothing.

    python experiments/pocket.py                 # everything: untrained baseline, every method x 5 seeds, the naive
                                                 # and oracle teams, the random-reward control; paired evaluation
                                                 # (with C, C = 0, shuffled C); results/pocket/{table.md, *.png}
    python experiments/pocket.py --seeds 0 --methods single ours --teams pocket   # a smaller slice
    python experiments/pocket.py --seeds 0 1 2 --methods single --teams pocket pocket-oracle   # the oracle test
    python experiments/pocket.py --seeds 0 --methods conductor rlae --teams pocket --no-random-reward   # the two
                                                 # methods of other papers (several times the cost of a step of ours)

It is resumable: a finished run (eval.json present) is skipped, an interrupted one continues with --resume.
Stop it at any time and run the same command again.

Deviations from the paper's protocol (all forced by a 2-core CPU; the GPU recipe in the README has the real ones):
  1. Policy SmolLM2-135M-Instruct, experts Gemma-3-270M, SmolLM2-135M-Instruct, all-MiniLM-L6-v2 (pocket team).
  2. One task: chain_sum with 2 terms of 1-2 digits, where the untrained policy is neither at 0 nor near 100 %
     (measured first, see results/pocket/untrained-*.json).
  3. A worked example in the system prompt, the response pre-filled with "<think>", C in front of the prompt,
     behind its first token (--context-position before).
  4. G = 4 (paper 8), 4 prompts per step (paper 32), 48 new tokens (paper 128; the policy's answers take 10-30),
     --steps 15 (paper 500), lr 1e-3 for LoRA and g_phi (paper 1e-4: we see ~1/500 of its samples).
  5. The speedrun's levers (--levers, on by default; results/performance.md): a format bonus of 0.1 in the training
     reward only, one re-draw of flat groups (dynamic sampling), a bfloat16 copy of the policy for the rollout with
     truncated importance sampling (cap 2). With them a step gets a reward signal from the first step; without
     them (the first pocket table: 30 steps, lr 5e-4) the first 4-8 steps were mostly flat.
  6. --state-norm standardize for the methods that read expert states (ours, identical, no_xattn): without it C
     is the same for every prompt (results/channel.md), so the question of this table
     could not even be asked. --state-norm none gives the paper's adapter.
  7. Validation on --n-eval items (greedy), not 4,000.
  8. Two cores: run one process per core with disjoint --seeds (each pinned to its core with
     OMP_NUM_THREADS=1 taskset -c K); every run is a separate folder, so they never collide.

The controls (what could produce the same number without the experts): `identical` (the policy's own frozen
base as the only expert), `soft_prompt` (free context tokens, no experts), the random-reward run of `ours`
(for rho(reward, H) against rho(step, H)), and every method with C scored on the same items with C, with C = 0
and with C shuffled across items (evaluate.py --paired). Every method of one seed is scored on the same 100
validation items, so methods can be compared item by item too. The oracle team (pocket + an expert that reads
the gold answer + a random GPT-2) is a diagnostic: it tells whether the channel can carry item information.
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from baselines import METHODS, NEIGHBOURS, kind  # noqa: E402  what each method is: the runs' flags ask it

TASK = ["--task", "chain_sum", "--task-config", '{"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2}']
# the prompt and generation budget: the same for training, the untrained baseline and every evaluation
PROMPT = ["--worked-example", "--response-prefix", "<think>", "--context-position", "before", "--max-new-tokens", "48"]

LEVERS = ["--format-bonus", "0.1", "--dynamic-sampling", "1", "--rollout-dtype", "bfloat16", "--tis-cap", "2"]


def run(cmd, log):
    print("$", " ".join(cmd), flush=True)
    t0 = time.time()
    with open(log, "a") as f:
        subprocess.run([sys.executable, *cmd], cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, check=True)
    seconds = time.time() - t0
    print(f"  done in {seconds:.0f} s", flush=True)
    return seconds


def archive(run_dir, into):
    """Copy a finished run's small records (config, per-step metrics, evaluations; ~40 KB) into results/, which
    is in git: `evaluate.py --summarize results/pocket/runs` rebuilds the table, item by item, without runs/."""
    dest = os.path.join(into, os.path.basename(run_dir))
    os.makedirs(dest, exist_ok=True)
    for name in sorted(os.listdir(run_dir)):
        if name in ("config.json", "metrics.jsonl", "timing.json") or name.startswith("eval"):
            shutil.copy2(os.path.join(run_dir, name), dest)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--methods", nargs="+", default=["single", "ours", "identical", "soft_prompt", "no_xattn",
                                                    "hard_routing", "output_collab"],
                   choices=sorted([*METHODS, *NEIGHBOURS]), metavar="METHOD", help="methods to compare: "
                   f"{', '.join(sorted([*METHODS, *NEIGHBOURS]))}")
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2, 3, 4], help="seeds per method")
    p.add_argument("--steps", type=int, default=15, help="GRPO steps per run (the first pocket table: 30)")
    p.add_argument("--lr", type=float, default=1e-3, help="learning rate of LoRA and g_phi (paper: 1e-4 over "
                   "500 steps of 256 completions; here far fewer samples; the first pocket table: 5e-4)")
    p.add_argument("--levers", action=argparse.BooleanOptionalAction, default=True, help="the speedrun's levers "
                   "(deviation 5); --no-levers and --steps 30 --lr 5e-4 --state-norm none: the first pocket table")
    p.add_argument("--n-eval", type=int, default=100, help="validation items per run")
    p.add_argument("--teams", nargs="+", default=["pocket", "pocket-naive", "pocket-oracle"],
                   choices=["pocket", "pocket-naive", "pocket-oracle", "pocket-strong"], help="pocket-naive (pocket + "
                   "a random-init GPT-2, Fig. 4), pocket-oracle (the diagnostic oracle team) and pocket-strong (pocket "
                   "+ Qwen2.5-Coder-1.5B-Instruct, an optional install) train `ours` only")
    p.add_argument("--random-reward", action=argparse.BooleanOptionalAction, default=True,
                   help="also train `ours` on the pocket team with --reward random (the control for rho)")
    p.add_argument("--state-norm", default="standardize", choices=["none", "standardize"], help="train.py --state-norm "
                   "for the methods that read expert states (ours, identical, no_xattn); the others cannot take it")
    p.add_argument("--train-flags", default="", help="extra train.py flags for every run, e.g. a channel option; "
                   "write --train-flags=--one-flag when it is a single flag (argparse would take it for one of ours)")
    p.add_argument("--out", default=os.path.join(ROOT, "runs", "pocket"), help="folder for the runs")
    p.add_argument("--results", default=os.path.join(ROOT, "results", "pocket"), help="folder for table and plots")
    a = p.parse_args()
    os.makedirs(a.out, exist_ok=True), os.makedirs(a.results, exist_ok=True)
    log = os.path.join(a.out, "log.txt")
    hyper = ["--batch-size", "4", "--grad-accum", "1", "--group-size", "4", "--lr", str(a.lr), "--router-lr",
             str(a.lr), "--steps", str(a.steps), "--save-every", "5", "--dataset-size", "2000"]

    untrained = os.path.join(a.results, "untrained-chain_sum-pocket.json")
    if not os.path.exists(untrained):
        run(["evaluate.py", "--untrained", "--team", "pocket", "--n", str(a.n_eval), "--out", a.results,
             *TASK, *PROMPT], log)
    jobs = [(m, s, team, []) for s in a.seeds for team in a.teams
            for m in (a.methods if team == "pocket" else ["ours"])]
    if a.random_reward:
        # the coin only: the levers' format bonus would pay for the form, which is not a random reward
        jobs += [("ours", s, "pocket", ["--reward", "random", "--format-bonus", "0"]) for s in a.seeds]
    extra = (LEVERS if a.levers else []) + a.train_flags.split()
    for method, seed, team, flags in jobs:
        out = os.path.join(a.out, f"{team}-{method}{'-random-reward' if flags else ''}-s{seed}")
        has_context = kind(method).tokens  # a method without context tokens has no C to pair
        if not os.path.exists(os.path.join(out, "eval_paired.json" if has_context else "eval.json")):
            resume = ["--resume"] if os.path.exists(os.path.join(out, "config.json")) else []  # started before
            done = os.path.exists(os.path.join(out, "lora_peft", "adapter_config.json"))
            norm = ["--state-norm", a.state_norm] if kind(method).state_norm else []
            # the neighbours (neighbours/NAME.py, not train.py --method NAME) evaluate their runs too
            script = [f"neighbours/{method}.py"] if method in NEIGHBOURS else ["train.py", "--method", method]
            scorer = [f"neighbours/{method}.py", "evaluate"] if method in NEIGHBOURS else ["evaluate.py"]
            if not done:
                run([*script, *TASK, *PROMPT, *hyper, *extra, *norm, *flags, "--team", team,
                     "--seed", str(seed), "--out", out, *resume], log)
            run([*scorer, "--run", out, "--n", str(a.n_eval), *(["--paired"] if has_context else [])], log)
        archive(out, os.path.join(a.results, "runs"))
    run(["evaluate.py", "--summarize", a.out, "--out", a.results], log)
    print(open(os.path.join(a.results, "table.md")).read())
    with open(os.path.join(a.results, "spearman.json")) as f:
        print(json.dumps(json.load(f)["by_method"], indent=1))


if __name__ == "__main__":
    main()
