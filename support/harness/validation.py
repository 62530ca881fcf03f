"""
Greedy validation of a live policy and its context builder: train.py --eval-items scores the policy
before and after training with it, evaluate.py a saved run.

Paper: the validation accuracy of Table 1 and Fig. 5 (with C, and with zero tokens where C was).
Choices the paper leaves open: greedy decoding, the training prompt and budget, the task's own scorer
(never --format-bonus); shuffled C (another item's C, a seeded derangement) is not in the paper.

Try it on CPU:  python -m pytest tests/test_collaboration.py -q -k paired
"""
import contextlib
import json
import os

import numpy as np
import torch
from tqdm import tqdm

import rewards
from adapter import empty_context
from baselines import NEIGHBOURS, kind
from rollout import encode_prompts
from adapter import anchor_context
from lora import apply_lora, load_lora_state_dict
from rollout import eos_token_ids
from support.harness.checkpoint import read_checkpoint
from support.harness.config import fail
from support.harness.gold import gold_logprobs, greedy_and_gold


def derangement(n, seed=0):
    """A seeded permutation with no fixed point (n >= 2): item k gets another item's C."""
    rng = np.random.default_rng(seed)
    while True:
        perm = rng.permutation(n)
        if n < 2 or not (perm == np.arange(n)).any():
            return perm


SHUFFLE_NA = ("n/a: C is the same for every prompt (e.g. soft_prompt), so shuffled C equals C "
              "by construction")


def context_depends_on_prompt(C_all):
    """Whether the n items' context tokens [n, m, D] differ at all. When they do not (a soft
    prompt, the adapter on constant states), shuffling C across items changes nothing: with C -
    shuffled C is 0 by construction, not by measurement, and evaluate() reports it as n/a."""
    return len(C_all) > 1 and bool((C_all != C_all[:1]).any())


def split(args):
    """--context-split of the run (a run recorded before the flag existed has none)."""
    return getattr(args, "context_split", "")


@torch.no_grad()
def score_items(policy, tok, method, eos_ids, items, args, conditions=("with_C",), batch_size=50,
                share_prefix=True):
    """Greedy validation of a live policy and its context builder `method` on `items`, under each
    condition (CONDITIONS). Returns ({condition: {"score": [per item], "gold_logprob": [per
    item]}}, scorer status counts). evaluate() scores a saved run with it; train.py --eval-items
    the policy before and after training. The task's own scorer only: training-only reward
    shaping (--format-bonus) never reaches it. share_prefix: see support.harness.gold.greedy_and_gold."""
    device = next(policy.parameters()).device
    answers_itself = kind(args.method).answers  # baselines.Kind
    # g(x) for every item first (shuffled C needs another item's), then the same items under each
    # condition
    ctxs = []
    for s in range(0, len(items), batch_size):
        chunk = items[s:s + batch_size]
        ctxs.append(method([it["question"] for it in chunk], [it["answer"] for it in chunk]))
    hints = [h for c in ctxs for h in c.hints]
    C_all = None if ctxs[0].C is None else torch.cat([c.C for c in ctxs])         # (n, m, D)
    perm = torch.as_tensor(derangement(len(items), args.seed), device=device)
    per_item, status = {}, {}
    for cond in conditions:
        if C_all is None and cond != "with_C":
            continue  # no context tokens: nothing to zero or shuffle
        if cond == "shuffled_C" and not context_depends_on_prompt(C_all):
            per_item[cond] = {"n/a": SHUFFLE_NA}  # shuffled C = C: a 0 would test nothing
            continue
        C_cond = None
        if C_all is not None:
            C_cond = {"with_C": C_all, "zero_C": empty_context(method, C_all),
                      "shuffled_C": C_all[perm]}[cond]
        scores, logps = [], []
        bar = tqdm(total=len(items), desc=f"validation ({cond})", unit="item", leave=False,
                   dynamic_ncols=True)  # 100 items take minutes on a CPU
        for s in range(0, len(items), batch_size):
            batch = items[s:s + batch_size]
            C = None if C_cond is None else C_cond[s:s + len(batch)]
            questions = [it["question"] for it in batch]
            prompts = rewards.policy_prompts(tok, questions, hints[s:s + len(batch)], args)
            ids, mask = encode_prompts(tok, prompts, device, split(args))
            # a method that declares it answers itself (the neighbours: conductor, rlae) writes the answer its
            # own way (greedy)
            golds = [it["answer"] for it in batch] if len(conditions) > 1 else None
            if answers_itself:
                texts = method.answer(policy, tok, questions, args)
            else:
                comp, gold = greedy_and_gold(policy, tok, ids, mask, C=C, prompts=prompts,
                                             golds=golds, args=args,
                                             eos_ids=eos_ids, share_prefix=share_prefix)
                texts = rewards.responses(args.response_prefix, tok.batch_decode(comp, skip_special_tokens=True))
                logps += gold or []
            if golds and answers_itself:
                logps += gold_logprobs(policy, tok, prompts, golds, C=C, args=args, device=device)
            r, counts = rewards.score_batch(batch, texts)
            scores += r
            for k, v in counts.items():
                status[k] = status.get(k, 0) + v
            bar.update(len(batch))
        bar.close()
        per_item[cond] = {"score": scores, "gold_logprob": logps}
    return per_item, status


