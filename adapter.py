"""
The Perceiver adapter g_phi: pooled expert hidden states -> m context tokens C for the policy.

Paper §3 (equation numbers are the paper's):
    z_i  = h_i W_i                                   (6)  per-expert projection, d_i -> d
    V    = (z_1, ..., z_n)                           (7)  [n, d]
    Q_lat in R^{m x d}                               (8)  trainable latent queries
    Q = Q_lat W_Q,  K = V W_K,  V' = V W_V           (9)
    C'   = FFN(Q_lat + softmax(Q K^T / sqrt(d)) V')  (10)
    C    = C' W_out + b_out                          (11) near-zero at init
    FFN(x) = tanh(W2 tanh(W1 x)),  d -> d/2 -> d     (16)
    A    = softmax(Q K^T / sqrt(d_head)), mean over heads: [m, n], the observable of §4.3 (Eq. 15)

How C reaches the policy (Eq. 3, pi(y | [x || C])) is rollout.policy_inputs: after the prompt (Eq.
3, the default) or in front of it, behind its first token (prefix tuning, [x_0 || C || x_1..]), with
the attention mask and position ids that rollout and scoring must share (positions that differ
between the two are a small error for RoPE models, a large one for GPT-2's learned positions).

Deviations / choices the paper leaves open:
  1. Attention has 8 heads (paper §4.1) and scales each head by sqrt(d / heads), the standard
     multi-head form; Eq. 9–10 are written for one head. There is no output projection after the
     heads (Eq. 10 has none), unlike nn.MultiheadAttention; tests check parity with
     nn.MultiheadAttention given an identity output projection.
  2. "Near-zero" W_out is exactly zero (b_out too), so C = 0 and step 0 is the reference policy bit
     for bit (tests/test_adapter.py). Small random values are not a no-op: the policy's RMSNorm
     divides by sqrt(mean(x^2) + eps), which amplifies a tiny token by up to 1/sqrt(eps), layer
     after layer. Measured on the tiny policy, max |log-prob - reference log-prob| for W_out ~ N(0,
     std^2):
         std     1e-6     1e-7     1e-8     1e-9     0
         after   4.1e-3   4.1e-4   3.9e-5   1.9e-6   0
         before  6.5e-1   6.1e-1   1.4e-1   2.0e-3   0
     (measured with C before the whole prompt, where it attended only to itself, so nothing diluted
     the amplified tokens; "before" now keeps the first prompt token in front, see
     rollout.policy_inputs.) The gradient still reaches W_out at step 0 (dC/dW_out = C'), like
     LoRA's B = 0; the rest of g_phi gets gradient from the second step on. `out_init_std` restores
     a random near-zero init.
  3. W_i have no bias (Eq. 6 has none); W_Q, W_K, W_V, W1, W2 have none either; W_out has b_out.
  4. Zero tokens are a no-op only at exactly 0 (deviation 2): the first thing a pre-norm policy does
     at C's positions is RMSNorm, which gives any vector much longer than sqrt(eps) (0.003 for eps =
     1e-5) the length of a real token. One Adam step puts C there, so step 1 switches on m
     full-strength tokens of an arbitrary direction. `--context-anchor newline` (not the paper's)
     starts every token at the policy's embedding of "\n" instead, C = a + C' W_out + b_out: a real
     token that the policy nearly ignores, around which a small change of C is a small change of the
     policy. Measured (experiments/scale_probe.py, the untrained pocket policy, 8 tokens, 32 items):
     the gold answer's log-prob moves from C = 0's by 0.48 nats at rms(C) = 0.001, and from the
     anchor's by 0.0005 at rms 0.001 and 0.005 at rms 0.01; the anchor alone moves it by 0.07 from
     the prompt without any C. The reference policy and the "C = 0" arm of evaluation then read the
     anchor tokens (empty_context).

Try it on CPU:  python adapter.py   (prints C and A for random expert states)
"""
import torch
import torch.nn as nn
import torch.nn.functional as F


