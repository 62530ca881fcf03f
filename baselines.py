"""
Every way to build the context g(x) for the same policy, side by side: the paper's method, its
baselines (§4.1) and three controls that tell the experts apart from the trainable interface.

Every method is a function  build(team, out_dim, args, device, dtype) -> nn.Module  whose forward
maps (questions, answers=None, reuse=None) to a Context (below: C, A, hints, and what the loss pass
reads again), and whose attribute `context_tokens` is m, the number of context tokens C holds per
prompt (0 when C is None; support/harness/plan.py reads it). Each builder declares what it is, `build.kind =
Kind(...)` (below: context tokens or none, whose experts it reads, ...), which the flag checks ask
before any model loads. `--method NAME` picks one from METHODS; only what a method returns differs,
the GRPO loop is shared. `answers` are the gold answers, read only by oracle experts (a diagnostic,
experts.py). `reuse` is the rollout's output for the same questions: the loss
pass passes it back so that the gradient is taken under the C the completions were sampled with
(same pooled states, same routing draw).

  ours           Eq. 6–11: pooled expert states -> PerceiverAdapter (adapter.py) -> C.
  single         no experts, no context tokens: plain single-model RLVR.
  output_collab  Eq. 12  g(x) = tau_pi([decode_i(LM_i(tau_i(x)))]_i): each expert writes a hint
                 (greedy, the same 128-token budget, its own chat template); the hints go verbatim
                 into an "[Expert Hints]" block in the policy's prompt. No trainable parameters.
  hard_routing   Eq. 13  g(x) = FFN(sum_i R_i(E_T(x)) W_i pool(LM_i(tau_i(x)))): a frozen sentence
                 encoder E_T (all-MiniLM-L6-v2) embeds x, a linear router head gives expert logits,
                 R is a straight-through Gumbel-softmax one-hot in training and the argmax at
                 evaluation; only the chosen expert runs; one memory token.
  no_xattn       Eq. 14  g(x) = FFN(V): the FFN on the n projected expert states, no latent queries
                 and no cross-attention; n context tokens.

Controls (not in the paper; C2C, a system that fuses a frozen model's KV cache into another through
a trained fuser, found that most of its gain came from the trainable interface, not from the other
model: its receiver fine-tuned alone scored 36.8 on MMLU, fused with *itself* 42.2, with another
model 42.9):
  identical      ours with the policy's own frozen base model as the only expert: the interface
                 without any knowledge the policy lacks.
  soft_prompt    ours without experts: C = FFN(Q_lat) W_out + b_out, m free trainable tokens, the
                 same for every prompt, built by the same layers as ours (so the same learning
                 dynamics). What C amounts to if it carries nothing about the prompt.
  bare_anchor    soft_prompt frozen at init (W_out = 0): C is the anchor alone (--context-anchor),
                 nothing in g trains. What m fixed tokens do without any training of the interface.

Deviations / choices: (1) the FFN output goes through the same near-zero output projection W_out as
ours, so every method starts as the reference policy; (2) encoders cannot write hints, so
output_collab uses only the team's decoders; (3) for hard routing, A is the router's probability
over experts [B, 1, n], so its entropy and utilisation are logged like ours; (4) the reference
policy of output_collab sees the same hints (they are part of its input, not trainable context); (5)
`--state-norm standardize` (ours, identical, no_xattn) standardises the pooled states before W_i
(adapter.StateNorm, fitted by fit_state_norm); hard routing's states are used as they are; (6) an oracle expert
cannot write a hint from the answer: output_collab gives it the question only.

Try it on CPU:  python train.py --preset smoke --method hard_routing --out runs/try-hard
"""
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from adapter import FFN, OutputProjection, PerceiverAdapter, StateNorm

HINT_INSTRUCTION = "Give a short hint or solution for this problem.\n\n"


@dataclass
class Context:
    """g(x) for B prompts: what every method's forward returns. The rollout keeps it; the loss pass
    hands it back as `reuse`, so that the gradient is taken under the C the completions were sampled
    with (the same pooled states, the same routing draw)."""
    C: Optional[torch.Tensor]        # (B, m, out_dim) context tokens, or None: the method adds none
    A: Optional[torch.Tensor]        # (B, m, n) attention of each context token over the n experts, or None
    hints: list                      # B strings appended to the questions (output_collab), else B Nones
    A_heads: Optional[torch.Tensor] = None  # (B, heads, m, n) A per attention head (ours), or None
    states: Optional[object] = None  # the pooled states h_i the rollout used: a list of n (B, d_i),
    #                                   or hard routing's {expert: its rows' h}; None without experts
    noise: Optional[torch.Tensor] = None    # (B, n) hard routing's Gumbel draw in training, else None


