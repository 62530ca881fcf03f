"""
Speedrun: wall-clock seconds of training until the greedy validation score on the pocket task's 100 held-out
items reaches 30 %, for `single`, `ours` and TRL's GRPOTrainer, and what each of our levers buys.

    python experiments/bench.py --speedrun                   # everything below -> results/speedrun.{json,md,png}
    python experiments/speedrun.py --contenders ours --seeds 0 --no-ablations     # a slice

What is measured, per run (a contender and a seed):
  - Training runs in its own process pinned to --train-core with one thread. The clock runs around each
    optimiser step only; model loading, checkpoint writes and evaluation are not counted.
  - Every --eval-every steps the trainable weights (LoRA, g_phi) are written. An evaluator process pinned to
    --eval-core scores the newest one on the same --items validation items (greedy, the task's own scorer:
    evaluate.score_items) while training goes on. When a score reaches --target, training stops; then the
    checkpoints it skipped since its last evaluated miss are scored in order, and the time reported is that of
    the first one at or above the target. (A checkpoint before the last miss is never scored: a noisy early hit
    there would be missed, so the figure is, if anything, late.)
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
import glob
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from types import SimpleNamespace

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


def save_weights(folder, step, seconds, lora, method):
    import torch
    path = os.path.join(folder, "ckpt", f"{step:05d}.pt")
    torch.save({"step": step, "seconds": seconds, "lora": lora, "method": method}, path + ".tmp")
    os.replace(path + ".tmp", path)


def train_worker(folder, kind, flags, o):
    import torch
    import rewards
    import train
    from lora import lora_state_dict
    torch.set_num_threads(1)
    args = train.parse_args(TASK + flags + ["--method", "single" if kind == "trl" else kind, "--seed", str(o["seed"]),
                                            "--steps", str(o["max_steps"]), "--out", folder])
    os.makedirs(os.path.join(folder, "ckpt"), exist_ok=True)
    stop = lambda seconds: os.path.exists(os.path.join(folder, "STOP")) or seconds > o["max_seconds"]  # noqa: E731
    if kind == "trl":
        return trl_train(folder, args, o, stop)
    run = train.build_run(args, torch.device("cpu"))
    train.write_json(os.path.join(folder, "config.json"), {**vars(args), "team_models": run["team"]})
    clock = 0.0
    for step in range(args.steps):
        t0 = time.perf_counter()
        rec, _ = train.grpo_step(step, run, args, rewards.score_batch)
        clock += time.perf_counter() - t0
        with open(os.path.join(folder, "metrics.jsonl"), "a") as f:
            f.write(json.dumps({**rec, "clock": clock}) + "\n")
        if (step + 1) % o["eval_every"] == 0:
            save_weights(folder, step + 1, clock, lora_state_dict(run["policy"]), run["method"].state_dict())
            wait_for_evaluator(folder, stop, clock)
        if stop(clock):
            break


def wait_for_evaluator(folder, stop, clock, lag=2):
    """Pause (off the clock) while `lag` or more checkpoints wait for a score: training far past the step that
    reached the target would only waste the core."""
    while not stop(clock):
        n_scored = sum(1 for _ in open(os.path.join(folder, "evals.jsonl"))) if os.path.exists(
            os.path.join(folder, "evals.jsonl")) else 0
        if len(glob.glob(os.path.join(folder, "ckpt", "*.pt"))) - n_scored < lag:
            return
        time.sleep(1)


def trl_train(folder, args, o, stop):
    """TRL's own loop; a callback keeps the clock (step begin to step end) and writes the LoRA weights under
    our names, so that the evaluator scores TRL's policy exactly as ours."""
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer
    import rewards
    import train
    from experts import load_model, team_models
    from lora import DEFAULT_TARGETS
    team = team_models(args)
    policy, tok = load_model(team["policy"])
    train.write_json(os.path.join(folder, "config.json"), {**vars(args), "team_models": team})
    items = rewards.load_entries(args.task, "train", args.dataset_size, args.seed, None, args.task_config)
    rows = [items[i] for s in range(args.steps) for i in train.batch_indices(s, 0, args.batch_size, 1, len(items),
                                                                             args.seed)]  # our data order
    prompts = train.policy_prompts(tok, [it["question"] for it in rows], [None] * len(rows), args)
    data = Dataset.from_list([{"prompt": p, "row": i} for i, p in enumerate(prompts)])

    def reward(prompts, completions, row, **_):
        task = rewards.score_batch([rows[i] for i in row], completions)[0]
        return [t + b for t, b in zip(task, rewards.format_bonus(completions, args.format_bonus))]
    config = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="speedrun-trl-"), per_device_train_batch_size=args.batch_size * args.group_size,
        num_generations=args.group_size, max_completion_length=args.max_new_tokens, temperature=args.temperature,
        beta=args.beta, epsilon=args.clip_eps, loss_type="grpo", learning_rate=args.lr,
        lr_scheduler_type="constant_with_warmup" if args.lr_schedule == "constant" else args.lr_schedule, warmup_steps=args.warmup_steps, weight_decay=args.weight_decay,
        adam_epsilon=args.adam_eps, max_grad_norm=args.grad_clip, max_steps=args.steps, seed=args.seed,
        bf16=False, use_cpu=True, report_to="none", logging_strategy="no", save_strategy="no", disable_tqdm=True,
        shuffle_dataset=False)
    clock = {"seconds": 0.0}

    class Clock(TrainerCallback):
        def on_step_begin(self, a, state, control, **kw):
            clock["t0"] = time.perf_counter()

        def on_step_end(self, a, state, control, **kw):
            clock["seconds"] += time.perf_counter() - clock["t0"]
            if state.global_step % o["eval_every"] == 0:
                lora = {k.replace("base_model.model.", "", 1).replace(".default.weight", ""): v.detach().clone()
                        for k, v in trainer.model.named_parameters() if "lora_" in k}
                save_weights(folder, state.global_step, clock["seconds"], lora, {})
                wait_for_evaluator(folder, stop, clock["seconds"])
            control.should_training_stop = stop(clock["seconds"])
    torch.set_num_threads(1)
    trainer = GRPOTrainer(model=policy, reward_funcs=reward, args=config, train_dataset=data, processing_class=tok,
                          peft_config=LoraConfig(r=args.lora_rank, lora_alpha=args.lora_alpha, lora_dropout=0.0,
                                                 target_modules=list(DEFAULT_TARGETS)), callbacks=[Clock()])
    trainer.train()


