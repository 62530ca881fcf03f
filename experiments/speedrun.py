"""
Speedrun: wall-clock seconds of training until the greedy validation score on the pocket task's 100 held-out
items reaches 30 %, for `single`, `ours` and TRL's GRPOTrainer, and what each of our levers buys.

    python experiments/bench.py --speedrun                   # everything below -> results/speedrun.{json,md,png}
    python experiments/speedrun.py --contenders ours --seeds 0 --no-ablations     # a slice

What is measured, per run (a contender and a seed):
  - Training runs in its own process pinned to --train-core with one thread. The clock runs around each
    optimiser step only; model loading, checkpoint writes and evaluation are not counted.
  - After steps 1, 2, 3, 4, 6, 8, 10, 12, 16, 20, ... (every step, then every 2nd, then every 4th: `due`) the clock
    stops and the policy is scored on the same --items validation items
    (greedy, the task's own scorer: evaluate.score_items, so never the format bonus); the first score at or above
    --target ends the run, and its clock is the run's time to target. (An evaluator process on the other core
    would let training go on meanwhile; on a machine whose other core is busy, as here, it only competes for
    memory and makes no difference to the clock.)
  - The median over seeds; a run that never reaches the target within --max-steps / --max-seconds counts as
    not reached (null), and the median is null when most seeds did not reach it.

The contenders share the pocket task, prompt, G, prompts per step, new tokens, learning rate and schedule, beta,
clip, LoRA (r 8, alpha 16, the same 7 projections), AdamW settings and the reward (with the format bonus):
  single, ours  train.grpo_step with SPEEDRUN's flags (ours: the pocket team's three experts).
  trl           TRL's GRPOTrainer + PEFT LoRA on the same model, prompts in the same order, loss_type "grpo"
                (GRPO's per-completion mean, as ours). It has no dynamic sampling and no low-precision rollout
                copy, and no experts: it is `single`'s maths in TRL's engine.
Ablations (ours, seed 0): SPEEDRUN with one lever set back to the old pocket protocol at a time.
"""
import argparse
import fcntl
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TASK = ["--task", "chain_sum", "--task-config", '{"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2}',
        "--team", "pocket", "--worked-example", "--response-prefix", "<think>", "--context-position", "before",
        "--device", "cpu"]
POCKET = ["--batch-size", "4", "--grad-accum", "1", "--group-size", "4", "--max-new-tokens", "48",
          "--lr", "5e-4", "--router-lr", "5e-4"]  # the pocket table's protocol (experiments/pocket.py)
SPEEDRUN = POCKET + ["--lr", "1e-3", "--router-lr", "1e-3", "--rollout-dtype", "bfloat16", "--tis-cap", "2",
                     "--dynamic-sampling", "1", "--format-bonus", "0.1"]
LEVERS = {  # lever -> the flags that switch it back to the pocket protocol
    "lr 1e-3 (pocket: 5e-4)": ["--lr", "5e-4", "--router-lr", "5e-4"],
    "bf16 rollout copy + TIS": ["--rollout-dtype", "float32", "--tis-cap", "0"],
    "dynamic sampling": ["--dynamic-sampling", "0"],
    "format bonus 0.1": ["--format-bonus", "0"],
}


# ---------------------------------------------------------------------------------------------------------------
# The trainer: one process per run; the clock runs around each optimiser step only


def due(step):
    """Whether the policy is scored after this step: every step up to 4, every 2nd up to 12, then every 4th. The
    time to target is exact where the target is reached early, and at most 4 steps late after that."""
    return step <= 4 or (step <= 12 and step % 2 == 0) or step % 4 == 0


class Validation:
    """The greedy score on the run's validation items, recorded with the training clock; True at the target."""

    def __init__(self, folder, args, o):
        import rewards
        items = rewards.load_entries(args.task, "val", o["items"], args.seed, None, args.task_config)
        self.items, self.args, self.o = [items[i] for i in range(o["items"])], args, o
        self.path = os.path.join(folder, "evals.jsonl")

    def __call__(self, step, seconds, policy, tok, method, eos_ids):
        import evaluate
        was_training = policy.training
        policy.eval(), method.eval()
        per_item, _ = evaluate.score_items(policy, tok, method, eos_ids, self.items, self.args, batch_size=50)
        policy.train(was_training), method.train()
        score = sum(per_item["with_C"]["score"]) / len(self.items)
        with open(self.path, "a") as f:
            f.write(json.dumps({"step": step, "seconds": seconds, "score": score}) + "\n")
        return score >= self.o["target"]


