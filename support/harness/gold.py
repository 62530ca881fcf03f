"""
The paired evaluation's greedy pass: each item's greedy completion and the log-probability of its gold answer,
both conditioned on the same [x || C], from one prefill per batch (evaluate.py calls greedy_and_gold).

    log pi(gold answer + "</answer>" | prompt + "</think>\n<answer>", C)     summed over the answer's tokens

The gold log-prob sees a change in how likely the right answer is even where greedy accuracy does not move: with
C against C = 0 or another item's C, it says whether C carries anything about this item.

  answer_bridge      the text between the prompt and the gold answer
  gold_logprobs      the gold log-prob by the training's own scoring pass (its own prefill)
  greedy_and_gold    greedy completions and gold log-probs from one shared prefill (the fast path)
  gold_inputs        what the fast path runs again on a cropped copy of the prefill's cache
  gold_from_prefill  the gold log-prob from that copy

Try it on CPU:  python -m pytest tests/test_collaboration.py -q -k gold
"""
import copy

import torch

from grpo import completion_mask, token_logprobs
from lora import lora_merged
from rollout import cache_kwargs, completion_logprobs, context_slot, decode, encode_prompts, prefill


def answer_bridge(response_prefix):
    """Text between the prompt and the gold answer when its log-prob is measured: nothing when the
    pre-filled response already opened the answer block ("<think></think>\n<answer>"), else the
    answer tag, after closing the reasoning block when the response opened one ("<think>")."""
    if response_prefix.rfind("<answer>") > response_prefix.rfind("</answer>"):
        return ""
    return "</think>\n<answer>" if response_prefix.rfind("<think>") > response_prefix.rfind("</think>") \
        else "<answer>"


def gold_logprobs(policy, tok, prompts, golds, C, args, device):
    """log pi(gold answer + "</answer>" | prompt + answer_bridge, C), summed over the answer's
    tokens, per item: sees a change in how likely the right answer is even where greedy accuracy
    does not move. Uses the training's own scoring pass (rollout.completion_logprobs), so
    positions are those of the rollout."""
    bridge = answer_bridge(args.response_prefix)
    split = getattr(args, "context_split", "")  # a run recorded before the flag existed has none
    split = split + bridge if split else ""  # C stays in front of the split, the bridge follows it
    ids, mask = encode_prompts(tok, [p + bridge for p in prompts], device, split)
    tok.padding_side = "right"  # completions start right after the prompt's last column
    ans = tok([f"{g}</answer>" for g in golds], return_tensors="pt", padding=True,
              add_special_tokens=False)
    comp, comp_mask = ans["input_ids"].to(device), ans["attention_mask"].bool().to(device)
    logp = completion_logprobs(policy, ids, mask, C, completion_ids=comp, completion_mask=comp_mask,
                               temperature=1.0, position=context_slot(tok, args.context_position, split))  # (B, T)
    return torch.where(comp_mask, logp, torch.zeros_like(logp)).sum(-1).tolist()


