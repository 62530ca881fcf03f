"""
GRPO by hand (DeepSeekMath, Shao et al. 2024) for the paper's Eq. 4: pure functions, tensors in, (loss, metrics)
out. Per prompt, G completions o_1..o_G with rewards r_1..r_G; for completion i and its token t:

    A_i    = (r_i - mean(r)) / (std(r) + eps)                        group_advantages (Dr. GRPO: scale=False)
    rho_it = exp(logp - logp_old)                                    the ratio to the sampling policy
    S_it   = min(rho_it A_i, clip(rho_it, 1 - eps_clip, 1 + eps_clip) A_i)
    KL_it  = exp(logp_ref - logp) - (logp_ref - logp) - 1            k3, >= 0; pi_ref = the initial policy with
                                                                     zero context tokens (paper section 4.1)
    L      = -1/G sum_i 1/|o_i| sum_t (S_it - beta KL_it)            grpo_loss, aggregation "sequence"
    L      = -1/(sum_i |o_i|) sum_i sum_t (S_it - beta KL_it)        aggregation "token" (DAPO), per micro-batch

beta = 0.04, eps_clip = 0.2, mu = 1 inner epoch (the caller passes logp_old = logp.detach(): the ratio is exactly 1,
the clip never fires and the loss is about 0 while its gradient A * grad(logp) is not). logp = token_logprobs:
log softmax(logits / T) at the chosen tokens, in float32. Where the policy runs (sampling, the scoring pass that
produces those logits) is rollout.py; head_logprobs runs the LM head one completion at a time for it.

Deviations and choices the paper leaves open (each derived beside the function it concerns):
1. Eq. 4 weights the KL by beta^-1 but calls beta = 0.04 "the KL coefficient": we weight it by beta (25 x KL would
   swamp rewards in [0, 1]).
2. Eq. 4's KL is a sequence log-ratio; we estimate it per token with k3 (unbiased, non-negative, lower variance).
3. The loss aggregation is not named: "sequence" (GRPO's) by default, "token" offered. Both sums run over one
   micro-batch and train.py averages the --grad-accum micro-batches' losses. For "sequence" that is the mean over
   the step's completions (every micro-batch holds B*G); "token" is a token mean per micro-batch, not DAPO's one
   mean over the step's tokens: a token of a micro-batch with fewer tokens weighs more (tests/test_train.py).
4. Empty completions and flat groups are handled exactly (grpo_loss, group_advantages).
5. Off by default, not the paper's: truncated_is_weights (--tis-cap), channel_forcing_loss (--channel-weight),
   DAPO's dynamic sampling with every group's KL kept (signal_scale, --dynamic-sampling).

Try it on CPU:  python -m pytest tests/test_grpo.py -q
"""
import torch

# ----------------------------------------------------------------------------- advantage

def group_advantages(rewards, group_size, scale=True, eps=1e-6):
    """rewards [B*G], groups = consecutive blocks of G -> advantages [B*G] (float32).

    A group whose rewards are all equal gets advantage exactly 0 by an explicit test, not by trusting
    (r - mean) to round to 0: in float32 eight rewards of 0.6 give r - mean = 6e-8 and std = 6e-8, so
    (r - mean) / (std + eps) = +0.056 for every member, a spurious push that is not even mean-zero.
    Such a group gives no signal; train.py logs the fraction (zero_std_fraction)."""
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [B*G], got shape {tuple(rewards.shape)}")
    if group_size < 2:
        raise ValueError(f"group_size (--group-size) must be >= 2 for a group baseline, got "
                         f"{group_size}")
    if rewards.numel() == 0 or rewards.numel() % group_size != 0:
        raise ValueError(f"len(rewards) = {rewards.numel()} is not a positive multiple of "
                         f"group_size = {group_size}")
    r = rewards.detach().float().view(-1, group_size)          # (B, G)
    if not torch.isfinite(r).all():
        raise ValueError("rewards contain NaN or inf")
    adv = r - r.mean(dim=1, keepdim=True)                      # (B, G)
    if scale:
        adv = adv / (r.std(dim=1, keepdim=True) + eps)  # torch.std: unbiased, divides by G - 1
    equal = (r == r[:, :1]).all(dim=1, keepdim=True)  # (B, 1) groups with no reward variance
    adv = torch.where(equal, torch.zeros_like(adv), adv)       # exactly 0, not "0 up to rounding"
    return adv.view(-1)                                        # (B*G,)

