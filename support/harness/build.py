"""
The two halves of building a run around its context builder g (train.build_run; each neighbour's
script has its own build_run, with its own g):

    parts = load_policy_and_data(args, device)   # a PolicyAndData: team, items, policy, tokenizer
    g = METHODS[args.method](parts.team, parts.policy.config.hidden_size, args, device, parts.dtype)
    optimizer = attach_lora(parts.policy, parts.tok, g, args)   # g's anchor, LoRA, the optimiser

The order is the seeded one (the policy, then g's initialisation, then LoRA's A), so a run's numbers do
not depend on which script built it. Nothing here is in the paper beyond LoRA itself (lora.py).

Try it on CPU:  python -m pytest tests/test_plan.py -q
"""
import random
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

import rewards
from adapter import anchor_context
from experts import frozen_dtype, load_model, team_models
from lora import apply_lora
from support.harness.config import fail
from lib.optim import make_optimizer


@dataclass
class PolicyAndData:
    """What a run is built on before its g exists (load_policy_and_data)."""
    team: dict                   # the team's model names: policy, experts, router
    train_items: list            # the task's training items, {"question", "answer", ...}
    dtype: torch.dtype           # the frozen weights' dtype (--dtype; auto: float32 on a CPU, bfloat16 on CUDA)
    policy: torch.nn.Module      # the frozen policy, seeded, LoRA not yet attached
    tok: Any                     # its tokenizer


def load_policy_and_data(args, device):
    """The team's model names, the training items, the seeded frozen policy and its tokenizer: a
    PolicyAndData. Raises ValueError with a one-line message on bad input."""
    team = team_models(args)
    train_items = rewards.load_entries(args.task, "train", args.dataset_size, args.seed,
                                       data_path=args.data_path, config=args.task_config)
    dtype = frozen_dtype(args.dtype, device)
    torch.manual_seed(args.seed), np.random.seed(args.seed), random.seed(args.seed)
    policy, tok = load_model(team["policy"], device, dtype, attention=args.attention)
    return PolicyAndData(team=team, train_items=train_items, dtype=dtype, policy=policy, tok=tok)


def attach_lora(policy, tok, method, args):
    """After g is built (and, with --state-norm, fitted): g's anchor, LoRA on the policy, the
    optimiser over both. Returns the optimiser."""
    anchor_context(method, policy, tok, args)
    apply_lora(policy, args.lora_rank, args.lora_alpha)
    if args.freeze_policy:
        for p in policy.parameters():
            p.requires_grad_(False)
    policy.train()  # no dropout in these models; train() only marks intent
    policy.recompute_mlps = not args.keep_activations  # read by lib.recompute.mlps_recomputed
    return make_optimizer(policy, method, args)


def precompute_states(run, args):
    """--precompute-states: the experts' pooled states of every prompt the run will read (its
    steps' training items, its --eval-items validation items, the --state-norm calibration
    prompts) into --expert-cache, then exit. The run itself, started without this flag, then
    never loads the experts (experts.ExpertPool reads the store): on a GPU, their memory (23 GB
    for the default team in bfloat16) goes to the policy's rollout instead. `run` is train.build_run's."""
    pool = run.pool
    if pool is None or not args.expert_cache:
        fail(f"--precompute-states: --method {args.method} with --expert-cache DIR: a method that reads "
             "experts, and where to keep their states")
    items = run.train_items
    picks = sorted({i for step in range(args.steps) for micro in range(args.grad_accum)
                    for i in rewards.batch_indices(step, micro, args.batch_size, args.grad_accum,
                                                   n_items=len(items), seed=args.seed)})
    questions = [items[i] for i in picks]
    if args.eval_items:
        val = rewards.load_entries(args.task, "val", args.eval_items, args.seed, data_path=args.data_path,
                                   config=args.task_config)
        questions += [val[i] for i in range(min(args.eval_items, len(val)))]
    for s in range(0, len(questions), 64):
        chunk = questions[s:s + 64]
        pool.encode([it["question"] for it in chunk], answers=[it["answer"] for it in chunk])
    print(f"--precompute-states: {len(questions)} prompts x {len(pool)} experts in {args.expert_cache}")
    return args.expert_cache