@dataclass(frozen=True)
class Kind:
    """What a method is, declared on its builder (`build.kind = Kind(...)`): the flag checks run before any model
    loads (support/harness/checks.py), so they ask this, never the method's name or its module's attributes."""
    tokens: bool               # C holds context tokens (False: C is None; --channel-weight and --context-anchor
    #                            newline have nothing to act on)
    experts: Optional[str]     # whose frozen states its .pool (experts.ExpertPool) reads: "team" (the team's
    #                            experts, whose weights a run needs), "policy" (the policy's own base) or None
    router: bool = False       # its .encoder is the team's sentence encoder (hard routing's router)
    state_norm: bool = False   # its .norm (adapter.StateNorm) standardises .pool's states: --state-norm
    #                            standardize fits it (fit_state_norm)
    hints: bool = False        # it writes text hints into the prompt, up to --max-new-tokens per expert
    answers: bool = False      # it writes the answer itself (.answer(policy, tok, questions, args)), not the policy


def expert_pool(names, args, device, dtype, heads=False):
    """The frozen experts, on --expert-device when given (they only run forward, once per prompt:
    a second GPU, or the CPU to save GPU memory); their pooled states come back to `device`,
    where g_phi and the policy are."""
    from experts import ExpertPool
    where = getattr(args, "expert_device", None) or device
    return ExpertPool(names, where, dtype, args.pooling, seed=args.seed,
                      depth=getattr(args, "expert_depth", 1.0), out_device=device,
                      store=getattr(args, "expert_cache", None), heads=heads)


def pooled_states(pool, questions, answers, reuse):
    """The experts' pooled states h_i (Eq. 5), or the rollout's own when the loss pass passes
    them back (`--pooling random_token` / `random_layer` would otherwise draw another token or
    layer)."""
    return reuse.states if reuse else pool.encode(questions, answers=answers)


def fit_state_norm(method, train_items, args):
    """--state-norm standardize: per-dimension statistics of the experts' pooled states h_i on the first
    --state-norm-prompts training prompts, into the method's adapter.StateNorm. Every method that declares
    state_norm (Kind) has .pool and .norm, so a new one brings no fitting code; the flag checks refused the others."""
    calibration = [train_items[i] for i in range(min(args.state_norm_prompts, len(train_items)))]
    method.norm.fit(method.pool.encode([it["question"] for it in calibration],
                                       answers=[it["answer"] for it in calibration]))


class ExpertContext(nn.Module):
    """g_phi of `ours`: frozen experts -> pooled states -> (standardised: StateNorm) ->
    PerceiverAdapter -> (C, A)."""

    def __init__(self, pool, adapter):
        super().__init__()
        # pool is not an nn.Module: experts are never trained or saved
        self.pool, self.adapter = pool, adapter
        self.context_tokens = adapter.latents.shape[0]  # m = --num-latents
        # the identity until fit_state_norm (--state-norm standardize)
        self.norm = StateNorm(pool.dims)

    def forward(self, questions, answers=None, reuse=None):
        states = pooled_states(self.pool, questions, answers, reuse)
        C, A, A_heads = self.adapter(self.norm(states), return_heads=True)
        return Context(C, A, [None] * len(questions), A_heads=A_heads, states=states)


def ours(team, out_dim, args, device, dtype):
    """The paper's method (§3)."""
    pool = expert_pool(team["experts"], args, device, dtype)
    adapter = PerceiverAdapter(pool.dims, out_dim, args.latent_dim, args.num_latents,
                               num_heads=args.num_heads)
    # g_phi stays float32 whatever the frozen weights are; .to(device) moves StateNorm's buffers
    # too (moving only the adapter left them on the CPU: every `ours` run on a GPU failed at its
    # first step, the device check's first run on an H200)
    return ExpertContext(pool, adapter).to(device)


ours.kind = Kind(tokens=True, experts="team", state_norm=True)


