"""
The paper's baselines (§4.1), side by side: four ways to build the context g(x) for the same policy.

Every method is a function  build(team, out_dim, args, device, dtype) -> nn.Module  whose forward maps a list
of questions to {"C": [B, m, out_dim] or None, "A": [B, m, n] or None, "hints": list of str or None}.
`--method NAME` picks one from METHODS; only what a method returns differs, the GRPO loop is shared.

  single         no experts, no context tokens: plain single-model RLVR.
  output_collab  Eq. 12  g(x) = tau_pi([decode_i(LM_i(tau_i(x)))]_i): each expert writes a hint (greedy, the
                 same 128-token budget, its own chat template); the hints go verbatim into an
                 "[Expert Hints]" block in the policy's prompt. No trainable parameters.
  hard_routing   Eq. 13  g(x) = FFN(sum_i R_i(E_T(x)) W_i pool(LM_i(tau_i(x)))): a frozen sentence encoder
                 E_T (all-MiniLM-L6-v2) embeds x, a linear router head gives expert logits, R is a
                 straight-through Gumbel-softmax one-hot in training and the argmax at evaluation; only the
                 chosen expert runs; one memory token.
  no_xattn       Eq. 14  g(x) = FFN(V): the FFN on the n projected expert states, no latent queries and no
                 cross-attention; n context tokens.
  ours           Eq. 6–11, in adapter.py.

Deviations / choices: (1) the FFN output goes through the same near-zero output projection W_out as ours, so
every method starts as the reference policy; (2) encoders cannot write hints, so output_collab uses only
the team's decoders; (3) for hard routing, A is the router's probability over experts [B, 1, n], so its
entropy and utilisation are logged like ours; (4) the reference policy of output_collab sees the same hints
(they are part of its input, not trainable context).

Try it on CPU:  python train.py --task chain_sum --team tiny --method hard_routing --steps 2 --batch-size 2 \
                    --grad-accum 1 --group-size 2 --max-new-tokens 8 --out runs/try-hard
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

from adapter import FFN, OutputProjection, ours

HINT_INSTRUCTION = "Give a short hint or solution for this problem.\n\n"


class NoContext(nn.Module):
    def forward(self, questions, reuse=None):
        return {"C": None, "A": None, "hints": [None] * len(questions)}


def single(team, out_dim, args, device, dtype):
    return NoContext()


class StackedFFN(nn.Module):
    def __init__(self, pool, out_dim, d):
        super().__init__()
        self.pool = pool
        self.proj = nn.ModuleList([nn.Linear(d_i, d, bias=False) for d_i in pool.dims])  # W_i, Eq. 6
        self.ffn, self.out = FFN(d), OutputProjection(d, out_dim)

    def forward(self, questions, reuse=None):
        V = torch.stack([W(h) for W, h in zip(self.proj, self.pool.encode(questions))], 1)  # (B, n, d)
        return {"C": self.out(self.ffn(V)), "A": None, "hints": [None] * len(questions)}


def no_xattn(team, out_dim, args, device, dtype):
    from experts import ExpertPool
    pool = ExpertPool(team["experts"], device, dtype, args.pooling, args.seed)
    return StackedFFN(pool, out_dim, args.latent_dim).to(device)


def straight_through_gumbel(logits, noise, tau=1.0):
    """One-hot forward, softmax gradient backward: R = hard - soft.detach() + soft, soft = softmax((l + g)/tau).
    The Gumbel noise g is passed in so the loss pass can reuse the rollout's draw (same expert, same C)."""
    soft = F.softmax((logits + noise) / tau, dim=-1)
    hard = F.one_hot(soft.argmax(-1), logits.shape[-1]).to(soft.dtype)
    return hard - soft.detach() + soft


class HardRouter(nn.Module):
    def __init__(self, pool, encoder, out_dim, d):
        super().__init__()
        self.pool, self.encoder = pool, encoder
        self.head = nn.Linear(encoder.dims[0], len(pool))                                # R(E_T(x))
        self.proj = nn.ModuleList([nn.Linear(d_i, d, bias=False) for d_i in pool.dims])  # W_i
        self.ffn, self.out = FFN(d), OutputProjection(d, out_dim)

    def forward(self, questions, reuse=None):
        logits = self.head(self.encoder.encode(questions)[0])                            # (B, n)
        if self.training:
            noise = reuse["noise"] if reuse else -torch.empty_like(logits).exponential_().log()  # Gumbel(0, 1)
            R = straight_through_gumbel(logits, noise)
        else:
            noise, R = None, F.one_hot(logits.argmax(-1), logits.shape[-1]).to(logits.dtype)
        chosen = R.argmax(-1)
        z = logits.new_zeros(len(questions), self.ffn.w1.in_features)
        for i in chosen.unique().tolist():  # selective execution: only the chosen expert runs, per prompt
            rows = (chosen == i).nonzero().squeeze(-1)
            h = self.pool.encode([questions[r] for r in rows.tolist()], experts=[i])[0]
            z = z.index_add(0, rows, R[rows, i:i + 1] * self.proj[i](h))                 # R_i W_i h_i
        C = self.out(self.ffn(z)).unsqueeze(1)                                           # (B, 1, out_dim)
        A = F.softmax(logits, -1).unsqueeze(1)                                           # (B, 1, n)
        return {"C": C, "A": A, "hints": [None] * len(questions), "noise": noise}


def hard_routing(team, out_dim, args, device, dtype):
    from experts import ExpertPool
    pool = ExpertPool(team["experts"], device, dtype, args.pooling, args.seed)
    encoder = ExpertPool([team["router"]], device, dtype, pooling="mean")
    return HardRouter(pool, encoder, out_dim, args.latent_dim).to(device)


class TextHints(nn.Module):
    def __init__(self, pool, max_new_tokens):
        super().__init__()
        self.pool, self.max_new_tokens, self.cache = pool, max_new_tokens, {}

    @torch.no_grad()
    def write_hints(self, questions):
        """Eq. 12 for a batch: each decoder expert writes one hint per question (greedy, so cached), cut at
        max_new_tokens expert tokens. One left-padded generate call per expert serves the whole batch."""
        from experts import expert_text, is_encoder
        todo = list(dict.fromkeys(q for q in questions if q not in self.cache))
        if todo:
            parts = [[] for _ in todo]
            for model, tok in self.pool.models:
                if is_encoder(model):
                    continue
                tok.padding_side = "left"  # every prompt ends at the last column, so new tokens line up
                enc = tok([expert_text(tok, HINT_INSTRUCTION + q) for q in todo], return_tensors="pt",
                          padding=True, add_special_tokens=not tok.chat_template).to(model.device)
                out = model.generate(**enc, max_new_tokens=self.max_new_tokens, do_sample=False,
                                     pad_token_id=tok.pad_token_id)
                for p, row in zip(parts, out[:, enc["input_ids"].shape[1]:]):
                    p.append(f"Expert {len(p) + 1}: {tok.decode(row, skip_special_tokens=True).strip()}")
            self.cache.update({q: "\n\n[Expert Hints]\n" + "\n".join(p) for q, p in zip(todo, parts)})
        return [self.cache[q] for q in questions]

    def forward(self, questions, reuse=None):
        return {"C": None, "A": None, "hints": self.write_hints(questions)}


def output_collab(team, out_dim, args, device, dtype):
    from experts import ExpertPool
    return TextHints(ExpertPool(team["experts"], device, dtype, args.pooling, args.seed), args.max_new_tokens)


METHODS = {"ours": ours, "single": single, "output_collab": output_collab, "hard_routing": hard_routing,
           "no_xattn": no_xattn}
