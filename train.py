"""
Train a LoRA policy with GRPO, conditioned on context tokens built from frozen experts.

    python train.py --task arithmetic --team default                 # the paper's setting (one CUDA GPU)
    torchrun --standalone --nproc_per_node 8 train.py --task arithmetic --team default   # 8 GPUs (distributed.py)
    python train.py --task arithmetic --team default --device cuda --plan                # memory per GPU (plan.py)
    python train.py --task chain_sum --team tiny --steps 3 --batch-size 2 --grad-accum 1 --group-size 4 \
        --max-new-tokens 16 --out runs/smoke                         # seconds, on any CPU

Paper: Eq. 3 (pi(y | [x || C])), Eq. 4 (reward minus beta * KL to pi_ref = the initial policy fed zero
context tokens at the same positions), GRPO with G = 8, beta = 0.04, 32 prompts per step (4 x 8 grad-accum),
lr 1e-4 for LoRA and adapter, 128 new tokens (§4.1, Appendix Listing 1). Every default below is the paper's.

The loop, one optimiser step (grpo_step):  rollout -> reward -> advantage -> reference -> loss -> step -> log
Every flag, its default and its checks are in config.py; `python train.py --help` lists them.

Deviations from the paper (and see grpo.py, rollout.py, adapter.py, experts.py, rewards.py):
  1. Sampling is plain temperature sampling (T = 1, no top-p/top-k), with our own KV-cached loop: one
     prefill per prompt shared by its G samples, and rollout and scoring use the same positions.
  2. Options the paper does not have, off by default: --inner-epochs (mu > 1 reuses a rollout; the paper's
     mu = 1 makes the ratio exactly 1), --system-prompt / --worked-example / --response-prefix (a 135M policy
     never writes the answer tags with the paper's prompt: 0 of 64 samples did), --context-position before,
     --clip-per-group, and two controls: --reward random, --method identical / soft_prompt (baselines.py).
     The speedrun's levers (README "Speedrun"): --format-bonus (training reward only), --dynamic-sampling,
     --rollout-dtype bfloat16 with --tis-cap, --lr-schedule / --warmup-steps; --eval-items scores the policy
     before and after training.
  3. A step whose loss or gradient is not finite is skipped (weights unchanged) and counted.

Failure modes (tests/test_hardening.py): bad input exits with code 2 and one line on stderr, before anything
in --out is written; --max-bad-steps non-finite steps in a row exit with code 3, the checkpoint holding the
last good weights; a killed run continues exactly with --resume (checkpoint.py); under torchrun, a rank that dies
stops the job with exit code 3 (distributed.py).
"""
import glob
import json
import math
import os
import random
import time

import numpy as np
import torch

import distributed
import grpo
import rewards
import rollout
from adapter import anchor_context, context_probes, empty_context
from baselines import METHODS
from checkpoint import keep_metrics_upto, load_checkpoint, save_checkpoint, sigkill_hook, write_json
from config import check_run, fail, parse_args
from experts import load_model, pick_device, team_models
from lora import apply_lora, lora_disabled, save_peft

# ----------------------------------------------------------------------------------------------------------
# Building a run: the policy (frozen + LoRA), the context builder g of the chosen method, data, optimiser


