"""
RLAE: a small trained agent picks the ensemble weights of frozen language models, span by span, during decoding.

    python neighbours/rlae.py --task chain_sum --team tiny --steps 2 --batch-size 2 --grad-accum 1 \
        --group-size 2 --max-new-tokens 16 --out runs/try-rlae            # seconds, on any CPU
    python neighbours/rlae.py evaluate --run runs/try-rlae --n 20       # eval.json

RLAE (Fu et al., EMNLP 2025) casts ensembling as a Markov decision process. The state s_j is the question and
the text generated so far; every L tokens (a span j) the agent takes an action, the weights w_j over the K
frozen members; within the span each next token comes from the weighted mixture of the members' next-token
distributions; the episode's reward is the exact match of the final answer. Here:

    s_j   = (E(question + text so far), j)              E: the team's frozen sentence encoder (mean pooled)
    alpha = ALPHA_INIT * exp(MLP([E(.) ; emb(j)]))       [K] concentrations; the MLP's last layer starts at 0
    w_j   ~ Dirichlet(alpha)                             training; the mean alpha / sum(alpha) in evaluation
    p(y)  = sum_k w_jk softmax(z_k / T)(y)              on the union vocabulary (neighbours/union_vocab.py)
    logp  = sum_j log Dir(w_j | alpha(s_j))              what the policy gradient uses

Training is GRPO-style: G weight trajectories per question, grpo.group_advantages, and grpo.grpo_loss with one
"token" per span (log Dir(w_j | alpha) for a token's log-prob, mu = 1, no KL): the loss is -mean_i A_i * mean_j
log Dir(w_ij | alpha_ij). Only the agent trains; the members, the encoder and the policy's LoRA (a member) stay
frozen. grpo_step is that step, train_run train.py's loop over it (one process); the rest is neighbours/plumbing.py.
The released RLAE trainer takes the PPO ratio on the weight vectors themselves (no action is sampled, so no
log-probability) with the raw reward as the advantage; we implement the paper's MDP: a stochastic policy over
weights (Dirichlet) with its real log-probabilities.

Deviations from the paper (numbered):
  1. The agent's encoder is the team's frozen sentence encoder (all-MiniLM-L6-v2 on the pocket team), not a
     trained DeBERTa, plus a learned embedding of the span index; only the MLP trains.
  2. GRPO's group baseline over G trajectories instead of PPO's learned critic; single agent (no MAPPO).
  3. Members: the team's generative experts and the policy model, each once, each reading the question with its
     own chat template and the task's prompt flags (system prompt, worked example, response prefix).
  4. A chosen token is re-tokenised piece by piece (the union token alone, not the whole text again), so a
     member may see "1", "2" where its own tokenizer would have written "12".
  5. Reward: the task's scorer (exact match for chain_sum); with --reward exact, full marks or 0; with --reward
     random, a fair coin per trajectory that never reads the text (rewards.coin_rewards, as train.py's control).

Cost: every generated token runs all K members once on their KV caches, and every L tokens the encoder reads the
text so far; no member runs a backward pass.

Logged per step beside train.py's fields: utilization (each member's drawn weight w, averaged over the step's span
decisions), agent_weights (the mean weights alpha / sum(alpha) over the same spans: exactly 1/K before the first
update), agent_weights_by_source (the same per reasoning-gym source dataset), entropy (of the drawn weights) and
concentration (mean sum of alpha at the first span).
"""
import math
import os
import sys
import time
from types import SimpleNamespace

import torch
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository's core

import grpo  # noqa: E402
import rewards  # noqa: E402
from adapter import entropy  # noqa: E402
from baselines import Context  # noqa: E402
from experts import ExpertPool, is_encoder, load_model  # noqa: E402
from rollout import draw, encode_prompts, eos_token_ids, prefill  # noqa: E402
from lib.kv_cache import cache_kwargs  # noqa: E402
from support.harness.build import load_policy_and_data, run_around  # noqa: E402
from support.harness.checks import parse  # noqa: E402
from support.harness.config import COUNT, build_parser  # noqa: E402
from support.harness.metrics import wall_clock  # noqa: E402
from support.harness.run import after_step, finish_run, progress_bar, resume_run  # noqa: E402
from support.harness.validation import restore_trained  # noqa: E402
from lib.optim import set_learning_rates  # noqa: E402
from neighbours import plumbing  # noqa: E402
from neighbours.union_vocab import UnionVocab, mixture  # noqa: E402

