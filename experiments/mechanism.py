"""
The mechanism test: can GRPO alone open the channel? The reinforcement-learning twin of the supervised channel
test (experiments/channel.py): the policy is frozen, an oracle expert knows the answer, and only the adapter
g_phi trains, by GRPO on the task's reward. The only way to more reward is through C.

    OMP_NUM_THREADS=1 taskset -c 0 python experiments/mechanism.py --suite     # results/mechanism/ (~1 h per run)
    python experiments/mechanism.py --steps 50 --channel-weight 1 --name try    # one run

The setting is the one under which the supervised channel opened (results/channel: SmolLM2's layer 8,
standardised states, C after the prompt: 43.3 % exact with C, 23.3 % with shuffled C after 400 x 8 items):
  policy   frozen SmolLM2-135M-Instruct, no LoRA; prompt p(x) = the DeepSeekZero system prompt with the worked
           example and the response prefix "<think>"; then C; then the pre-filled "</think>\n<answer>", so the
           first sampled token is the answer (a frozen policy cannot learn the format: deviation 4).
  expert   an oracle: SmolLM2-135M-Instruct reading "{x} The answer is {a}." through its chat template; its
           state at block 8 of 30, last token, standardised per dimension with the statistics of the first
           256 training items (channel.py's ChannelAdapter, normalize="standardize").
  start    anchored: C = e("\n") + W_out(...), W_out = 0 at init, so step 0 is the policy reading eight newline
           embeddings (train.py --context-anchor newline). The "C = anchor" arm is the policy without any
           information from the expert.
  task     chain_sum, 2 terms of 1-2 digits (the pocket task); reward 1 if the answer written before
           "</answer>" equals the gold answer, else 0: the task's exact answer, no format bonus.
  GRPO     B items x G samples per step at temperature 1, up to --max-new-tokens tokens; advantages
           grpo.group_advantages (scaled); loss grpo.grpo_loss with mu = 1 (logp_old = logp, detached) and
           beta = 0 (deviation 1); optionally + lambda * grpo.channel_forcing_loss (--channel-weight), the
           mismatched context of item i being the C of item i + 1 of the batch.
  measure  on the same held-out items at steps 0, 25, 50, 100, 200 (--eval-at): greedy exact match and the
           gold answer's log-prob with C, with C = the anchor alone, and with C shuffled across items (C of the
           next item: a derangement). "RL opens the channel" means: exact with C above shuffled C (paired sign
           test over items), and the gold log-prob with it.

Deviations (numbered):
  1. beta = 0: the reference of Eq. 4 would be this same frozen policy reading the anchor alone, so the KL term
     would charge exactly for using C, the thing under test. --beta > 0 adds it back (k3, grpo_loss).
  2. The fast path of channel.py (its Policy class): the prompt tokens common to every item run once and
     their KV cache is reused; the per-item tail runs without gradient (it comes before C); only C and the
     completion tokens carry gradient. The sampled completions' log-probs are checked against
     rollout.completion_logprobs on a few items before training (recorded as fast_path_check).
  3. Items are drawn in order from the training split without repetition (steps x B distinct items).
  4. Where C goes: the supervised test put C after the whole pre-fill, right before the answer; there a zero or
     newline C derails the frozen policy (0 % exact at step 0, gold log-prob -10 to -21), which leaves GRPO no
     reward to start from. Here C sits after "<think>" and the fixed "</think>\n<answer>" follows it
     (PrefilledPolicy), so the untrained policy answers as it does without C and RL has a signal from step 0.
  5. The supervised run of the suite is the same setting (placement, anchor, budget of items) trained by
     cross-entropy on the gold answer: the reference for "how many steps RL costs against supervision".
Machine: one core; see each run's wall times in table.md.
"""
import argparse
import json
import os
import sys
import time
import zlib

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "experiments"))

import grpo  # noqa: E402
import rollout  # noqa: E402
from channel import (CACHE, POLICY, RESPONSE, TASK, TASK_CONFIG, ChannelAdapter, Policy, encode,  # noqa: E402
                     expert_input, expert_model, pad_left, teacher_forced)
from experts import load_model  # noqa: E402
from rewards import build_prompt, extract_answer, load_entries  # noqa: E402
from lib import kv_cache  # noqa: E402
from lib.stats import paired_comparison  # noqa: E402

