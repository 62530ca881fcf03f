"""
Speedrun: wall-clock seconds of training until the greedy validation score on the pocket task's 100 held-out
items reaches 30 % and then 45 %, for `single`, `ours` and TRL's GRPOTrainer, 5 seeds each, side by side.

    python experiments/bench.py --speedrun --core 1         # the table -> results/speedrun.{json,md,png}
    python experiments/speedrun.py --dry-run                # the plan (what is recorded, what is to run) and its cost
    python experiments/speedrun.py --contenders ours --seeds 0 --out /tmp/slice.json         # a slice

What is measured, per run (a contender and a seed):
  - Training runs in its own process pinned to --core with one thread. The clock runs around each optimiser
    step only; model loading, checkpoint writes and evaluation are not counted.
  - After steps 1, 2, 3, 4, 6, 8, 10, 12, 16, 20, ... (every step, then every 2nd, then every 4th: `due`) the clock
    stops and the policy is scored on the same --items validation items (greedy, the task's own scorer:
    evaluate.score_items, never the format bonus). The clock at the first score >= each of --targets is the run's
    time to that target; the run goes on until the last target, --max-steps or --max-seconds, and a target it
    never reached is null.
  - Per contender and target: the median over seeds, counting "not reached" as slower than any time, so it is
    null when at least half the seeds did not reach; and how many did.
  - ours against single and against TRL on the same seeds (the same data order and validation items): the ratio
    of the medians, each seed's ratio, the exact sign-flip test of the paired differences in seconds (seeds where
    both reached; with 5 it cannot go below p = 0.0625) and the sign test of which got there first (a seed where
    only one reached counts for it; where neither did, it is dropped).

The contenders share the pocket task, prompt, G, prompts per step, new tokens, learning rate and schedule, beta,
clip, LoRA (r 8, alpha 16, the same 7 projections), AdamW settings and the reward: the task's scorer plus the
STRICT format bonus (0.1 only when the completion ends with its answer block, a number where the gold answer is
one: rewards.answer_shaped). The plain bonus, paid for any text in the block, was a trap: in the first speedrun
(results/speedrun/plain-bonus/) one `ours` seed of three wrote a wrong number in it, ran on to the token limit
and needed 20 steps to reach 30 %, and that one seed set the median.
  single, ours  train.grpo_step with SPEEDRUN's flags (ours: the team's three experts), dynamic sampling 1.
  trl           TRL's GRPOTrainer + PEFT LoRA on the same model, prompts in the same order, loss_type "grpo"
                (GRPO's per-completion mean, as ours), trl_reward (the same reward, tested equal). It has no
                dynamic sampling, no low-precision rollout copy and no experts: it is `single`'s maths in TRL's
                engine, and its recorded flags say so.
Rollout precision (--rollout-dtype, in every run's config): float32 by default. bfloat16 or int8 give single and
ours a low-precision copy of the weights for the rollout, with truncated importance sampling (--tis-cap 2); TRL
always samples in float32. Which is faster on a CPU without bf16 instructions is for a slice to measure (with its
own --out: one report holds one setup), not for the default to assume.
Ablations (--ablations; ours, the first seed): SPEEDRUN with one lever set back to the first pocket protocol.

Order and resumption: seed by seed, the contenders' order rotated each seed (seed 0: single, ours, trl; seed 1:
ours, trl, single; ...), so that a slowdown of the machine falls on each alike. Every finished run is written to
--out at once, under a lock file (two queues on disjoint slices, one per core, may share it), with its config,
its (step, clock, score) trace and the commit; a run whose recorded config equals the planned one is skipped, so
a killed queue continues where it stopped.

Cost (`worst_case_seconds`; seconds per step measured on this machine in the first speedrun: single 30.5, ours
30.9, TRL 102.3, one thread; an evaluation of 100 items ~60 s, loading ~30 s): a run stops after --max-seconds
600 of training (~20 steps of ours or single, ~6 of TRL) or --max-steps 40, so the 15 runs cost at most 4.8
core-hours, and less for every run that reaches 45 % early. Measured (results/speedrun.md, 2026-11-26): the 15
runs took 3.15 core-hours (2.0 h of wall time on core 0, 1.1 on core 1). Until then the bounds were 1200 s and 60
steps (8.3 core-hours at most): halved so that the 15 runs fit in ~2 hours on two cores. A run that has not
reached a target in 600 s says "slower than 600 s", no more; for TRL, whose steps take ~100 s, that is 6 steps.
"""
import argparse
import contextlib
import fcntl
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "experiments"))
import speedrun_report as report_of  # noqa: E402
from support.harness.config import COUNT, POSITIVE, ArgumentParser, fail, number  # noqa: E402