def validation_scores(run, args):
    """--eval-items: the live policy's greedy score on each of the first N validation items, the
    items evaluate.py scores for this seed."""
    items = rewards.load_entries(args.task, "val", args.eval_items, args.seed, data_path=args.data_path,
                                 config=args.task_config)
    items = [items[i] for i in range(min(args.eval_items, len(items)))]
    run.policy.eval(), run.method.eval()
    per_item, _ = score_items(run.policy, run.tok, run.method, run.eos_ids, items=items, args=args,
                              batch_size=50)
    run.policy.train(), run.method.train()
    return per_item["with_C"]["score"]


def validation_items(args, n):
    """The first n validation items of the run's task and seed: the items every evaluation of the seed
    scores (paired across runs)."""
    items = rewards.load_entries(args.task, "val", n, args.seed, data_path=args.data_path,
                                 config=getattr(args, "task_config", None))
    return [items[i] for i in range(min(n, len(items)))]


def restore_trained(policy, tok, method, args, lora_state=None, method_state=None, anchor=True):
    """A frozen policy and its freshly built g, made the trained run's again: g's anchor, LoRA and the
    weights of the checkpoint, in eval mode. Returns (policy, tokenizer, method, eos_ids)."""
    if anchor:
        anchor_context(method, policy, tok, args)
    if lora_state is not None:
        apply_lora(policy, args.lora_rank, args.lora_alpha)
        load_lora_state_dict(policy, lora_state)
    if method_state is not None:
        method.load_state_dict(method_state)
    policy.eval(), method.eval()
    return policy, tok, method, eos_token_ids(policy, tok)  # the same stop tokens as in training


def scored(per_item, status, items, args, method_name, condition="with_C", no_context=None):
    """evaluate.py's result of score_items' output: the summary of `condition`'s scores, and every
    item's score in item order (runs of one seed share items: paired)."""
    sources = [it.get("metadata", {}).get("source_dataset", args.task) for it in items]
    result = summary(np.array(per_item[condition]["score"]), sources)
    result.update({"task": args.task, "method": method_name, "n": len(items),
                   "no_context": condition == "zero_C" if no_context is None else no_context,
                   "scorer_status": status, "per_item": per_item})
    return result


def summary(scores, sources, per_dataset=True):
    out = {"score": float(scores.mean()), "solve_rate": float((scores == 1).mean())}
    if per_dataset:
        out["per_dataset"] = {}
        for s in sorted(set(sources)):
            mine = scores[[x == s for x in sources]]
            out["per_dataset"][s] = {"score": float(mine.mean()),
                                     "solve_rate": float((mine == 1).mean()), "n": sources.count(s)}
    return out


