"""
The two halves of building a run around its context builder g, shared by train.py and the neighbours'
scripts. Each script builds its own g between them (train.py: baselines.METHODS[--method]; a neighbour:
its own class), so no function here takes a builder:

    parts = load_policy_and_data(args, device)                        # team, policy, tokenizer, items
    method = METHODS[args.method](parts["team"], parts["policy"].config.hidden_size, args, device,
                                  parts["dtype"])
    run = attach_lora(parts, method, args)                              # LoRA, optimiser: the run dict

The order is the seeded one (the policy, then g's initialisation, then LoRA's A), so a run's numbers do
not depend on which script built it. Nothing here is in the paper beyond LoRA itself (lora.py).

Try it on CPU:  python -m pytest tests/test_plan.py -q
"""
import random

import numpy as np
import torch

import rewards
import rollout
from adapter import anchor_context
from experts import frozen_dtype, load_model, team_models
from lora import apply_lora
from support import distributed
from support.optim import make_optimizer


def load_policy_and_data(args, device):
    """The team's model names, the training items, the seeded frozen policy and its tokenizer: a dict
    (team, train_items, dtype, policy, tok, device). Raises ValueError with a one-line message on bad
    input."""
    team = team_models(args)
    train_items = rewards.load_entries(args.task, "train", args.dataset_size, args.seed,
                                       args.data_path, args.task_config)
    dtype = frozen_dtype(args.dtype, device)
    torch.manual_seed(args.seed), np.random.seed(args.seed), random.seed(args.seed)
    policy, tok = load_model(team["policy"], device, dtype, attention=args.attention)
    return dict(team=team, train_items=train_items, dtype=dtype, policy=policy, tok=tok, device=device)


def attach_lora(parts, method, args):
    """After g is built (and, with --state-norm, fitted): g's anchor, LoRA on the policy, the optimiser.
    Returns the run dict every step reads."""
    policy, tok = parts["policy"], parts["tok"]
    anchor_context(method, policy, tok, args)
    apply_lora(policy, args.lora_rank, args.lora_alpha)
    if args.freeze_policy:
        for p in policy.parameters():
            p.requires_grad_(False)
    policy.train()  # no dropout in these models; train() only marks intent
    policy.recompute_mlps = not args.keep_activations  # read by rollout.mlps_recomputed
    optimizer = make_optimizer(policy, method, args)
    embed_rms = policy.get_input_embeddings().weight.float().pow(2).mean().sqrt().item()
    return dict(team=parts["team"], policy=policy, tok=tok, method=method, optimizer=optimizer,
                train_items=parts["train_items"], eos_ids=rollout.eos_token_ids(policy, tok),
                device=parts["device"], pool=getattr(method, "pool", None), embed_rms=embed_rms,
                world=distributed.ONE)
