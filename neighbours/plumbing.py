"""
The plumbing both neighbour scripts (conductor.py, rlae.py) share around their own GRPO step, written once: the
micro-batch's items, the update, the record fields train.py logs too, the refusal of train.py's levers their step
lacks, the run's opening, and the `evaluate` command that scores a saved run. Each script keeps its own step and its
own loop over the steps (train.py's loop, copied: one file per algorithm); nothing here takes a step, a builder or a
method as an argument.

Try it on CPU:  python -m pytest tests/test_conductor.py tests/test_rlae.py -q -k trains_and_evaluates
"""
import contextlib
import os
from types import SimpleNamespace

import torch

import grpo
import rewards
from baselines import NEIGHBOURS
from experts import frozen_dtype, load_model, pick_device
from lib.files import whole_write
from support.harness.config import COUNT, SPLIT_SIZE, ArgumentParser, HelpFormatter, create_folder, fail, remove_created
from support.harness.metrics import LOSS_TERMS
from support.harness.model_check import check_models
from support.harness.folder import stopping_on_signals
from support.harness.run import open_run, release_folders
from support.harness.validation import read_run, score_items, scored, validation_items
from lib import distributed
from lib.optim import clip_gradients, step_if_finite

# ----------------------------------------------------------------------------------------------------------
# The step: its items, its update, its record


def micro_batch_items(run, args, step, micro):
    """The micro-batch's B training items, picked as train.py picks them (the same after --resume)."""
    picks = rewards.batch_indices(step, micro, args.batch_size, args.grad_accum, n_items=len(run.train_items),
                                  seed=args.seed)
    return [run.train_items[i] for i in picks]


def update(optimizer, args, losses):
    """Clip (--grad-clip, --clip-per-group) and step; a non-finite loss or gradient skips the update, and an
    update that makes a weight non-finite is undone. Returns (grad_norm, group_norms, skipped)."""
    grad_norm, group_norms = clip_gradients(optimizer.param_groups, args.grad_clip, args.clip_per_group)
    finite = bool(torch.isfinite(torch.tensor([grad_norm, *losses])).all())
    return grad_norm, group_norms, not (finite and step_if_finite(optimizer))


def step_record(step, batches, G, *, losses, stats, grads, lengths, truncated_fraction, own):
    """The step's record for metrics.jsonl (README "Metrics"), the fields train.py logs too, from the micro-batches'
    rewards b.r [B*G] and scorer counts b.counts, the loss terms, grads = update's (grad_norm, group_norms, skipped)
    and the completions' lengths [(N,)]; the method's `own` fields come before skipped_update."""
    r_all = torch.cat([b.r for b in batches])
    grad_norm, group_norms, skipped = grads
    return {"step": step + 1, "reward": r_all.mean().item(), "reward_std": r_all.std().item(),
            "solve_rate": (r_all == 1).float().mean().item(), "loss": sum(losses) / len(losses),
            **{k: sum(m[k] for m in stats) / len(stats) for k in LOSS_TERMS},
            "grad_norm": grad_norm, **{f"grad_norm_{k}": v for k, v in group_norms.items()},
            "completion_length": torch.cat(lengths).float().mean().item(), "truncated_fraction": truncated_fraction,
            "zero_std_fraction": torch.cat([grpo.flat_groups(b.r, G) for b in batches]).float().mean().item(),
            "scorer_failures": sum(b.counts.get(k, 0) for b in batches for k in ("refused", "error", "timeout")),
            **own, "skipped_update": skipped}


# ----------------------------------------------------------------------------------------------------------
# The run: opened as train.train opens one, one process (no torchrun)


@contextlib.contextmanager
def opened(args):
    """The checks (bad input: exit 2), --out locked, Ctrl-C / SIGTERM, the device (support/harness/run.open_run);
    however the run ends, the lock on --out goes with it."""
    life = open_run(args, distributed.ONE)
    try:
        yield life
    finally:
        release_folders(life)


def refuse_train_levers(p, args, rewards=("task",)):
    """A neighbour script's own step has mu = 1, a float32 rollout and one of `rewards` (the --reward
    values its step implements): a lever of train.py's step given to it fails loudly instead of doing
    nothing."""
    own_step = (args.inner_epochs == 1 and args.reward in rewards and not (
        args.format_bonus or args.dynamic_sampling or args.tis_cap or args.rollout_dtype != "float32"))
    if not own_step:
        p.error(f"--method {args.method} runs its own step (mu = 1, --reward {' or '.join(rewards)}, a "
                "float32 rollout): drop --inner-epochs / --reward / --format-bonus / --dynamic-sampling / "
                "--rollout-dtype / --tis-cap")
    return args