def read_run(folder):
    """(config, checkpoint) of a train.py run; exits with one line naming --run if either is
    missing or corrupt, or if the run has no validation split of its own. The checkpoint is read
    with weights_only=True (support/harness/checkpoint.py): a shared run folder cannot run code."""
    cfg_path, ckpt = os.path.join(folder, "config.json"), os.path.join(folder, "checkpoint.pt")
    if not os.path.isdir(folder):
        fail(f"--run {folder} is not a folder (a run folder written by train.py)")
    if not (os.path.exists(cfg_path) and os.path.exists(ckpt)):
        fail(f"--run {folder} has no config.json and checkpoint.pt (is it a finished train.py "
             "run?)")
    try:  # a corrupt or foreign file: say so in one line
        with open(cfg_path) as f:
            cfg = json.load(f)
        state = read_checkpoint(ckpt, f"--run {folder}")
    except (OSError, ValueError) as e:  # read_checkpoint's ValueError names --run already
        fail(str(e) if str(e).startswith("--run") else f"--run {folder}: unreadable config.json "
             f"({type(e).__name__}: {(str(e).splitlines() or [''])[0][:160]})")
    if not (isinstance(cfg, dict) and "team_models" in cfg and isinstance(state, dict)
            and all(k in state for k in ("lora", "method", "step"))):
        fail(f"--run {folder}: config.json needs team_models; checkpoint.pt needs lora, method and "
             "step")
    data = cfg.get("data_path")
    if cfg.get("task") == "gsm8k" and data and not os.path.isdir(data):  # one file: the training split
        fail(f"--run {folder} trained on the one file --data-path {data}, which has no test split: its "
             "validation items would be training items")
    return cfg, state


def neighbour_eval_args(argv, script):
    """The command line of a neighbour script's `evaluate` (neighbours/*.py): --run, --n, --batch-size,
    --device, --out, as evaluate.py spells them. Returns (flags, the run's config as a namespace, its
    checkpoint, the eval.json path, the folders made for it); bad input exits with code 2 and one line."""
    from types import SimpleNamespace

    from support.harness.model_check import check_models
    from support.harness.config import COUNT, SPLIT_SIZE, ArgumentParser, HelpFormatter, create_folder
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
    try:
        check_models([(m, f"--run {a.run}") for m in [team["policy"], *team["experts"]]])
    except (ValueError, FileNotFoundError) as e:
        fail(str(e))
    return a, SimpleNamespace(**cfg), state, path, made


def frozen_policy(args, device="cpu"):
    """The frozen policy of a run's config `args` (its team's policy, its --dtype) on `device`: (policy,
    tokenizer, dtype). A neighbour's script builds its g beside it and calls restore_trained."""
    from experts import frozen_dtype, load_model
    device = torch.device(device)
    dtype = frozen_dtype(getattr(args, "dtype", "auto"), device)
    policy, tok = load_model(args.team_models["policy"], device, dtype)
    return policy, tok, dtype


@torch.no_grad()
def score_run(policy, tok, method, eos_ids, args, n, batch_size=50):
    """The greedy validation score of a loaded run (restore_trained's) on its seed's first n items:
    evaluate.py's result."""
    items = validation_items(args, n)
    per_item, status = score_items(policy, tok, method, eos_ids, items=items, args=args,
                                   batch_size=batch_size)
    return scored(per_item, status, items, args, method_name=args.method)


@contextlib.contextmanager
def evaluating(made):
    """Around a neighbour script's `evaluate`: Ctrl-C / SIGTERM end it in one line with exit code 130 / 143
    within seconds (support/harness/stop.py), and a loader's ValueError / FileNotFoundError (an unknown
    task, missing data, no CUDA) in one line with exit code 2; either way nothing half-written, and the
    folders neighbour_eval_args made removed again."""
    from support.harness.config import remove_created
    from support.harness.stop import stopping_on_signals
    with stopping_on_signals(lambda name: f"stopped by {name}: nothing written; run the same command again",
                             cleanup=lambda: remove_created(made)):
        try:
            yield
        except (ValueError, FileNotFoundError) as e:
            remove_created(made)
            fail(str(e))


def save_eval(path, result, state):
    """eval.json of a run (its checkpoint's step beside the score), and the line that says so."""
    from support.harness.checkpoint import write_json
    result["step"] = int(state["step"])
    write_json(path, result)
    print(f"{result['method']} on {result['task']}: score {100 * result['score']:.1f} | "
          f"solved {100 * result['solve_rate']:.1f} | n {result['n']} -> {path}")