def build_run(args, device):
    """Raises ValueError with a one-line message on bad input."""
    team = team_models(args)
    train_items = rewards.load_entries(args.task, "train", args.dataset_size, args.seed, args.data_path,
                                       args.task_config)
    dtype = frozen_dtype(args.dtype, device)
    torch.manual_seed(args.seed), np.random.seed(args.seed), random.seed(args.seed)
    policy, tok = load_model(team["policy"], device, dtype)
    method = METHODS[args.method](team, policy.config.hidden_size, args, device, dtype)
    if args.state_norm == "standardize":
        if not hasattr(method, "fit_state_norm"):
            raise ValueError(f"--state-norm standardize: --method {args.method} has no expert states to standardise")
        calibration = [train_items[i] for i in range(min(args.state_norm_prompts, len(train_items)))]
        method.fit_state_norm([it["question"] for it in calibration], [it["answer"] for it in calibration])
    anchor_context(method, policy, tok, args)
    apply_lora(policy, args.lora_rank, args.lora_alpha)
    if args.freeze_policy:
        for p in policy.parameters():
            p.requires_grad_(False)
    policy.train()  # no dropout in these models; train() only marks intent
    groups = []  # named, so that the probes and --clip-per-group can tell them apart
    if not args.freeze_policy:
        groups.append({"name": "lora", "params": [p for p in policy.parameters() if p.requires_grad],
                       "lr": args.lr, "base_lr": args.lr})
    if any(p.requires_grad for p in method.parameters()):
        groups.append({"name": "g_phi", "params": [p for p in method.parameters() if p.requires_grad],
                       "lr": args.router_lr, "base_lr": args.router_lr})
    if not groups:
        raise ValueError(f"--freeze-policy with --method {args.method}: nothing left to train")
    # An Adam step of 3e-5 on a weight of 0.02 rounds to nothing in bfloat16 (8 bits of mantissa): whatever
    # the frozen weights are, what trains, and so its AdamW state, is float32 (tests/test_collaboration.py).
    assert all(p.dtype == torch.float32 for g in groups for p in g["params"]), "trainable parameters must be fp32"
    optimizer = torch.optim.AdamW(groups, eps=args.adam_eps, weight_decay=args.weight_decay)
    embed_rms = policy.get_input_embeddings().weight.float().pow(2).mean().sqrt().item()
    return dict(team=team, policy=policy, tok=tok, method=method, optimizer=optimizer, train_items=train_items,
                eos_ids=rollout.eos_token_ids(policy, tok), device=device, pool=getattr(method, "pool", None),
                embed_rms=embed_rms)