def train_worker(folder, kind, flags, o):
    import torch
    import rewards
    import train
    torch.set_num_threads(1)
    args = train.parse_args(TASK + flags + ["--method", "single" if kind == "trl" else kind, "--seed", str(o["seed"]),
                                            "--steps", str(o["max_steps"]), "--out", folder])
    if kind == "trl":
        return trl_train(folder, args, o)
    run = train.build_run(args, torch.device("cpu"))
    validate, clock = Validation(folder, args, o), 0.0
    for step in range(args.steps):
        t0 = time.perf_counter()
        rec, _ = train.grpo_step(step, run, args, rewards.score_batch)
        clock += time.perf_counter() - t0
        with open(os.path.join(folder, "metrics.jsonl"), "a") as f:
            f.write(json.dumps({**rec, "clock": clock}) + "\n")
        if due(step + 1) and validate(step + 1, clock, run["policy"], run["tok"], run["method"],
                                                          run["eos_ids"]):
            break
        if clock > o["max_seconds"]:
            break


def trl_train(folder, args, o):
    """TRL's own loop; a callback keeps the clock (step begin to step end) and, at every `due` step, copies
    TRL's LoRA weights into our copy of the policy, so that TRL's policy is scored exactly as ours."""
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer
    import evaluate
    import rewards
    from experts import load_model, team_models
    from lora import DEFAULT_TARGETS, load_lora_state_dict
    args.team_models = team = team_models(args)
    policy, tok = load_model(team["policy"])
    items = rewards.load_entries(args.task, "train", args.dataset_size, args.seed, None, args.task_config)
    rows = [items[i] for s in range(args.steps) for i in rewards.batch_indices(s, 0, args.batch_size, 1, len(items),
                                                                               args.seed)]  # our data order
    prompts = rewards.policy_prompts(tok, [it["question"] for it in rows], [None] * len(rows), args)
    data = Dataset.from_list([{"prompt": p, "row": i} for i, p in enumerate(prompts)])

    def reward(prompts, completions, row, **_):
        task = rewards.score_batch([rows[i] for i in row], completions)[0]
        golds = [rows[i]["answer"] for i in row] if args.format_bonus_strict else None
        return [t + b for t, b in zip(task, rewards.format_bonus(completions, args.format_bonus, golds))]
    config = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="speedrun-trl-"), per_device_train_batch_size=args.batch_size * args.group_size,
        num_generations=args.group_size, max_completion_length=args.max_new_tokens, temperature=args.temperature,
        beta=args.beta, epsilon=args.clip_eps, loss_type="grpo", learning_rate=args.lr,
        lr_scheduler_type="constant_with_warmup" if args.lr_schedule == "constant" else args.lr_schedule,
        warmup_steps=args.warmup_steps, weight_decay=args.weight_decay, adam_epsilon=args.adam_eps,
        max_grad_norm=args.grad_clip, max_steps=args.steps, seed=args.seed, bf16=False, use_cpu=True,
        report_to="none", logging_strategy="no", save_strategy="no", disable_tqdm=True, shuffle_dataset=False)
    validate, clock, ours = Validation(folder, args, o), {"seconds": 0.0}, {}

    class Clock(TrainerCallback):
        def on_step_begin(self, a, state, control, **kw):
            clock["t0"] = time.perf_counter()

        def on_step_end(self, a, state, control, **kw):
            clock["seconds"] += time.perf_counter() - clock["t0"]
            if due(state.global_step):
                lora = {k.replace("base_model.model.", "", 1).replace(".default.weight", ""): v.detach().clone()
                        for k, v in trainer.model.named_parameters() if "lora_" in k}
                if not ours:  # our copy of the policy with our LoRA, loaded once
                    ours["model"] = evaluate.load_policy(args, lora, None)
                load_lora_state_dict(ours["model"][0], lora)
                control.should_training_stop = validate(state.global_step, clock["seconds"], *ours["model"])
            control.should_training_stop |= clock["seconds"] > o["max_seconds"]
    trainer = GRPOTrainer(model=policy, reward_funcs=reward, args=config, train_dataset=data, processing_class=tok,
                          peft_config=LoraConfig(r=args.lora_rank, lora_alpha=args.lora_alpha, lora_dropout=0.0,
                                                 target_modules=list(DEFAULT_TARGETS)), callbacks=[Clock()])
    trainer.train()