ALPHA_INIT = 2.0   # Dirichlet concentration per member at initialisation: w_j ~ Dir(2, .., 2), mean uniform


# ----------------------------------------------------------------------------------------------------------
# The agent


class Agent(nn.Module):
    """(encoder state e [N, d_e], span index j [N]) -> Dirichlet concentrations alpha [N, K]."""

    def __init__(self, d_e, K, max_spans, hidden=128, d_span=16):
        super().__init__()
        self.span = nn.Embedding(max_spans, d_span)
        self.w1, self.w2 = nn.Linear(d_e + d_span, hidden), nn.Linear(hidden, K)
        nn.init.zeros_(self.w2.weight), nn.init.zeros_(self.w2.bias)    # alpha = ALPHA_INIT for every state at init
        self.max_spans = max_spans

    def forward(self, e, j):
        x = torch.cat([e, self.span(j.clamp(max=self.max_spans - 1))], -1)     # (N, d_e + d_span)
        return ALPHA_INIT * torch.exp(self.w2(torch.tanh(self.w1(x))).clamp(-6, 6))  # (N, K)


def dirichlet_logprob(alpha, w):
    """log Dir(w | alpha), written out: lgamma(sum a) - sum lgamma(a_k) + sum (a_k - 1) log w_k."""
    return torch.lgamma(alpha.sum(-1)) - torch.lgamma(alpha).sum(-1) + ((alpha - 1) * w.log()).sum(-1)


class Member:
    """One frozen member decoding N rows on its own KV cache."""

    def __init__(self, model, tok):
        self.model, self.tok = model, tok

    @torch.no_grad()
    def start(self, prompts, G):
        """Prefill the prompts (padding behind each first token, rollout.encode_prompts, so no attention row is
        all masked; their common beginning run once, rollout.prefill's share) and repeat each row's cache G times."""
        ids, mask = encode_prompts(self.tok, prompts, self.model.device)
        self.cache, logits, mask, _ = prefill(self.model, ids, mask, None, G=1, position="after")
        self.cache.batch_repeat_interleave(G)                                   # (B, ...) -> (B*G, ...)
        self.mask, self.logits = mask.repeat_interleave(G, 0), logits.repeat_interleave(G, 0)

    @torch.no_grad()
    def extend(self, pieces):
        """Append each row's ids (a list, empty for finished rows) and keep the logits after its last new id."""
        L = max(len(p) for p in pieces)
        if L == 0:
            return
        pad = self.tok.pad_token_id
        ids = torch.tensor([p + [pad] * (L - len(p)) for p in pieces], device=self.mask.device)       # (N, L)
        new = torch.tensor([[1] * len(p) + [0] * (L - len(p)) for p in pieces], device=self.mask.device)
        self.mask = torch.cat([self.mask, new], 1)                                                      # (N, S + L)
        pos = (self.mask.cumsum(-1) - 1).clamp(min=0)[:, -L:]
        logits = self.model(input_ids=ids, attention_mask=self.mask, position_ids=pos, use_cache=True,
                            **cache_kwargs(self.model, self.cache)).logits                              # (N, L, V)
        n = new.sum(-1)                                                                                 # (N,)
        rows = (n > 0).nonzero().squeeze(-1)
        self.logits[rows] = logits[rows, n[rows] - 1].to(self.logits.dtype)


# ----------------------------------------------------------------------------------------------------------
# The method