def flat_groups(r, G):
    """[B*G] rewards -> [B] bool: the groups whose G rewards are all equal (advantage 0: no
    gradient)."""
    groups = r.view(-1, G)
    return (groups == groups[:, :1]).all(-1)


def signal_scale(signal, comp_mask, n_signal, n_all, aggregation="sequence"):
    """The factor c >= 0 on one micro-batch's advantages that makes its surrogate average over the
    groups with reward variance only (DAPO), while its KL term keeps every completion.

    Why the KL stays on flat groups. With mu = 1 (ratio 1, no clip) the per-token gradient of L is,
    with w_i the aggregation's weight of completion i (1 / (N |o_i|) for "sequence"):

        dL/dlogp_it = -w_i A_i  +  beta w_i (1 - exp(logp_ref_it - logp_it))
                       surrogate   KL: d/dx [exp(r - x) - (r - x) - 1] = 1 - exp(r - x)

    A flat group has A_i = 0, so its surrogate term is 0, but its KL term pulls logp toward
    logp_ref whatever the rewards. Leaving flat groups out with their KL (what --dynamic-sampling
    did before) removed that pull: a policy that stopped writing answers got reward 0 in every
    group, no loss remained, and nothing brought it back. So every group is trained, and only the
    surrogate's denominator follows DAPO, counting the completions in groups with signal S:

        L = -1/N_S sum_{i in S} 1/|o_i| sum_t S_it  +  beta/N sum_i 1/|o_i| sum_t KL_it   ("sequence")

    grpo_loss gives this unchanged when a micro-batch's advantages are multiplied by c: the
    surrogate is linear in A for c > 0 (min(rho c A, clip(rho) c A) = c min(rho A, clip(rho) A)) and
    the KL does not see A. With no flat group c = 1 exactly; with no group with signal L = beta KL.

    signal    [B] bool: the micro-batch's groups whose G rewards are not all equal
    comp_mask [B*G, T] bool: its completions' masks
    n_signal, n_all: completions in groups with signal, and all completions, of the whole step
                     (every micro-batch of every process)

    Each micro-batch's loss is weighted N / n_all (train.py: 1 / --grad-accum) and divides by U,
    its aggregation's denominator (N completions for "sequence", its tokens for "token"); DAPO's
    surrogate weighs it N_S / n_signal and divides by U_S (the same counts over its groups with
    signal). The ratio of the two:

        c = (n_all / n_signal) * (N_S / N) * (U / U_S)     ("sequence": n_all / n_signal)

    and c = 0 when the micro-batch has no group with signal (its advantages are all 0)."""
    G = comp_mask.shape[0] // max(signal.numel(), 1)
    if signal.dim() != 1 or signal.numel() * G != comp_mask.shape[0]:
        raise ValueError(f"signal [B] must have one entry per group of comp_mask [B*G, T], got "
                         f"{tuple(signal.shape)} and {tuple(comp_mask.shape)}")
    rows = signal.repeat_interleave(G)                         # (B*G,) in groups with signal
    n_sig = int(rows.sum())                                    # N_S
    if n_sig == 0 or n_signal == 0:
        return 0.0
    if aggregation == "sequence":                              # U = N, U_S = N_S
        return n_all / n_signal
    units, units_sig = int(comp_mask.sum()), int(comp_mask[rows].sum())  # U, U_S in tokens
    return (n_all / n_signal) * (n_sig / len(rows)) * (units / units_sig) if units_sig else 0.0

# ----------------------------------------------------------------------------- loss

def _aggregate(x, mask, aggregation):
    """x [N, T] per-token values -> scalar. The only place the mask weights a value. A completion with
    zero tokens has its count clamped to 1: it adds 0 and still counts in the denominator N (the
    sampled completions), so the loss is finite and its scale fixed."""
    x = torch.where(mask, x, torch.zeros_like(x))              # (N, T) padded positions -> 0
    if aggregation == "sequence":
        n_tok = mask.sum(dim=1).clamp(min=1)  # (N,) tokens per completion, 0 -> 1
        # mean over each completion, then over the N
        return (x.sum(dim=1) / n_tok).sum() / mask.shape[0]
    return x.sum() / mask.sum().clamp(min=1)  # "token": all tokens / number of tokens


