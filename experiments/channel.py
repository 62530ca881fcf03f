"""
The channel test: do the context tokens C carry *this* item's information from an expert, or only act as a
learned soft prompt? Supervised, on CPU, with the pocket models and no GRPO.

    OMP_NUM_THREADS=1 taskset -c 1 python experiments/channel.py --suite    # results/channel/{results.json, table.md}

One configuration:  python experiments/channel.py --expert gemma3-270m --pooling last_text --layer 9 ...
(every finished run is merged into results/channel/results.json by its name; table.md is rebuilt each time).

Part 1, the probe (before any policy training). An "oracle" expert reads the question and its answer,
    o(x, a) = "{x} The answer is {a}."            through the expert's chat template if it has one (expert_text)
and we keep h = pool(H_l) for several layers l (about every quarter of the depth) and three poolings:
    last       H_l at the last token (what ExpertPool's `last` reads: for a chat decoder a template token)
    last_text  H_l at the last token of o(x, a) itself, before any chat-template or special token
    mean_text  the mean of H_l over the tokens of o(x, a)
A ridge probe on standardised states predicts the answer's sign and three decimal digits (one-hot targets,
one linear map per position, alpha picked on a held-out fifth of the training items):
    W = argmin ||Z W - Y||^2 + alpha ||W||^2,  Z = (h - mean) / std,   exact = every position right
Varying-energy share of a set of states: tr(Cov(h)) / E ||h||^2 (the share of ||h||^2 that changes with the item).

Part 2, the channel: frozen SmolLM2-135M-Instruct policy, one expert, only the adapter g_phi trained (LoRA too
with --lora) by cross-entropy on the gold tokens y = "{a}</answer>" after the prompt
    p(x) = build_prompt(tok, x, "DeepSeekZero", worked_example=True, response_prefix="<think>") + "</think>\n<answer>"
    L(phi) = - 1/|y| sum_t log pi(y_t | splice(p(x), C), y_<t),   C = g_phi(h(x, a))
then on held-out items, paired (the same items in every arm): greedy exact match and the gold log-prob
sum_t log pi(y_t | ...) with C, with C = 0 and with C shuffled across the eval items (C of item i+1 for item i,
a derangement). "Carries the item" means: with C >> shuffled ~ C = 0.

Deviations / choices (numbered):
  1. The response is pre-filled with an empty thought, "<think></think>\n<answer>", so the first generated
     token is the answer; the worked example in the system prompt shows this format. Greedy decoding runs
     --max-new-tokens tokens; exact match = extract_answer("<answer>" + completion) == a.
  2. Pooled states are computed once per (expert, oracle/question, split) for all layers and poolings and
     cached under /tmp/channel/cache (the experts are frozen); items are in load_entries order, so a longer
     list extends the cached one. Experts read right-padded batches with default positions: the same states as
     ExpertPool's left padding with shifted positions, for the real tokens.
  3. `--normalize standardize` uses the per-dim mean/std of the first 256 training states of the run (the
     same texts the adapter trains on); `layernorm` is an nn.LayerNorm(d) applied to each z_i = h_i W_i.
  4. The adapter here is a prototype (ChannelAdapter, a subclass of adapter.PerceiverAdapter) with the
     options under test: input standardisation, LayerNorm after W_i, FFN kind (Eq. 16 tanh, residual
     x + FFN(x), or none), W_out init std. With the defaults it computes exactly PerceiverAdapter's forward.
  5. Position "after" without LoRA takes a fast path: the prompt tokens common to every item (system prompt,
     worked example, question stem) are run once and their KV cache reused; the per-item tail runs without
     gradient (it cannot depend on C, which comes after it) and only C and the gold tokens carry gradient.
     Each such run first checks its log-probs and greedy outputs against rollout.completion_logprobs / rollout.sample
     on a few items (max |diff| is recorded as fast_path_check). "before" and --lora use grpo's functions.
  6. Curves (--eval-every) use teacher-forced exact match (every gold token is the argmax), which equals greedy
     exact match unless greedy writes the same answer with other tokens; the final numbers are greedy.
  7. Train items are distinct (steps x batch of them, one pass) unless --train-n is smaller (then cycled).

Machine: one core (OMP_NUM_THREADS=1 taskset -c 1); --suite takes about 2 h 10 min, of which the middle-layer run
~35 min and the run with LoRA ~45 min (10 s a step: LoRA needs the full forward and backward; a 150 x 8 run with C
"after" about 6.5 minutes; with C "before" a step costs ~12 s instead of ~1.6 s).
"""
import argparse
import json
import os
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from adapter import PerceiverAdapter  # noqa: E402
from experts import expert_text, load_model  # noqa: E402
import grpo  # noqa: E402
import rollout  # noqa: E402
from rollout import policy_inputs  # noqa: E402
from rewards import build_prompt, extract_answer, load_entries  # noqa: E402
from lib import kv_cache  # noqa: E402