# ---------------------------------------------------------------------------------------------------------------
# The evaluator: newest checkpoint first while training runs, then the skipped ones before a hit


def eval_worker(folder, o):
    import torch
    import evaluate
    import rewards
    from lora import load_lora_state_dict
    torch.set_num_threads(1)
    while not glob.glob(os.path.join(folder, "ckpt", "*.pt")):
        time.sleep(2)
    with open(os.path.join(folder, "config.json")) as f:
        args = SimpleNamespace(**json.load(f))
    items = rewards.load_entries(args.task, "val", o["items"], args.seed, None, args.task_config)
    items = [items[i] for i in range(o["items"])]
    scored, hit, model = {}, None, None

    def score(step):
        nonlocal model
        state = torch.load(os.path.join(folder, "ckpt", f"{step:05d}.pt"), weights_only=False)
        if model is None:
            model = evaluate.load_policy(args, state["lora"], state["method"] or None)
        load_lora_state_dict(model[0], state["lora"])
        if state["method"]:
            model[2].load_state_dict(state["method"])
        per_item, _ = evaluate.score_items(*model, items, args, batch_size=50)  # greedy; the batch only changes rounding
        scored[step] = s = sum(per_item["with_C"]["score"]) / len(items)
        with open(os.path.join(folder, "evals.jsonl"), "a") as f:
            f.write(json.dumps({"step": step, "seconds": state["seconds"], "score": s}) + "\n")
        return s

    while True:
        steps = sorted(int(os.path.basename(p)[:5]) for p in glob.glob(os.path.join(folder, "ckpt", "*.pt")))
        pending = [s for s in steps if s not in scored]
        if hit is None:  # training runs: the newest checkpoint
            if pending:
                if score(pending[-1]) >= o["target"]:
                    hit = pending[-1]
                    open(os.path.join(folder, "STOP"), "w").close()
            elif os.path.exists(os.path.join(folder, "DONE")):
                break
            else:
                time.sleep(2)
            continue
        last_miss = max([s for s in scored if s < hit and scored[s] < o["target"]], default=0)
        todo = [s for s in steps if last_miss < s < hit and s not in scored]
        if not todo:
            break
        if score(todo[0]) >= o["target"]:
            hit = todo[0]
    return hit