# ---------------------------------------------------------------------------------------------------------------
# The parent: each run is a trainer and an evaluator on their own cores; results after every run


def run_one(folder, kind, flags, seed, a):
    o = dict(seed=seed, max_steps=a.max_steps, max_seconds=a.max_seconds, items=a.items,
             target=a.target)
    if not os.path.exists(os.path.join(folder, "result.json")):
        subprocess.run(["rm", "-rf", folder], check=True)  # an unfinished run starts again
        os.makedirs(folder)
        env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
        with open(os.path.join(folder, "train.log"), "w") as log:
            code = subprocess.run(["taskset", "-c", str(a.core), sys.executable, os.path.abspath(__file__), "--worker",
                                   folder, kind, json.dumps(flags), "--opts", json.dumps(o)], cwd=ROOT, env=env,
                                  stdout=log, stderr=subprocess.STDOUT).returncode
        if code != 0:
            raise RuntimeError(f"the run in {folder} failed; see {folder}/train.log")
        with open(os.path.join(folder, "evals.jsonl")) as f:
            evals = [json.loads(ln) for ln in f]
        first = next((e for e in evals if e["score"] >= a.target), None)
        steps = []
        if os.path.exists(os.path.join(folder, "metrics.jsonl")):  # ours and single (TRL keeps its own)
            with open(os.path.join(folder, "metrics.jsonl")) as f:
                steps = [json.loads(ln) for ln in f]
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=ROOT).stdout.strip()
        result = dict(seed=seed, commit=commit, seconds_to_target=first and first["seconds"], steps_to_target=first and first["step"],
                      evals=evals, seconds_per_step=statistics.median([s["seconds"] for s in steps]) if steps else
                      (evals[-1]["seconds"] / evals[-1]["step"] if evals else None))
        with open(os.path.join(folder, "result.json"), "w") as f:
            json.dump(result, f, indent=1)
    with open(os.path.join(folder, "result.json")) as f:
        return json.load(f)


def contender(results):
    times = [r["seconds_to_target"] for r in results]
    reached = sorted(t for t in times if t is not None)
    # the median of all seeds, counting "not reached" as slower than any time: null when most did not reach it
    median = statistics.median(reached + [float("inf")] * (len(times) - len(reached))) if times else None
    return dict(median_seconds_to_target=None if median in (None, float("inf")) else median,
                seeds={str(r["seed"]): r for r in results})


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--contenders", nargs="*", default=["ours", "single", "trl"], choices=["ours", "single", "trl"],
                   help="none: only the ablations")
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--trl-seeds", nargs="+", type=int, default=None, help="seeds for trl (default: --seeds)")
    p.add_argument("--no-ablations", action="store_true", help="skip the one-lever-off runs of ours")
    p.add_argument("--levers", nargs="*", default=list(LEVERS), choices=list(LEVERS), help="the levers to ablate")
    p.add_argument("--no-reference", action="store_true", help="skip the ablations' reference run of ours")
    p.add_argument("--target", type=float, default=0.30, help="validation score to reach")
    p.add_argument("--items", type=int, default=100, help="validation items (greedy)")
    p.add_argument("--max-steps", type=int, default=60)
    p.add_argument("--max-seconds", type=float, default=1200, help="training seconds after which a run gives up")
    p.add_argument("--core", type=int, default=1, help="the core every run is pinned to (one thread)")
    p.add_argument("--runs", default=os.path.join(ROOT, "runs", "speedrun"))
    p.add_argument("--out", default=os.path.join(ROOT, "results", "speedrun.json"))
    p.add_argument("--worker", nargs="+", help=argparse.SUPPRESS)
    p.add_argument("--opts", help=argparse.SUPPRESS)
    a = p.parse_args(sys.argv[2:] if sys.argv[1:2] == ["--speedrun"] else None)
    if a.worker:
        sys.path.insert(0, ROOT)
        return train_worker(a.worker[0], a.worker[1], json.loads(a.worker[2]), json.loads(a.opts))
    seeds = lambda c: a.trl_seeds if c == "trl" and a.trl_seeds is not None else a.seeds  # noqa: E731
    plan = [(c, c, SPEEDRUN, s) for s in a.seeds for c in a.contenders if s in seeds(c)]  # seed by seed
    if not a.no_ablations:
        if not a.no_reference:  # run on the same code as the ablations
            plan += [("ours (reference of the ablations)", "ours", SPEEDRUN, a.seeds[0])]
        plan += [(f"ours without {lever}", "ours", SPEEDRUN + LEVERS[lever], a.seeds[0]) for lever in a.levers]
    t_start = time.time()
    for label, kind, flags, seed in plan:
        folder = os.path.join(a.runs, label.replace(" ", "_").replace("/", "-"), f"s{seed}")
        print(f"[{time.time() - t_start:5.0f} s] {label} seed {seed}", flush=True)
        r = run_one(folder, kind, flags, seed, a)
        print(f"    -> {r['seconds_to_target']} s to {a.target:.0%} (steps {r['steps_to_target']}); evals "
              + ", ".join(f"{e['step']}:{e['score']:.2f}" for e in r["evals"]), flush=True)
        with open(a.out + ".lock", "w") as lock:  # two of these may run at once, one per core
            fcntl.flock(lock, fcntl.LOCK_EX)
            report = {}
            if os.path.exists(a.out):
                with open(a.out) as f:
                    report = json.load(f)
            runs = report.setdefault("runs", {}).setdefault(label, {})
            runs[str(seed)] = r
            report[label] = contender(list(runs.values()))
            write(a, report)