TASK, TASK_CONFIG = "chain_sum", '{"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2}'
POLICY = "pocket:smollm2-135m-instruct"
EXPERTS = ("smollm2-135m-instruct", "gemma3-270m", "all-minilm-l6-v2")
POOLINGS = ("last", "last_text", "mean_text")
RESPONSE = "</think>\n<answer>"   # appended after build_prompt's "<think>" (deviation 1)
CACHE = "/tmp/channel/cache"
OUT = os.path.join(ROOT, "results", "channel")


def items(split, n, seed):
    """[(question, answer)] of chain_sum, 2 terms of 1-2 digits, in load_entries order."""
    return [(e["question"], e["answer"]) for e in load_entries(TASK, split, n, seed, None, TASK_CONFIG)[:n]]


def expert_input(q, a, oracle):
    return f"{q} The answer is {a}." if oracle else q


# ----------------------------------------------------------------------------------------------------------
# Expert states: every layer x {last, last_text, mean_text}, cached


@torch.no_grad()
def encode(model, tok, raw, batch=16):
    """raw: texts before the chat template. Returns {pooling: [L + 1, N, d]} (layer 0 = embeddings, L = the
    final state after the model's final norm, what ExpertPool's `last` reads)."""
    chat = bool(tok.chat_template)
    out = {p: [] for p in POOLINGS}
    tok.padding_side = "right"   # causal models: real tokens never see right padding (deviation 2)
    for i in range(0, len(raw), batch):
        r = raw[i:i + batch]
        texts = [expert_text(tok, x) for x in r]
        enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=not chat,
                  return_offsets_mapping=True)
        off = enc.pop("offset_mapping")                                   # (B, T, 2) character spans
        mask = enc["attention_mask"].bool()
        start = torch.tensor([t.rfind(x) for t, x in zip(texts, r)])[:, None]
        end = start + torch.tensor([len(x) for x in r])[:, None]
        # a token is part of the text if its span overlaps it; template and special tokens are not
        in_text = (off[..., 1] > start) & (off[..., 0] < end) & (off[..., 1] > off[..., 0]) & mask
        T = mask.shape[1]
        last = mask.long().sum(1) - 1
        last_text = torch.where(in_text, torch.arange(T), -1).max(1).values
        hs = torch.stack(model.base_model(**enc, output_hidden_states=True).hidden_states)  # (L+1, B, T, d)
        rows = torch.arange(len(r))
        w = in_text.float()[None, :, :, None]
        out["last"].append(hs[:, rows, last])
        out["last_text"].append(hs[:, rows, last_text])
        out["mean_text"].append((hs * w).sum(2) / w.sum(2))
        if i == 0:
            ids = enc["input_ids"][0]
            print(f"  pooled tokens of item 0: last {tok.convert_ids_to_tokens([ids[last[0]]])} last_text "
                  f"{tok.convert_ids_to_tokens([ids[last_text[0]]])} | text tokens {int(in_text[0].sum())}",
                  flush=True)
    return {p: torch.cat(v, 1).float() for p, v in out.items()}


_MODELS = {}


def expert_model(name):
    if name not in _MODELS:
        _MODELS.clear()   # one expert in memory at a time
        _MODELS[name] = load_model("pocket:" + name)
    return _MODELS[name]


def states(expert, oracle, split, n, seed):
    """{pooling: [L+1, n, d]} for the first n items of a split, from the disk cache, extended if too short."""
    os.makedirs(CACHE, exist_ok=True)
    path = os.path.join(CACHE, f"{expert}-{'oracle' if oracle else 'question'}-{split}-s{seed}.pt")
    have = torch.load(path) if os.path.exists(path) else None
    m = 0 if have is None else have["last"].shape[1]
    if m < n:
        t0 = time.time()
        model, tok = expert_model(expert)
        print(f"  encoding {n - m} {split} items with {expert} ({'oracle' if oracle else 'question'})", flush=True)
        new = encode(model, tok, [expert_input(q, a, oracle) for q, a in items(split, n, seed)[m:]])
        have = new if have is None else {p: torch.cat([have[p], new[p]], 1) for p in POOLINGS}
        torch.save(have, path)
        print(f"  encoded in {time.time() - t0:.0f} s", flush=True)
    return {p: v[:, :n] for p, v in have.items()}


# ----------------------------------------------------------------------------------------------------------
# Part 1: the probe


def digits(answers):
    """Answer strings -> [N, 4] labels: sign (0/1), hundreds, tens, units."""
    rows = []
    for a in answers:
        v = int(a)
        rows.append([int(v < 0)] + [int(c) for c in f"{abs(v):03d}"])
    return torch.tensor(rows)