TASK = ["--task", "chain_sum", "--task-config", '{"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2}',
        "--worked-example", "--response-prefix", "<think>", "--context-position", "before", "--device", "cpu"]
POCKET = {"--batch-size": "4", "--grad-accum": "1", "--group-size": "4", "--max-new-tokens": "48",
          "--lr": "5e-4", "--router-lr": "5e-4"}  # the first pocket table's protocol (experiments/pocket.py)
SPEEDRUN = {**POCKET, "--lr": "1e-3", "--router-lr": "1e-3", "--dynamic-sampling": "1", "--format-bonus": "0.1",
            "--format-bonus-strict": True}  # a flag: value, True (given alone) or None (left out)
ROLLOUT = {"float32": {}, "bfloat16": {"--rollout-dtype": "bfloat16", "--tis-cap": "2"},
           "int8": {"--rollout-dtype": "int8", "--tis-cap": "2"}}
LEVERS = {  # lever -> the flags that set it back to the first pocket protocol
    "lr 1e-3 (pocket: 5e-4)": {"--lr": "5e-4", "--router-lr": "5e-4"},
    "low-precision rollout + TIS": {"--rollout-dtype": None, "--tis-cap": None},
    "dynamic sampling": {"--dynamic-sampling": None},
    "strict format bonus 0.1": {"--format-bonus": None, "--format-bonus-strict": None},
}
CONTENDERS = report_of.ORDER  # single, ours, trl
MEASURED = {"single": 30.5, "ours": 30.9, "trl": 102.3}  # s/step in the first speedrun (results/speedrun/plain-bonus)
EVAL_SECONDS, LOAD_SECONDS = 60, 30  # one evaluation of 100 items, and loading, on this machine


def train_flags(kind, rollout_dtype, lever=None):
    """train.py's flags of a contender, as argv: SPEEDRUN, the rollout precision (TRL: none, and no dynamic
    sampling, which it does not have), and one lever set back."""
    f = {**SPEEDRUN, **({"--dynamic-sampling": None} if kind == "trl" else ROLLOUT[rollout_dtype]),
         **LEVERS.get(lever, {})}
    return [x for k, v in f.items() if v is not None for x in ([k] if v is True else [k, v])]


def due(step):
    """Whether the policy is scored after this step: every step up to 4, every 2nd up to 12, then every 4th. The
    time to a target is exact where it is reached early, and at most 4 steps late after that."""
    return step <= 4 or (step <= 12 and step % 2 == 0) or step % 4 == 0


# ---------------------------------------------------------------------------------------------------------------
# The trainer: one process per run; the clock runs around each optimiser step only


class Validation:
    """The greedy score on the run's validation items, recorded with the training clock; True at the last target."""

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
        return score >= self.o["targets"][-1]


def train_worker(folder, o):
    """One run: o is its config (run_config)."""
    import torch
    import rewards
    import train
    torch.set_num_threads(1)
    args = train.parse_args(o["argv"] + ["--out", folder])
    if o["kind"] == "trl":
        return trl_train(folder, args, o)
    run = train.build_run(args, torch.device("cpu"))
    validate, clock = Validation(folder, args, o), 0.0
    for step in range(args.steps):
        t0 = time.perf_counter()
        rec, _ = train.grpo_step(step, run, args, rewards.score_batch)
        clock += time.perf_counter() - t0
        with open(os.path.join(folder, "metrics.jsonl"), "a") as f:
            f.write(json.dumps({**rec, "clock": clock}) + "\n")
        if due(step + 1) and validate(step + 1, clock, run.policy, run.tok, run.method, run.eos_ids):
            break
        if clock > o["max_seconds"]:
            break