class RLAE(nn.Module):
    """The frozen members, their union vocabulary, the frozen encoder and the trainable Agent (its only
    parameters, so its state_dict is what a checkpoint keeps)."""
    context_tokens = 0  # no C: the policy reads no context tokens

    def __init__(self, members, names, encoder, span, max_new_tokens, prompt_args):
        super().__init__()
        self.members, self.names, self.encoder = [Member(m, t) for m, t in members], names, encoder  # frozen
        self.vocab = UnionVocab([t for _, t in members],
                                [set(eos_token_ids(m, t)) for m, t in members],
                                [m.get_output_embeddings().weight.shape[0] for m, _ in members])
        self.span, self.max_new_tokens, self.prompt_args = span, max_new_tokens, prompt_args
        self.agent = Agent(encoder.dims[0], len(members), math.ceil(max_new_tokens / span))
        self.fixed_weights = None  # a [K] tensor: greedy decoding with these weights, not the agent's (a control)

    def forward(self, questions, answers=None, reuse=None):  # the interface of baselines.py: no context tokens
        return Context(None, None, [None] * len(questions))

    @torch.no_grad()
    def decode(self, questions, G, temperature=1.0, greedy=False):
        """G ensemble completions per question. Returns (texts [N]: each the response prefix and what was
        written after it, as the scorer reads it, rewards.responses), trajectory) with the trajectory's encoder
        states e [N, J, d_e], span indices, drawn weights w [N, J, K] and span mask [N, J] (spans the row was
        still decoding in), for the loss pass."""
        sp, we, rp = self.prompt_args
        for m in self.members:
            m.start([rewards.build_prompt(m.tok, q, sp, we, response_prefix=rp) for q in questions], G)
        N, K, J = len(questions) * G, len(self.members), math.ceil(self.max_new_tokens / self.span)
        rows_q = [q for q in questions for _ in range(G)]
        units = [[] for _ in range(N)]
        done = torch.zeros(N, dtype=torch.bool)
        E, W, span_mask = [], [], torch.zeros(N, J, dtype=torch.bool)
        for t in range(self.max_new_tokens):
            j = t // self.span
            if t % self.span == 0:  # a new span: the agent reads the state and sets the weights
                e = self.encoder.encode([q + "\n" + self.vocab.decode(u) for q, u in zip(rows_q, units)])[0]  # (N, d_e)
                alpha = self.agent(e, torch.full((N,), j, dtype=torch.long))                               # (N, K)
                w = alpha / alpha.sum(-1, keepdim=True) if greedy else torch.distributions.Dirichlet(alpha).sample()
                w = w.clamp_min(1e-6)
                w = w / w.sum(-1, keepdim=True)
                if greedy and self.fixed_weights is not None:  # experiments/rlae_members.py: one member alone
                    w = self.fixed_weights.to(w).expand(N, K)
                E.append(e), W.append(w)
                span_mask[:, j] = ~done
            P = torch.stack([self.vocab.member_probs(k, m.logits, temperature) for k, m in enumerate(self.members)])
            p = mixture(P, w)                                                                               # (N, U)
            nxt = p.argmax(-1) if greedy else draw(p.log(), 1.0)  # (N,) inverse-CDF draw from p itself
            for n in range(N):
                if not done[n]:
                    units[n].append(int(nxt[n]))
            done = done | (nxt == 0)
            if done.all():
                break
            for k, m in enumerate(self.members):  # K forwards of the chosen token, re-tokenised per member
                m.extend([[] if done[n] else self.vocab.piece(k, int(nxt[n])) for n in range(N)])
        Jr = len(E)
        traj = {"e": torch.stack(E, 1), "j": torch.arange(Jr).expand(N, Jr), "w": torch.stack(W, 1),
                "span_mask": span_mask[:, :Jr], "length": torch.tensor([len(u) for u in units]),
                "eos": torch.tensor([bool(u) and u[-1] == 0 for u in units])}
        return rewards.responses(rp, [self.vocab.decode(u) for u in units]), traj  # with the pre-filled words

    def span_logprobs(self, traj):
        """log Dir(w_j | alpha(s_j)) for every span of every row: [N, J], with gradient into the agent."""
        N, J = traj["w"].shape[:2]
        alpha = self.agent(traj["e"].flatten(0, 1), traj["j"].flatten()).view(N, J, -1)          # (N, J, K)
        return dirichlet_logprob(alpha, traj["w"]), alpha

    def answer(self, policy, tok, questions, args):
        """Greedy: the mean weights of each Dirichlet and the most likely union token (evaluate.py)."""
        return self.decode(questions, 1, greedy=True)[0]