def ridge_probe(Xtr, ytr, Xte, yte, alphas=(1e-1, 1, 10, 100, 1e3, 1e4)):
    """One-hot ridge per answer position on standardised states; alpha chosen on the last fifth of train.
    Returns (exact-match accuracy, units-digit accuracy, alpha)."""
    mu, sd = Xtr.mean(0), Xtr.std(0) + 1e-6
    Ztr, Zte = ((Xtr - mu) / sd).double(), ((Xte - mu) / sd).double()

    def fit_predict(Za, ya, Zb, alpha):
        Y = torch.cat([F.one_hot(ya[:, j], 10) for j in range(ya.shape[1])], 1).double()
        ym = Y.mean(0)
        U, S, Vh = torch.linalg.svd(Za - Za.mean(0), full_matrices=False)
        W = Vh.T @ torch.diag(S / (S ** 2 + alpha)) @ U.T @ (Y - ym)
        P = (Zb - Za.mean(0)) @ W + ym
        return torch.stack([P[:, 10 * j:10 * j + 10].argmax(1) for j in range(ya.shape[1])], 1)

    k = len(Ztr) * 4 // 5
    best = max(alphas, key=lambda al: (fit_predict(Ztr[:k], ytr[:k], Ztr[k:], al) == ytr[k:]).all(1).float().mean()
               + 1e-3 * (fit_predict(Ztr[:k], ytr[:k], Ztr[k:], al) == ytr[k:])[:, 3].float().mean())
    pred = fit_predict(Ztr, ytr, Zte, best)
    return (pred == yte).all(1).float().mean().item(), (pred[:, 3] == yte[:, 3]).float().mean().item(), best


def varying_share(X):
    """tr(Cov) / E||h||^2: the share of the states' energy that changes from item to item."""
    return (X.var(0, unbiased=False).sum() / X.pow(2).sum(1).mean()).item()


def probe(args):
    rows = []
    for expert in EXPERTS:
        for oracle in (True, False):
            tr = states(expert, oracle, "train", args.probe_train, args.seed)
            te = states(expert, oracle, "val", args.probe_test, args.seed)
            ytr = digits([a for _, a in items("train", args.probe_train, args.seed)])
            yte = digits([a for _, a in items("val", args.probe_test, args.seed)])
            L = tr["last"].shape[0] - 1
            layers = sorted({max(1, round(k * L / 4)) for k in (1, 2, 3, 4)})
            for layer in layers:
                for pooling in POOLINGS:
                    exact, units, alpha = ridge_probe(tr[pooling][layer], ytr, te[pooling][layer], yte)
                    X = tr[pooling][layer]
                    top = X.abs().mean(0)
                    row = dict(expert=expert, oracle=oracle, layer=layer, layers=L, pooling=pooling,
                               probe_exact=exact, probe_units=units, alpha=alpha,
                               varying_share=varying_share(X), top_dim_mean_abs=top.max().item(),
                               median_dim_mean_abs=top.median().item())
                    rows.append(row)
                    print(f"{expert:22s} {'oracle' if oracle else 'question':8s} layer {layer:2d}/{L} "
                          f"{pooling:9s} exact {exact:.3f} units {units:.3f} varying {row['varying_share']:.4f}",
                          flush=True)
    chance = digits([a for _, a in items("val", args.probe_test, args.seed)])
    # the most frequent value per position: what a probe with no information scores
    maj = torch.stack([chance[:, j].mode().values.expand(len(chance)) for j in range(4)], 1)
    return {"rows": rows, "chance_exact": (maj == chance).all(1).float().mean().item(),
            "chance_units": (maj[:, 3] == chance[:, 3]).float().mean().item(),
            "n_train": args.probe_train, "n_test": args.probe_test}


# ----------------------------------------------------------------------------------------------------------
# Part 2: the adapter prototype (deviation 4)


class ChannelAdapter(PerceiverAdapter):
    """PerceiverAdapter with the options under test. normalize: none | standardize (h -> (h - mu) / sd with
    fixed per-dim statistics, before W_i) | layernorm (LayerNorm(d) on z_i = h_i W_i). ffn: tanh (Eq. 16),
    residual (x + FFN(x), so C' is not squashed into [-1, 1]^d), none (C' = Q_lat + attention)."""

    def __init__(self, expert_dims, out_dim, normalize="none", stats=None, ffn="tanh", out_init_std=0.0,
                 latent_dim=512, num_latents=8, num_heads=8):
        super().__init__(expert_dims, out_dim, latent_dim, num_latents, num_heads, out_init_std)
        self.normalize, self.ffn_kind = normalize, ffn
        if normalize == "standardize":
            for i, (mu, sd) in enumerate(stats):
                self.register_buffer(f"mu{i}", mu)
                self.register_buffer(f"sd{i}", sd)
        self.norms = nn.ModuleList([nn.LayerNorm(latent_dim) for _ in expert_dims]) if normalize == "layernorm" else None

    def forward(self, hidden_states):
        dtype = self.latents.dtype
        hs = [h.to(dtype) for h in hidden_states]
        if self.normalize == "standardize":
            hs = [(h - getattr(self, f"mu{i}")) / getattr(self, f"sd{i}") for i, h in enumerate(hs)]
        zs = [W(h) for W, h in zip(self.proj, hs)]
        if self.norms is not None:
            zs = [norm(z) for norm, z in zip(self.norms, zs)]
        V = torch.stack(zs, dim=1)                                            # (B, n, d)
        B, n, d = V.shape
        m, nh, hsz = self.latents.shape[0], self.num_heads, d // self.num_heads
        Q = self.w_q(self.latents).view(m, nh, hsz).transpose(0, 1)
        K = self.w_k(V).view(B, n, nh, hsz).transpose(1, 2)
        Vp = self.w_v(V).view(B, n, nh, hsz).transpose(1, 2)
        att = F.softmax(Q @ K.transpose(-2, -1) / hsz ** 0.5, dim=-1)
        x = self.latents + (att @ Vp).transpose(1, 2).reshape(B, m, d)
        C_prime = {"tanh": self.ffn, "residual": lambda v: v + self.ffn(v), "none": lambda v: v}[self.ffn_kind](x)
        return self.out(C_prime), att.mean(dim=1)