# ---------------------------------------------------------------------------------------------------------------
# The parent: each run is a trainer and an evaluator on their own cores; results after every run


def run_one(folder, kind, flags, seed, a):
    o = dict(seed=seed, eval_every=a.eval_every, max_steps=a.max_steps, max_seconds=a.max_seconds, items=a.items,
             target=a.target)
    if not os.path.exists(os.path.join(folder, "result.json")):
        for name in ("ckpt", "metrics.jsonl", "evals.jsonl", "STOP", "DONE", "config.json"):  # a fresh start
            subprocess.run(["rm", "-rf", os.path.join(folder, name)], check=True)
        os.makedirs(folder, exist_ok=True)
        env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
        spawn = lambda core, *w: subprocess.Popen(  # noqa: E731
            ["taskset", "-c", str(core), sys.executable, os.path.abspath(__file__), "--worker", *w, "--opts",
             json.dumps(o)], cwd=ROOT, env=env, stdout=open(os.path.join(folder, f"{w[0]}.log"), "w"),
            stderr=subprocess.STDOUT)
        trainer = spawn(a.train_core, "train", folder, kind, json.dumps(flags))
        evaluator = spawn(a.eval_core, "eval", folder)
        if trainer.wait() != 0:
            evaluator.kill()
            raise RuntimeError(f"the trainer of {folder} failed; see {folder}/train.log")
        open(os.path.join(folder, "DONE"), "w").close()
        if evaluator.wait() != 0:
            raise RuntimeError(f"the evaluator of {folder} failed; see {folder}/eval.log")
        with open(os.path.join(folder, "evals.jsonl")) as f:
            evals = sorted((json.loads(ln) for ln in f), key=lambda e: e["step"])
        hits = [e for e in evals if e["score"] >= a.target]
        misses = [e["step"] for e in evals if e["score"] < a.target]
        first = next((e for e in hits if e["step"] > max([m for m in misses if m < hits[0]["step"]], default=0)),
                     None) if hits else None
        with open(os.path.join(folder, "metrics.jsonl")) as f:
            steps = [json.loads(ln) for ln in f] if kind != "trl" else []
        result = dict(seed=seed, seconds_to_target=first and first["seconds"], steps_to_target=first and first["step"],
                      evals=evals, steps_trained=len(steps) or None,
                      seconds_per_step=statistics.median([s["seconds"] for s in steps]) if steps else None)
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
    p.add_argument("--contenders", nargs="+", default=["ours", "single", "trl"], choices=["ours", "single", "trl"])
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--trl-seeds", nargs="+", type=int, default=None, help="seeds for trl (default: --seeds)")
    p.add_argument("--no-ablations", action="store_true", help="skip the one-lever-off runs of ours")
    p.add_argument("--target", type=float, default=0.30, help="validation score to reach")
    p.add_argument("--items", type=int, default=100, help="validation items (greedy)")
    p.add_argument("--eval-every", type=int, default=2, help="write the weights every N steps")
    p.add_argument("--max-steps", type=int, default=60)
    p.add_argument("--max-seconds", type=float, default=1200, help="training seconds after which a run gives up")
    p.add_argument("--train-core", type=int, default=1)
    p.add_argument("--eval-core", type=int, default=0)
    p.add_argument("--runs", default=os.path.join(ROOT, "runs", "speedrun"))
    p.add_argument("--out", default=os.path.join(ROOT, "results", "speedrun.json"))
    p.add_argument("--worker", nargs="+", help=argparse.SUPPRESS)
    p.add_argument("--opts", help=argparse.SUPPRESS)
    a = p.parse_args(sys.argv[2:] if sys.argv[1:2] == ["--speedrun"] else None)
    if a.worker:
        sys.path.insert(0, ROOT)
        o = json.loads(a.opts)
        return train_worker(a.worker[1], a.worker[2], json.loads(a.worker[3]), o) if a.worker[0] == "train" \
            else eval_worker(a.worker[1], o)
    plan = [(c, c, SPEEDRUN, s) for c in a.contenders for s in (a.trl_seeds or a.seeds if c == "trl" else a.seeds)]
    if not a.no_ablations:
        plan += [(f"ours without {lever}", "ours", SPEEDRUN + off, a.seeds[0]) for lever, off in LEVERS.items()]
    report, t_start = load(a.out), time.time()
    for label, kind, flags, seed in plan:
        folder = os.path.join(a.runs, label.replace(" ", "_").replace("/", "-"), f"s{seed}")
        print(f"[{time.time() - t_start:5.0f} s] {label} seed {seed}", flush=True)
        r = run_one(folder, kind, flags, seed, a)
        print(f"    -> {r['seconds_to_target']} s to {a.target:.0%} (steps {r['steps_to_target']}); evals "
              + ", ".join(f"{e['step']}:{e['score']:.2f}" for e in r["evals"]), flush=True)
        runs = report.setdefault("runs", {}).setdefault(label, {})
        runs[str(seed)] = r
        report[label] = contender(list(runs.values()))
        write(a, report)


