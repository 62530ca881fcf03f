"""
Train a LoRA policy with GRPO, conditioned on context tokens built from frozen experts.

    python train.py --preset pocket    # the README's first run: pocket team, 6 steps, before/after
    python train.py --preset smoke     # seconds, on any CPU (the tiny random-init team)
    python train.py --task arithmetic --team default                # the paper's setting (a GPU)
    torchrun --standalone --nproc_per_node 8 train.py --task arithmetic --team default   # 8 GPUs
    python train.py --task arithmetic --team default --device cuda --plan   # memory per GPU

Paper: Eq. 3 (pi(y | [x || C])), Eq. 4 (reward minus beta * KL to pi_ref = the initial policy fed
zero context tokens at the same positions), GRPO with G = 8, beta = 0.04, 32 prompts per step (4 x 8
grad-accum), lr 1e-4 for LoRA and adapter, 128 new tokens (§4.1, Appendix Listing 1). Every default
is the paper's (`--help`: support/harness/config.py; a --preset is a dict of flag values).

The loop, train: the run built once (support/harness/build.build_run), then for each step, grpo_step (rollout ->
reward -> advantage -> reference -> loss -> step -> its metrics), then its samples, log line, metrics.jsonl and
checkpoint (support/harness/run.after_step).
A line marked `# lever:` is not the paper's (a flag, off by default): skip them to read the paper's.

Deviations from the paper (and see grpo.py, rollout.py, adapter.py, experts.py, rewards.py):
  1. Sampling is plain temperature sampling (T = 1, no top-p/top-k), with our own KV-cached loop:
     one prefill per prompt shared by its G samples, and rollout and scoring use the same positions.
  2. Prompt options for small policies (--system-prompt, --worked-example, --response-prefix: a 135M
     policy never writes the answer tags with the paper's prompt, 0 of 64 samples did), C's place
     (--context-position before, --context-split), and two controls: --reward random, --method
     identical / soft_prompt (baselines.py).
  3. The levers, each one call or one `if` in grpo_step: --inner-epochs, --format-bonus,
     --dynamic-sampling, --rollout-dtype with --tis-cap, --lr-schedule / --warmup-steps,
     --clip-per-group, --channel-weight, torchrun (lib/distributed.py); --eval-items scores the
     policy before and after training.
  4. A step whose loss, gradient or update is not finite is skipped, weights unchanged, and counted
     (lib/optim.step_if_finite).
Conductor and RLAE are scripts of their own (neighbours/). When things go wrong (bad input, Ctrl-C, a
full disk, a killed run): support/harness/run.py.
"""
import time
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

import grpo
import rewards
import rollout
from adapter import empty_context
from experts import pick_device
from lora import lora_disabled
from support.harness.build import build_run, precompute_states
from support.harness.checks import parse_args
from support.harness.config import fail
from support.harness.metrics import step_metrics, wall_clock
from support.harness.folder import claim_expert_cache, writes_or_fail
from support.harness.run import after_step, finish_run, open_run, progress_bar, release_folders, resume_run
from lib import distributed
from lib.optim import clip_gradients, set_learning_rates, step_if_finite
from lib.runtime import deterministic_kernels, expandable_segments

# --------------------------------------------------------------------------------------------------
# What a step reads and makes: the Run (support/harness/build.py) and its micro-batches