# ----------------------------------------------------------------------------------------------------------
# Part 2: the policy side


def pad_right(seqs, pad):
    T = max(len(s) for s in seqs)
    ids = torch.tensor([s + [pad] * (T - len(s)) for s in seqs])
    mask = torch.tensor([[1] * len(s) + [0] * (T - len(s)) for s in seqs]).bool()
    return ids, mask


def pad_left(seqs, pad):
    T = max(len(s) for s in seqs)
    ids = torch.tensor([[pad] * (T - len(s)) + s for s in seqs])
    mask = torch.tensor([[0] * (T - len(s)) + [1] * len(s) for s in seqs]).bool()
    return ids, mask


class Policy:
    """The frozen policy with the prompts and gold tokens of a list of items: teacher-forced log-probs and
    greedy completions for any C, through grpo's functions or the fast "after" path (deviation 5)."""

    def __init__(self, model, tok, position, fast):
        self.model, self.tok, self.position, self.fast = model, tok, position, fast
        self.embed = model.get_input_embeddings()
        self.pad = tok.pad_token_id
        self.eos = rollout.eos_token_ids(model, tok)
        self.prefix_kv, self.P = None, 0

    def prompt_ids(self, q):
        text = build_prompt(self.tok, q, "DeepSeekZero", worked_example=True, response_prefix="<think>") + RESPONSE
        return self.tok(text, add_special_tokens=False)["input_ids"]

    def gold_ids(self, a):
        return self.tok(f"{a}</answer>", add_special_tokens=False)["input_ids"]

    @torch.no_grad()
    def set_prefix(self, questions):
        """Fast path: the longest token prefix common to all these prompts, run once."""
        ids = [self.prompt_ids(q) for q in questions]
        P = min(len(s) for s in ids) - 1
        for s in ids[1:]:
            P = min(P, next((k for k, (u, v) in enumerate(zip(ids[0], s)) if u != v), P))
        self.P = P
        out = self.model(input_ids=torch.tensor([ids[0][:P]]), use_cache=True)
        self.prefix_kv = [(l.keys, l.values) for l in kv_cache.cache_of(out).layers]

    def _fast_prefill(self, questions, C, extra_embeds=None, extra_mask=None, logits_to_keep=1):
        """[prefix | pad | tail | C | extra]: the tail without gradient, C and extra with it."""
        from transformers import DynamicCache
        B = len(questions)
        tails, tmask = pad_left([self.prompt_ids(q)[self.P:] for q in questions], self.pad)
        cache = DynamicCache(ddp_cache_data=[(k.expand(B, -1, -1, -1), v.expand(B, -1, -1, -1))
                                             for k, v in self.prefix_kv])
        mask = torch.cat([torch.ones(B, self.P, dtype=torch.bool), tmask], 1)
        pos = (mask.long().cumsum(-1) - 1).clamp(min=0)
        with torch.no_grad():
            self.model(input_ids=tails, attention_mask=mask, position_ids=pos[:, self.P:],
                       **kv_cache.cache_kwargs(self.model, cache), use_cache=True, logits_to_keep=1)
        x = C.to(self.embed.weight.dtype)
        mask = torch.cat([mask, torch.ones(C.shape[:2], dtype=torch.bool)], 1)
        if extra_embeds is not None:
            x, mask = torch.cat([x, extra_embeds], 1), torch.cat([mask, extra_mask], 1)
        pos = (mask.long().cumsum(-1) - 1).clamp(min=0)
        out = self.model(inputs_embeds=x, attention_mask=mask, position_ids=pos[:, -x.shape[1]:],
                         **kv_cache.cache_kwargs(self.model, cache), use_cache=True, logits_to_keep=logits_to_keep)
        return out, mask, pos

    def gold_logprobs(self, items_, C, fast=None):
        """log pi(y_t | splice(p(x), C), y_<t), fp32 [B, T], and the mask of real gold tokens."""
        fast = self.fast if fast is None else fast
        gold, gmask = pad_right([self.gold_ids(a) for _, a in items_], self.pad)
        if fast:
            T = gold.shape[1]
            out, _, _ = self._fast_prefill([q for q, _ in items_], C, self.embed(gold), gmask, logits_to_keep=T + 1)
            return grpo.token_logprobs(out.logits[:, :T], gold), gmask
        ids, mask = pad_left([self.prompt_ids(q) for q, _ in items_], self.pad)
        return rollout.completion_logprobs(self.model, ids, mask, C, gold, gmask, 1.0, self.position), gmask

    @torch.no_grad()
    def greedy(self, items_, C, max_new, fast=None):
        fast = self.fast if fast is None else fast
        if not fast:
            ids, mask = pad_left([self.prompt_ids(q) for q, _ in items_], self.pad)
            out = rollout.sample(self.model, ids, mask, C, 1, max_new, 1.0, self.eos, self.pad, self.position,
                              greedy=True)
        else:
            o, mask, pos = self._fast_prefill([q for q, _ in items_], C)
            cache, logits, pos, toks = kv_cache.cache_of(o), o.logits[:, -1], pos[:, -1:], []
            done = torch.zeros(len(items_), dtype=torch.bool)
            for _ in range(max_new):
                nxt = torch.where(done, torch.full_like(logits[:, 0], self.pad, dtype=torch.long), logits.argmax(-1))
                toks.append(nxt)
                done |= torch.isin(nxt, torch.tensor(self.eos))
                if done.all():
                    break
                mask, pos = torch.cat([mask, torch.ones_like(mask[:, :1])], 1), pos + 1
                o = self.model(input_ids=nxt[:, None], attention_mask=mask, position_ids=pos,
                               **kv_cache.cache_kwargs(self.model, cache), use_cache=True)
                cache, logits = kv_cache.cache_of(o), o.logits[:, -1]
            out = torch.stack(toks, 1)
        return [self.tok.decode(row, skip_special_tokens=True) for row in out]


