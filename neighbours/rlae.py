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
    p(y)  = sum_k w_jk softmax(z_k / T)(y)              on the union vocabulary, for the L tokens of span j
    logp  = sum_j log Dir(w_j | alpha(s_j))              what the policy gradient uses

Training is GRPO-style: G weight trajectories per question, the group advantage of grpo.group_advantages, and
grpo.grpo_loss with one "token" per span (log Dir(w_j | alpha) in place of a token's log-prob, mu = 1, no KL),
so the loss is -mean_i A_i * mean_j log Dir(w_ij | alpha_ij). Only the agent trains: the members, the encoder and
the policy's LoRA (a member, never updated) stay frozen.

The union vocabulary (UnionVocab, mixture: members with different tokenizers mixed over one vocabulary
matched by token strings) is neighbours/union_vocab.py.

The released RLAE trainer departs from the paper's MDP: it takes the PPO ratio on the weight vectors themselves
(no action is sampled, so there is no log-probability of an action), and uses the raw reward as the advantage.
We implement the paper's MDP: a stochastic policy over weights (Dirichlet) with its real log-probabilities.

Deviations from the paper (numbered):
  1. The agent's encoder is the team's frozen sentence encoder (all-MiniLM-L6-v2 on the pocket team), not a
     trained DeBERTa, plus a learned embedding of the span index; only the MLP trains.
  2. GRPO's group baseline over G trajectories instead of PPO's learned critic; single agent (no MAPPO).
  3. Members: the team's generative experts and the policy model, each once (the pocket team's SmolLM2 is both
     an expert and the policy: one member). Each member reads the question with its own chat template and the
     task's prompt flags (system prompt, worked example, response prefix).
  4. A chosen token is re-tokenised piece by piece (the union token alone, not the whole text again), so a
     member may see "1", "2" where its own tokenizer would have written "12".
  5. Reward: the task's scorer (rewards.score_batch), which is exact match for chain_sum; with --reward exact,
     full marks or 0 (rewards.full_marks: no partial credit); or, with --reward random, a fair coin per
     trajectory that never reads the text (rewards.coin_rewards, as train.py's control): what the agent's
     weights do when the reward carries no information (experiments/neighbours_learning.py compares).

Cost: every generated token runs all K members once (K forwards of one token each, on their KV caches), and every
L tokens the encoder reads the text so far; no member runs a backward pass. On the pocket team (K = 2: Gemma-3-270M
with a 262k-token head, SmolLM2-135M) a token costs about as much as the two models' decoding steps together.

Logged per step beside train.py's fields: utilization (each member's drawn weight w, averaged over every span
decision of the step), agent_weights (the agent's mean weights alpha / sum(alpha), averaged over the same spans:
the policy itself, without the Dirichlet's sampling noise; exactly 1/K before the first update),
agent_weights_by_source (the same per item type: the reasoning-gym source dataset), entropy (mean entropy of the
drawn weights) and concentration (mean sum of alpha at the first span).

This file is a script with its own step, one file per algorithm: grpo_step below is GRPO on the agent's span
decisions, and train_run is train.py's loop, copied, over it with this script's g (train.py's helpers:
checks, checkpoints, --resume, --eval-items). No torchrun: one process. Its `evaluate` scores a run with
RLAE.answer.
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
import train  # noqa: E402
from adapter import entropy  # noqa: E402
from baselines import Context  # noqa: E402
from experts import ExpertPool, is_encoder, load_model, pick_device  # noqa: E402
from rollout import draw, encode_prompts, prefill_shared  # noqa: E402
from support.lib import distributed  # noqa: E402
from support.lib.kv_cache import cache_kwargs  # noqa: E402
from support.harness.checks import parse, refuse_train_levers  # noqa: E402
from support.harness.config import COUNT, build_parser  # noqa: E402
from support.lib.optim import clip_gradients, set_learning_rates, step_if_finite  # noqa: E402
from support.harness.metrics import wall_clock  # noqa: E402
from support.harness.build import load_policy_and_data  # noqa: E402
from support.harness.config import fail  # noqa: E402
from support.harness.run import after_step, finish_run, open_run, progress_bar, release_folders, resume_run  # noqa: E402
from support.harness.validation import evaluating, frozen_policy, neighbour_eval_args  # noqa: E402
from support.harness.validation import restore_trained, save_eval, score_run  # noqa: E402
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
        all masked; their common beginning run once, rollout.prefill_shared) and repeat each row's cache G times."""
        ids, mask = encode_prompts(self.tok, prompts, self.model.device)
        self.cache, logits, mask, _ = prefill_shared(self.model, ids, mask, None, position="after")
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
                                [set(eos_ids(m, t)) for m, t in members],
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