class FFN(nn.Module):
    """Eq. 16: tanh(W2 tanh(W1 x)), a d -> d/2 -> d bottleneck. Shared with baselines.py."""

    def __init__(self, d):
        super().__init__()
        self.w1 = nn.Linear(d, d // 2, bias=False)
        self.w2 = nn.Linear(d // 2, d, bias=False)

    def forward(self, x):
        return torch.tanh(self.w2(torch.tanh(self.w1(x))))


class OutputProjection(nn.Linear):
    """Eq. 11: C = C' W_out + b_out, initialised at zero so C starts as a no-op (deviation 2).

    With an anchor a (`--context-anchor newline`, not in the paper): C = a + C' W_out + b_out,
    every context token starting as the same fixed vector a, the policy's own embedding of "\n"
    (deviation 4)."""

    def __init__(self, d, out_dim, init_std=0.0):
        super().__init__(d, out_dim, bias=True)
        nn.init.normal_(self.weight, std=init_std)
        nn.init.zeros_(self.bias)
        # (out_dim,) once set_context_anchor gives one; then in checkpoints
        self.register_buffer("anchor", None)

    def forward(self, x):
        y = super().forward(x)
        return y if self.anchor is None else y + self.anchor.to(y.dtype)


def set_context_anchor(method, vector):
    """Make every context token of `method` start from `vector` [D] instead of 0. Raises
    ValueError if the method has no output projection (single, output_collab, conductor, rlae:
    nothing to anchor)."""
    outs = [m for m in method.modules() if isinstance(m, OutputProjection)]
    if not outs:
        raise ValueError("--context-anchor: this --method has no context tokens to anchor")
    for m in outs:
        m.anchor = vector.detach().float().clone().to(m.weight.device)


def anchor_context(method, policy, tok, args):
    """--context-anchor newline (deviation 4): every context token of `method` starts at the
    policy's embedding of "\n" instead of at 0. Call it before a checkpoint of g_phi is loaded
    (the anchor is in it)."""
    # configs written before the flag: zero
    if getattr(args, "context_anchor", "zero") == "newline":
        newline = tok.encode("\n", add_special_tokens=False)[-1]
        set_context_anchor(method, policy.get_input_embeddings().weight[newline])


def empty_context(method, C):
    """What stands where C was for the reference policy (Eq. 4) and in the C = 0 arm of
    evaluation: zero tokens (the paper), or the anchor tokens when the method has one (C with
    g_phi's own part at 0)."""
    anchor = next((m.anchor for m in method.modules() if isinstance(m, OutputProjection)
                   and m.anchor is not None), None)
    return torch.zeros_like(C) if anchor is None else anchor.to(C.dtype).expand_as(C).clone()


class StateNorm(nn.Module):
    """Per-expert, per-dimension standardisation of the pooled states, h -> (h - mean) / std,
    with statistics fitted once on a sample of training prompts (`--state-norm standardize`; not
    in the paper) and kept as buffers, so a checkpoint carries them and evaluation uses the same.
    Why: a decoder's final states have a few huge dimensions that are the same for every prompt
    (SmolLM2-135M: mean |h| 42.5, 16.1, 10.9 on its top three vs a median of 0.67), so the part
    that varies from prompt to prompt is ~1 % of the energy W_i sees. Until fitted it is the
    identity. A std below 1 % of the median std is floored there, so a dimension that was
    constant on the sample cannot blow up on a new prompt."""

    def __init__(self, dims):
        super().__init__()
        for i, d in enumerate(dims):
            self.register_buffer(f"mean{i}", torch.zeros(d))
            self.register_buffer(f"std{i}", torch.ones(d))

    @torch.no_grad()
    def fit(self, states):
        for i, h in enumerate(states):                                    # h (N, d_i)
            std = h.float().std(0)
            getattr(self, f"mean{i}").copy_(h.float().mean(0))
            getattr(self, f"std{i}").copy_(std.clamp_min(1e-2 * std.median().clamp_min(1e-12)))

    def forward(self, states):
        return [(h.float() - getattr(self, f"mean{i}")) / getattr(self, f"std{i}")
                for i, h in enumerate(states)]


class PerceiverAdapter(nn.Module):
    def __init__(self, expert_dims, out_dim, latent_dim=512, num_latents=8, num_heads=8,
                 out_init_std=0.0):
        super().__init__()
        if latent_dim % num_heads:
            raise ValueError(f"--latent-dim {latent_dim} must be divisible by --num-heads "
                             f"{num_heads}")
        d = latent_dim
        self.num_heads = num_heads
        # W_i, Eq. 6
        self.proj = nn.ModuleList([nn.Linear(d_i, d, bias=False) for d_i in expert_dims])
        self.latents = nn.Parameter(torch.randn(num_latents, d) * d ** -0.5)  # Q_lat, Eq. 8
        self.w_q = nn.Linear(d, d, bias=False)                                           # Eq. 9
        self.w_k = nn.Linear(d, d, bias=False)
        self.w_v = nn.Linear(d, d, bias=False)
        self.ffn = FFN(d)                                                                # Eq. 16
        self.out = OutputProjection(d, out_dim, out_init_std)                            # Eq. 11

    def forward(self, hidden_states, return_heads=False):
        """hidden_states: list of n tensors [B, d_i]. Returns C [B, m, out_dim] and A [B, m, n]
        (the mean over heads); with return_heads also the per-head attention [B, heads, m, n]."""
        dtype = self.latents.dtype
        # (B, n, d)
        V = torch.stack([W(h.to(dtype)) for W, h in zip(self.proj, hidden_states)], dim=1)
        B, n, d = V.shape
        m, nh, hs = self.latents.shape[0], self.num_heads, d // self.num_heads
        Q = self.w_q(self.latents).view(m, nh, hs).transpose(0, 1)  # (nh, m, hs), same for all B
        K = self.w_k(V).view(B, n, nh, hs).transpose(1, 2)                    # (B, nh, n, hs)
        Vp = self.w_v(V).view(B, n, nh, hs).transpose(1, 2)                   # (B, nh, n, hs)
        att = F.softmax(Q @ K.transpose(-2, -1) / hs ** 0.5, dim=-1)          # (B, nh, m, n)
        mixed = (att @ Vp).transpose(1, 2).reshape(B, m, d)  # (B, m, d), heads concatenated
        C_prime = self.ffn(self.latents + mixed)  # Eq. 10, residual on Q_lat
        C, A = self.out(C_prime), att.mean(dim=1)  # C (B, m, out), A (B, m, n)
        return (C, A, att) if return_heads else (C, A)


def routing_stats(A):
    """Eq. 15 from A [B, m, n]: entropy H (mean over latents and batch) and utilisation u_i [n]."""
    return entropy(A).mean().item(), A.mean(dim=(0, 1)).tolist()


@torch.no_grad()
def context_probes(ctxs, embed_rms):
    """What C does, from the outputs of g of one training step (a list of dicts, one per
    micro-batch, baselines.Context): rms(C) against the policy's token embeddings' rms, how much of C depends on the
    prompt, the same for each expert's pooled states, and the routing entropy and utilisation
    (Eq. 15), per attention head too. Costs ~1 ms."""
    rec = {}
    C = [c.C for c in ctxs if c.C is not None]
    if C:
        C = torch.cat(C).float()                                               # (prompts, m, D)
        rec.update(c_rms=C.pow(2).mean().sqrt().item(), embed_rms=embed_rms,
                   c_varying=varying_fraction(C))
    states = [c.states for c in ctxs if isinstance(c.states, list)]
    if states:  # one list of n [B, d_i] per micro-batch
        rec["state_varying"] = [varying_fraction(torch.cat(h)) for h in zip(*states)]
    A = [c.A for c in ctxs if c.A is not None]
    if A:
        rec["entropy"], rec["utilization"] = routing_stats(torch.cat(A))
    heads = [c.A_heads for c in ctxs if c.A_heads is not None]
    if heads:
        rec["entropy_heads"] = entropy(torch.cat(heads)).mean(dim=(0, 2)).tolist()  # (heads,)
    return rec


def varying_fraction(X):
    """Share of the energy of X [N, ...] that varies across its N rows: sum Var_N(X) / sum
    mean_N(X^2), in [0, 1]. 0 when every row is the same (C is then a soft prompt: it carries
    nothing about the prompt), NaN when X is all zeros (C at step 1, W_out = 0)."""
    X = X.flatten(1).double()
    return (X.var(0, unbiased=False).sum() / X.pow(2).mean(0).sum()).item()


def entropy(A):
    """-sum_i A_i log A_i over the last (expert) axis: [..., n] -> [...]. For per-head routing
    entropy pass the per-head attention [B, heads, m, n] and average over (0, 2). The head
    average of A hides heads that route sharply to different experts (its entropy is higher than
    the mean of the heads' entropies)."""
    return -(A * A.clamp_min(1e-12).log()).sum(-1)


if __name__ == "__main__":
    torch.manual_seed(0)
    adapter = PerceiverAdapter(expert_dims=[640, 576, 384], out_dim=576)
    h = [torch.randn(2, d) for d in (640, 576, 384)]
    C, A = adapter(h)
    H, u = routing_stats(A)
    print(f"C {tuple(C.shape)} rms {C.pow(2).mean().sqrt():.2e} | A {tuple(A.shape)} | "
          f"H {H:.3f} | u {u}")
    print(f"trainable parameters: {sum(p.numel() for p in adapter.parameters()):,}")