def rlae(team, out_dim, args, device, dtype):
    """baselines.py's signature. Members: the team's generative experts, then the policy model, each once."""
    members, names = [], []
    for name in dict.fromkeys(team["experts"] + [team["policy"]]):
        if name.startswith("oracle:"):
            continue  # an oracle reads the gold answer: it cannot take part in decoding
        model, tok = load_model(name, device, dtype)
        if not is_encoder(model):
            members.append((model, tok)), names.append(name)
    encoder = ExpertPool([team["router"]], device, dtype, pooling="mean")
    return RLAE(members, names, encoder, args.ensemble_span, max_new_tokens=args.max_new_tokens,
                prompt_args=(args.system_prompt, args.worked_example, args.response_prefix)).to(device)


def load_trained(args, lora_state=None, method_state=None, device="cpu"):
    """A run of this script (its config `args`), loaded: (policy, tokenizer, method, eos_ids)."""
    policy, tok, dtype = plumbing.frozen_policy(args, device)
    g = rlae(args.team_models, policy.config.hidden_size, args, torch.device(device), dtype=dtype)
    return restore_trained(policy, tok, g, args, lora_state=lora_state, method_state=method_state)


def build_run(args, life):
    """A Run (support/harness/build.py) with this script's g, in build_run's seeded order: the frozen policy
    (seeded), rlae(...), LoRA on the policy and the optimiser, for the run `life` (plumbing.opened)."""
    with plumbing.one_line_errors():  # loaders raise ValueError / FileNotFoundError with a one-line message
        parts = load_policy_and_data(args, life.device)
        g = rlae(parts.team, parts.policy.config.hidden_size, args, life.device, dtype=parts.dtype)
        run = run_around(parts, g, args, life.device)
    run.life = life
    return run


# ----------------------------------------------------------------------------------------------------------
# One GRPO step, and the loop over them


def grpo_step(step, run, args, score_batch):
    """rollout (G weight trajectories per question) -> reward -> advantage -> loss on the agent -> step -> log."""
    ens, optimizer, G, device, t0 = run.method, run.optimizer, args.group_size, run.device, time.time()
    set_learning_rates(optimizer, step, args)                                    # --lr-schedule
    batches = []
    for micro in range(args.grad_accum):
        items = plumbing.micro_batch_items(run, args, step, micro)
        questions = [it["question"] for it in items]
        texts, traj = ens.decode(questions, G, args.temperature)                       # ---- rollout
        if args.reward == "random":                                                     # ---- reward
            r = rewards.coin_rewards(args.seed, step, micro, 0, n=len(texts))  # the control: text never read
            counts = {"no_answer": sum(rewards.extract_answer(t) is None for t in texts)}
        else:
            r, counts = score_batch([it for it in items for _ in range(G)], texts)
            if args.reward == "exact":  # full marks or nothing: partial credit pays no reward
                r = rewards.full_marks(r)
        r = torch.tensor(r, dtype=torch.float32, device=device)
        adv = grpo.group_advantages(r, G, scale=not args.no_scale_rewards)              # ---- advantage
        batches.append(SimpleNamespace(questions=questions, items=items, texts=texts, traj=traj, r=r, adv=adv,
                                       counts=counts))  # after_step reads .questions, .items, .texts, ...
    optimizer.zero_grad(set_to_none=True)                                               # ---- loss and step
    losses, stats, W, M, sources = [], [], [], [], []
    for b in batches:
        logp, alpha = ens.span_logprobs(b.traj)                                        # (N, J)
        mask = b.traj["span_mask"]
        loss, m = grpo.grpo_loss(logp=logp, logp_old=logp.detach(), logp_ref=logp.detach(), advantages=b.adv,
                                 mask=mask, clip_eps=args.clip_eps, beta=0.0, aggregation=args.loss_aggregation)
        (loss / args.grad_accum).backward()
        losses.append(loss.item()), stats.append(m)
        W.append(b.traj["w"][mask])                                                     # (spans, K) drawn
        M.append((alpha / alpha.sum(-1, keepdim=True)).detach()[mask])                  # (spans, K) their means
        # the item's type: its reasoning-gym source dataset (a composite task mixes several), else the task
        rows = [it.get("metadata", {}).get("source_dataset", args.task) for it in b.items for _ in range(G)]  # (N,)
        sources += [rows[n] for n in mask.nonzero()[:, 0].tolist()]                     # one per span of W
    grads = plumbing.update(optimizer, args, losses)
    W, M = torch.cat(W), torch.cat(M)                                                   # ---- log
    own = {"answer_rate": 1 - sum(b.counts.get("no_answer", 0) for b in batches) / sum(len(b.r) for b in batches),
           # the weights as the routing distribution of Eq. 15: one row per span decision
           "entropy": entropy(W).mean().item(), "utilization": W.mean(0).tolist(), "utilization_names": ens.names,
           "agent_weights": M.mean(0).tolist(),
           "agent_weights_by_source": {s: M[torch.tensor([x == s for x in sources])].mean(0).tolist()
                                       for s in sorted(set(sources))},
           "concentration": torch.cat([ens.agent(b.traj["e"][:, 0], b.traj["j"][:, 0]).sum(-1)
                                       for b in batches]).mean().item()}
    ended = torch.cat([b.traj["eos"] for b in batches])                                 # (N,) ended by EOS
    rec = plumbing.step_record(step, batches, G, losses=losses, stats=stats, grads=grads, own=own,
                               lengths=[b.traj["length"] for b in batches],
                               truncated_fraction=1 - ended.float().mean().item())
    # seconds, and tokens_per_s over the units of the union vocabulary the ensemble wrote
    rec.update(wall_clock(t0, int(sum(b.traj["length"].sum() for b in batches))))
    return rec, batches