def grpo_loss(logp, logp_old, logp_ref, advantages, mask, clip_eps=0.2, beta=0.04,
              aggregation="sequence", is_weight=None):
    """
    logp      [N, T] log-probs of the completion tokens under pi_theta (carries the gradient)
    logp_old  [N, T] the same under the sampling policy (stored at rollout; no gradient)
    logp_ref  [N, T] the same under the frozen reference pi_ref (no gradient)
    advantages [N]   one per completion, e.g. from group_advantages
    mask      [N, T] bool, True on completion tokens (see completion_mask)
    is_weight [N, T] or None: per-token weights on the surrogate (truncated_is_weights), when the
    tokens were
              drawn by a sampler that is not exactly pi_old (a bfloat16 copy of it); the KL term is
              unweighted
    Returns (loss: scalar tensor to minimise, metrics: dict of python floats). metrics' kl uses the
    loss's aggregation over every completion passed in; clip_fraction and ratio_mean are means over
    all masked tokens. Padding is safe: positions outside mask contribute nothing, even where their
    logp is -inf or NaN.
    """
    if aggregation not in ("sequence", "token"):
        raise ValueError(f"aggregation must be 'sequence' or 'token', got {aggregation!r}")
    if mask.dtype != torch.bool:
        raise ValueError(f"mask must be a bool tensor, got {mask.dtype}")
    if mask.dim() != 2 or any(t.shape != mask.shape for t in (logp, logp_old, logp_ref)):
        raise ValueError(f"logp, logp_old, logp_ref and mask must share one [N, T] shape, got "
                         f"{[tuple(t.shape) for t in (logp, logp_old, logp_ref, mask)]}")
    if advantages.shape != mask.shape[:1]:
        raise ValueError(f"advantages must be [N] = [{mask.shape[0]}], got "
                         f"{tuple(advantages.shape)}")

    # Make padding safe first: values there may be -inf or NaN, and NaN * 0 = NaN. torch.where
    # passes zero gradient to the branch it does not select, so padded positions get gradient
    # exactly 0.
    zero = torch.zeros_like(logp)
    logp = torch.where(mask, logp, zero)                               # (N, T)
    logp_old = torch.where(mask, logp_old.detach(), zero)              # (N, T)
    logp_ref = torch.where(mask, logp_ref.detach(), zero)              # (N, T)
    adv = advantages.detach().to(logp.dtype).unsqueeze(1)              # (N, 1)

    ratio = torch.exp(logp - logp_old)  # (N, T) exactly 1 when mu = 1
    surr_unclipped = ratio * adv                                       # (N, T)
    surr_clipped = torch.clamp(ratio, 1 - clip_eps, 1 + clip_eps) * adv  # (N, T)
    surr = torch.min(surr_unclipped, surr_clipped)                     # (N, T) pessimistic bound
    if is_weight is not None:
        surr = is_weight.detach().to(surr.dtype) * surr  # (N, T) sampler -> pi_old correction
    log_ratio_ref = logp_ref - logp                                    # (N, T)
    kl = torch.exp(log_ratio_ref) - log_ratio_ref - 1  # (N, T) k3, >= 0, 0 where equal
    per_token_loss = -(surr - beta * kl)                               # (N, T)
    loss = _aggregate(per_token_loss, mask, aggregation)               # scalar

    with torch.no_grad():
        n_tok = mask.sum().clamp(min=1)  # all completion tokens, 0 -> 1
        clipped = (surr_clipped < surr_unclipped) & mask  # (N, T) clipped branch chosen and differs
        metrics = {
            "loss": loss.item(),
            "pg_loss": _aggregate(-surr, mask, aggregation).item(),    # the surrogate part alone
            "kl": _aggregate(kl, mask, aggregation).item(),  # same aggregation as the loss
            "clip_fraction": (clipped.sum() / n_tok).item(),  # token mean over masked tokens
            "ratio_mean": (torch.where(mask, ratio, zero).sum() / n_tok).item(),
        }
    return loss, metrics