@dataclass
class MicroBatch:
    """One of a step's --grad-accum micro-batches, as grpo_step builds it and the loss, the log
    (support/harness/metrics.py) and the samples read it: B prompts, G samples each, N = B*G
    completions, P prompt tokens, T completion tokens, m context tokens of width D."""
    items: list                 # B task items: {"question", "answer", "metadata"}
    questions: list             # B questions, the items' own
    ctx: object                 # g(x)'s output, a baselines.Context: C (B, m, D) or None, hints (B), ...
    ids: torch.Tensor           # (B, P) the policy's prompt tokens
    mask: torch.Tensor          # (B, P) bool, True on a prompt token
    comp: torch.Tensor          # (N, T) completions, G per prompt in prompt order
    comp_mask: torch.Tensor     # (N, T) bool, True up to and including EOS
    r: torch.Tensor             # (N,) reward: the task's scorer (+ --format-bonus), after --dynamic-sampling
    adv: torch.Tensor           # (N,) group-relative advantage
    logp_ref: torch.Tensor      # (N, T) log pi_ref(y_t): LoRA off, zero tokens where C was
    logp_mu: Optional[torch.Tensor]  # (N, T) the sampler's log-probs, or None when it is the scoring pass
    counts: dict                # the scorer's status counts ("no_answer", "refused", ...)
    texts: list                 # N decoded completions
    signal: torch.Tensor        # (B,) bool: the group's rewards differ (after --dynamic-sampling)
    task_r: torch.Tensor        # (N,) the first draw's task reward alone: what the log reports
    flat: torch.Tensor          # (B,) bool: the first draw's group had G equal rewards
    first_counts: dict          # the first draw's scorer counts
    logp_old: Optional[torch.Tensor] = None   # (N, T) log pi_old, detached: set by the first inner epoch
    is_weight: Optional[torch.Tensor] = None  # (N, T) --tis-cap's min(pi_old / pi_mu, cap), or None


# --------------------------------------------------------------------------------------------------
# The algorithm: one GRPO step


def grpo_step(step, run, args, score_batch):
    """One GRPO step: C = g(x) -> prompts -> G samples each -> rewards -> advantages -> reference -> loss ->
    update -> metrics. Returns (the step's metrics, its micro-batches: MicroBatch)."""
    G, g, policy, t0 = args.group_size, run.method, run.policy, time.time()
    set_learning_rates(run.optimizer, step, args)  # lever: --lr-schedule, --warmup-steps (paper: constant)
    micros = list(distributed.my_micro_batches(run.world, args.grad_accum))  # torchrun: this rank's share
    # ---- C = g(x) and the prompts per micro-batch, then G samples per prompt, one decode loop for all ----
    inputs = [micro_batch_inputs(run, args, step, micro) for micro in micros]  # (items, ctx, ids, mask)
    samples = sample_step(run, args, step, micros, inputs=inputs)  # [(comp, logp_mu)] per micro-batch
    batches = []
    for micro, (items, ctx, ids, mask), (comp, logp_mu) in zip(micros, inputs, samples):
        # ---- reward: the task's scorer (or the random-reward control), plus --format-bonus ----------
        key = (step, micro, 0)  # seeds the random-reward control's coins
        drawn = score_draw(run, args, items, comp, logp_mu=logp_mu, key=key, score_batch=score_batch)
        first = dict(task_r=drawn["task_r"].clone(), flat=grpo.flat_groups(drawn["r"], G),
                     first_counts=drawn["counts"])  # what the log reports: the first draw
        if args.dynamic_sampling:  # lever: DAPO, draw the groups whose rewards are all equal again
            redraw_flat_groups(run, args, items, ids, mask=mask, ctx=ctx, drawn=drawn, key=key, score_batch=score_batch)
        comp = drawn["comp"]                                       # (B*G, T) every group's
        comp_mask = grpo.completion_mask(comp, run.eos_ids)        # (B*G, T) up to EOS, inclusive
        # ---- advantage: group-relative, one group per prompt -----------------------------------------
        adv = grpo.group_advantages(drawn["r"], G, scale=not args.no_scale_rewards)
        # ---- reference: pi_ref = the initial policy (LoRA off), zero tokens where C was (§4.1) -------
        logp_ref = reference_logprobs(run, args, ids, mask, C=ctx.C, comp=comp, comp_mask=comp_mask)
        batches.append(MicroBatch(items=items, questions=[it["question"] for it in items], ctx=ctx, ids=ids,
                                  mask=mask, comp=comp, comp_mask=comp_mask, r=drawn["r"], adv=adv,
                                  logp_ref=logp_ref, logp_mu=drawn["logp_mu"], counts=drawn["counts"],
                                  texts=drawn["texts"], signal=~grpo.flat_groups(drawn["r"], G), **first))
    if args.dynamic_sampling:  # lever: DAPO, the surrogate averages over groups with signal; KL over all
        dapo_advantages(batches, G, run.world, args.loss_aggregation)
    # ---- loss: each micro-batch's GRPO loss, its gradient accumulated; then one update ----------------
    skipped = False
    for epoch in range(args.inner_epochs):  # lever: --inner-epochs mu (paper: 1)
        run.optimizer.zero_grad(set_to_none=True)
        losses, stats = [], []
        for b in batches:
            C = g(b.questions, reuse=b.ctx).C  # the rollout's C again (its states), now with gradient
            logp = rollout.completion_logprobs(policy, b.ids, b.mask, C, completion_ids=b.comp,
                                               completion_mask=b.comp_mask, temperature=args.temperature,
                                               position=run.position, share=not args.no_shared_prefix)  # (N, T)
            if epoch == 0:  # the weights have not moved: logp_old = logp, detached
                b.logp_old = logp.detach()
                b.is_weight = tis_weights(b, args)  # lever: --tis-cap (None without it)
            loss, m = grpo.grpo_loss(logp=logp, logp_old=b.logp_old, logp_ref=b.logp_ref, advantages=b.adv,
                                     mask=b.comp_mask, clip_eps=args.clip_eps, beta=args.beta,
                                     aggregation=args.loss_aggregation, is_weight=b.is_weight)
            if args.channel_weight:  # lever: + lambda * grpo.channel_forcing_loss
                loss, m = add_channel_forcing(loss, m, logp, b, C=C, run=run, args=args)
            (loss / args.grad_accum).backward()  # each micro-batch holds B*G completions
            losses.append(loss.item())
            stats.append(m)
        # ---- update: clip the gradient, step AdamW (a non-finite loss, gradient or weight: skipped) ---
        losses, stats, grad_norm, group_norms, finite = update(run, args, losses, stats)
        skipped = skipped or not finite
    # ---- the step's metrics (README "Metrics"), of the first draw -----------------------------------
    batches = distributed.gather(run.world, batches, run.device)  # every rank's, in order
    rec = step_metrics(step, batches, losses, stats, grad_norm=grad_norm, group_norms=group_norms,
                       skipped=skipped, run=run, args=args)
    return rec | wall_clock(t0, tokens=sum(int(b.comp_mask.sum()) for b in batches)), batches  # EOS counts, padding not