def trl_reward(rows, args):
    """TRL's reward function: the task's scorer plus --format-bonus (strict with --format-bonus-strict), as
    train.draw_and_score pays it; `row` (a dataset column) is each completion's index into `rows`."""
    import rewards

    def reward(prompts, completions, row, **_):
        task = rewards.score_batch([rows[i] for i in row], completions)[0]
        golds = [rows[i]["answer"] for i in row] if args.format_bonus_strict else None
        return [t + b for t, b in zip(task, rewards.format_bonus(completions, args.format_bonus, golds))]
    return reward


def trl_train(folder, args, o):
    """TRL's own loop; a callback keeps the clock (step begin to step end) and, at every `due` step, copies
    TRL's LoRA weights into our copy of the policy, so that TRL's policy is scored exactly as ours."""
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
    trainer = GRPOTrainer(model=policy, reward_funcs=trl_reward(rows, args), args=config, train_dataset=data,
                          processing_class=tok, callbacks=[Clock()],
                          peft_config=LoraConfig(r=args.lora_rank, lora_alpha=args.lora_alpha, lora_dropout=0.0,
                                                 target_modules=list(DEFAULT_TARGETS)))
    trainer.train()


# ---------------------------------------------------------------------------------------------------------------
# The parent: the plan, one process per run, the report after every run


def measure(a):
    """What makes two runs' times comparable: a report (--out) holds runs of one measure only."""
    return dict(task=TASK, team=a.team, targets=a.targets, items=a.items, max_steps=a.max_steps,
                max_seconds=a.max_seconds, rollout_dtype=a.rollout_dtype,
                eval_schedule=[s for s in range(1, a.max_steps + 1) if due(s)])


def run_config(kind, seed, a, lever=None):
    """A run's config: the worker's options, with train.py's argv (without --out). Equal config, equal run."""
    argv = TASK + ["--team", a.team] + train_flags(kind, a.rollout_dtype, lever) + [
        "--method", "single" if kind == "trl" else kind, "--seed", str(seed), "--steps", str(a.max_steps)]
    return dict(kind=kind, seed=seed, argv=argv, targets=a.targets, items=a.items, max_seconds=a.max_seconds,
                rollout_dtype="float32" if kind == "trl" else a.rollout_dtype)


def plan(a):
    """[(label, config)]: seed by seed, the contenders' order rotated by one each seed; then the ablations."""
    runs = []
    for k, seed in enumerate(a.seeds):
        order = CONTENDERS[k % 3:] + CONTENDERS[:k % 3]
        runs += [(c, run_config(c, seed, a)) for c in order if c in a.contenders and seed in a.seeds_of[c]]
    if a.ablations:
        runs += [(f"ours without {lever}", run_config("ours", a.seeds[0], a, lever)) for lever in a.levers]
    return runs