def evaluate(pol, adapter, eval_items, eval_h, max_new, greedy=True, batch=20):
    """Paired arms on the same items: C, C = 0, C shuffled (C of the next item, a derangement). Per arm: the mean
    gold log-prob (summed over the gold tokens), teacher-forced exact match and, with greedy, greedy exact match."""
    with torch.no_grad():
        C = adapter([eval_h])[0]
    n = len(eval_items)
    arms = {"C": C, "zero": torch.zeros_like(C), "shuffled": C[torch.arange(n).roll(-1)]}
    res = {}
    for arm, Ca in arms.items():
        lp, tf, texts = [], [], []
        for i in range(0, n, batch):
            it, c = eval_items[i:i + batch], Ca[i:i + batch]
            logp, ok = teacher_forced(pol, it, c)
            lp.append(logp)
            tf.append(ok)
            if greedy:
                texts += pol.greedy(it, c, max_new)
        lp = torch.cat(lp)
        r = {"gold_logprob": lp.mean().item(), "tf_exact": torch.cat(tf).float().mean().item(),
             "per_item_logprob": [round(v, 3) for v in lp.tolist()]}
        if greedy:
            ok = [extract_answer("<answer>" + t) == a for t, (_, a) in zip(texts, eval_items)]
            r.update(exact=sum(ok) / n, per_item_exact=[int(v) for v in ok], samples=texts[:3])
        res[arm] = r
    # same-answer neighbours make the shuffled arm right by luck: count them
    res["shuffle_same_answer"] = sum(eval_items[i][1] == eval_items[(i + 1) % n][1] for i in range(n))
    return res


@torch.no_grad()
def teacher_forced(pol, it, C):
    """One forward over [prompt spliced with C || gold]: the gold log-prob summed over its tokens [B], and
    whether every gold token is the argmax [B] (then greedy writes exactly the gold tokens, deviation 6)."""
    gold, gm = pad_right([pol.gold_ids(a) for _, a in it], pol.pad)
    T = gold.shape[1]
    if pol.fast:
        out, _, _ = pol._fast_prefill([q for q, _ in it], C, pol.embed(gold), gm, logits_to_keep=T + 1)
        logits = out.logits[:, :T]
    else:
        ids, mask = pad_left([pol.prompt_ids(q) for q, _ in it], pol.pad)
        x, m, _ = policy_inputs(pol.embed, ids, mask, C, pol.position)
        x, m = torch.cat([x, pol.embed(gold)], 1), torch.cat([m, gm], 1)
        pos = (m.long().cumsum(-1) - 1).clamp(min=0)
        logits = pol.model(inputs_embeds=x, attention_mask=m, position_ids=pos, logits_to_keep=T + 1).logits[:, :T]
    logp = grpo.token_logprobs(logits, gold)
    return torch.where(gm, logp, torch.zeros_like(logp)).sum(1), ((logits.argmax(-1) == gold) | ~gm).all(1)