def greedy_and_gold(policy, tok, ids, mask, C, prompts, golds, args, eos_ids, share_prefix=False):
    """Greedy completions [B, T] (padding after EOS) and, when `golds` are given, each item's
    gold log-prob (gold_logprobs), both from one prefill of [x || C].

    The gold pass reads prompt + answer_bridge + gold, tokenised as gold_logprobs tokenises it;
    that sequence and the prompt's own share all but the prompt's last k tokens (a tokeniser
    may merge the prompt's end with the bridge: SmolLM2 writes "<think></think>" with a "></"
    token). So the prefill's KV cache, copied and cropped by k columns, is that sequence's
    prefix, and only the rest (k + bridge + answer tokens) is run again: one prefill instead of
    two, the costlier half of a paired evaluation. The completions are bit for bit those of
    rollout.sample (the same prefill and loop); the log-probs equal gold_logprobs' up to float
    rounding (LoRA merged, another order of sums; tests/test_collaboration.py). The crop needs C
    in front ("before") or no C: with C after the prompt ("after") C sits in the cropped
    columns, and the gold pass runs on its own (so it does with --context-split, whose tokens are
    encoded apart from the prompt's).

    share_prefix: the prefill runs with rollout.prefill's share, which runs the items' common beginning
    (system prompt, worked example, and C when it is the same for every item) once per batch
    instead of once per item; it keeps each item's last k columns in its own tail for the crop.
    The same function in another order of sums: on the verdict's runs the scores were identical
    item for item (results/performance.md)."""
    split = getattr(args, "context_split", "")  # its tokens are encoded apart: no crop (gold_inputs)
    slot = context_slot(tok, args.context_position, split)
    shared = golds is not None and (C is None or slot == "before") and not split
    bridge = gold_inputs(tok, prompts, golds, args) if shared else None  # None: k is too long
    keep = max(1, bridge[0]) if bridge else 1  # the columns the gold pass crops stay in each tail
    with lora_merged(policy):
        cache, first, pmask, pos = (
            prefill(policy, ids, mask, C, G=1, position=slot, keep=keep) if share_prefix
            else prefill(policy, ids, mask, C, G=1, position=slot, share=False))
        gold = gold_from_prefill(policy, tok, cache, pmask, pos, *bridge) if bridge else \
            gold_logprobs(policy, tok, prompts, golds, C=C, args=args, device=ids.device) if shared else None
        comp = decode(policy, cache, first, pmask, pos=pos, max_new_tokens=args.max_new_tokens,
                      temperature=1.0, eos_ids=eos_ids, pad_id=tok.pad_token_id, greedy=True)
    if golds is not None and not shared:
        gold = gold_logprobs(policy, tok, prompts, golds, C=C, args=args, device=ids.device)
    return comp.masked_fill(~completion_mask(comp, eos_ids), tok.pad_token_id), gold


def gold_inputs(tok, prompts, golds, args):
    """What the gold pass runs on a copy of the prefill's cache (see greedy_and_gold): k, the
    prompt columns to run again, and per item those k tokens + the bridge + the answer, and the
    answer's tokens. None when k reaches into the shortest prompt (gold_logprobs runs instead)."""
    special = not tok.chat_template
    own = tok(prompts, add_special_tokens=special)["input_ids"]
    bridged = tok([p + answer_bridge(args.response_prefix) for p in prompts],
                  add_special_tokens=special)["input_ids"]
    answers = tok([f"{g}</answer>" for g in golds], add_special_tokens=False)["input_ids"]
    same = [next((i for i, (a, b) in enumerate(zip(q, o)) if a != b), min(len(q), len(o)))
            for q, o in zip(own, bridged)]
    k = max(len(q) - c for q, c in zip(own, same))     # prompt columns to run again
    if k >= min(len(q) for q in own):
        return None
    return k, [o[len(q) - k:] + a for q, o, a in zip(own, bridged, answers)], answers


def gold_from_prefill(policy, tok, cache, mask, pos, k, rest, answers):
    """gold_logprobs on a copy of the prefill's cache, cropped by k columns: see greedy_and_gold."""
    T = max(map(len, rest))
    ids = torch.tensor([r + [tok.pad_token_id] * (T - len(r)) for r in rest], device=mask.device)
    rest_mask = torch.tensor([[1] * len(r) + [0] * (T - len(r)) for r in rest], dtype=torch.bool,
                             device=mask.device)
    cache = copy.deepcopy(cache)                      # the greedy loop goes on from the original
    if k:
        cache.crop(-k)                                              # drop the last k columns
    full_mask = torch.cat([mask[:, :-k] if k else mask, rest_mask], 1)
    out = policy(input_ids=ids, attention_mask=full_mask,
                 position_ids=pos - k + rest_mask.long().cumsum(-1), use_cache=True,
                 **cache_kwargs(policy, cache))
    logp = token_logprobs(out.logits[:, :-1], ids[:, 1:])            # row t predicts token t + 1
    is_answer = torch.zeros_like(rest_mask)
    for row, (r, a) in enumerate(zip(rest, answers)):
        is_answer[row, len(r) - len(a):len(r)] = True
    return torch.where(is_answer[:, 1:], logp, torch.zeros_like(logp)).sum(-1).tolist()
