"""
The pocket reproduction: the paper's Table 1 and Fig. 4 in miniature, on a 2-core CPU, from nothing.

    python experiments/pocket.py                 # everything: untrained baseline, 5 methods x 3 seeds, naive team,
                                                 # evaluation with and without C, results/pocket/{table.md, *.png}
    python experiments/pocket.py --seeds 0 --methods single ours --teams pocket   # a smaller slice

It is resumable: a finished run (eval.json present) is skipped, an interrupted one continues with --resume.
Stop it at any time and run the same command again.

Deviations from the paper's protocol (all forced by a 2-core CPU; the GPU recipe in the README has the real ones):
  1. Policy SmolLM2-135M-Instruct, experts Gemma-3-270M, SmolLM2-135M-Instruct, all-MiniLM-L6-v2 (pocket team).
  2. One task: chain_sum with 2 terms of 1-2 digits, where the untrained policy is neither at 0 nor near 100 %
     (measured first, see results/pocket/untrained-*.json).
  3. A worked example in the system prompt, the response pre-filled with "<think>", C in front of the prompt,
     behind its first token (--context-position before).
  4. G = 4 (paper 8), 4 prompts per step (paper 32), 48 new tokens (paper 128; the policy's answers take 10-30),
     --steps 30 (paper 500), lr 5e-4 for LoRA and g_phi (paper 1e-4: we see ~1/200 of its samples).
  5. Validation on --n-eval items (greedy), not 4,000.
  6. Two cores: run one process per core with disjoint --seeds (each pinned to its core with
     OMP_NUM_THREADS=1 taskset -c K); every run is a separate folder, so they never collide.
"""
import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TASK = ["--task", "chain_sum", "--task-config", '{"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2}']
# the prompt and generation budget: the same for training, the untrained baseline and every evaluation
PROMPT = ["--worked-example", "--response-prefix", "<think>", "--context-position", "before", "--max-new-tokens", "48"]


def run(cmd, log):
    print("$", " ".join(cmd), flush=True)
    t0 = time.time()
    with open(log, "a") as f:
        subprocess.run([sys.executable, *cmd], cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, check=True)
    print(f"  done in {time.time() - t0:.0f} s", flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--methods", nargs="+", default=["single", "ours", "no_xattn", "hard_routing", "output_collab"],
                   help="methods to compare")
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2], help="seeds per method")
    p.add_argument("--steps", type=int, default=30, help="GRPO steps per run")
    p.add_argument("--lr", type=float, default=5e-4, help="learning rate of LoRA and g_phi (paper: 1e-4 over "
                   "500 steps of 256 completions; here far fewer samples)")
    p.add_argument("--n-eval", type=int, default=100, help="validation items per run")
    p.add_argument("--teams", nargs="+", default=["pocket", "pocket-naive"], choices=["pocket", "pocket-naive"],
                   help="pocket-naive (pocket + a random-init GPT-2, Fig. 4) trains `ours` only")
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
    jobs = [(m, s, team) for team in a.teams for s in a.seeds
            for m in (a.methods if team == "pocket" else ["ours"])]
    for method, seed, team in jobs:
        out = os.path.join(a.out, f"{team}-{method}-s{seed}")
        if not os.path.exists(os.path.join(out, "eval.json")):
            resume = ["--resume"] if os.path.exists(os.path.join(out, "config.json")) else []  # started before
            done = os.path.exists(os.path.join(out, "lora_peft", "adapter_config.json"))
            if not done:
                run(["train.py", *TASK, *PROMPT, *hyper, "--team", team, "--method", method, "--seed", str(seed),
                     "--out", out, *resume], log)
            run(["evaluate.py", "--run", out, "--n", str(a.n_eval)], log)
        has_context = method in ("ours", "no_xattn", "hard_routing")
        if has_context and not os.path.exists(os.path.join(out, "eval_no_context.json")):
            run(["evaluate.py", "--run", out, "--n", str(a.n_eval), "--no-context"], log)
    run(["evaluate.py", "--summarize", a.out, "--out", a.results], log)
    print(open(os.path.join(a.results, "table.md")).read())
    print(json.load(open(os.path.join(a.results, "spearman.json")))["mean"])


if __name__ == "__main__":
    main()