# ----------------------------------------------------------------------------------------------------------
# Part 2: one run


def run_name(a):
    parts = [a.expert.split("-")[0], "oracle" if a.oracle else "question", a.pooling, f"L{a.layer}", a.normalize,
             a.position, f"ffn-{a.ffn}", f"lr{a.lr:g}", f"{a.steps}x{a.batch}"]
    if a.out_init_std:
        parts.append(f"init{a.out_init_std:g}")
    if a.lora:
        parts.append("lora")
    if a.seed:
        parts.append(f"s{a.seed}")
    return "-".join(parts)


def channel(a):
    torch.manual_seed(a.seed)
    t_start = time.time()
    n_train = a.train_n or a.steps * a.batch
    train = items("train", n_train, a.seed)
    evals = items("val", a.eval_n, a.seed)
    H_tr = states(a.expert, a.oracle, "train", n_train, a.seed)[a.pooling]
    L = H_tr.shape[0] - 1
    layer = L if a.layer == -1 else a.layer
    H_tr = H_tr[layer]
    H_ev = states(a.expert, a.oracle, "val", a.eval_n, a.seed)[a.pooling][layer]
    t_enc = time.time() - t_start

    model, tok = load_model(POLICY)
    if a.lora:
        from lora import apply_lora
        apply_lora(model, rank=8)
    fast = a.position == "after" and not a.lora
    pol = Policy(model, tok, a.position, fast)
    stats = [(H_tr[:256].mean(0), H_tr[:256].std(0) + 1e-6)]
    adapter = ChannelAdapter([H_tr.shape[1]], model.config.hidden_size, a.normalize, stats, a.ffn, a.out_init_std)
    result = {"config": {k: v for k, v in vars(a).items() if k not in ("suite", "probe_only", "skip_probe")},
              "layer_index": layer, "layers": L, "n_train_items": n_train}
    if fast:  # deviation 5: the fast path must agree with grpo's functions
        pol.set_prefix([q for q, _ in train] + [q for q, _ in evals])
        chk = evals[:3]
        C = torch.randn(3, adapter.latents.shape[0], model.config.hidden_size) * 0.05
        with torch.no_grad():
            d = (pol.gold_logprobs(chk, C, fast=True)[0] - pol.gold_logprobs(chk, C, fast=False)[0]).abs()
        d = d[pol.gold_logprobs(chk, C, fast=True)[1]].max().item()
        same = pol.greedy(chk, C, a.max_new_tokens, fast=True) == pol.greedy(chk, C, a.max_new_tokens, fast=False)
        result["fast_path_check"] = {"max_abs_logprob_diff": d, "greedy_identical": same}
        print(f"  fast path vs grpo: max |d logp| {d:.2e}, greedy identical {same}", flush=True)
        assert d < 1e-3 and same, "the fast path disagrees with rollout.completion_logprobs / rollout.sample"

    params = [p for p in adapter.parameters()] + [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=a.lr, weight_decay=1e-2, eps=1e-6)  # train.py's AdamW defaults
    curve = []

    def curve_point(step):
        if a.eval_every and (step % a.eval_every == 0 or step == a.steps):
            r = evaluate(pol, adapter, evals, H_ev, a.max_new_tokens, greedy=False)
            curve.append({"step": step, **{f"{arm}_tf_exact": r[arm]["tf_exact"] for arm in ("C", "zero", "shuffled")},
                          **{f"{arm}_logprob": r[arm]["gold_logprob"] for arm in ("C", "zero", "shuffled")}})
            c = curve[-1]
            print(f"  step {step:4d} tf-exact C {c['C_tf_exact']:.3f} zero {c['zero_tf_exact']:.3f} shuffled "
                  f"{c['shuffled_tf_exact']:.3f} | logp C {c['C_logprob']:.2f} zero {c['zero_logprob']:.2f} "
                  f"shuffled {c['shuffled_logprob']:.2f}", flush=True)

    t0 = time.time()
    curve_point(0)
    t_eval_curve = time.time() - t0
    t_train, losses = 0.0, []
    for step in range(1, a.steps + 1):
        t0 = time.time()
        idx = [(step - 1) * a.batch + j for j in range(a.batch)]
        idx = [k % n_train for k in idx]
        C, _ = adapter([H_tr[idx]])
        logp, gm = pol.gold_logprobs([train[k] for k in idx], C)
        loss = -(torch.where(gm, logp, torch.zeros_like(logp)).sum() / gm.sum())   # token mean (CE)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        t_train += time.time() - t0
        if step % 10 == 0:
            print(f"  step {step:4d} loss {sum(losses[-10:]) / 10:.3f} | C rms {C.pow(2).mean().sqrt():.3f} | "
                  f"{t_train / step:.2f} s/step", flush=True)
        t0 = time.time()
        curve_point(step)
        t_eval_curve += time.time() - t0
    t0 = time.time()
    final = evaluate(pol, adapter, evals, H_ev, a.max_new_tokens, greedy=True)
    with torch.no_grad():
        C = adapter([H_ev])[0]
    result.update(final=final, curve=curve, loss_first10=sum(losses[:10]) / max(1, len(losses[:10])),
                  loss_last10=sum(losses[-10:]) / max(1, len(losses[-10:])),
                  C_rms=C.pow(2).mean().sqrt().item(),
                  C_item_varying_share=varying_share(C.flatten(1)),
                  wall={"encode_s": t_enc, "train_s": t_train, "curve_eval_s": t_eval_curve,
                        "final_eval_s": time.time() - t0, "total_s": time.time() - t_start},
                  policy_embedding_rms=pol.embed.weight.pow(2).mean().sqrt().item())
    print(f"  final greedy exact: C {final['C']['exact']:.3f} zero {final['zero']['exact']:.3f} shuffled "
          f"{final['shuffled']['exact']:.3f} | gold logp C {final['C']['gold_logprob']:.2f} zero "
          f"{final['zero']['gold_logprob']:.2f} shuffled {final['shuffled']['gold_logprob']:.2f} | "
          f"{result['wall']['total_s']:.0f} s", flush=True)
    return result