def frozen_dtype(name, device):
    """--dtype: the frozen weights' dtype; auto = bfloat16 on CUDA, float32 elsewhere."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)


# ----------------------------------------------------------------------------------------------------------
# The algorithm: one GRPO step


def grpo_step(step, run, args, score_batch):
    """rollout -> reward -> advantage -> reference -> loss -> step. Returns (metrics, rollout batches)."""
    policy, tok, method, optimizer = run["policy"], run["tok"], run["method"], run["optimizer"]
    G, device, t0 = args.group_size, run["device"], time.time()
    world = run.get("world", distributed.ONE)  # under torchrun: this process's share of the micro-batches
    for g in optimizer.param_groups:  # a pure function of the step, so --resume needs no scheduler state
        g["lr"] = g["base_lr"] * lr_factor(step, args.steps, args.lr_schedule, args.warmup_steps)
    if hasattr(method, "grpo_step"):  # conductor.py, rlae.py: their own rollout, reward and loss, same log record
        return method.grpo_step(step, run, args, score_batch)
    batches = []
    for micro in distributed.my_micro_batches(world, args.grad_accum):
        distributed.seed_micro_batch(args.seed, step, micro, run["pool"])  # same draws on any rank, after a resume
        items = [run["train_items"][i] for i in rewards.batch_indices(step, micro, args.batch_size, args.grad_accum,
                                                              len(run["train_items"]), args.seed)]
        questions, answers = [it["question"] for it in items], [it["answer"] for it in items]
        # ---- rollout: C = g(x), then G samples per prompt, all conditioned on the same C ---------------------
        method.train()  # training behaviour in the rollout too: hard routing draws its Gumbel expert here
        with torch.no_grad():
            ctx = method(questions, answers)  # answers: read only by oracle experts (a diagnostic)
        ids, mask = rollout.encode_prompts(tok, rewards.policy_prompts(tok, questions, ctx["hints"], args), device)
        drawn = draw_and_score(run, args, items, ids, mask, ctx["C"], (step, micro, 0), score_batch)
        r = drawn["r"]
        first = dict(task_r=drawn["task_r"].clone(), flat=flat_groups(r, G), first_counts=drawn["counts"])
        # ---- dynamic sampling (--dynamic-sampling N): draw the groups with no reward variance again -----------
        for draw in range(1, args.dynamic_sampling + 1):
            redo = flat_groups(r, G).nonzero().squeeze(1)                # (k,) prompts to draw again
            if len(redo) == 0:
                break
            again = draw_and_score(run, args, [items[i] for i in redo.tolist()], ids[redo], mask[redo],
                                   None if ctx["C"] is None else ctx["C"][redo], (step, micro, draw), score_batch)
            replace_groups(drawn, again, redo, G, tok.pad_token_id)
        keep = ~flat_groups(r, G) if args.dynamic_sampling else torch.ones(len(items), dtype=torch.bool,
                                                                              device=device)
        rows = keep.repeat_interleave(G)                                 # (B*G,) the completions trained on
        comp, logp_mu = drawn["comp"], drawn["logp_mu"]
        comp_mask = grpo.completion_mask(comp, run["eos_ids"])
        # ---- advantage: group-relative, one group per prompt -------------------------------------------------
        adv = grpo.group_advantages(r, G, scale=not args.no_scale_rewards)
        # ---- reference: pi_ref = the initial policy (LoRA off) with zero tokens where C was (paper §4.1) -----
        with torch.no_grad(), lora_disabled(policy):
            C0 = None if ctx["C"] is None else empty_context(method, ctx["C"][keep])  # zeros or the anchor
            logp_ref = rollout.completion_logprobs(policy, ids[keep], mask[keep], C0, comp[rows], comp_mask[rows],
                                                   args.temperature, args.context_position) if keep.any() else None
        batches.append(dict(questions=questions, ctx=ctx, ids=ids[keep], mask=mask[keep], comp=comp[rows],
                            comp_mask=comp_mask[rows], keep=keep, r=r, adv=adv[rows], logp_ref=logp_ref,
                            logp_mu=None if logp_mu is None else logp_mu[rows], counts=drawn["counts"],
                            texts=drawn["texts"],
                            items=items, **first))

    # ---- loss and step: mu passes over the rollout batch, gradient accumulation over micro-batches ------------
    # completions in the loss, on every rank (fewer with --dynamic-sampling)
    n_trained = sum(distributed.gather(world, [sum(len(b["comp"]) for b in batches)]))
    skipped = False
    for epoch in range(args.inner_epochs):
        optimizer.zero_grad(set_to_none=True)
        losses, stats = [], []
        for b in (b for b in batches if len(b["comp"])):  # a micro-batch left with no group trains nothing
            ctx = method(b["questions"], reuse=b["ctx"])  # the rollout's pooled states and routing draw
            C = None if ctx["C"] is None else ctx["C"][b["keep"]]
            logp = rollout.completion_logprobs(policy, b["ids"], b["mask"], C, b["comp"], b["comp_mask"],
                                               args.temperature, args.context_position)
            if epoch == 0:  # the weights have not moved yet: logp_old = logp, detached (no extra forward)
                b["logp_old"] = logp.detach()
                b["is_weight"] = grpo.truncated_is_weights(b["logp_old"], b["logp_mu"], b["comp_mask"], args.tis_cap) \
                    if args.tis_cap and b["logp_mu"] is not None else None
            loss, m = grpo.grpo_loss(logp, b["logp_old"], b["logp_ref"], b["adv"], b["comp_mask"], args.clip_eps,
                                     args.beta, args.loss_aggregation, b["is_weight"])
            if args.channel_weight:  # not the paper's: + lambda * grpo.channel_forcing_loss
                loss, m = add_channel_forcing(loss, m, logp, b, C, policy, args)
            # each trained completion weighs the same, however many groups dynamic sampling left per micro-batch
            (loss / args.grad_accum if not args.dynamic_sampling else loss * (len(b["comp"]) / n_trained)).backward()
            losses.append(loss.item()), stats.append(m)
        losses, stats = distributed.gather(world, losses), distributed.gather(world, stats)  # every rank's
        distributed.all_reduce_grads(world, optimizer.param_groups)  # the sum over all micro-batches of the step
        grad_norm, group_norms = clip_gradients(optimizer.param_groups, args.grad_clip, args.clip_per_group)
        finite = bool(np.isfinite(grad_norm) and np.isfinite(losses).all())
        if finite and losses:  # a non-finite loss or gradient skips the update: the weights stay as they were
            optimizer.step()
        skipped = skipped or not finite

    # ---- log: the step's metrics (README "Metrics"); reward and the like describe the first draw ----------------
    batches = distributed.gather(world, batches, device)  # every rank's micro-batches, in order
    rec = step_metrics(step, batches, losses, stats, grad_norm, group_norms, skipped, run, args)
    rec["seconds"] = time.time() - t0
    return rec, batches


def add_channel_forcing(loss, metrics, logp, b, C, policy, args):
    """--channel-weight lambda: loss + lambda * grpo.channel_forcing_loss, where each prompt's
    mismatched context is the C of the next prompt of the micro-batch (a cyclic shift: no prompt
    keeps its own). With fewer than two prompts left there is no other prompt: the term is 0."""
    if len(C) < 2:
        return loss, {**metrics, "cf_loss": 0.0, "cf_margin": float("nan"), "cf_fraction": 0.0}
    C_mismatched = C.roll(-1, dims=0)                          # (B, m, D) prompt b reads C of b + 1
    logp_mismatched = rollout.completion_logprobs(policy, b["ids"], b["mask"], C_mismatched,
                                                  b["comp"], b["comp_mask"], args.temperature,
                                                  args.context_position)
    cf, m = grpo.channel_forcing_loss(logp, logp_mismatched, b["adv"], b["comp_mask"])
    return loss + args.channel_weight * cf, {**metrics, **m}


def step_metrics(step, batches, losses, stats, grad_norm, group_norms, skipped, run, args):
    """The step's record for metrics.jsonl (each field is defined in the README, "Metrics"): the first draw's
    rewards, the loss terms averaged over micro-batches, gradient norms before clipping, what the completions
    looked like, and the context probes (adapter.context_probes)."""
    device, optimizer = run["device"], run["optimizer"]
    r_all = torch.cat([b["task_r"] for b in batches])
    eos, trained = torch.tensor(run["eos_ids"], device=device), [b for b in batches if len(b["comp"])]
    mean = lambda xs: float(np.mean(xs)) if len(xs) else float("nan")  # noqa: E731
    rec = {"step": step + 1, "reward": r_all.mean().item(), "reward_std": r_all.std().item(),
           "solve_rate": (r_all == 1).float().mean().item(), "loss": mean(losses),
           **{k: mean([m[k] for m in stats]) for k in ("pg_loss", "kl", "clip_fraction", "ratio_mean")},
           **{k: mean([m[k] for m in stats if np.isfinite(m[k])])  # NaN: a batch with no A > 0
              for k in ("cf_loss", "cf_margin", "cf_fraction") if args.channel_weight},
           "grad_norm": grad_norm, **{f"grad_norm_{k}": v for k, v in group_norms.items()},
           "completion_length": mean(torch.cat([b["comp_mask"].sum(-1) for b in trained]).float().tolist()
                                     if trained else []),
           "truncated_fraction": mean(torch.cat([~torch.isin(b["comp"], eos).any(-1) for b in trained]).float().tolist()
                                      if trained else []),
           "zero_std_fraction": torch.cat([b["flat"] for b in batches]).float().mean().item(),
           # refused, failed or timed-out scorings; "no_answer" is the model's fault, not a scorer failure
           "scorer_failures": sum(b["counts"].get(k, 0) for b in batches for k in ("refused", "error", "timeout")),
           "answer_rate": 1 - sum(b["first_counts"].get("no_answer", 0) for b in batches) / len(r_all),
           "lr": optimizer.param_groups[0]["lr"], "skipped_update": skipped,
           **context_probes([b["ctx"] for b in batches], run["embed_rms"])}
    if args.dynamic_sampling:
        rec["trained_group_fraction"] = torch.cat([b["keep"] for b in batches]).float().mean().item()
    if trained and trained[0]["logp_mu"] is not None:  # --rollout-dtype: how far the sampler is from pi_old
        gaps = [(b["logp_old"] - b["logp_mu"]).abs()[b["comp_mask"]] for b in trained]
        rec["rollout_logp_gap"] = torch.cat(gaps).mean().item()
        if args.tis_cap:
            rec["is_weight_mean"] = torch.cat([b["is_weight"][b["comp_mask"]] for b in trained]).mean().item()
    return rec


def draw_and_score(run, args, items, ids, mask, C, key, score_batch):
    """The rollout of B prompts and its rewards: {comp [B*G, T], logp_mu [B*G, T] (the sampler's own log-probs
    when it is a --rollout-dtype copy of the policy, else None), r [B*G] (the task's scorer, or the random-reward
    control's coins seeded by key = (step, micro-batch, draw), plus --format-bonus), task_r [B*G] (the task's
    part alone), counts (the scorer's), texts}."""
    tok, G = run["tok"], args.group_size
    dtype = None if args.rollout_dtype == "float32" else getattr(torch, args.rollout_dtype)
    out = rollout.sample(run["policy"], ids, mask, C, G, args.max_new_tokens, args.temperature, run["eos_ids"],
                         tok.pad_token_id, args.context_position, return_logprobs=dtype is not None, dtype=dtype)
    comp, logp_mu = out if dtype is not None else (out, None)
    texts = tok.batch_decode(comp.masked_fill(~grpo.completion_mask(comp, run["eos_ids"]), tok.pad_token_id),
                             skip_special_tokens=True)
    if args.reward == "random":  # the coin and nothing else (config refuses --format-bonus with it)
        task_r = rewards.coin_rewards(args.seed, *key, len(texts))
        counts = {"no_answer": sum(rewards.extract_answer(t) is None for t in texts)}
    else:
        task_r, counts = score_batch([it for it in items for _ in range(G)], texts)
    task_r = torch.tensor(task_r, dtype=torch.float32, device=run["device"])
    bonus = torch.tensor(rewards.format_bonus(texts, args.format_bonus), dtype=torch.float32, device=run["device"])
    return dict(comp=comp, logp_mu=logp_mu, r=task_r + bonus, task_r=task_r, counts=counts, texts=texts)


def replace_groups(drawn, again, prompts, G, pad_id):
    """Put the groups of `again` (a new draw for `prompts`, [k]) in place of theirs in `drawn`, in place."""
    rows = (prompts[:, None] * G + torch.arange(G, device=prompts.device)).flatten()  # (k*G,) their completions
    for key, fill in (("comp", pad_id), ("logp_mu", 0.0)):
        if drawn[key] is not None:  # completions of two draws differ in length: pad the shorter one
            T = max(drawn[key].shape[1], again[key].shape[1])
            drawn[key], new = (torch.nn.functional.pad(x, (0, T - x.shape[1]), value=fill) for x in (drawn[key],
                                                                                                    again[key]))
            drawn[key][rows] = new
    drawn["r"][rows], drawn["task_r"][rows] = again["r"], again["task_r"]
    for i, row in enumerate(rows.tolist()):
        drawn["texts"][row] = again["texts"][i]
    drawn["counts"] = {k: drawn["counts"].get(k, 0) + again["counts"].get(k, 0)
                       for k in set(drawn["counts"]) | set(again["counts"])}


def flat_groups(r, G):
    """[B*G] rewards -> [B] bool: the groups whose G rewards are all equal (advantage 0: no policy gradient)."""
    groups = r.view(-1, G)
    return (groups == groups[:, :1]).all(-1)


def lr_factor(step, steps, schedule, warmup):
    """The learning rate of optimiser step `step` (0-based), as a fraction of --lr / --router-lr."""
    if step < warmup:
        return (step + 1) / warmup
    if schedule == "cosine":
        return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))
    return 1.0


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