def write(a, report):
    ours, trl = report.get("ours", {}), report.get("trl", {})
    o, t = ours.get("median_seconds_to_target"), trl.get("median_seconds_to_target")
    report["ratio_ours_vs_trl"] = o / t if o and t else None
    one = report.get("single", {}).get("median_seconds_to_target")
    report["ratio_single_vs_trl"] = one / t if one and t else None  # the same maths in both engines
    report["setup"] = dict(task=TASK, speedrun_flags=SPEEDRUN, pocket_flags=POCKET, levers=LEVERS, target=a.target,
                           items=a.items, eval_schedule=[s for s in range(1, a.max_steps + 1) if due(s)], max_steps=a.max_steps, max_seconds=a.max_seconds,
                           threads=1, core=a.core)
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out + ".tmp", "w") as f:
        json.dump({k: v for k, v in report.items() if k != "runs"} | {"runs": report.get("runs", {})}, f, indent=1)
    os.replace(a.out + ".tmp", a.out)
    plot(report, os.path.splitext(a.out)[0] + ".png", a.target)
    with open(os.path.splitext(a.out)[0] + ".md", "w") as f:
        f.write(markdown(report, a.target))


def markdown(report, target):
    """The speedrun table (results/speedrun.md, discussed in results/performance.md): seconds (steps) to the target per seed, and the median."""
    runs = report.get("runs", {})
    seeds = sorted({s for r in runs.values() for s in r}, key=int)
    cell = lambda r: "not reached" if r["seconds_to_target"] is None else (  # noqa: E731
        f"{r['seconds_to_target']:.0f} s ({r['steps_to_target']} step{'s' * (r['steps_to_target'] > 1)})")
    out = [f"| run | " + " | ".join(f"seed {s}" for s in seeds) + f" | median s to {target:.0%} | s/step |",
           "|---" * (len(seeds) + 3) + "|"]
    for label, by_seed in runs.items():
        med = report[label]["median_seconds_to_target"]
        per_step = statistics.median([r["seconds_per_step"] for r in by_seed.values() if r["seconds_per_step"]])
        out.append(f"| {label} | " + " | ".join(cell(by_seed[s]) if s in by_seed else "–" for s in seeds)
                   + f" | {'not reached' if med is None else f'{med:.0f}'} | {per_step:.1f} |")
    for k in ("ours", "single"):
        if report.get(f"ratio_{k}_vs_trl"):
            out += ["", f"{k} / TRL (medians): {report[f'ratio_{k}_vs_trl']:.2f}"]
    return "\n".join(out) + "\n"


def plot(report, path, target):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 5))
    colours = {"ours": "C0", "single": "C1", "trl": "C2"}
    ablations = iter(f"C{k}" for k in range(3, 10))  # the one-lever-off runs: dotted, a colour each
    for label, runs in report.get("runs", {}).items():
        colour = colours.get(label) or next(ablations)
        for seed, r in runs.items():
            ax.plot([e["seconds"] for e in r["evals"]], [100 * e["score"] for e in r["evals"]],
                    "o-" if label in colours else "o:", color=colour, alpha=0.8, markersize=3,
                    label=label if seed == min(runs) else None)
    ax.axhline(100 * target, color="k", lw=0.8, ls="--")
    ax.set_xlabel("training seconds (one core; loading and evaluation excluded)")
    ax.set_ylabel("greedy validation score, % (100 items)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