def ceiling(a):
    """No training: C = the policy's own embeddings of " The answer is {a}." (m tokens, zero-padded at the end).
    Can the frozen policy read an answer placed where C goes at all?"""
    model, tok = load_model(POLICY)
    evals = items("val", a.eval_n, a.seed)
    out = {}
    for position in ("after", "before"):
        pol = Policy(model, tok, position, fast=position == "after")
        if pol.fast:
            pol.set_prefix([q for q, _ in evals])
        m = a.num_latents
        rows = []
        for _, ans in evals:
            ids = tok(f" The answer is {ans}.", add_special_tokens=False)["input_ids"][:m]
            e = pol.embed(torch.tensor(ids)).detach()
            rows.append(torch.cat([e, torch.zeros(m - len(ids), e.shape[1])]) if len(ids) < m else e)
        C = torch.stack(rows)
        adapter = lambda h: (C, None)   # noqa: E731, evaluate() calls adapter([h])[0]
        out[position] = evaluate(pol, adapter, evals, None, a.max_new_tokens, greedy=True)
        print(f"  ceiling {position}: exact C {out[position]['C']['exact']:.3f} zero {out[position]['zero']['exact']:.3f} "
              f"shuffled {out[position]['shuffled']['exact']:.3f}", flush=True)
    return out


# ----------------------------------------------------------------------------------------------------------
# Results


def load_results():
    path = os.path.join(OUT, "results.json")
    return json.load(open(path)) if os.path.exists(path) else {"probe": None, "ceiling": None, "runs": {}}


def save_results(res):
    os.makedirs(OUT, exist_ok=True)
    json.dump(res, open(os.path.join(OUT, "results.json"), "w"), indent=1)
    with open(os.path.join(OUT, "table.md"), "w") as f:
        f.write(markdown(res))


def markdown(res):
    L = ["# Channel test (experiments/channel.py)", ""]
    if res.get("probe"):
        p = res["probe"]
        L += [f"## Probe: ridge on standardised pooled states -> answer digits ({p['n_train']} train / {p['n_test']} "
              f"held-out items; chance exact {p['chance_exact']:.3f}, units {p['chance_units']:.3f})", "",
              "| expert | input | layer | pooling | probe exact | probe units digit | varying-energy share |",
              "|---|---|---|---|---|---|---|"]
        for r in p["rows"]:
            L.append(f"| {r['expert']} | {'oracle' if r['oracle'] else 'question'} | {r['layer']}/{r['layers']} | "
                     f"{r['pooling']} | {r['probe_exact']:.3f} | {r['probe_units']:.3f} | {r['varying_share']:.4f} |")
        L.append("")
    if res.get("ceiling"):
        L += ["## Ceiling: C = policy embeddings of \" The answer is {a}.\" (no training)", "",
              "| position | exact C | exact C=0 | exact shuffled | logp C | logp C=0 | logp shuffled |", "|---|---|---|---|---|---|---|"]
        for pos, r in res["ceiling"].items():
            L.append(f"| {pos} | {r['C']['exact']:.3f} | {r['zero']['exact']:.3f} | {r['shuffled']['exact']:.3f} | "
                     f"{r['C']['gold_logprob']:.2f} | {r['zero']['gold_logprob']:.2f} | {r['shuffled']['gold_logprob']:.2f} |")
        L.append("")
    if res.get("runs"):
        L += ["## Channel runs (greedy exact match and mean gold log-prob on the same held-out items)", "",
              "| run | exact C | C=0 | shuffled | logp C | logp C=0 | logp shuffled | steps x items | wall s |",
              "|---|---|---|---|---|---|---|---|---|"]
        for name, r in res["runs"].items():
            f_, c = r["final"], r["config"]
            L.append(f"| {name} | {f_['C']['exact']:.3f} | {f_['zero']['exact']:.3f} | {f_['shuffled']['exact']:.3f} | "
                     f"{f_['C']['gold_logprob']:.2f} | {f_['zero']['gold_logprob']:.2f} | "
                     f"{f_['shuffled']['gold_logprob']:.2f} | {c['steps']}x{c['batch']} | {r['wall']['total_s']:.0f} |")
        L.append("")
        L += ["## Curves (teacher-forced exact match C / C=0 / shuffled)", ""]
        for name, r in res["runs"].items():
            if r["curve"]:
                L.append(f"- {name}: " + ", ".join(f"{c['step']}: {c['C_tf_exact']:.2f}/{c['zero_tf_exact']:.2f}/"
                                                   f"{c['shuffled_tf_exact']:.2f}" for c in r["curve"]))
        L.append("")
    return "\n".join(L)