OUT = os.path.join(ROOT, "results", "mechanism")
# The GRPO runs of the suite are shorter than the defaults for lack of CPU: on one shared core a step of
# B 4 x G 16 took over 36 s (the 64 rows' KV caches are copied at every decoding step), so the suite runs
# B 4 x G 8 for 60 steps (240 items), against the supervised reference's 100 steps (400 items).
SHORT = ["--group-size", "8", "--steps", "60", "--eval-at", "30", "60"]
SUITE = {  # name -> flags over the defaults; run in this order by --suite
    "supervised": ["--objective", "supervised"],
    "grpo": SHORT,
    # twice the cost of a step (a second scoring pass with the mismatched C): 30 steps, the grpo run's first point
    "grpo+cf1": SHORT[:2] + ["--steps", "30", "--eval-at", "30", "--channel-weight", "1"],
}


def items(split, n, seed, config, task=TASK):
    """[(question, answer)] of the task with this reasoning-gym config, in load_entries order."""
    return [(e["question"], e["answer"]) for e in load_entries(task, split, n, seed, None, config)[:n]]


def states(expert, layer, split, n, seed, config, task=TASK, oracle=True):
    """The expert's last-token states at `layer` [n, d] for the first n items, cached on disk (the expert is
    frozen). oracle: the expert reads "{question} The answer is {answer}." (channel.encode, as the supervised
    channel test); else the question alone, through its chat template, exactly as the screen's probe read it
    (screen.last_token_states: the same function, so the ceiling and the probe see the same vectors)."""
    os.makedirs(CACHE, exist_ok=True)
    key = zlib.crc32((config + task).encode()) if task != TASK else zlib.crc32(config.encode())
    reads = "" if oracle else "-question"
    path = os.path.join(CACHE, f"mechanism-{expert}{reads}-L{layer}-{split}-s{seed}-{key:08x}.pt")
    have = torch.load(path) if os.path.exists(path) else torch.zeros(0)
    if len(have) < n:
        model, tok = expert_model(expert)
        todo = items(split, n, seed, config, task)[len(have):]
        if oracle:
            new = encode(model, tok, [expert_input(q, a, True) for q, a in todo])["last"][layer]
        else:
            from screen import last_token_states
            by_depth, _ = last_token_states(model, tok, [q for q, _ in todo])
            if layer not in by_depth:
                raise SystemExit(f"error: --layer {layer}: the question-only states exist at {sorted(by_depth)}")
            new = by_depth[layer]
        have = torch.cat([have.view(-1, new.shape[-1]), new])
        torch.save(have, path)
    return have[:n]


class PrefilledPolicy(Policy):
    """channel.py's frozen policy with C between the prompt and the pre-filled end of the thought: the input is
    [p(x) || C || "</think>\n<answer>" || y], p(x) ending in the response prefix "<think>" (as train.py's
    [x || C] with --response-prefix "<think>"), so the answer format comes after C whatever C is (deviation 4)."""

    def prompt_ids(self, q):
        text = build_prompt(self.tok, q, "DeepSeekZero", worked_example=True, response_prefix="<think>")
        return self.tok(text, add_special_tokens=False)["input_ids"]

    def post_ids(self):
        return torch.tensor(self.tok(RESPONSE, add_special_tokens=False)["input_ids"])

    def _fast_prefill(self, questions, C, extra_embeds=None, extra_mask=None, logits_to_keep=1):
        post = self.embed(self.post_ids())[None].expand(len(C), -1, -1)                 # (B, P', D)
        post_mask = torch.ones(post.shape[:2], dtype=torch.bool)
        if extra_embeds is not None:
            post, post_mask = torch.cat([post, extra_embeds], 1), torch.cat([post_mask, extra_mask], 1)
        return super()._fast_prefill(questions, C, post, post_mask, logits_to_keep)


class Anchored(torch.nn.Module):
    """C = anchor + g_phi(h): the adapter's output moved to the policy's newline embedding (deviation: start)."""

    def __init__(self, adapter, anchor):
        super().__init__()
        self.adapter = adapter
        self.register_buffer("anchor", anchor)

    def forward(self, h):
        C, A = self.adapter([h])
        return C + self.anchor, A