def update(run, args, losses, stats):
    """After a pass's backward: every process's losses and gradients together (torchrun; one process: as they
    are), the gradient clipped to --grad-clip, then AdamW's step unless a loss, the gradient or an updated weight
    is not finite (lib/optim.step_if_finite undoes such an update). Returns (losses, stats, grad_norm,
    group_norms, finite)."""
    losses, stats = distributed.gather(run.world, losses), distributed.gather(run.world, stats)
    distributed.all_reduce_grads(run.world, run.optimizer.param_groups)  # torchrun: all ranks' sum
    grad_norm, group_norms = clip_gradients(run.optimizer.param_groups, args.grad_clip,
                                            args.clip_per_group)  # lever: --clip-per-group
    finite = bool(np.isfinite(grad_norm) and np.isfinite(losses).all())
    if finite and losses:
        finite = step_if_finite(run.optimizer)
    return losses, stats, grad_norm, group_norms, finite


def tis_weights(b, args):
    """--tis-cap: min(pi_old / mu, cap) per token (grpo.truncated_is_weights), where the sampler mu is not the
    scoring pass; None otherwise."""
    if not args.tis_cap or b.logp_mu is None:
        return None
    return grpo.truncated_is_weights(b.logp_old, b.logp_mu, b.comp_mask, args.tis_cap)


# --------------------------------------------------------------------------------------------------
# The loop: the steps, each followed by its log and checkpoint (the helpers: support/harness/run.py)