# The configurations of --suite, in the order they were run; each is a list of flags over the defaults.
_A = ["--position", "after", "--eval-every", "50"]
SUITE = [
    _A,                                                                   # the adapter as in adapter.py
    _A + ["--normalize", "standardize"],                                  # remove the constant massive dims
    _A[:2] + ["--normalize", "standardize", "--steps", "400", "--eval-every", "100"],   # the trend with steps
    _A + ["--normalize", "standardize", "--expert", "gemma3-270m"],       # a base decoder as the oracle
    _A + ["--normalize", "standardize", "--expert", "all-minilm-l6-v2"],  # an encoder as the oracle
    _A[:2] + ["--normalize", "standardize", "--layer", "8", "--lr", "3e-3", "--steps", "400", "--eval-every", "100"],
    _A[:2] + ["--normalize", "standardize", "--layer", "8", "--lr", "3e-3", "--steps", "200", "--eval-every", "100",
              "--lora"],                                                  # LoRA trains beside g_phi
]


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    a = p.add_argument
    a("--suite", action="store_true", help="regenerate results/channel/: probe, ceiling and every SUITE run")
    a("--probe-only", action="store_true", help="run only part 1 (the probe) and the ceiling")
    a("--skip-probe", action="store_true", help="with --suite: keep the stored probe and ceiling")
    a("--expert", default="smollm2-135m-instruct", choices=EXPERTS, help="pocket model that reads the text")
    a("--oracle", action=argparse.BooleanOptionalAction, default=True,
      help="the expert reads '{question} The answer is {answer}.' (--no-oracle: the question only)")
    a("--pooling", default="last", choices=POOLINGS, help="which token(s) of the expert's states are pooled")
    a("--layer", type=int, default=-1, help="hidden-state index (0 = embeddings, -1 = final, after the norm)")
    a("--normalize", default="none", choices=("none", "standardize", "layernorm"),
      help="standardize: per-dim (h - mean) / std before W_i; layernorm: LayerNorm after W_i")
    a("--ffn", default="tanh", choices=("tanh", "residual", "none"), help="adapter FFN (Eq. 16) variant")
    a("--out-init-std", type=float, default=0.0, help="std of W_out's init (0 = exact zero, Eq. 11)")
    a("--num-latents", type=int, default=8, help="m context tokens")
    a("--position", default="before", choices=("before", "after"), help="where C goes in the policy's input")
    a("--lr", type=float, default=1e-3, help="AdamW learning rate of the adapter (and LoRA)")
    a("--steps", type=int, default=150, help="optimizer steps")
    a("--batch", type=int, default=8, help="items per step")
    a("--train-n", type=int, default=0, help="distinct training items (0 = steps x batch, one pass)")
    a("--eval-n", type=int, default=60, help="held-out items for the final evaluation")
    a("--eval-every", type=int, default=0, help="teacher-forced curve point every N steps (0 = none)")
    a("--max-new-tokens", type=int, default=8, help="greedy tokens for the final evaluation")
    a("--lora", action="store_true", help="also train LoRA (rank 8) on the policy")
    a("--seed", type=int, default=0, help="seed of the data and the adapter's init")
    a("--probe-train", type=int, default=512, help="probe: training items")
    a("--probe-test", type=int, default=200, help="probe: held-out items")
    return p.parse_args(argv)


def main():
    a = parse()
    res = load_results()
    if a.suite or a.probe_only:
        if not (a.skip_probe and res.get("probe")):
            res["probe"] = probe(a)
            save_results(res)
            res["ceiling"] = ceiling(a)
            save_results(res)
        if a.probe_only:
            return
        for flags in SUITE:
            ra = parse(flags)
            name = run_name(ra)
            print(f"== {name}", flush=True)
            res["runs"][name] = channel(ra)
            save_results(res)
        return
    name = run_name(a)
    print(f"== {name}", flush=True)
    r = channel(a)
    res = load_results()   # another process may have added runs meanwhile
    res["runs"][name] = r
    save_results(res)


if __name__ == "__main__":
    main()
