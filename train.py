"""
Train a LoRA policy with GRPO, conditioned on context tokens built from frozen experts.

    python train.py --task arithmetic --team default                 # the paper's setting (one CUDA GPU)
    python train.py --task chain_sum --team tiny --steps 3 --batch-size 2 --grad-accum 1 --group-size 4 \
        --max-new-tokens 16 --out runs/smoke                         # seconds, on any CPU

Paper: Eq. 3 (pi(y | [x || C])), Eq. 4 (reward minus beta * KL to pi_ref = the initial policy fed zero
context tokens at the same positions), GRPO with G = 8, beta = 0.04, 32 prompts per step (4 x 8 grad-accum),
lr 1e-4 for LoRA and adapter, 128 new tokens (§4.1, Appendix Listing 1). Every default below is the paper's.

The loop, one optimiser step:   rollout -> reward -> advantage -> loss -> step -> log -> checkpoint

Deviations from the paper (see also grpo.py, adapter.py, experts.py, rewards.py):
  1. Sampling is plain temperature sampling (T = 1, no top-p/top-k), with our own KV-cached loop: one
     prefill per prompt shared by its G samples, and rollout and scoring use the same positions.
  2. Options the paper does not have, off by default: --inner-epochs (mu > 1 reuses a rollout; the paper's
     mu = 1 makes the ratio exactly 1), --system-prompt / --worked-example / --response-prefix (small
     policies never write the answer tags with the paper's prompt: DESIGN §3), --context-position before.
  3. A step whose loss or gradient is not finite is skipped (weights unchanged) and counted.

Failure modes (issue 6; tests/test_hardening.py): bad input exits with code 2 and one line on stderr, before
anything in --out is written; --max-bad-steps non-finite steps in a row exit with code 3, the checkpoint
holding the last good weights; a killed run continues exactly with --resume (a resumed run must keep the flags
that change the maths).
"""
import argparse
import glob
import json
import os
import random
import signal
import sys
import time

import numpy as np
import torch

# ----------------------------------------------------------------------------------------------------------
# Configuration: one flat argparse block. Flags use dashes, variables underscores.

TASK_HELP = "a family (arithmetic, algorithmic, logic), gsm8k, or any reasoning-gym dataset name"
# Flags a resumed run may change: none of them changes the maths of a step.
RESUME_MAY_CHANGE = {"steps", "device", "out", "resume", "save_every", "sample_every", "max_bad_steps"}


class ArgumentParser(argparse.ArgumentParser):
    """argparse with a one-line error (no usage block), like every other bad-input error here."""

    def error(self, message):
        fail(message)


