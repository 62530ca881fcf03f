"""
Building a run: the Run every step reads (the policy with LoRA, the context builder g, the optimiser, the data),
in two halves around g. build_run builds train.py's (g: --method's builder, baselines.METHODS); each neighbour's
script has its own build_run, with its own g, and the same halves:

    parts = load_policy_and_data(args, device)   # a PolicyAndData: team, items, policy, tokenizer
    g = METHODS[args.method](parts.team, parts.policy.config.hidden_size, args, device, parts.dtype)
    run = run_around(parts, g, args, device)     # attach_lora: g's anchor, LoRA, the optimiser; a Run

The order is the seeded one (the policy, then g's initialisation, then LoRA's A), so a run's numbers do
not depend on which script built it. Nothing here is in the paper beyond LoRA itself (lora.py).

Try it on CPU:  python -m pytest tests/test_plan.py -q
"""
import random
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch

import rewards
import rollout
from adapter import anchor_context
from baselines import METHODS, fit_state_norm
from experts import frozen_dtype, load_model, team_models
from lora import apply_lora
from support.harness.config import fail
from lib import distributed
from lib.optim import make_optimizer


@dataclass
class Run:
    """The trained system and its data: build_run (or a neighbour script's) makes it, each step trains the
    weights inside `policy` and `method` in place."""
    policy: torch.nn.Module             # pi_theta: the frozen policy with LoRA on its linear layers (lora.py)
    tok: Any                            # the policy's tokenizer
    method: torch.nn.Module             # g, --method's context builder (baselines.METHODS): C = g(x)
    optimizer: torch.optim.Optimizer    # AdamW over LoRA's and g's trainable parameters (lib/optim.py)
    train_items: list                   # the task's training items, {"question", "answer", ...}
    eos_ids: list                       # the token ids that end a completion
    device: torch.device
    team: dict                          # the team's model names: policy, experts, router
    position: Any = "after"             # where C goes in the policy's input (rollout.context_slot)
    pool: Optional[Any] = None          # the frozen experts g reads (experts.ExpertPool); None without
    embed_rms: float = 1.0              # RMS of the policy's input embeddings: the scale C is compared with
    world: Any = distributed.ONE        # torchrun's processes (lib/distributed.py), or one
    life: Optional[Any] = None          # its folder, lock, writes and signals (support/harness/run.Life); None in tests


def build_run(args, device):
    """train.py's run: the policy (frozen + LoRA), --method's context builder g (baselines.METHODS), the data and
    the optimiser, in the seeded order (the policy, then g's initialisation, then LoRA's A). Bad input (a loader's
    ValueError / FileNotFoundError, whose message is one line): that line, exit code 2."""
    try:
        parts = load_policy_and_data(args, device)  # team, items, the seeded frozen policy, tokenizer
        g = METHODS[args.method](parts.team, parts.policy.config.hidden_size, args, device, parts.dtype)
        if args.state_norm == "standardize":
            fit_state_norm(g, parts.train_items, args)
        return run_around(parts, g, args, device)
    except (ValueError, FileNotFoundError) as e:
        fail(str(e))


def run_around(parts, g, args, device):
    """The Run around a built g (build_run's, or a neighbour script's own): g's anchor, LoRA on the
    policy, the optimiser over both (attach_lora)."""
    policy, tok = parts.policy, parts.tok
    optimizer = attach_lora(policy, tok, g, args)
    return Run(policy=policy, tok=tok, method=g, optimizer=optimizer, train_items=parts.train_items,
               eos_ids=rollout.eos_token_ids(policy, tok), device=device, team=parts.team,
               # --context-position, or in front of the --context-split tokens that end every prompt
               position=rollout.context_slot(tok, args.context_position, args.context_split),
               pool=getattr(g, "pool", None),
               embed_rms=policy.get_input_embeddings().weight.float().pow(2).mean().sqrt().item())


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
    for the default team in bfloat16) goes to the policy's rollout instead. `run` is build_run's."""
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