def eos_ids(model, tok):
    ids = model.generation_config.eos_token_id
    ids = [] if ids is None else [ids] if isinstance(ids, int) else list(ids)
    return sorted({tok.eos_token_id, *ids} - {None})


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


# ----------------------------------------------------------------------------------------------------------
# One GRPO step (train, below, runs the loop)


def grpo_step(step, run, args, score_batch):
    """rollout (G weight trajectories per question) -> reward -> advantage -> loss on the agent -> step -> log."""
    ens, optimizer, G, device, t0 = run.method, run.optimizer, args.group_size, run.device, time.time()
    set_learning_rates(optimizer, step, args)                                    # --lr-schedule
    batches = []
    for micro in range(args.grad_accum):
        items = [run.train_items[i] for i in rewards.batch_indices(step, micro, args.batch_size, args.grad_accum,
                                                              n_items=len(run.train_items), seed=args.seed)]
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
        batches.append(dict(questions=questions, items=items, texts=texts, traj=traj, r=r, adv=adv, counts=counts))
    optimizer.zero_grad(set_to_none=True)                                               # ---- loss and step
    losses, stats, W, M, sources = [], [], [], [], []
    for b in batches:
        logp, alpha = ens.span_logprobs(b["traj"])                                     # (N, J)
        mask = b["traj"]["span_mask"]
        loss, m = grpo.grpo_loss(logp=logp, logp_old=logp.detach(), logp_ref=logp.detach(), advantages=b["adv"],
                                 mask=mask, clip_eps=args.clip_eps, beta=0.0, aggregation=args.loss_aggregation)
        (loss / args.grad_accum).backward()
        losses.append(loss.item()), stats.append(m)
        W.append(b["traj"]["w"][mask])                                                  # (spans, K) drawn
        M.append((alpha / alpha.sum(-1, keepdim=True)).detach()[mask])                  # (spans, K) their means
        rows = [item_source(it, args.task) for it in b["items"] for _ in range(G)]      # (N,) one per row
        sources += [rows[n] for n in mask.nonzero()[:, 0].tolist()]                     # one per span of W
    grad_norm, group_norms = clip_gradients(optimizer.param_groups, args.grad_clip, args.clip_per_group)
    finite = bool(torch.isfinite(torch.tensor([grad_norm, *losses])).all())
    if finite:  # and an update that makes a weight non-finite is undone
        finite = step_if_finite(optimizer)
    r_all = torch.cat([b["r"] for b in batches])                                        # ---- log
    same = torch.cat([(b["r"].view(-1, G) == b["r"].view(-1, G)[:, :1]).all(-1) for b in batches])
    W, M = torch.cat(W), torch.cat(M)
    rec = {"step": step + 1, "reward": r_all.mean().item(), "reward_std": r_all.std().item(),
           "solve_rate": (r_all == 1).float().mean().item(), "loss": sum(losses) / len(losses),
           **{k: sum(m[k] for m in stats) / len(stats) for k in ("pg_loss", "kl", "clip_fraction", "ratio_mean")},
           "grad_norm": grad_norm, **{f"grad_norm_{k}": v for k, v in group_norms.items()},
           "completion_length": torch.cat([b["traj"]["length"] for b in batches]).float().mean().item(),
           "truncated_fraction": 1 - torch.cat([b["traj"]["eos"] for b in batches]).float().mean().item(),
           "zero_std_fraction": same.float().mean().item(),
           "scorer_failures": sum(b["counts"].get(k, 0) for b in batches for k in ("refused", "error", "timeout")),
           "answer_rate": 1 - sum(b["counts"].get("no_answer", 0) for b in batches) / len(r_all),
           # the weights as the routing distribution of Eq. 15: one row per span decision
           "entropy": entropy(W).mean().item(), "utilization": W.mean(0).tolist(), "utilization_names": ens.names,
           "agent_weights": M.mean(0).tolist(),
           "agent_weights_by_source": {s: M[torch.tensor([x == s for x in sources])].mean(0).tolist()
                                       for s in sorted(set(sources))},
           "concentration": torch.cat([ens.agent(b["traj"]["e"][:, 0], b["traj"]["j"][:, 0]).sum(-1)
                                       for b in batches]).mean().item(),
           "skipped_update": not finite}
    # seconds, and tokens_per_s over the units of the union vocabulary the ensemble wrote
    rec.update(wall_clock(t0, int(sum(b["traj"]["length"].sum() for b in batches))))
    return rec, [SimpleNamespace(**b) for b in batches]  # after_step reads .questions, .items, ...