def load(path):
    if os.path.exists(path):
        with open(path) as f:
            return json.load(f)
    return {}


def write(a, report):
    ours, trl = report.get("ours", {}), report.get("trl", {})
    o, t = ours.get("median_seconds_to_target"), trl.get("median_seconds_to_target")
    report["ratio_ours_vs_trl"] = o / t if o and t else None
    report["setup"] = dict(task=TASK, speedrun_flags=SPEEDRUN, pocket_flags=POCKET, levers=LEVERS, target=a.target,
                           items=a.items, eval_every=a.eval_every, max_steps=a.max_steps, max_seconds=a.max_seconds,
                           threads=1, train_core=a.train_core, eval_core=a.eval_core)
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out + ".tmp", "w") as f:
        json.dump({k: v for k, v in report.items() if k != "runs"} | {"runs": report.get("runs", {})}, f, indent=1)
    os.replace(a.out + ".tmp", a.out)
    plot(report, os.path.splitext(a.out)[0] + ".png", a.target)


def plot(report, path, target):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 5))
    colours = {"ours": "C0", "single": "C1", "trl": "C2"}
    for label, runs in report.get("runs", {}).items():
        for seed, r in runs.items():
            xs, ys = [0] + [e["seconds"] for e in r["evals"]], [None] + [100 * e["score"] for e in r["evals"]]
            ax.plot(xs[1:], ys[1:], "o-" if label in colours else ":", color=colours.get(label, "grey"), alpha=0.8,
                    label=label if seed == min(runs) else None, markersize=3)
    ax.axhline(100 * target, color="k", lw=0.8, ls="--")
    ax.set_xlabel("training seconds (one core; loading and evaluation excluded)")
    ax.set_ylabel("greedy validation score, % (100 items)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