def parse_args(argv=None):
    from baselines import METHODS
    from experts import POOLINGS, TEAMS
    from rewards import SYSTEM_PROMPT_NAMES
    p = ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    a = p.add_argument
    a("--task", default="arithmetic", help=TASK_HELP)
    a("--team", default="default", choices=sorted(TEAMS), help="expert team (experts.py TEAMS)")
    a("--method", default="ours", choices=sorted(METHODS), help="how experts reach the policy (baselines.py)")
    a("--policy", default=None, help="policy model: hub id, local folder or .gguf (default: the team's)")
    a("--experts", default=None, help="comma-separated expert models, overriding the team's")
    a("--steps", type=int, default=None, help="optimiser steps (default 500; 233 for gsm8k: one epoch)")
    a("--batch-size", type=int, default=4, help="prompts per micro-batch")
    a("--grad-accum", type=int, default=8, help="micro-batches per optimiser step (paper: 4 x 8 = 32 prompts)")
    a("--group-size", type=int, default=8, help="GRPO group size G: completions per prompt")
    a("--max-new-tokens", type=int, default=128, help="generation budget for the policy and expert hints")
    a("--temperature", type=float, default=1.0, help="sampling temperature (log-probs use the same)")
    a("--lr", type=float, default=1e-4, help="learning rate of the LoRA policy")
    a("--router-lr", type=float, default=1e-4, help="learning rate of the adapter / router g_phi")
    a("--weight-decay", type=float, default=1e-2, help="AdamW weight decay")
    a("--adam-eps", type=float, default=1e-6, help="AdamW epsilon")
    a("--grad-clip", type=float, default=1.0, help="max global gradient norm")
    a("--clip-per-group", action="store_true", help="clip LoRA's and g_phi's gradients to --grad-clip each, not "
      "jointly: with one global norm, a large adapter gradient (W_out's) shrinks LoRA's step too")
    a("--beta", type=float, default=0.04, help="KL coefficient beta (Eq. 4)")
    a("--clip-eps", type=float, default=0.2, help="PPO clip epsilon")
    a("--inner-epochs", type=int, default=1, help="mu: optimisation passes per rollout batch (paper: 1)")
    a("--loss-aggregation", default="sequence", choices=["sequence", "token"], help="see grpo.py")
    a("--no-scale-rewards", action="store_true", help="advantage = r - mean (no division by the group std)")
    a("--freeze-policy", action="store_true", help="train only g_phi (no LoRA): can C alone move the reward?")
    a("--reward", default="task", choices=["task", "random"], help="task: the task's own scorer; random: a "
      "seeded fair coin per completion that ignores the text (a control: what any rising reward does to H)")
    a("--dtype", default="auto", choices=["auto", "float32", "bfloat16"], help="dtype of the frozen weights "
      "(auto: bfloat16 on CUDA, float32 elsewhere); LoRA, g_phi and their optimiser state are always float32")
    a("--lora-rank", type=int, default=8, help="LoRA rank r")
    a("--lora-alpha", type=float, default=16.0, help="LoRA alpha (scaling alpha / r)")
    a("--latent-dim", type=int, default=512, help="adapter latent width d")
    a("--num-latents", type=int, default=8, help="m: number of latent queries = context tokens")
    a("--num-heads", type=int, default=8, help="cross-attention heads")
    a("--pooling", default="last", choices=POOLINGS, help="expert hidden-state pooling (paper Table 2)")
    a("--context-position", default="after", choices=["after", "before"],
      help="[x || C] (Eq. 3) or [x_0 || C || x_1..] (in front, behind the first token: adapter.policy_inputs)")
    a("--system-prompt", default="DeepSeekZero", choices=SYSTEM_PROMPT_NAMES, help="reasoning-gym system prompt")
    a("--worked-example", action="store_true", help="add one worked example to the system prompt (small policies)")
    a("--response-prefix", default="", help="text the response starts with, e.g. '<think>' (small policies)")
    a("--dataset-size", type=int, default=20000, help="reasoning-gym items per split (paper: 20000)")
    a("--task-config", default=None, help="JSON overriding a single dataset's reasoning-gym config, e.g. "
      "'{\"min_terms\": 2, \"max_terms\": 2, \"max_digits\": 2}' with --task chain_sum")
    a("--data-path", default=None, help="local GSM8K jsonl or folder (default: the hub's openai/gsm8k)")
    a("--seed", type=int, default=0, help="seed for data order, sampling and initialisation")
    a("--device", default="auto", help="auto (cuda -> mps -> cpu), cuda, mps or cpu")
    a("--out", default=None, help="output folder (default runs/TASK-TEAM-METHOD-sSEED)")
    a("--resume", action="store_true", help="continue from OUT/checkpoint.pt")
    a("--save-every", type=int, default=50, help="checkpoint every N steps (and at the end)")
    a("--sample-every", type=int, default=10, help="write a few completions to OUT/samples.jsonl every N steps")
    a("--max-bad-steps", type=int, default=5, help="stop (exit code 3) after this many non-finite steps in a row")
    args = p.parse_args(argv)

    # Fail in the first second, naming the flag (STYLE 7).
    for flag in ("steps", "batch_size", "grad_accum", "max_new_tokens", "lora_rank", "latent_dim",
                 "num_latents", "num_heads", "inner_epochs", "save_every", "sample_every", "dataset_size",
                 "max_bad_steps"):
        v = getattr(args, flag)
        if v is not None and v < 1:
            p.error(f"--{flag.replace('_', '-')} must be >= 1, got {v}")
    for flag in ("temperature", "lr", "router_lr", "adam_eps", "grad_clip", "lora_alpha"):
        v = getattr(args, flag)
        if not (np.isfinite(v) and v > 0):  # `not`, so that NaN fails too
            p.error(f"--{flag.replace('_', '-')} must be a finite number > 0, got {v}")
    for flag in ("beta", "weight_decay", "seed"):
        v = getattr(args, flag)
        if not (np.isfinite(v) and v >= 0):
            p.error(f"--{flag.replace('_', '-')} must be a finite number >= 0, got {v}")
    checks = [(args.group_size >= 2, f"--group-size must be >= 2 (GRPO compares samples), got {args.group_size}"),
              (args.latent_dim % args.num_heads == 0,
               f"--latent-dim {args.latent_dim} must be divisible by --num-heads {args.num_heads}"),
              (0 <= args.clip_eps < 1, f"--clip-eps must be in [0, 1), got {args.clip_eps}"),
              (args.device in ("auto", "cpu", "cuda", "mps") or args.device.startswith("cuda:"),
               f"--device must be auto, cpu, cuda[:N] or mps, got {args.device!r}"),
              (args.data_path is None or args.task == "gsm8k", "--data-path is only read with --task gsm8k"),
              (args.data_path is None or os.path.exists(args.data_path),
               f"--data-path {args.data_path}: no such file or folder"),
              (not (args.experts and args.method == "single"), "--experts is not used by --method single")]
    for ok, msg in checks:
        if not ok:
            p.error(msg)
    if args.steps is None:
        args.steps = 233 if args.task == "gsm8k" else 500
    args.out = args.out or f"runs/{args.task}-{args.team}-{args.method}-s{args.seed}"
    return args