def channel_forcing_loss(logp, logp_mismatched, advantages, mask):
    """
    The channel-forcing term (not in the paper; train.py --channel-weight, off by default). GRPO
    alone rewards a completion whatever made it likely; once the policy can solve the task by
    itself it has no reason to read C, and the paired evaluations show with C = shuffled C. This
    term asks for that difference directly.

    For completion i of prompt x_i, let l_i be its mean per-token log-prob with its own context
    C(x_i), and l'_i the same completion's with the context of another prompt of the batch, C(x_j),
    j != i (the caller picks x_j; train.py takes the next prompt of the micro-batch). Read
    sigma(l_i - l'_i) as the probability that a two-way classifier picks the true context as the
    one that explains o_i: InfoNCE with one negative, the contrastive idea of latent-communication
    work (true against mismatched latents). On the completions worth reinforcing,
    P = {i : A_i > 0}, minimise its negative log-likelihood:

        L_cf = 1/|P| sum_{i in P} -log sigma(l_i - l'_i)
             = 1/|P| sum_{i in P} softplus(l'_i - l_i)                    (L_cf = 0 if P is empty)
        dL_cf/dl_i = -sigma(l'_i - l_i) / |P|,    dL_cf/dl'_i = +sigma(l'_i - l_i) / |P|

    and the training loss becomes L_GRPO + lambda * L_cf. Why this shape: L_cf >= 0, each
    completion's gradient is bounded by 1/|P| and fades once the true C explains o_i much better
    than the mismatched one, whereas a raw difference l_i - l'_i could be raised without end by
    making the mismatched context absurd. Gradient reaches C(x_i) through l_i and C(x_j) through
    l'_i, and the policy's weights through both. Only A_i > 0: a completion worse than its group
    need not be explained by its own C. lambda = 0 is plain GRPO: the caller then skips the
    mismatched pass altogether (tests/test_collaboration.py checks it bit for bit).

    logp, logp_mismatched [N, T]  per-token log-probs of the same completions (both with gradient)
    advantages [N]; mask [N, T] bool.
    Returns (loss, metrics): cf_loss, cf_margin = mean of l_i - l'_i over P, cf_fraction = |P| / N.
    """
    shapes = [t.shape for t in (logp, logp_mismatched)]
    if mask.dtype != torch.bool or mask.dim() != 2 or any(sh != mask.shape for sh in shapes):
        raise ValueError(f"logp, logp_mismatched [N, T] and a bool mask of that shape, got "
                         f"{[tuple(sh) for sh in shapes]}, mask {mask.dtype} {tuple(mask.shape)}")
    n_tok = mask.sum(dim=1).clamp(min=1)                                   # (N,) 0 -> 1
    zero = torch.zeros_like(logp)
    l_true = torch.where(mask, logp, zero).sum(dim=1) / n_tok              # (N,) l_i
    l_mis = torch.where(mask, logp_mismatched, zero).sum(dim=1) / n_tok    # (N,) l'_i
    pos_mask = advantages.detach() > 0                                     # (N,) P
    per_completion = torch.nn.functional.softplus(l_mis - l_true)          # (N,) -log sigma(l - l')
    per_completion = torch.where(pos_mask, per_completion, torch.zeros_like(per_completion))
    loss = per_completion.sum() / pos_mask.sum().clamp(min=1)
    with torch.no_grad():
        margin = (l_true - l_mis)[pos_mask].mean().item() if pos_mask.any() else float("nan")
        metrics = {"cf_loss": loss.item(), "cf_margin": margin,
                   "cf_fraction": pos_mask.float().mean().item()}
    return loss, metrics


def truncated_is_weights(logp_old, logp_sampler, mask, cap=2.0):
    """Truncated importance sampling (TIS; Yao et al. 2025, "Your efficient RL framework secretly
    brings you off-policy RL training"). The tokens were drawn from mu (the rollout's bfloat16 copy
    of the policy), but the surrogate's expectation is over pi_old (the float32 scoring pass of the
    same weights). Per token,

        w_t = min(pi_old(y_t) / mu(y_t), cap) = min(exp(logp_old - logp_sampler), cap)

    reweights each token toward pi_old; the cap bounds the variance where mu gave a token far
    less mass than pi_old does (truncation trades that variance for a small bias). [N, T] in, [N,
    T] out, 1 on padding."""
    if cap <= 0:
        raise ValueError(f"the importance-weight cap must be > 0, got {cap}")
    log_w = torch.where(mask, logp_old.detach() - logp_sampler.detach(), torch.zeros_like(logp_old))
    return torch.exp(log_w).clamp(max=cap)                              # (N, T)

# ----------------------------------------------------------------------------- masks and log-probs