@torch.no_grad()
def sample(pol, questions, C, G, max_new, generator):
    """G completions per question at temperature 1 through the fast path: token ids [B*G, T] (pad after EOS).
    Each question's prompt and C run once and the cache is repeated G times, as rollout.prefill does (the
    prefill of B*G rows, once per sample, made the item screen 16x slower)."""
    qs = [q for q in questions for _ in range(G)]
    out, mask, pos = pol._fast_prefill(list(questions), C)
    cache = kv_cache.cache_of(out)
    cache.batch_repeat_interleave(G)                                                  # (B, ...) -> (B*G, ...)
    logits, mask, pos = (t.repeat_interleave(G, 0) for t in (out.logits[:, -1], mask, pos[:, -1:]))
    done, toks = torch.zeros(len(qs), dtype=torch.bool), []
    eos = torch.tensor(pol.eos)
    for _ in range(max_new):
        probs = torch.softmax(logits.float(), -1)
        nxt = torch.multinomial(probs, 1, generator=generator).squeeze(1)
        nxt = torch.where(done, torch.full_like(nxt, pol.pad), nxt)
        toks.append(nxt)
        done |= torch.isin(nxt, eos)
        if done.all():
            break
        mask, pos = torch.cat([mask, torch.ones_like(mask[:, :1])], 1), pos + 1
        o = pol.model(input_ids=nxt[:, None], attention_mask=mask, position_ids=pos,
                      **kv_cache.cache_kwargs(pol.model, cache), use_cache=True)
        cache, logits = kv_cache.cache_of(o), o.logits[:, -1]
    return torch.stack(toks, 1)


def completion_logprobs(pol, questions, C, comp, comp_mask):
    """log pi(y_t | p(x) C, y_<t) [N, T] for N = B*G completions (G per question), gradient to C only. The
    prompt, C and the pre-fill run once per question (B rows, C with its gradient); their cache is repeated G
    times (repeat_interleave is differentiable) and only the completions run at B*G rows: 2 x 13 + 32 x 5
    tokens a step instead of 32 x 18 (fast_path_check holds it to rollout.completion_logprobs)."""
    G = comp.shape[0] // len(questions)
    T = comp.shape[1]
    out, mask, pos = pol._fast_prefill(list(questions), C)                      # [tail | C | pre-fill], B rows
    cache = kv_cache.cache_of(out)
    cache.batch_repeat_interleave(G)                                            # (B, ...) -> (B*G, ...)
    first = out.logits[:, -1:].repeat_interleave(G, 0)                          # predicts y_0
    mask = torch.cat([mask.repeat_interleave(G, 0), comp_mask], 1)
    pos = pos[:, -1:].repeat_interleave(G, 0) + torch.arange(1, T + 1)          # padding after EOS: unread
    o = pol.model(inputs_embeds=pol.embed(comp), attention_mask=mask, position_ids=pos,
                  **kv_cache.cache_kwargs(pol.model, cache), use_cache=True, logits_to_keep=T)
    return grpo.token_logprobs(torch.cat([first, o.logits[:, :T - 1]], 1), comp)


def rewards_of(pol, comp, comp_mask, answers, G):
    texts = pol.tok.batch_decode(comp.masked_fill(~comp_mask, pol.pad), skip_special_tokens=True)
    gold = [a for a in answers for _ in range(G)]
    return torch.tensor([float(extract_answer("<answer>" + t) == a) for t, a in zip(texts, gold)]), texts