@contextlib.contextmanager
def one_line_errors(made=()):
    """A loader's ValueError / FileNotFoundError (an unknown task, missing data, no CUDA) ends the command in one
    line with exit code 2, and the folders `made` for it are removed again."""
    try:
        yield
    except (ValueError, FileNotFoundError) as e:
        remove_created(made)
        fail(str(e))


# ----------------------------------------------------------------------------------------------------------
# `evaluate --run DIR --n N`: a saved run scored greedy on its seed's first n validation items, eval.json


@contextlib.contextmanager
def evaluation(argv, script):
    """The `evaluate` command of a neighbour script: --run, --n, --batch-size, --device, --out, as evaluate.py
    spells them. Yields `ev`, the run to score (ev.cfg: its config as a namespace, ev.state: its checkpoint, ev.n,
    ev.batch_size, ev.device), for the script to set ev.result (score_run of its own load_trained); then writes
    eval.json. Bad input, a loader's error, Ctrl-C and SIGTERM end it in one line (exit code 2, 130, 143;
    support/harness/folder.py) with nothing half-written and the folders made for it removed again."""
    p = ArgumentParser(prog=f"{script} evaluate", description=f"Score a run of {script} on the "
                       "validation split, greedy -> eval.json", formatter_class=HelpFormatter)
    p.add_argument("--run", required=True, help=f"a run folder written by {script}")
    p.add_argument("--n", type=SPLIT_SIZE, default=4000, help="validation items (paper: 4000)")
    p.add_argument("--batch-size", type=COUNT, default=50, help="prompts per generation batch")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or mps")
    p.add_argument("--out", default=None, help="where eval.json goes (default: the run folder)")
    a = p.parse_args(argv)
    cfg, state = read_run(a.run)
    own = os.path.splitext(os.path.basename(script))[0]  # neighbours/conductor.py: a conductor run
    if cfg.get("method") != own:  # another script's run would be built as this one's, and fail in a traceback
        command = (f"python neighbours/{cfg['method']}.py evaluate" if cfg.get("method") in NEIGHBOURS
                   else "python evaluate.py")
        fail(f"--run {a.run} is not a {own} run (--method {cfg.get('method')}): {command} --run {a.run}")
    team = cfg["team_models"]
    path = os.path.join(a.out or a.run, "eval.json")
    made = create_folder(os.path.dirname(path), "--out" if a.out else "--run")
    with one_line_errors():  # a model of the run missing or unreadable
        check_models([(m, f"--run {a.run}") for m in [team["policy"], *team["experts"]]])
    ev = SimpleNamespace(cfg=SimpleNamespace(**cfg), state=state, n=a.n, batch_size=a.batch_size, result=None)
    with stopping_on_signals(lambda name: f"stopped by {name}: nothing written; run the same command again",
                             cleanup=lambda: remove_created(made)), one_line_errors(made):
        ev.device = pick_device(a.device)
        yield ev
    ev.result["step"] = int(state["step"])  # the checkpoint's step beside the score
    whole_write(path, ev.result)
    r = ev.result
    print(f"{r['method']} on {r['task']}: score {100 * r['score']:.1f} | solved {100 * r['solve_rate']:.1f} | "
          f"n {r['n']} -> {path}")


def frozen_policy(args, device="cpu"):
    """The frozen policy of a run's config `args` (its team's policy, its --dtype) on `device`: (policy,
    tokenizer, dtype). The script builds its g beside it and calls validation.restore_trained."""
    device = torch.device(device)
    dtype = frozen_dtype(getattr(args, "dtype", "auto"), device)
    policy, tok = load_model(args.team_models["policy"], device, dtype)
    return policy, tok, dtype


@torch.no_grad()
def score_run(policy, tok, method, eos_ids, args, n, batch_size=50):
    """The greedy validation score of a loaded run (restore_trained's) on its seed's first n items:
    evaluate.py's result."""
    items = validation_items(args, n)
    per_item, status = score_items(policy, tok, method, eos_ids, items=items, args=args, batch_size=batch_size)
    return scored(per_item, status, items, args, method_name=args.method)