def fail(msg, code=2):
    """One line on stderr, then exit: code 2 for bad input, before anything is written (STYLE 7, issue 6);
    code 3 when --max-bad-steps stops a run."""
    print(f"error: {msg}", file=sys.stderr)
    sys.exit(code)


def sigkill_hook(point, step):
    """Test hook, inert unless NMUSK_TEST_SIGKILL=POINT:STEP is set (tests/test_hardening.py): die here, as a
    power cut or the OOM killer would, to show that --resume continues exactly."""
    if os.environ.get("NMUSK_TEST_SIGKILL") == f"{point}:{step}":
        os.kill(os.getpid(), signal.SIGKILL)


# ----------------------------------------------------------------------------------------------------------
# Checkpoints: one file, written to a temporary name and renamed, so it is the old one or the new one.


def save_checkpoint(path, step, policy, method, optimizer, pool):
    from lora import lora_state_dict
    state = {"step": step, "lora": lora_state_dict(policy), "method": method.state_dict(),
             "optimizer": optimizer.state_dict(),
             "rng": {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate(),
                     "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
                     "experts": pool.generator.get_state() if pool is not None else None}}
    tmp = f"{path}.tmp{os.getpid()}"
    torch.save(state, tmp)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    sigkill_hook("checkpoint", step)  # a kill here leaves the old checkpoint and a stray .tmp file
    os.replace(tmp, path)