def identical(team, out_dim, args, device, dtype):
    """Control: ours with the policy's own frozen base as the only expert (C2C's "identical"
    arm)."""
    return ours({**team, "experts": [team["policy"]]}, out_dim, args, device, dtype=dtype)


identical.kind = Kind(tokens=True, experts="policy", state_norm=True)  # its run loads only the policy's weights


class SoftPrompt(nn.Module):
    """Control: C = FFN(Q_lat) W_out + b_out, the same m tokens for every prompt, no experts."""

    def __init__(self, out_dim, d, m):
        super().__init__()
        self.latents = nn.Parameter(torch.randn(m, d) * d ** -0.5)  # as ours' Q_lat
        self.ffn, self.out = FFN(d), OutputProjection(d, out_dim)
        self.context_tokens = m

    def forward(self, questions, answers=None, reuse=None):
        C = self.out(self.ffn(self.latents))  # (m, out_dim)
        return Context(C.expand(len(questions), *C.shape), None, [None] * len(questions))


def soft_prompt(team, out_dim, args, device, dtype):
    return SoftPrompt(out_dim, args.latent_dim, args.num_latents).to(device)


soft_prompt.kind = Kind(tokens=True, experts=None)


def bare_anchor(team, out_dim, args, device, dtype):
    """Control: the soft prompt frozen at init, W_out = 0, so C is the anchor alone for ever (with
    --context-anchor newline: m newline embeddings; with zero: m zero vectors). Only LoRA trains. It
    separates what the anchored soft prompt gains by training from what m fixed tokens do alone."""
    return SoftPrompt(out_dim, args.latent_dim, args.num_latents).to(device).requires_grad_(False)


bare_anchor.kind = Kind(tokens=True, experts=None)


class NoContext(nn.Module):
    context_tokens = 0

    def forward(self, questions, answers=None, reuse=None):
        return Context(None, None, [None] * len(questions))


def single(team, out_dim, args, device, dtype):
    return NoContext()


single.kind = Kind(tokens=False, experts=None)


class StackedFFN(nn.Module):
    def __init__(self, pool, out_dim, d):
        super().__init__()
        self.pool = pool
        # W_i, Eq. 6
        self.proj = nn.ModuleList([nn.Linear(d_i, d, bias=False) for d_i in pool.dims])
        self.ffn, self.out = FFN(d), OutputProjection(d, out_dim)
        self.norm = StateNorm(pool.dims)
        self.context_tokens = len(pool.dims)  # n: one token per expert

    def forward(self, questions, answers=None, reuse=None):
        states = pooled_states(self.pool, questions, answers, reuse)
        V = torch.stack([W(h) for W, h in zip(self.proj, self.norm(states))], 1)       # (B, n, d)
        return Context(self.out(self.ffn(V)), None, [None] * len(questions), states=states)


def no_xattn(team, out_dim, args, device, dtype):
    pool = expert_pool(team["experts"], args, device, dtype)
    return StackedFFN(pool, out_dim, args.latent_dim).to(device)


no_xattn.kind = Kind(tokens=True, experts="team", state_norm=True)


def straight_through_gumbel(logits, noise, tau=1.0):
    """One-hot forward, softmax gradient backward: R = hard - soft.detach() + soft, soft =
    softmax((l + g)/tau). The Gumbel noise g is passed in so the loss pass can reuse the
    rollout's draw (same expert, same C)."""
    soft = F.softmax((logits + noise) / tau, dim=-1)
    hard = F.one_hot(soft.argmax(-1), logits.shape[-1]).to(soft.dtype)
    return hard - soft.detach() + soft