def evaluate(pol, g, eval_items, H, max_new, batch=20, anchor=None):
    """The paired arms on the same items: C, C = anchor alone, C shuffled (item k reads the C of item k + 1).
    anchor: an earlier evaluation's "anchor" arm, reused (the frozen policy reading the fixed anchor gives the same
    greedy answers and log-probs at every step, so it is evaluated once per run)."""
    with torch.no_grad():
        C = g(H)[0]
    n = len(eval_items)
    arms = {"C": C, "anchor": g.anchor.expand_as(C), "shuffled": C[torch.arange(n).roll(-1)]}
    res = {"anchor": anchor} if anchor is not None else {}
    for arm, Ca in arms.items():
        if arm in res:
            continue
        lp, texts = [], []
        for i in range(0, n, batch):
            it, c = eval_items[i:i + batch], Ca[i:i + batch]
            lp.append(teacher_forced(pol, it, c)[0])
            texts += pol.greedy(it, c, max_new)
        ok = [int(extract_answer("<answer>" + t) == a) for t, (_, a) in zip(texts, eval_items)]
        lp = torch.cat(lp)
        res[arm] = {"exact": float(np.mean(ok)), "gold_logprob": lp.mean().item(), "per_item_exact": ok,
                    "per_item_logprob": [round(v, 4) for v in lp.tolist()]}
    for other in ("anchor", "shuffled"):
        res[f"C - {other}"] = {k: paired_comparison(res["C"][f"per_item_{k}"], res[other][f"per_item_{k}"])
                               for k in ("exact", "logprob")}
    res["shuffle_same_answer"] = sum(eval_items[i][1] == eval_items[(i + 1) % n][1] for i in range(n))
    return res


def fast_path_check(pol, g, H, train, G, max_new):
    """Deviation 2: the fast path's log-probs of sampled completions against rollout.completion_logprobs."""
    its = train[:2]  # one item when the screen kept one
    with torch.no_grad():
        C = g(H[:len(its)])[0] + 0.05 * torch.randn(len(its), g.anchor.shape[0], g.anchor.shape[1])
        comp = sample(pol, [q for q, _ in its], C, 2, max_new, torch.Generator().manual_seed(0))
        cmask = grpo.completion_mask(comp, pol.eos)
        fast = completion_logprobs(pol, [q for q, _ in its], C, comp, cmask)
        ids, mask = pad_left([pol.prompt_ids(q) for q, _ in its], pol.pad)
        post = pol.post_ids()[None].expand(len(comp), -1)                               # the pre-fill
        ref = rollout.completion_logprobs(pol.model, ids, mask, C, torch.cat([post, comp], 1),
                                          torch.cat([torch.ones_like(post, dtype=torch.bool), cmask], 1), 1.0,
                                          "after")[:, post.shape[1]:]
    return (fast - ref).abs()[cmask].max().item()


def solved_in_range(pol, g, train, solved_range, G, max_new, seed, batch=4):
    """Indices of the training items whose G samples at temperature 1, with C = the anchor (the frozen policy
    knowing nothing from the expert), are right between LO and HI of the time (both included): the items where a
    group's rewards can differ. Returns (indices, {"solved": [fraction per item], "seconds"})."""
    t0, gen, solved = time.time(), torch.Generator().manual_seed(seed + 7919), []
    for i in range(0, len(train), batch):
        chunk = train[i:i + batch]
        C = g.anchor.expand(len(chunk), -1, -1)
        comp = sample(pol, [q for q, _ in chunk], C, G, max_new, gen)
        r, _ = rewards_of(pol, comp, grpo.completion_mask(comp, pol.eos), [ans for _, ans in chunk], G)
        solved += r.view(len(chunk), G).mean(1).tolist()
    lo, hi = solved_range
    return [k for k, f in enumerate(solved) if lo <= f <= hi], {"solved": solved, "seconds": time.time() - t0}