def train(args, world, score_batch):
    """One run: checked and opened, built, resumed, its steps, finished. Returns --out."""
    life = open_run(args, world)  # checks (bad input: exit 2), --out locked, Ctrl-C / SIGTERM, the device
    try:  # however the run ends, the lock on --out goes with it
        with writes_or_fail(args):  # a write the system refuses, --expert-cache's too: one line, exit code 4
            run = build_run(args, life.device)  # a bad input's one line: exit code 2
            run.life = life
            start = resume_run(run, args, world)  # --resume's checkpoint, config.json, validation before
            bar, bad_steps = progress_bar(start, args, life.writer), 0
            for step in range(start, args.steps):
                rec, batches = grpo_step(step, run, args, score_batch)
                # ---- log and checkpoint: samples.jsonl, metrics.jsonl, the log line, checkpoint.pt ----
                bad_steps = after_step(run, args, step, rec, batches=batches, bar=bar, bad_steps=bad_steps)
                bar.update(1)
            bar.close()
            return finish_run(run, args)  # lora_peft/, g_phi, the plot, validation after training
    finally:
        release_folders(life)


# --------------------------------------------------------------------------------------------------
# The step's parts, in the order grpo_step calls them


def micro_batch_inputs(run, args, step, micro):
    """The micro-batch's B training items (the same on any rank and after a resume; seeds the
    micro-batch's other draws too), its context C = g(x) and its tokenised prompts: (items, ctx,
    ids [B, P], mask [B, P])."""
    distributed.seed_micro_batch(args.seed, step, micro, run.pool)
    n = len(run.train_items)
    picks = rewards.batch_indices(step, micro, args.batch_size, args.grad_accum, n_items=n, seed=args.seed)
    items = [run.train_items[i] for i in picks]
    return (items, *context_and_prompts(run, args, items))


def context_and_prompts(run, args, items):
    """C = g(x) (with the method's training behaviour: hard routing draws its Gumbel expert here)
    and the policy's tokenised prompts. Returns (ctx, ids [B, P], mask [B, P])."""
    questions, answers = [it["question"] for it in items], [it["answer"] for it in items]
    run.method.train()
    with torch.no_grad():
        # answers: read only by oracle experts (a diagnostic)
        ctx = run.method(questions, answers)
    prompts = rewards.policy_prompts(run.tok, questions, ctx.hints, args)
    ids, mask = rollout.encode_prompts(run.tok, prompts, run.device, args.context_split)
    return ctx, ids, mask


def sample_step(run, args, step, micros, inputs):
    """One decode loop for all the step's prompts (at most --rollout-batch micro-batches a loop): a
    GPU's decode step costs about the same for 32 rows as for 256 (H200, 3B shape: 95 vs 101 ms a
    token), so one loop, not --grad-accum, is ~8x cheaper. Each row's uniforms are seeded by its own
    micro-batch, so a completion does not depend on its loop-mates (N processes equal 1). Returns
    [(comp [B*G, T], logp_mu [B*G, T] or None)] per micro-batch, cut as its own loop would have."""
    G = args.group_size
    chunk = args.rollout_batch or len(inputs)  # micro-batches per decode loop
    out = []
    for c in range(0, len(inputs), chunk):
        part = inputs[c:c + chunk]
        ids, mask = rollout.same_width([(i, m) for _, _, i, m in part], run.tok.pad_token_id)
        Cs = [ctx.C for _, ctx, _, _ in part]
        C = None if Cs[0] is None else torch.cat(Cs)                           # (B_all, m, D)
        u = torch.cat([row_uniforms(args, step, micro, 0, n=len(i) * G)
                       for micro, (_, _, i, _) in zip(micros[c:c + chunk], part)]).to(run.device)
        comp, logp_mu = sample_rows(run, args, ids, mask, C=C, uniforms=u)
        start = 0
        for _, _, i, _ in part:  # back into micro-batches
            rows = slice(start, start + len(i) * G)
            start = rows.stop
            out.append(rollout.cut_padding(comp[rows], None if logp_mu is None else logp_mu[rows],
                                           run.eos_ids, run.tok.pad_token_id))
    return out


def row_uniforms(args, step, micro, draw, n):
    """The uniform numbers [n, --max-new-tokens] the sampler of (step, micro-batch, draw) uses,
    from a generator of their own (on the CPU, so every device draws the same)."""
    seed = int(np.random.SeedSequence([args.seed, step, micro, draw, 13]).generate_state(1, np.uint64)[0])
    return torch.rand(n, args.max_new_tokens, generator=torch.Generator().manual_seed(seed))