def train_run(args, score_batch):
    """One run, as train.train runs one: opened, built, resumed, its steps, finished. Returns --out."""
    with plumbing.opened(args) as life:  # checks (bad input: exit 2), --out locked, Ctrl-C / SIGTERM, the device
        run = build_run(args, life)
        start = resume_run(run, args, run.world)  # --resume's checkpoint, config.json, validation before
        bar, bad_steps = progress_bar(start, args, life.writer), 0
        for step in range(start, args.steps):
            rec, batches = grpo_step(step, run, args, score_batch)
            # samples.jsonl, metrics.jsonl, the log line, checkpoint.pt; --max-bad-steps
            bad_steps = after_step(run, args, step, rec, batches=batches, bar=bar, bad_steps=bad_steps)
            bar.update(1)
        bar.close()
        return finish_run(run, args)  # lora_peft/, g_phi, the plot, validation after training


# ----------------------------------------------------------------------------------------------------------
# The command line: train, or `evaluate` a saved run (load_trained, above)


def parse_args(argv=None):
    """train.py's flags (support/harness/config.py), --method rlae, and RLAE's own; --reward random is the control."""
    p = build_parser(methods=["rlae"], description=__doc__.strip().splitlines()[0])
    a = p.add_argument_group("RLAE's own", "the agent's decisions during decoding").add_argument
    a("--ensemble-span", type=COUNT, default=8, help="tokens between two weight decisions (paper: L = 8)")
    args = parse(p, argv)
    return plumbing.refuse_train_levers(p, args, rewards=("task", "exact", "random"))


def main(argv=None, score_batch=None):
    """Train the agent (train.py's flags), or `evaluate --run DIR --n N` a run of it (eval.json)."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] != ["evaluate"]:
        return train_run(parse_args(argv), score_batch or rewards.score_batch)
    with plumbing.evaluation(argv[1:], "neighbours/rlae.py") as ev:  # one line on failure, nothing half-written
        loaded = load_trained(ev.cfg, ev.state["lora"], method_state=ev.state["method"], device=ev.device)
        ev.result = plumbing.score_run(*loaded, ev.cfg, ev.n, ev.batch_size)  # greedy, evaluate.py's result


if __name__ == "__main__":
    main()