def screen_from(path, a, n_train, ds):
    """The "screen" of an earlier run's record (a partial-NAME.json), checked to be of the same items and draws."""
    try:
        with open(path) as f:
            rec = json.load(f)
        screen, c = rec["screen"], rec["config"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise SystemExit(f"error: --screen-from {path}: not a record with a screen ({type(e).__name__}: {e})")
    theirs = c["seed"] if c.get("data_seed") is None else c["data_seed"]
    same = {"task": c["task"] == a.task, "task config": c["task_config"] == a.task_config,
            "data seed": theirs == ds, "screen group": c["screen_group"] == a.screen_group,
            "max new tokens": c["max_new_tokens"] == a.max_new_tokens, "items": len(screen["solved"]) == n_train}
    if not all(same.values()):
        raise SystemExit(f"error: --screen-from {path}: another screen ({', '.join(k for k, v in same.items() if not v)}"
                         " differ)")
    return {**screen, "from": path}


def run(a, partial=None):
    torch.manual_seed(a.seed)
    t_start = time.time()
    n_train = min(a.steps * a.batch, a.train_items or a.steps * a.batch)
    oracle = a.expert_reads == "question+answer"
    ds = a.seed if a.data_seed is None else a.data_seed  # the items (and the screen's draws)
    train = items("train", n_train, ds, a.task_config, a.task)
    evals = items("val", a.eval_n, ds, a.task_config, a.task)
    H_tr = states(a.expert, a.layer, "train", n_train, ds, a.task_config, a.task, oracle)
    H_ev = states(a.expert, a.layer, "val", a.eval_n, ds, a.task_config, a.task, oracle)
    expert_model.__globals__["_MODELS"].clear()   # the expert's weights are not needed any more
    model, tok = load_model(POLICY)
    for p in model.parameters():
        p.requires_grad_(False)
    pol = PrefilledPolicy(model, tok, "after", fast=True)
    pol.set_prefix([q for q, _ in train] + [q for q, _ in evals])
    stats = [(H_tr[:256].mean(0), H_tr[:256].std(0) + 1e-6)]
    newline = model.get_input_embeddings().weight[tok.encode("\n", add_special_tokens=False)[-1]].detach()
    adapter = ChannelAdapter([H_tr.shape[1]], model.config.hidden_size, "standardize", stats, "tanh", 0.0,
                             num_latents=a.num_latents)
    g = Anchored(adapter, newline.expand(a.num_latents, -1).clone())
    if a.init_g:  # e.g. the ceiling's g_phi: does RL keep an open channel open?
        g.load_state_dict(torch.load(a.init_g, weights_only=True))
    screen = None
    if a.solved_range:  # keep the training items the frozen policy (C = the anchor) solves LO..HI of the time
        if a.screen_from:  # an earlier run's screen of the same items (its draws are seeded by the data seed)
            screen = screen_from(a.screen_from, a, n_train, ds)
            keep = [k for k, f in enumerate(screen["solved"]) if a.solved_range[0] <= f <= a.solved_range[1]]
        else:
            keep, screen = solved_in_range(pol, g, train, a.solved_range, a.screen_group, a.max_new_tokens, ds)
        counts = [0] * (a.screen_group + 1)  # items by how many of their G draws were right
        for f in screen["solved"]:
            counts[round(f * a.screen_group)] += 1
        screen["items_by_right_draws"] = counts
        print(f"  items the anchored policy solves {a.solved_range[0]:g}-{a.solved_range[1]:g} of {a.screen_group} "
              f"draws: {len(keep)} of {len(train)} ({screen['seconds']:.0f} s); items by right draws "
              f"0..{a.screen_group}: {counts}", flush=True)
        if partial:  # the screen is worth keeping whatever happens next
            os.makedirs(os.path.dirname(partial), exist_ok=True)
            with open(partial, "w") as f:
                json.dump({"config": vars(a), "screen": screen}, f)
        if not keep:
            raise SystemExit("error: --solved-range: no training item in that range")
        train, H_tr, n_train = [train[k] for k in keep], H_tr[keep], len(keep)
    opt = torch.optim.AdamW([p for p in g.parameters() if p.requires_grad], lr=a.lr, weight_decay=1e-2, eps=1e-6)
    gen = torch.Generator().manual_seed(a.seed)
    result = {"config": vars(a), "fast_path_check": fast_path_check(pol, g, H_tr, train, 2, a.max_new_tokens),
              "curve": [], "steps": [], "screen": screen}
    print(f"  fast path vs rollout.completion_logprobs: max |d logp| {result['fast_path_check']:.2e}", flush=True)
    assert result["fast_path_check"] < 1e-3, "the fast path disagrees with rollout.completion_logprobs"
    t_train = t_eval = 0.0

    def curve_point(step):
        nonlocal t_eval
        t0 = time.time()
        r = evaluate(pol, g, evals, H_ev, a.max_new_tokens,
                     anchor=result["curve"][0]["anchor"] if result["curve"] else None)
        t_eval += time.time() - t0
        result["curve"].append({"step": step, **r})
        if partial:  # what a stopped run leaves: every evaluation so far and the steps before it
            os.makedirs(os.path.dirname(partial), exist_ok=True)
            with open(partial, "w") as f:
                json.dump({**result, "wall": {"train_s": t_train, "eval_s": t_eval,
                                              "total_s": time.time() - t_start}}, f)
        print(f"  step {step:4d} | exact C {r['C']['exact']:.3f} anchor {r['anchor']['exact']:.3f} shuffled "
              f"{r['shuffled']['exact']:.3f} (C - shuffled p = {r['C - shuffled']['exact']['p_sign']:.3g}) | "
              f"gold logp C {r['C']['gold_logprob']:.2f} anchor {r['anchor']['gold_logprob']:.2f} shuffled "
              f"{r['shuffled']['gold_logprob']:.2f}", flush=True)

    curve_point(0)
    for step in range(1, a.steps + 1):
        t0 = time.time()
        idx = [k % n_train for k in range((step - 1) * a.batch, step * a.batch)]  # cycles over --train-items
        qs, ans = [train[k][0] for k in idx], [train[k][1] for k in idx]
        if a.objective == "supervised":  # the reference: cross-entropy on the gold tokens, as channel.py
            C, _ = g(H_tr[idx])
            logp, gold_mask = pol.gold_logprobs([train[k] for k in idx], C)
            loss = -(torch.where(gold_mask, logp, torch.zeros_like(logp)).sum() / gold_mask.sum())
            opt.zero_grad()
            loss.backward()
            opt.step()
            t_train += time.time() - t0
            result["steps"].append({"step": step, "loss": loss.item(), "reward": float("nan"),
                                    "C_rms": (C - g.anchor).pow(2).mean().sqrt().item()})
            if step in a.eval_at:
                curve_point(step)
            continue
        with torch.no_grad():
            C_roll = g(H_tr[idx])[0]
        comp = sample(pol, qs, C_roll, a.group_size, a.max_new_tokens, gen)             # (B*G, T)
        comp_mask = grpo.completion_mask(comp, pol.eos)
        r, _ = rewards_of(pol, comp, comp_mask, ans, a.group_size)
        adv = grpo.group_advantages(r, a.group_size)
        C, _ = g(H_tr[idx])                                                              # (B, m, D) with grad
        logp = completion_logprobs(pol, qs, C, comp, comp_mask)
        logp_ref = logp.detach()                                                         # beta = 0: unused
        if a.beta:
            with torch.no_grad():
                logp_ref = completion_logprobs(pol, qs, g.anchor.expand_as(C), comp, comp_mask)
        loss, m = grpo.grpo_loss(logp=logp, logp_old=logp.detach(), logp_ref=logp_ref, advantages=adv, mask=comp_mask,
                                 clip_eps=0.2, beta=a.beta, aggregation="sequence")
        if a.channel_weight:
            logp_mis = completion_logprobs(pol, qs, C.roll(-1, dims=0), comp, comp_mask)
            cf, mcf = grpo.channel_forcing_loss(logp, logp_mis, adv, comp_mask)
            loss, m = loss + a.channel_weight * cf, {**m, **mcf}
        opt.zero_grad()
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(g.parameters(), 1.0).item()
        opt.step()
        t_train += time.time() - t0
        rec = {"step": step, "reward": r.mean().item(), "zero_std_fraction":
               float((r.view(-1, a.group_size).std(1) == 0).float().mean()), "grad_norm": grad_norm,
               "C_rms": (C - g.anchor).pow(2).mean().sqrt().item(), **m}
        result["steps"].append(rec)
        if step % 10 == 0:
            last = result["steps"][-10:]
            print(f"  step {step:4d} | reward {np.mean([x['reward'] for x in last]):.3f} | |C - anchor| "
                  f"{rec['C_rms']:.3f} | {t_train / step:.2f} s/step"
                  + (f" | cf margin {rec['cf_margin']:.3f}" if a.channel_weight else ""), flush=True)
        if step in a.eval_at:
            curve_point(step)
    result["wall"] = {"train_s": t_train, "eval_s": t_eval, "total_s": time.time() - t_start}
    if a.save_g:
        torch.save(g.state_dict(), a.save_g)
    return result


def markdown(res):
    L = ["# The mechanism test: can the context builder alone carry an expert's state into a frozen policy? "
         "(experiments/mechanism.py)", "",
         "Frozen SmolLM2-135M-Instruct policy, only g_phi trained (by cross-entropy on the gold answer, or by GRPO "
         "on the exact-answer reward), the anchored start; each run's expert, task and items below. Held-out items, "
         "greedy; paired arms on the same items. Sign test p over the items that differ.",
         "", "Each run's command is its config (results.json) as flags of experiments/mechanism.py; `OMP_NUM_THREADS=1 "
         "taskset -c 0 python experiments/mechanism.py --suite` re-runs the oracle suite (results/mechanism/).", ""]
    for name, r in res["runs"].items():
        c = r["config"]
        kind = (f"GRPO, B {c['batch']} x G {c['group_size']}, channel weight {c['channel_weight']:g}, beta "
                f"{c['beta']:g}" if c["objective"] == "grpo" else f"supervised (cross-entropy), B {c['batch']}")
        reads = ("the question and its answer (an oracle)" if c.get("expert_reads", "question+answer") ==
                 "question+answer" else "the question only")
        screen = r.get("screen")
        kept = (f"; items the anchored policy solves {c['solved_range'][0]:g}-{c['solved_range'][1]:g} of "
                f"{c['screen_group']} draws: {sum(c['solved_range'][0] <= f <= c['solved_range'][1] for f in screen['solved'])}"
                f" of {len(screen['solved'])} (by right draws 0..{c['screen_group']}: "
                f"{screen.get('items_by_right_draws', 'not counted')})" if screen else "")
        L += [f"## {name}: {kind}, lr {c['lr']:g}, seed {c['seed']}", "",
              f"Task {c.get('task', TASK)} {c['task_config']}; expert {c['expert']} reading {reads}, state "
              f"{c['layer']}; {c.get('train_items') or c['steps'] * c['batch']} training items{kept}; "
              f"{c['eval_n']} held-out items.", "",
              "| step | exact C | exact anchor | exact shuffled | C − shuffled (points) [95 % CI], p | "
              "gold log-prob C | anchor | shuffled | C − shuffled log-prob [95 % CI], p |",
              "|---|---|---|---|---|---|---|---|---|"]
        for p in r["curve"]:
            e, lp = p["C - shuffled"]["exact"], p["C - shuffled"]["logprob"]
            L.append(f"| {p['step']} | {100 * p['C']['exact']:.1f} | {100 * p['anchor']['exact']:.1f} | "
                     f"{100 * p['shuffled']['exact']:.1f} | {100 * e['diff']:+.1f} [{100 * e['ci95'][0]:+.1f}, "
                     f"{100 * e['ci95'][1]:+.1f}], {e['p_sign']:.3g} | {p['C']['gold_logprob']:.2f} | "
                     f"{p['anchor']['gold_logprob']:.2f} | {p['shuffled']['gold_logprob']:.2f} | "
                     f"{lp['diff']:+.2f} [{lp['ci95'][0]:+.2f}, {lp['ci95'][1]:+.2f}], {lp['p_sign']:.3g} |")
        w = r.get("wall", {})
        steps = r["steps"]
        if steps:
            reward = (f"Training reward (mean of the first / last 20 steps): "
                      f"{np.mean([s['reward'] for s in steps[:20]]):.3f} / "
                      f"{np.mean([s['reward'] for s in steps[-20:]]):.3f}; "
                      if c["objective"] == "grpo" else "")
            L += ["", reward + f"|C − anchor| rms at the end {steps[-1]['C_rms']:.3f}; fast-path check "
                  f"{r['fast_path_check']:.1e}; wall: training {w.get('train_s', 0) / 60:.1f} min "
                  f"({w.get('train_s', 0) / len(steps):.1f} s/step), evaluations {w.get('eval_s', 0) / 60:.1f} "
                  f"min, total {w.get('total_s', 0) / 60:.1f} min."]
        L.append("")
    return "\n".join(L)


def save(res):
    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(OUT, "results.json"), "w") as f:
        json.dump(res, f, indent=1)
    with open(os.path.join(OUT, "table.md"), "w") as f:
        f.write(markdown(res))