def sample_rows(run, args, ids, mask, C, uniforms):
    """G completions per prompt [B*G, T], and the sampler's own log-probs [B*G, T] whenever the
    sampler is not the scoring pass: a --rollout-dtype copy, or frozen weights below float32 (on
    a GPU the default bfloat16: the sampler runs LoRA merged into bfloat16 weights, the scoring
    pass unmerged), so that rollout_logp_gap is logged and --tis-cap can correct it."""
    dtype = None if args.rollout_dtype == "float32" else getattr(torch, args.rollout_dtype)
    frozen = run.policy.get_input_embeddings().weight.dtype
    own = dtype is not None or frozen != torch.float32
    out = rollout.sample(run.policy, ids, mask, C, G=args.group_size, max_new_tokens=args.max_new_tokens,
                         temperature=args.temperature, eos_ids=run.eos_ids, pad_id=run.tok.pad_token_id,
                         position=run.position, return_logprobs=own, dtype=dtype, uniforms=uniforms,
                         share=not args.no_shared_prefix)
    return out if own else (out, None)


def score_draw(run, args, items, comp, logp_mu, key, score_batch):
    """The rewards of a draw of B prompts x G (rewards.draw_rewards): {comp [B*G, T], logp_mu [B*G, T] or None,
    r [B*G] (the task's scorer, or the random-reward control's coins seeded by key = (step, micro-batch, draw),
    plus --format-bonus), task_r [B*G] (the task's part alone), counts (the scorer's), texts}."""
    texts = run.tok.batch_decode(comp, skip_special_tokens=True)  # the sampler writes padding after EOS
    task_r, bonus, counts = rewards.draw_rewards(items, texts, args, key=key, score_batch=score_batch)
    task_r, bonus = (torch.tensor(x, dtype=torch.float32, device=run.device) for x in (task_r, bonus))
    return dict(comp=comp, logp_mu=logp_mu, r=task_r + bonus, task_r=task_r, counts=counts, texts=texts)


def draw_and_score(run, args, items, ids, mask, C, key, score_batch):
    """A new draw of B prompts x G (dynamic sampling's re-draws), scored: score_draw's dict."""
    step, micro, draw = key
    u = row_uniforms(args, step, micro, draw, n=len(ids) * args.group_size).to(run.device)
    comp, logp_mu = sample_rows(run, args, ids, mask, C=C, uniforms=u)
    return score_draw(run, args, items, comp, logp_mu=logp_mu, key=key, score_batch=score_batch)


def redraw_flat_groups(run, args, items, ids, mask, ctx, drawn, key, score_batch):
    """--dynamic-sampling N (DAPO): draw the groups whose G rewards are all equal again, up to N
    times; each new draw replaces its group in `drawn`, in place. key = (step, micro-batch, 0)."""
    step, micro, _ = key
    for draw in range(1, args.dynamic_sampling + 1):
        redo = grpo.flat_groups(drawn["r"], args.group_size).nonzero().squeeze(1)  # (k,) prompts
        if len(redo) == 0:
            break
        again = draw_and_score(run, args, [items[i] for i in redo.tolist()], ids[redo], mask=mask[redo],
                               C=None if ctx.C is None else ctx.C[redo], key=(step, micro, draw),
                               score_batch=score_batch)
        replace_groups(drawn, again, redo, args.group_size, pad_id=run.tok.pad_token_id)


def replace_groups(drawn, again, prompts, G, pad_id):
    """Put the groups of `again` (a new draw for `prompts`, [k]) in place of theirs in `drawn`."""
    offsets = torch.arange(G, device=prompts.device)
    rows = (prompts[:, None] * G + offsets).flatten()          # (k*G,) their completions
    for key, fill in (("comp", pad_id), ("logp_mu", 0.0)):
        if drawn[key] is None:
            continue
        T = max(drawn[key].shape[1], again[key].shape[1])    # two draws differ in length: pad
        drawn[key] = torch.nn.functional.pad(drawn[key], (0, T - drawn[key].shape[1]), value=fill)
        new = torch.nn.functional.pad(again[key], (0, T - again[key].shape[1]), value=fill)
        drawn[key][rows] = new
    drawn["r"][rows], drawn["task_r"][rows] = again["r"], again["task_r"]
    for i, row in enumerate(rows.tolist()):
        drawn["texts"][row] = again["texts"][i]
    names = set(drawn["counts"]) | set(again["counts"])
    drawn["counts"] = {k: drawn["counts"].get(k, 0) + again["counts"].get(k, 0) for k in names}