def item_source(item, task):
    """The item's type: its reasoning-gym source dataset (a composite task mixes several), else the task."""
    return item.get("metadata", {}).get("source_dataset", task)


def parse_args(argv=None):
    """train.py's flags (support/harness/config.py), --method rlae, and RLAE's own; --reward random is the control."""
    p = build_parser(methods=["rlae"], description=__doc__.strip().splitlines()[0])
    a = p.add_argument_group("RLAE's own", "the agent's decisions during decoding").add_argument
    a("--ensemble-span", type=COUNT, default=8, help="tokens between two weight decisions (paper: L = 8)")
    args = parse(p, argv)
    return refuse_train_levers(p, args, rewards=("task", "exact", "random"))


def main(argv=None, score_batch=None):
    """Train the agent (train.py's flags), or `evaluate --run DIR --n N` a run of it (eval.json)."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["evaluate"]:  # `evaluate --run DIR --n N`: eval.json in the run folder
        return evaluate(argv[1:])
    return train_run(parse_args(argv), score_batch or rewards.score_batch)


# ----------------------------------------------------------------------------------------------------------
# The run: train.py's loop and helpers (support/harness/run.py), with this script's g and step


def build_run(args, device):
    """train.Run with this script's g: the frozen policy (seeded) with LoRA, rlae(...), the data and the
    optimiser, in train.build_run's seeded order."""
    parts = load_policy_and_data(args, device)
    g = rlae(parts.team, parts.policy.config.hidden_size, args, device, dtype=parts.dtype)
    return train.run_around(parts, g, args, device)


def train_run(args, score_batch):
    """One run, as train.train runs one: checked and opened, built, resumed, its steps, finished. Returns --out."""
    world = distributed.ONE  # one process
    life = open_run(args, world)  # checks (bad input: exit 2), --out locked, Ctrl-C / SIGTERM, the device
    try:  # however the run ends, the lock on --out goes with it
        try:
            run = build_run(args, life.device)
        except (ValueError, FileNotFoundError) as e:  # loaders raise these with a one-line message
            fail(str(e))
        run.life = life
        start = resume_run(run, args, world)  # --resume's checkpoint, config.json, validation before
        bar, bad_steps = progress_bar(start, args, life.writer), 0
        for step in range(start, args.steps):
            rec, batches = grpo_step(step, run, args, score_batch)
            # samples.jsonl, metrics.jsonl, the log line, checkpoint.pt; --max-bad-steps
            bad_steps = after_step(run, args, step, rec, batches=batches, bar=bar, bad_steps=bad_steps)
            bar.update(1)
        bar.close()
        return finish_run(run, args)  # lora_peft/, g_phi, the plot, validation after training
    finally:
        release_folders(life)


def evaluate(argv):
    """`evaluate --run DIR --n N [--batch-size B] [--device D] [--out DIR]`: a run of this script scored on its
    checkpoint, eval.json written (nothing half-written on Ctrl-C, SIGTERM or bad input)."""
    a, cfg, state, path, made = neighbour_eval_args(argv, "neighbours/rlae.py")
    with evaluating(made):
        result = evaluate_run(cfg, a.n, a.batch_size, state["lora"], method_state=state["method"],
                              device=pick_device(a.device))
    save_eval(path, result, state)


def load_trained(args, lora_state=None, method_state=None, device="cpu"):
    """A run of this script (its config `args`), loaded: (policy, tokenizer, method, eos_ids)."""
    policy, tok, dtype = frozen_policy(args, device)
    g = rlae(args.team_models, policy.config.hidden_size, args, torch.device(device), dtype=dtype)
    return restore_trained(policy, tok, g, args, lora_state=lora_state, method_state=method_state)


def evaluate_run(args, n, batch_size=50, lora_state=None, method_state=None, device="cpu"):
    """The greedy validation score of a run of this script on its seed's first n items (evaluate.py's result)."""
    return score_run(*load_trained(args, lora_state, method_state, device), args, n, batch_size)


if __name__ == "__main__":
    main()