def completion_mask(completion_ids, eos_token_id):
    """completion_ids [N, T] -> bool [N, T]: True up to and including the first EOS, False after
    it. eos_token_id: an int or a list of ints (several EOS ids). Never pass pad_token_id: when
    pad == eos a pad-derived mask drops the EOS itself and the policy never learns to stop."""
    if completion_ids.dim() != 2:
        raise ValueError(f"completion_ids must be [N, T], got shape {tuple(completion_ids.shape)}")
    eos_ids = [eos_token_id] if isinstance(eos_token_id, int) else eos_token_id
    if (not isinstance(eos_ids, (list, tuple)) or not eos_ids
            or not all(isinstance(e, int) and not isinstance(e, bool) for e in eos_ids)):
        raise ValueError(f"eos_token_id must be an int or a non-empty list of ints, got "
                         f"{eos_token_id!r}")
    # (N, T)
    is_eos = torch.isin(completion_ids, torch.tensor(eos_ids, device=completion_ids.device))
    # (N, T) EOS strictly before position t
    eos_before = is_eos.long().cumsum(dim=1) - is_eos.long()
    return eos_before == 0                                     # no EOS -> all True


# ----------------------------------------------------------------------------- log-probs


def token_logprobs(logits, tokens, temperature=1.0, allowed_mask=None):
    """logits [N, T, V] (any float dtype), tokens [N, T] -> log softmax(logits / temperature) at
    tokens, float32 [N, T]. Align first: logits[:, t] must be the distribution that produced
    tokens[:, t] (for a prompt of length P, completion tokens ids[:, P:] are scored by logits[:,
    P-1:-1]). Temperature must be the sampling temperature, or logp_old and logp describe a
    different policy.

    log softmax(x)_k = x_k - logsumexp(x): gather one logit and subtract the row's logsumexp, so
    no [T, V] log_softmax tensor is written. Going one completion at a time bounds the float32
    copy of the logits to one [T, V] row: under torch.no_grad (the logp_ref pass) that is the
    peak extra memory; with gradient, autograd keeps each row's float32 logits for the backward
    pass, as log_softmax would.

    allowed_mask [N, T, V] bool: only those tokens could be drawn (constrained decoding), so the
    distribution is softmax over them: x_k - logsumexp_{j allowed} x_j, the others set to -inf."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if logits.dim() != 3 or logits.shape[:2] != tokens.shape:
        raise ValueError(f"need logits [N, T, V] and tokens [N, T], "
                         f"got {tuple(logits.shape)} and {tuple(tokens.shape)}")
    rows = []
    for n, (row_logits, row_tokens) in enumerate(zip(logits, tokens)):  # (T, V), (T,)
        x = row_logits.float()  # (T, V) float32: bf16 softmax loses ~1e-2
        if temperature != 1:  # x / 1 is x: no copy for logsumexp to keep for the backward pass
            x = x / temperature
        if allowed_mask is not None:
            x = x.masked_fill(~allowed_mask[n], -torch.inf)
        picked = x.gather(-1, row_tokens.unsqueeze(-1)).squeeze(-1)  # (T,)
        rows.append(picked - torch.logsumexp(x, dim=-1))      # (T,)
    # (N, T) fp32
    return torch.stack(rows) if rows else logits.new_zeros(tokens.shape, dtype=torch.float32)


def head_logprobs(head, h, tokens, temperature=1.0, allowed_mask=None):
    """token_logprobs(head(h), tokens), h [N, T, D] -> float32 [N, T], one completion at a time: its
    logits [T, V] exist only while its row is computed, and with gradient they are not kept for
    the backward pass but computed again there (non-reentrant torch.utils.checkpoint: the same
    kernels on the same inputs; only h, which the model's graph holds anyway, is kept). Today's
    path held the head's [N, T, V] output, a copy of it and float32 rows for the backward pass: on
    the default team (N 32, T 128, V 151,936) ~4.6 GiB; here one row's, ~0.2 GiB. Exact: each
    row's logits are rows of the same matmul (tests/test_memory.py compares values and gradients
    with token_logprobs over the whole head output and with the model's own logits)."""
    from torch.utils.checkpoint import checkpoint
    rows = []
    for n in range(h.shape[0]):
        allowed = None if allowed_mask is None else allowed_mask[n:n + 1]
        row = lambda x, n=n, allowed=allowed: token_logprobs(head(x), tokens[n:n + 1], temperature, allowed)  # noqa: E731
        grad = torch.is_grad_enabled() and h.requires_grad
        rows.append(checkpoint(row, h[n:n + 1], use_reentrant=False) if grad else row(h[n:n + 1]))
    return torch.cat(rows) if rows else h.new_zeros(tokens.shape, dtype=torch.float32)    # (N, T)