class HardRouter(nn.Module):
    context_tokens = 1  # one memory token

    def __init__(self, pool, encoder, out_dim, d):
        super().__init__()
        self.pool, self.encoder = pool, encoder
        self.head = nn.Linear(encoder.dims[0], len(pool))                                # R(E_T(x))
        self.proj = nn.ModuleList([nn.Linear(d_i, d, bias=False) for d_i in pool.dims])  # W_i
        self.ffn, self.out = FFN(d), OutputProjection(d, out_dim)

    def forward(self, questions, answers=None, reuse=None):
        logits = self.head(self.encoder.encode(questions)[0])                            # (B, n)
        if self.training:
            # Gumbel(0, 1)
            noise = reuse.noise if reuse else -torch.empty_like(logits).exponential_().log()
            R = straight_through_gumbel(logits, noise)
        else:
            noise, R = None, F.one_hot(logits.argmax(-1), logits.shape[-1]).to(logits.dtype)
        chosen = R.argmax(-1)
        z = logits.new_zeros(len(questions), self.ffn.w1.in_features)
        states = {}  # expert -> its rows' h
        # selective execution: only the chosen expert runs, per prompt
        for i in chosen.unique().tolist():
            rows = (chosen == i).nonzero().squeeze(-1)
            if reuse:
                h = reuse.states[i]
            else:
                pick = rows.tolist()
                golds = None if answers is None else [answers[r] for r in pick]
                h = self.pool.encode([questions[r] for r in pick], experts=[i], answers=golds)[0]
            states[i] = h
            z = z.index_add(0, rows, R[rows, i:i + 1] * self.proj[i](h))  # R_i W_i h_i
        C = self.out(self.ffn(z)).unsqueeze(1)  # (B, 1, out_dim)
        A = F.softmax(logits, -1).unsqueeze(1)                                           # (B, 1, n)
        return Context(C, A, [None] * len(questions), states=states, noise=noise)


def hard_routing(team, out_dim, args, device, dtype):
    from experts import ExpertPool
    pool = expert_pool(team["experts"], args, device, dtype)
    encoder = ExpertPool([team["router"]], device, dtype, pooling="mean")
    return HardRouter(pool, encoder, out_dim, args.latent_dim).to(device)


hard_routing.kind = Kind(tokens=True, experts="team", router=True)


class TextHints(nn.Module):
    context_tokens = 0  # the hints are text in the prompt

    def __init__(self, pool, max_new_tokens):
        super().__init__()
        self.pool, self.max_new_tokens, self.cache = pool, max_new_tokens, {}

    @torch.no_grad()
    def write_hints(self, questions):
        """Eq. 12 for a batch: each decoder expert writes one hint per question (greedy, so
        cached), cut at max_new_tokens expert tokens. One batch per expert serves every question
        (rollout.greedy_texts: padding behind each first token, the shared beginning run once)."""
        from experts import expert_text, is_encoder
        from rollout import greedy_texts
        todo = list(dict.fromkeys(q for q in questions if q not in self.cache))
        if todo:
            parts = [[] for _ in todo]
            for model, tok in self.pool.models:
                if is_encoder(model):
                    continue
                texts = [expert_text(tok, HINT_INSTRUCTION + q) for q in todo]
                for p, hint in zip(parts, greedy_texts(model, tok, texts, self.max_new_tokens)):
                    p.append(f"Expert {len(p) + 1}: {hint.strip()}")
            self.cache.update({q: "\n\n[Expert Hints]\n" + "\n".join(p)
                               for q, p in zip(todo, parts)})
        return [self.cache[q] for q in questions]

    def forward(self, questions, answers=None, reuse=None):
        return Context(None, None, self.write_hints(questions))


def output_collab(team, out_dim, args, device, dtype):
    return TextHints(expert_pool(team["experts"], args, device, dtype, heads=True), args.max_new_tokens)


output_collab.kind = Kind(tokens=False, experts="team", hints=True)


METHODS = {"ours": ours, "single": single, "output_collab": output_collab,
           "hard_routing": hard_routing, "no_xattn": no_xattn, "identical": identical,
           "soft_prompt": soft_prompt, "bare_anchor": bare_anchor}

# Two systems of other papers are scripts of their own, each with its own loop
# (neighbours/conductor.py: a policy that writes workflows for frozen workers; neighbours/rlae.py:
# RL-chosen ensemble weights over the experts' next-token distributions). They import this
# repository's core; nothing here imports them, so what each is is declared here, for the flag checks.
NEIGHBOURS = {"conductor": Kind(tokens=False, experts="team", answers=True),
              "rlae": Kind(tokens=False, experts="team", router=True, answers=True)}


def kind(method):
    """What --method NAME is: its builder's declaration (METHODS) or a neighbour's (NEIGHBOURS); None for a
    builder that declares nothing (support/harness/checks.py refuses it)."""
    return NEIGHBOURS[method] if method in NEIGHBOURS else getattr(METHODS[method], "kind", None)