# ----------------------------------------------------------------------------------------------------------
# Plumbing: check everything, then the loop with its log lines and checkpoints


def main(argv=None, score_batch=None):
    """Run training. `score_batch(items, completions) -> (rewards, counts)` replaces the task's scorer (a fork's
    own reward, or the tests' synthetic one); by default rewards.score_batch."""
    from tqdm import tqdm
    args = parse_args(argv)
    world = distributed.world_from_env()  # torchrun's processes, or one
    if world.size > args.grad_accum:
        fail(f"torchrun --nproc_per_node {world.size} is more processes than --grad-accum {args.grad_accum} "
             "micro-batches per step: each process needs one; start fewer processes or raise --grad-accum")
    if args.plan:  # the memory plan: nothing is loaded, allocated or written
        import plan
        return plan.main(args, world)
    score_batch = score_batch or rewards.score_batch
    ckpt_path, metrics_path = os.path.join(args.out, "checkpoint.pt"), os.path.join(args.out, "metrics.jsonl")
    config_path = os.path.join(args.out, "config.json")
    # ---- check everything before writing anything into --out ---------------------------------------------------
    try:
        check_run(args, world, config_path)
        run = build_run(args, distributed.rank_device(pick_device(args.device), world))
        # a run killed before its first checkpoint resumes from step 0
        start = load_checkpoint(ckpt_path, run["policy"], run["method"], run["optimizer"], run["pool"]) \
            if args.resume and os.path.exists(ckpt_path) else 0
    except (ValueError, FileNotFoundError) as e:  # loaders raise these with a one-line message
        fail(str(e))
    if start > args.steps:
        fail(f"--steps {args.steps} is below the step {start} of the checkpoint in --out {args.out}")
    # every process has checked everything; joining waits for all of them, so rank 0 writes only after that
    distributed.init(world, run["device"])
    run["world"], writer = world, world.rank == 0  # only rank 0 writes
    # ---- from here on we write: metrics after the checkpoint are dropped, each file is replaced atomically ------
    if args.resume and writer:
        for name in ("metrics.jsonl", "samples.jsonl"):
            keep_metrics_upto(os.path.join(args.out, name), start)
        for tmp in glob.glob(ckpt_path + ".tmp*"):  # left by a run killed while saving
            os.remove(tmp)
    if writer:
        os.makedirs(args.out, exist_ok=True)
        write_json(config_path, {**vars(args), "team_models": run["team"], "device_used": str(run["device"]),
                                 "processes": world.size})

    validation_path = os.path.join(args.out, "validation.json")
    if args.eval_items and start == 0 and writer:  # the policy before training: LoRA's B = 0 and W_out = 0, so C = 0
        write_json(validation_path, {"items": args.eval_items, "before": validation_scores(run, args)})
    bad_steps = 0
    bar = tqdm(range(start, args.steps), initial=start, total=args.steps, desc="train", dynamic_ncols=True,
               disable=not writer)
    for step in bar:
        rec, batches = grpo_step(step, run, args, score_batch)
        sigkill_hook("step", step + 1)  # tests: a kill after the update, before its log line and checkpoint
        bad_steps = bad_steps + 1 if rec["skipped_update"] else 0
        if not writer:  # the other ranks took their share of the step; rank 0 logs and saves it
            if bad_steps >= args.max_bad_steps:
                distributed.barrier(world)  # rank 0 has saved the checkpoint: stop too (it says why)
                fail("", code=3)
            continue
        with open(metrics_path, "a") as f:  # strict JSON: NaN is written as null
            f.write(json.dumps({k: None if isinstance(v, float) and not np.isfinite(v) else v
                                for k, v in rec.items()}) + "\n")
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
        if (step + 1) % args.save_every == 0 or step + 1 == args.steps or bad_steps >= args.max_bad_steps:
            save_checkpoint(ckpt_path, step + 1, run["policy"], run["method"], run["optimizer"], run["pool"])
        if bad_steps >= args.max_bad_steps:  # the skipped steps left the weights as they were, and saved
            bar.close()  # so that the message gets a line of its own
            distributed.barrier(world)  # the others stop with rank 0, not while it saves (torchrun would end it)
            fail(f"{bad_steps} steps in a row (--max-bad-steps) had a non-finite loss or gradient; stopped. The "
                 f"last good weights are in {ckpt_path}; try a lower --lr / --router-lr", code=3)
    distributed.finish(world)  # the other ranks are done; rank 0 writes the rest alone
    if not writer:
        return args.out
    save_peft(run["policy"], os.path.join(args.out, "lora_peft"), run["team"]["policy"])
    if args.eval_items:
        with open(validation_path) as f:
            before = json.load(f)["before"]
        after = validation_scores(run, args)
        write_json(validation_path, {"items": args.eval_items, "before": before, "after": after})
        better, worse = sum(a > b for a, b in zip(after, before)), sum(a < b for a, b in zip(after, before))
        print(f"validation, {len(after)} items, greedy, the task's scorer: before training {100 * np.mean(before):.1f} % "
              f"-> after {100 * np.mean(after):.1f} % ({better} items better, {worse} worse)", flush=True)
    return args.out


def validation_scores(run, args):
    """--eval-items: the live policy's greedy score on each of the first N validation items, the items
    evaluate.py scores for this seed."""
    from evaluate import score_items  # evaluate.py imports this file, so not at the top
    items = rewards.load_entries(args.task, "val", args.eval_items, args.seed, args.data_path, args.task_config)
    items = [items[i] for i in range(min(args.eval_items, len(items)))]
    run["policy"].eval(), run["method"].eval()
    per_item, _ = score_items(run["policy"], run["tok"], run["method"], run["eos_ids"], items, args, batch_size=50)
    run["policy"].train(), run["method"].train()
    return per_item["with_C"]["score"]


if __name__ == "__main__":
    main()