def load_checkpoint(path, policy, method, optimizer, pool):
    from lora import load_lora_state_dict
    try:
        state = torch.load(path, map_location="cpu", weights_only=False)
        load_lora_state_dict(policy, state["lora"])
        method.load_state_dict(state["method"])
        optimizer.load_state_dict(state["optimizer"])
        rng, step = state["rng"], int(state["step"])
    except Exception as e:  # corrupt file, other model, other method: refuse, say which
        why = (str(e).splitlines() or [""])[0][:160]
        raise ValueError(f"--resume: checkpoint {path} is unreadable or does not fit this run "
                         f"({type(e).__name__}: {why})") from None
    torch.set_rng_state(rng["torch"]), np.random.set_state(rng["numpy"]), random.setstate(rng["python"])
    if rng["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
    if pool is not None and rng["experts"] is not None:
        pool.generator.set_state(rng["experts"])
    return step


def check_resume(args, config_path):
    """--resume continues the run saved in --out: refuse flags that would change its maths (RESUME_MAY_CHANGE
    lists those that may change), so that a resumed run is the run it claims to be."""
    if not os.path.exists(config_path):
        fail(f"--resume: no run to resume in --out {args.out} (no config.json)")
    try:
        with open(config_path) as f:
            saved = json.load(f)
    except (ValueError, OSError) as e:
        fail(f"--resume: cannot read {config_path} ({type(e).__name__})")
    for k, v in vars(args).items():
        if k not in RESUME_MAY_CHANGE and saved.get(k) != v:
            fail(f"--resume: --{k.replace('_', '-')} {v!r} differs from the run's {saved.get(k)!r} ({config_path}); "
                 "resume with the run's flags or choose another --out")


def keep_metrics_upto(path, step):
    """On resume: drop metric lines after the checkpoint's step (and any torn last line), atomically."""
    if not os.path.exists(path):
        return
    kept = []
    with open(path) as f:
        for line in f:
            try:
                if json.loads(line)["step"] <= step:
                    kept.append(line if line.endswith("\n") else line + "\n")
            except (ValueError, KeyError):
                break
    with open(path + ".tmp", "w") as f:
        f.writelines(kept)
    os.replace(path + ".tmp", path)


def batch_indices(step, micro, batch_size, grad_accum, n_items, seed):
    """Data order, a pure function of (seed, position), so resume needs no state: the first epoch in order
    (reasoning-gym items are drawn at random and generated lazily, GSM8K is shuffled on load), every later
    epoch a fresh seeded permutation."""
    start = (step * grad_accum + micro) * batch_size
    out = []
    for k in range(start, start + batch_size):
        epoch, i = divmod(k, n_items)
        out.append(i if epoch == 0 else int(np.random.default_rng([seed, epoch]).permutation(n_items)[i]))
    return out


# ----------------------------------------------------------------------------------------------------------
# The training run


def build_run(args, device):
    """Models, data and optimiser for a run: the policy (frozen + LoRA), the context builder g_phi of the
    chosen method, the training items. Raises ValueError with a one-line message on bad input."""
    import grpo
    import rewards
    from baselines import METHODS
    from experts import load_model, team_models
    from lora import apply_lora
    team = team_models(args)
    train_items = rewards.load_entries(args.task, "train", args.dataset_size, args.seed, args.data_path,
                                       args.task_config)
    dtype = frozen_dtype(args.dtype, device)
    torch.manual_seed(args.seed), np.random.seed(args.seed), random.seed(args.seed)
    policy, tok = load_model(team["policy"], device, dtype)
    method = METHODS[args.method](team, policy.config.hidden_size, args, device, dtype)
    apply_lora(policy, args.lora_rank, args.lora_alpha)
    if args.freeze_policy:
        for p in policy.parameters():
            p.requires_grad_(False)
    policy.train()  # no dropout in these models; train() only marks intent
    groups = []  # named, so that probes and --clip-per-group can tell them apart
    if not args.freeze_policy:
        groups.append({"name": "lora", "params": [p for p in policy.parameters() if p.requires_grad],
                       "lr": args.lr})
    if any(p.requires_grad for p in method.parameters()):
        groups.append({"name": "g_phi", "params": [p for p in method.parameters() if p.requires_grad],
                       "lr": args.router_lr})
    # An Adam step of 3e-5 on a weight of 0.02 rounds to nothing in bfloat16 (8 bits of mantissa): whatever the
    # frozen weights are, what trains and its optimiser state must be float32 (tests/test_lora.py).
    assert all(p.dtype == torch.float32 for g in groups for p in g["params"]), "trainable parameters must be fp32"
    if not groups:
        raise ValueError(f"--freeze-policy with --method {args.method}: nothing left to train")
    optimizer = torch.optim.AdamW(groups, eps=args.adam_eps, weight_decay=args.weight_decay)
    eos_ids = grpo.eos_token_ids(policy, tok)
    embed_rms = policy.get_input_embeddings().weight.float().pow(2).mean().sqrt().item()
    return dict(team=team, policy=policy, tok=tok, method=method, optimizer=optimizer, train_items=train_items,
                eos_ids=eos_ids, device=device, pool=getattr(method, "pool", None), embed_rms=embed_rms)


def policy_prompts(tok, questions, hints, args):
    """The policy's input text x for each question (hints: output_collab's expert hints, else None). Training
    and evaluation both call this, so a fork that changes the prompt changes it in both."""
    import rewards
    return [rewards.build_prompt(tok, q if h is None else q + h, args.system_prompt, args.worked_example,
                                 args.response_prefix) for q, h in zip(questions, hints)]


def frozen_dtype(name, device):
    """--dtype: the frozen weights' dtype; auto = bfloat16 on CUDA, float32 elsewhere."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)


def coin_rewards(seed, step, micro, n):
    """The random-reward control: n fair coins, a pure function of (seed, step, micro-batch), so a resumed
    run draws the same ones. The text is never read."""
    return np.random.default_rng([seed, step, micro, 7]).integers(0, 2, n).astype(float).tolist()


def grpo_step(step, run, args, score_batch):
    """One optimiser step: rollout -> reward -> advantage -> loss -> step. Returns (metrics, rollout batches)."""
    import grpo
    import rewards
    from grpo import completion_mask, group_advantages, grpo_loss
    from lora import lora_disabled
    policy, tok, method, optimizer = run["policy"], run["tok"], run["method"], run["optimizer"]
    G, device, eos_ids, t0 = args.group_size, run["device"], run["eos_ids"], time.time()
    # ---- rollout: G samples per prompt, all conditioned on the same C -----------------------------------------
    batches = []
    for micro in range(args.grad_accum):
        items = [run["train_items"][i] for i in batch_indices(step, micro, args.batch_size, args.grad_accum,
                                                              len(run["train_items"]), args.seed)]
        questions, answers = [it["question"] for it in items], [it["answer"] for it in items]
        method.train()  # training behaviour in the rollout too: hard routing draws its Gumbel expert here
        with torch.no_grad():
            ctx = method(questions, answers)  # answers: read only by oracle experts (a diagnostic)
        prompts = policy_prompts(tok, questions, ctx["hints"], args)
        ids, mask = grpo.encode_prompts(tok, prompts, device)
        comp = grpo.sample(policy, ids, mask, ctx["C"], G, args.max_new_tokens, args.temperature, eos_ids,
                      tok.pad_token_id, args.context_position)
        sigkill_hook("rollout", step + 1)
        comp_mask = completion_mask(comp, eos_ids)
        texts = tok.batch_decode(comp.masked_fill(~comp_mask, tok.pad_token_id), skip_special_tokens=True)
        # ---- reward: untrusted text, scored with a time limit (rewards.py) ------------------------------------
        if args.reward == "random":  # the control: a coin that ignores the text
            r, counts = coin_rewards(args.seed, step, micro, len(texts)), {}
        else:
            r, counts = score_batch([it for it in items for _ in range(G)], texts)
        r = torch.tensor(r, dtype=torch.float32, device=device)
        # ---- advantage: group-relative, one group per prompt -------------------------------------------------
        adv = group_advantages(r, G, scale=not args.no_scale_rewards)
        with torch.no_grad(), lora_disabled(policy):  # pi_ref: LoRA off, zero tokens where C was (paper §4.1)
            C0 = None if ctx["C"] is None else torch.zeros_like(ctx["C"])  # one row per prompt: shared prefix
            logp_ref = grpo.completion_logprobs(policy, ids, mask, C0, comp, comp_mask, args.temperature,
                                           args.context_position)
        batches.append(dict(questions=questions, ctx=ctx, ids=ids, mask=mask, comp=comp, comp_mask=comp_mask,
                            r=r, adv=adv, logp_ref=logp_ref, counts=counts, texts=texts, items=items))

    # ---- loss and step: mu passes over the rollout batch, gradient accumulation over micro-batches ------------
    skipped = False
    for epoch in range(args.inner_epochs):
        optimizer.zero_grad(set_to_none=True)
        losses, stats = [], []
        for b in batches:
            ctx = method(b["questions"], reuse=b["ctx"])  # the rollout's pooled states and routing draw
            logp = grpo.completion_logprobs(policy, b["ids"], b["mask"], ctx["C"], b["comp"], b["comp_mask"],
                                       args.temperature, args.context_position)
            if epoch == 0:  # the weights have not moved yet: logp_old = logp, detached (no extra forward)
                b["logp_old"] = logp.detach()
            loss, m = grpo_loss(logp, b["logp_old"], b["logp_ref"], b["adv"], b["comp_mask"], args.clip_eps,
                                args.beta, args.loss_aggregation)
            (loss / args.grad_accum).backward()
            losses.append(loss.item()), stats.append(m)
        grad_norm, group_norms = clip_gradients(optimizer.param_groups, args.grad_clip, args.clip_per_group)
        finite = bool(np.isfinite(grad_norm) and np.isfinite(losses).all())
        if finite:  # a non-finite loss or gradient skips the update: the weights stay as they were
            optimizer.step()
        skipped = skipped or not finite

    # ---- metrics (README: "Metrics") --------------------------------------------------------------------------
    r_all = torch.cat([b["r"] for b in batches])
    eos = torch.tensor(eos_ids, device=device)
    same = torch.cat([(b["r"].view(-1, G) == b["r"].view(-1, G)[:, :1]).all(-1) for b in batches])
    rec = {"step": step + 1, "reward": r_all.mean().item(), "reward_std": r_all.std().item(),
           "solve_rate": (r_all == 1).float().mean().item(), "loss": float(np.mean(losses)),
           "kl": float(np.mean([m["kl"] for m in stats])),
           "clip_fraction": float(np.mean([m["clip_fraction"] for m in stats])), "grad_norm": grad_norm,
           "completion_length": torch.cat([b["comp_mask"].sum(-1) for b in batches]).float().mean().item(),
           "truncated_fraction": torch.cat([~torch.isin(b["comp"], eos).any(-1) for b in batches]).float().mean().item(),
           "zero_std_fraction": same.float().mean().item(),
           # refused, failed or timed-out scorings (rewards.STATUSES); "no_answer" is the model's fault, not one
           "scorer_failures": sum(b["counts"].get(k, 0) for b in batches for k in ("refused", "error", "timeout")),
           "answer_rate": 1 - sum(b["counts"].get("no_answer", 0) for b in batches) / len(r_all),
           "skipped_update": skipped}
    rec.update({f"grad_norm_{k}": v for k, v in group_norms.items()})
    rec.update(probes(batches, run["embed_rms"]))
    rec["seconds"] = time.time() - t0
    return rec, batches


def clip_gradients(param_groups, max_norm, per_group=False):
    """Clip to max_norm, jointly (one global norm, the usual) or per group (--clip-per-group). Returns the
    global norm and each group's norm, both before clipping."""
    norms = {g["name"]: torch.nn.utils.clip_grad_norm_(g["params"], float("inf")).item() for g in param_groups}
    if per_group:
        for g in param_groups:
            torch.nn.utils.clip_grad_norm_(g["params"], max_norm)
        return float(np.sqrt(sum(v ** 2 for v in norms.values()))), norms
    params = [p for g in param_groups for p in g["params"]]
    return torch.nn.utils.clip_grad_norm_(params, max_norm).item(), norms


def varying_fraction(X):
    """Share of the energy of X [N, ...] that varies across its N rows: sum Var_N(X) / sum mean_N(X^2), in
    [0, 1]; 0 for rows that are all the same (C is then a soft prompt), NaN when X is all zeros."""
    X = X.flatten(1).double()
    return (X.var(0, unbiased=False).sum() / X.pow(2).mean(0).sum()).item()


@torch.no_grad()
def probes(batches, embed_rms):
    """What C does, per step (README "Metrics"): its scale against the policy's token embeddings, how much of
    it depends on the prompt, the same for each expert's pooled states, and routing per attention head."""
    from adapter import entropy, routing_stats
    rec = {}
    C = [b["ctx"]["C"] for b in batches if b["ctx"]["C"] is not None]
    if C:
        C = torch.cat(C).float()                                               # (prompts, m, D)
        rec.update(c_rms=C.pow(2).mean().sqrt().item(), embed_rms=embed_rms, c_varying=varying_fraction(C))
    states = [b["ctx"]["states"] for b in batches if isinstance(b["ctx"].get("states"), list)]
    if states:  # one list of n [B, d_i] per micro-batch
        rec["state_varying"] = [varying_fraction(torch.cat(h)) for h in zip(*states)]
    A = [b["ctx"]["A"] for b in batches if b["ctx"]["A"] is not None]
    if A:
        rec["entropy"], rec["utilization"] = routing_stats(torch.cat(A))
    heads = [b["ctx"]["A_heads"] for b in batches if b["ctx"].get("A_heads") is not None]
    if heads:
        rec["entropy_heads"] = entropy(torch.cat(heads)).mean(dim=(0, 2)).tolist()  # (heads,)
    return rec


def main(argv=None, score_batch=None):
    """Run training. `score_batch(items, completions) -> (rewards, counts)` replaces the task's scorer (a fork's
    own reward, or the tests' synthetic one); by default rewards.score_batch."""
    args = parse_args(argv)
    import rewards
    from experts import check_models, pick_device, team_models
    from lora import save_peft
    from tqdm import tqdm
    score_batch = score_batch or rewards.score_batch

    ckpt_path, metrics_path = os.path.join(args.out, "checkpoint.pt"), os.path.join(args.out, "metrics.jsonl")
    # ---- check everything before writing anything into --out ---------------------------------------------------
    config_path = os.path.join(args.out, "config.json")
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        fail(f"--out {args.out} is a file, not a folder")
    if args.resume:
        check_resume(args, config_path)
    elif any(os.path.exists(os.path.join(args.out, n)) for n in ("config.json", "metrics.jsonl", "checkpoint.pt")):
        fail(f"--out {args.out} already holds a run; pass --resume to continue it or choose another --out")
    team, by_team = team_models(args), f"--team {args.team}"  # each model with the flag that chose it
    models = [(team["policy"], "--policy" if args.policy else by_team)]
    if args.method != "single":
        models += [(e, "--experts" if args.experts else by_team) for e in team["experts"]]
    if args.method == "hard_routing":
        models.append((team["router"], by_team))
    try:
        check_models(models)
        run = build_run(args, pick_device(args.device))
        # a run killed before its first checkpoint resumes from step 0
        start = load_checkpoint(ckpt_path, run["policy"], run["method"], run["optimizer"], run["pool"]) \
            if args.resume and os.path.exists(ckpt_path) else 0
    except (ValueError, FileNotFoundError) as e:  # loaders raise these with a one-line message
        fail(str(e))
    if start > args.steps:
        fail(f"--steps {args.steps} is below the step {start} of the checkpoint in --out {args.out}")
    # ---- from here on we write: metrics after the checkpoint are dropped, each file is replaced atomically ------
    if args.resume:
        for name in ("metrics.jsonl", "samples.jsonl"):  # drop what was logged after the checkpoint
            keep_metrics_upto(os.path.join(args.out, name), start)
        for tmp in glob.glob(ckpt_path + ".tmp*"):  # left by a run killed while saving
            os.remove(tmp)
    os.makedirs(args.out, exist_ok=True)
    with open(config_path + ".tmp", "w") as f:
        json.dump({**vars(args), "team_models": run["team"], "device_used": str(run["device"])}, f, indent=2)
    os.replace(config_path + ".tmp", config_path)

    bad_steps = 0
    bar = tqdm(range(start, args.steps), initial=start, total=args.steps, desc="train", dynamic_ncols=True)
    for step in bar:
        rec, batches = grpo_step(step, run, args, score_batch)
        bad_steps = bad_steps + 1 if rec["skipped_update"] else 0
        # ---- log: one line, one JSON object ------------------------------------------------------------------
        with open(metrics_path, "a") as f:
            f.write(json.dumps({k: None if isinstance(v, float) and not np.isfinite(v) else v  # strict JSON:
                                for k, v in rec.items()}) + "\n")                        # NaN -> null
        bar.write(f"step {step + 1}/{args.steps} | reward {rec['reward']:.3f} | kl {rec['kl']:.4f} | "
                  f"len {rec['completion_length']:.0f}" + (f" | H {rec['entropy']:.3f}" if "entropy" in rec else "")
                  + f" | {rec['seconds']:.1f} s" + (" | update skipped: non-finite loss or gradient"
                                                     if rec["skipped_update"] else ""))
        if (step + 1) % args.sample_every == 0 or step == start:
            b = batches[0]
            with open(os.path.join(args.out, "samples.jsonl"), "a") as f:
                for k in range(min(args.group_size, 4)):  # the first prompt's first few completions
                    f.write(json.dumps({"step": step + 1, "question": b["questions"][0],
                                        "answer": b["items"][0].get("answer"), "completion": b["texts"][k],
                                        "reward": b["r"][k].item()}) + "\n")
        # ---- checkpoint --------------------------------------------------------------------------------------
        if (step + 1) % args.save_every == 0 or step + 1 == args.steps:
            save_checkpoint(ckpt_path, step + 1, run["policy"], run["method"], run["optimizer"], run["pool"])
        if bad_steps >= args.max_bad_steps:  # skipped steps left the weights as they were: save them
            save_checkpoint(ckpt_path, step + 1, run["policy"], run["method"], run["optimizer"], run["pool"])
            bar.close()  # so that the message gets a line of its own
            fail(f"{bad_steps} steps in a row (--max-bad-steps) had a non-finite loss or gradient; stopped. The "
                 f"last good weights are in {ckpt_path}; try a lower --lr / --router-lr", code=3)
    save_peft(run["policy"], os.path.join(args.out, "lora_peft"), run["team"]["policy"])
    return args.out


if __name__ == "__main__":
    main()