def launch(folder, config, core):
    """The run in its own process, pinned to `core` with one thread; False if it failed."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    with open(os.path.join(folder, "train.log"), "w") as log:
        return subprocess.run(["taskset", "-c", str(core), sys.executable, os.path.abspath(__file__), "--worker",
                               folder, "--opts", json.dumps(config)], cwd=ROOT, env=env, stdout=log,
                              stderr=subprocess.STDOUT).returncode == 0


def commit():
    """HEAD, with -dirty when tracked code (results/ aside) differs from it."""
    git = lambda *c: subprocess.run(["git", *c], capture_output=True, text=True, cwd=ROOT).stdout.strip()  # noqa: E731
    dirty = git("status", "--porcelain", "--untracked-files=no", "--", ".", ":!results")
    return git("rev-parse", "--short", "HEAD") + ("-dirty" if dirty else "")


def run_one(folder, config, core):
    """Train one run from scratch (an unfinished one starts again) -> its record for the report."""
    subprocess.run(["rm", "-rf", folder], check=True)
    os.makedirs(folder)
    if not launch(folder, config, core):
        raise RuntimeError(f"the run in {folder} failed; see {folder}/train.log")
    with open(os.path.join(folder, "evals.jsonl")) as f:
        evals = [json.loads(ln) for ln in f]
    steps = []
    if os.path.exists(os.path.join(folder, "metrics.jsonl")):  # ours and single (TRL keeps its own)
        with open(os.path.join(folder, "metrics.jsonl")) as f:
            steps = [json.loads(ln) for ln in f]
    per_step = statistics.median([s["seconds"] for s in steps]) if steps else (
        evals[-1]["seconds"] / evals[-1]["step"] if evals else None)
    return dict(config=config, commit=commit(), core=core, evals=evals, seconds_per_step=per_step,
                targets=report_of.times_to_targets(evals, config["targets"]))


@contextlib.contextmanager
def locked_report(out):
    """The report at `out` (a dict, {} if none yet), under an exclusive lock for as long as the block runs."""
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        report = {}
        if os.path.exists(out):
            with open(out) as f:
                report = json.load(f)
        yield report


def recorded(out, label, config):
    """Whether `out` holds a finished run of `label` with exactly this config."""
    with locked_report(out) as report:
        return report.get("runs", {}).get(label, {}).get(str(config["seed"]), {}).get("config") == config


def worst_case_seconds(per_step, max_steps, max_seconds):
    """A run that never reaches its last target: it stops after the first step whose clock passes max_seconds
    (or at max_steps), and was evaluated at every `due` step on the way, and loaded once."""
    steps = min(max_steps, math.floor(max_seconds / per_step) + 1)
    return steps * per_step + sum(due(s) for s in range(1, steps + 1)) * EVAL_SECONDS + LOAD_SECONDS


def parse(argv):
    p = ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--contenders", nargs="*", default=list(CONTENDERS), choices=CONTENDERS,
                   help="none: only the ablations")
    p.add_argument("--seeds", nargs="+", type=number(int, 0), default=[0, 1, 2, 3, 4], help="seeds of each contender")
    p.add_argument("--trl-seeds", nargs="+", type=number(int, 0), default=None, help="seeds of trl (default: --seeds)")
    p.add_argument("--targets", nargs="+", type=POSITIVE, default=[0.30, 0.45],
                   help="validation scores to reach, ascending, each in (0, 1]; a run ends at the last")
    p.add_argument("--rollout-dtype", default="float32", choices=sorted(ROLLOUT),
                   help="single's and ours' rollout copy (with --tis-cap 2 when not float32); TRL samples in float32")
    p.add_argument("--team", default="pocket", choices=["pocket", "tiny"], help="tiny: the random-init test team")
    p.add_argument("--ablations", action="store_true", help="also ours, first seed, with one lever set back each")
    p.add_argument("--levers", nargs="+", default=None, choices=list(LEVERS),
                   help="the levers --ablations sets back (default: all there are)")
    p.add_argument("--items", type=COUNT, default=100, help="validation items (greedy)")
    p.add_argument("--max-steps", type=COUNT, default=40, help="optimiser steps after which a run gives up")
    p.add_argument("--max-seconds", type=POSITIVE, default=600, help="training seconds after which a run gives up")
    p.add_argument("--core", type=number(int, 0), default=1, help="the core every run is pinned to (one thread)")
    p.add_argument("--runs", default=os.path.join(ROOT, "runs", "speedrun"), help="the runs' folders")
    p.add_argument("--out", default=os.path.join(ROOT, "results", "speedrun.json"),
                   help="the report (its .md and .png beside it)")
    p.add_argument("--dry-run", action="store_true", help="print the plan and its worst-case cost; run nothing")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--opts", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.worker:
        return a
    a.seeds_of = {c: a.trl_seeds if c == "trl" and a.trl_seeds is not None else a.seeds for c in CONTENDERS}
    rollout_lever = a.rollout_dtype != "float32"
    checks = [(all(0 < t <= 1 for t in a.targets), f"--targets must each be in (0, 1], got {a.targets}"),
              (all(x < y for x, y in zip(a.targets, a.targets[1:])), f"--targets must ascend, got {a.targets}"),
              (len(set(a.seeds)) == len(a.seeds), f"--seeds repeats a seed: {a.seeds}"),
              (a.trl_seeds is None or len(set(a.trl_seeds)) == len(a.trl_seeds), "--trl-seeds repeats a seed"),
              (a.trl_seeds is None or "trl" in a.contenders, "--trl-seeds without trl in --contenders"),
              (a.levers is None or a.ablations, "--levers chooses the ablations' levers: give --ablations too"),
              (rollout_lever or "low-precision rollout + TIS" not in (a.levers or []),
               "--levers 'low-precision rollout + TIS': with --rollout-dtype float32 there is none to set back"),
              (a.contenders or a.ablations, "--contenders none and no --ablations: nothing to run")]
    for ok, msg in checks:
        if not ok:
            fail(msg)
    if a.levers is None:
        a.levers = [lv for lv in LEVERS if rollout_lever or lv != "low-precision rollout + TIS"]
    return a


def main(argv=None):
    a = parse(sys.argv[2:] if argv is None and sys.argv[1:2] == ["--speedrun"] else argv)
    if a.worker:
        return train_worker(a.worker, json.loads(a.opts))
    with locked_report(a.out) as report:
        if report and report.get("setup", {}).get("measure") != measure(a):
            fail(f"--out {a.out} holds a speedrun of another measure (targets, team, items, budget or rollout "
                 f"dtype: {report.get('setup', {}).get('measure')}); choose another --out or move it away")
    todo, t_start = plan(a), time.time()
    if a.dry_run:
        left = [(label, c) for label, c in todo if not recorded(a.out, label, c)]
        for label, c in todo:
            print(f"{label} seed {c['seed']}: {'to run' if (label, c) in left else 'recorded, skipped'}")
        hours = sum(worst_case_seconds(MEASURED[c["kind"]], a.max_steps, a.max_seconds) for _, c in left) / 3600
        return print(f"{len(left)} runs, at most {hours:.1f} core-hours (s/step as measured before: {MEASURED})")
    for label, config in todo:
        seed = str(config["seed"])
        if recorded(a.out, label, config):
            print(f"{label} seed {seed}: recorded in {a.out}, skipped", flush=True)
            continue
        print(f"[{time.time() - t_start:5.0f} s] {label} seed {seed}", flush=True)
        folder = os.path.join(a.runs, label.replace(" ", "_").replace("/", "-"), f"s{seed}")
        r = run_one(folder, config, a.core)
        hit = lambda v: "not reached" if v is None else "%.0f s (%d steps)" % (v["seconds"], v["step"])  # noqa: E731
        print("    -> " + ", ".join(f"{t}: {hit(v)}" for t, v in r["targets"].items()) + "; evals "
              + ", ".join(f"{e['step']}:{e['score']:.2f}" for e in r["evals"]), flush=True)
        with locked_report(a.out) as report:  # read again: another queue may have written meanwhile
            report.setdefault("runs", {}).setdefault(label, {})[seed] = r
            write(a, report)


def write(a, report):
    """The report at --out with the setup and the summaries, then its table and plot."""
    runs = report_of.ordered(report["runs"])
    setup = dict(measure=measure(a), flags={c: train_flags(c, a.rollout_dtype) for c in CONTENDERS}, levers=LEVERS,
                 threads=1, core=a.core, machine=report_of.machine(), versions=report_of.versions())
    report_of.save(a.out, {"setup": setup, **report_of.analyse(runs, a.targets), "runs": runs})



if __name__ == "__main__":
    main()