def reference_logprobs(run, args, ids, mask, C, comp, comp_mask):
    """log pi_ref(y_t) [B*G, T] of the completions: LoRA off, and zero tokens (or the anchor) where
    C was."""
    method, policy = run.method, run.policy
    with torch.no_grad(), lora_disabled(policy):
        C0 = None if C is None else empty_context(method, C)
        return rollout.completion_logprobs(policy, ids, mask, C0, completion_ids=comp,
                                           completion_mask=comp_mask, temperature=args.temperature,
                                           position=run.position, share=not args.no_shared_prefix)


def dapo_advantages(batches, G, world, aggregation):
    """--dynamic-sampling: every group keeps its KL term (a flat one has A = 0, so no surrogate),
    and each micro-batch's advantages are scaled by grpo.signal_scale, so that the surrogate
    averages over the step's groups with signal only (grpo.py derives it). The counts are the
    step's, over every process. In place."""
    counts = distributed.gather(world, [(len(b.comp), int(b.signal.sum()) * G)
                                        for b in batches])  # (completions, in groups with signal)
    n_all, n_signal = (sum(c) for c in zip(*counts))
    for b in batches:
        b.adv = b.adv * grpo.signal_scale(b.signal, b.comp_mask, n_signal, n_all, aggregation=aggregation)


def add_channel_forcing(loss, metrics, logp, b, C, run, args):
    """--channel-weight lambda: loss + lambda * grpo.channel_forcing_loss, where each prompt's
    mismatched context is the C of the next prompt of the micro-batch (a cyclic shift: no prompt
    keeps its own). With fewer than two prompts there is no other prompt: the term is 0."""
    if len(C) < 2:
        return loss, {**metrics, "cf_loss": 0.0, "cf_margin": float("nan"), "cf_fraction": 0.0}
    C_mismatched = C.roll(-1, dims=0)                          # (B, m, D) prompt b reads C of b + 1
    logp_mismatched = rollout.completion_logprobs(run.policy, b.ids, b.mask, C_mismatched,
                                                  completion_ids=b.comp,
                                                  completion_mask=b.comp_mask,
                                                  temperature=args.temperature, position=run.position,
                                                  share=not args.no_shared_prefix)
    cf, m = grpo.channel_forcing_loss(logp, logp_mismatched, b.adv, b.comp_mask)
    return loss + args.channel_weight * cf, {**metrics, **m}


def main(argv=None, score_batch=None):
    """Run training. `score_batch(items, completions) -> (rewards, counts)` replaces the task's
    scorer (a fork's own reward, or the tests' synthetic one); by default rewards.score_batch."""
    args = parse_args(argv)
    expandable_segments(args)  # before any CUDA work: the allocator reads its settings once
    if args.deterministic:  # before any CUDA work: cuBLAS reads its workspace setting once
        deterministic_kernels()
    world = distributed.world_from_env()  # torchrun's processes, or one
    if world.size > args.grad_accum:
        fail(f"torchrun --nproc_per_node {world.size} is more processes than --grad-accum "
             f"{args.grad_accum} micro-batches per step: each process needs one; start fewer "
             "processes or raise --grad-accum")
    if args.precompute_states:  # --expert-cache filled for every prompt the run reads, then exit
        claim_expert_cache(args.expert_cache)  # checked before any model loads, as a run's
        with writes_or_fail(args):  # a full disk: one line, exit code 4
            return precompute_states(build_run(args, pick_device(args.device)), args)
    if args.plan:  # the memory plan: nothing is loaded, allocated or written
        from support.harness import plan
        return plan.main(args, world)
    return train(args, world, score_batch or rewards.score_batch)


if __name__ == "__main__":
    main()
