"""
The optimiser's side of a step, shared by train.py and the neighbours' scripts (values in, values out; no
algorithm here): AdamW over two named parameter groups, the learning rate of a step, gradient clipping, and the
update undone when it leaves a weight non-finite (step_if_finite).

Paper: AdamW at lr 1e-4 for LoRA and the adapter (Appendix Listing 1); gradient clipping at norm 1.0.
Deviations (levers, off by default): --router-lr (g_phi's own rate), --lr-schedule cosine, --warmup-steps,
--clip-per-group.

Try it on CPU:  python -m pytest tests/test_collaboration.py -q -k clip_gradients
"""
import math

import numpy as np
import torch


def make_optimizer(policy, method, args):
    """AdamW over two named groups (the probes and --clip-per-group tell them apart): LoRA at --lr,
    g_phi at --router-lr."""
    groups = []
    if not args.freeze_policy:
        lora_params = [p for p in policy.parameters() if p.requires_grad]
        groups.append({"name": "lora", "params": lora_params, "lr": args.lr, "base_lr": args.lr})
    if any(p.requires_grad for p in method.parameters()):
        g_params = [p for p in method.parameters() if p.requires_grad]
        groups.append({"name": "g_phi", "params": g_params, "lr": args.router_lr,
                       "base_lr": args.router_lr})
    if not groups:
        raise ValueError(f"--freeze-policy with --method {args.method}: nothing left to train")
    # An Adam step of 3e-5 on a weight of 0.02 rounds to nothing in bfloat16 (8 bits of mantissa):
    # whatever the frozen weights are, what trains, and so its AdamW state, is float32
    # (test_collaboration.py).
    fp32 = all(p.dtype == torch.float32 for g in groups for p in g["params"])
    assert fp32, "trainable parameters must be fp32"
    return torch.optim.AdamW(groups, eps=args.adam_eps, weight_decay=args.weight_decay)


def set_learning_rates(optimizer, step, args):
    """A pure function of the step, so --resume needs no scheduler state."""
    for g in optimizer.param_groups:
        g["lr"] = g["base_lr"] * lr_factor(step, args.steps, args.lr_schedule, args.warmup_steps)


def lr_factor(step, steps, schedule, warmup):
    """The learning rate of optimiser step `step` (0-based), as a fraction of --lr / --router-lr."""
    if step < warmup:
        return (step + 1) / warmup
    if schedule == "cosine":
        return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))
    return 1.0


def clip_gradients(param_groups, max_norm, per_group=False):
    """Clip to max_norm, jointly (one global norm, the usual) or per group (--clip-per-group).
    Returns the global norm and each group's norm, both before clipping."""
    norms = {g["name"]: torch.nn.utils.clip_grad_norm_(g["params"], float("inf")).item()
             for g in param_groups}
    if per_group:
        for g in param_groups:
            torch.nn.utils.clip_grad_norm_(g["params"], max_norm)
        return float(np.sqrt(sum(v ** 2 for v in norms.values()))), norms
    params = [p for g in param_groups for p in g["params"]]
    return torch.nn.utils.clip_grad_norm_(params, max_norm).item(), norms


def step_if_finite(optimizer):
    """optimizer.step(), undone when it leaves any trainable tensor non-finite: the weights and the optimiser's
    state (AdamW's moments and step counts) go back to copies taken before the step. Returns whether the update
    stayed. A finite loss and gradient can still make one (an Adam denominator that underflows, an overflow in
    the update): without this the run would go on from, and save, NaN weights."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    weights = [p.detach().clone() for p in params]
    states = [{k: v.clone() if torch.is_tensor(v) else v for k, v in optimizer.state[p].items()}
              if p in optimizer.state else None for p in params]
    optimizer.step()
    if bool(torch.stack([torch.isfinite(p).all() for p in params]).all()):
        return True
    with torch.no_grad():
        for p, w, state in zip(params, weights, states):
            p.copy_(w)
            if state is None:
                optimizer.state.pop(p, None)
            else:
                optimizer.state[p] = state
    return False