def load():
    path = os.path.join(OUT, "results.json")
    return json.load(open(path)) if os.path.exists(path) else {"runs": {}}


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    a = p.add_argument
    a("--suite", action="store_true", help="every SUITE run not yet in results/mechanism/results.json")
    a("--table-only", action="store_true", help="rebuild results/mechanism/table.md from results.json")
    a("--name", default=None, help="the run's name in results.json (default: from its flags)")
    a("--expert", default="smollm2-135m-instruct", help="pocket model that reads the item")
    a("--expert-reads", default="question+answer", choices=["question+answer", "question"],
      help="question+answer: an oracle (deviation: a diagnostic); question: what a real expert sees, read as the "
      "screen's probe read it (the ceiling of issue 33 on gcd)")
    a("--task", default=TASK, help="reasoning-gym task (chain_sum: the pocket task; gcd: the second verdict's)")
    a("--layer", type=int, default=8, help="hidden-state index of the expert (0 = embeddings)")
    a("--num-latents", type=int, default=8, help="m context tokens")
    a("--task-config", default=TASK_CONFIG, help="chain_sum's reasoning-gym config, JSON (default: the pocket "
      "task, 2 terms of 1-2 digits)")
    a("--steps", type=int, default=100, help="optimiser steps")
    a("--eval-at", type=int, nargs="+", default=[25, 50, 100], help="steps after which to evaluate (and 0)")
    a("--batch", type=int, default=4, help="items per step (B)")
    a("--group-size", type=int, default=16, help="samples per item (G): the untrained policy is right about "
      "1 % of the time, so a group needs many draws to hold one right answer")
    a("--max-new-tokens", type=int, default=8, help="sampled and greedy tokens after '<answer>'")
    a("--lr", type=float, default=3e-3, help="AdamW learning rate of g_phi (the supervised run's)")
    a("--beta", type=float, default=0.0, help="KL coefficient (deviation 1: 0)")
    a("--channel-weight", type=float, default=0.0, help="lambda of grpo.channel_forcing_loss (0: plain GRPO)")
    a("--objective", default="grpo", choices=["grpo", "supervised"], help="grpo: the test; supervised: the "
      "same setting trained by cross-entropy on the gold answer (the reference curve)")
    a("--eval-n", type=int, default=60, help="held-out items")
    a("--results", default=OUT, help="folder of results.json and table.md")
    a("--save-g", default=None, help="write g_phi's state_dict here at the end (the ceiling's, for --init-g)")
    a("--init-g", default=None, help="start g_phi from this state_dict (e.g. the ceiling's)")
    a("--solved-range", type=float, nargs=2, default=None, metavar=("LO", "HI"),
      help="train only on items the anchored policy solves LO..HI of --screen-group draws (e.g. 0.2 0.5)")
    a("--screen-group", type=int, default=16, help="draws per item for --solved-range")
    a("--train-items", type=int, default=0, help="distinct training items, cycled (0: steps x batch, each once)")
    a("--seed", type=int, default=0, help="seed of the adapter's init and the sampling (and of the items, unless "
      "--data-seed)")
    a("--data-seed", type=int, default=None, help="seed of the items and the screen's draws (default: --seed): "
      "seeds of one test share their items")
    a("--screen-from", default=None, help="take --solved-range's screen from this earlier record (partial-NAME.json) "
      "of the same items instead of re-running it")
    args = p.parse_args(argv)
    for flag, v in (("--steps", args.steps), ("--batch", args.batch - 1), ("--group-size", args.group_size - 1),
                    ("--eval-n", args.eval_n - 1), ("--max-new-tokens", args.max_new_tokens)):
        if v < 1:
            p.error(f"{flag} is too small")
    return args


def main():
    global OUT
    a = parse()
    OUT = a.results
    if a.table_only:
        return save(load())
    jobs = [(n, parse(f)) for n, f in SUITE.items()] if a.suite else \
        [(a.name or f"cf{a.channel_weight:g}-lr{a.lr:g}-s{a.seed}", a)]
    for name, args in jobs:
        if a.suite and name in load()["runs"]:
            continue
        print(f"== {name}", flush=True)
        r = run(args, partial=os.path.join(OUT, f"partial-{name}.json"))
        res = load()   # another process may have added runs meanwhile
        res["runs"][name] = r
        save(res)


if __name__ == "__main__":
    main()
