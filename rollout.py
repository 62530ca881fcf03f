"""
Where the policy runs: the rollout (sampling G completions per prompt) and the scoring pass (their
log-probs under the current policy or the reference), both conditioned on the context tokens C.

    pi_theta(y | [x || C])                                   (Eq. 3)

Both start from the same `prefill`: [x || C] built by `policy_inputs`, run once per prompt, its KV
cache repeated G times. So the rollout and the scoring pass see the same inputs and the same
positions by construction; if they did not, the log-probs of the scoring pass would not be those of
the policy that sampled (a small error for RoPE models, a large one for GPT-2's learned positions).
tests/test_adapter.py checks it token for token.

  sample_plain, completion_logprobs_plain
                            the rollout and the scoring pass in their plain form: read these first
  encode_prompts, policy_inputs, context_slot, same_width, cut_padding
                            the prompts as the policy reads them, [x || C]
  prefill                   [x || C] once per prompt (their common beginning once) -> the KV cache
                            of G completions
  sample, greedy_texts      the rollout: prefill, then `decode` with LoRA merged in (lib/static_decode.py, the
                            engine: the KV-cached loop, on CUDA its step captured as a CUDA graph once per run);
                            a frozen writer's greedy answers (conductor workers, output_collab's hints)
  completion_logprobs       the scoring pass: log pi(y_t | [x || C], y_<t) for every completion token
                            (grpo.token_logprobs, grpo.head_logprobs; lib/recompute.py: the MLPs'
                            activations recomputed in the backward pass)
  (lib/low_precision.py: --rollout-dtype, the rollout's matmuls on a bfloat16 / int8 copy of the
  weights; lib/kv_cache.py: the KV cache's keyword)

Deviations from the paper: sampling is plain temperature sampling (no top-p / top-k), with our own
loop instead of HF generate (it needs no inputs_embeds special cases and lets rollout and scoring
share `prefill`).

Try it on CPU:  python -m pytest tests/test_adapter.py -q -k "positions or prefix"
"""
import contextlib

import torch

from grpo import head_logprobs, token_logprobs
from lora import lora_merged
from lib.kv_cache import cache_kwargs, cache_of
from lib.low_precision import low_precision_linears
from lib.recompute import mlps_recomputed
from lib import static_decode
from lib.static_decode import decode, draw  # the loop after prefill; the draw every sampler makes

# --------------------------------------------------------------------------------------------------
# How C reaches the policy: [x || C] (Eq. 3) or [x_0 || C || x_1..] (prefix tuning, behind the first
# token)


def policy_inputs(embed, prompt_ids, prompt_mask, C=None, position="after"):
    """Build (inputs_embeds, attention_mask, position_ids) for the policy.

    prompt_ids, prompt_mask: [B, T] left-padded (padding on the left, so every prompt ends at T-1
    and the completion follows directly). C: [B, m, D] or None (no context tokens). embed: the
    policy's input embedding module. The sequence is, with x_0 the first real token of the prompt:
        "after"   [pad.. x C]            Eq. 3
        k (int)   [pad.. x_..-k C x_-k..] C in front of the prompt's last k tokens (--context-split:
                                         the end of the response prefix follows C, e.g.
                                         "<think>" C "</think><answer>", the mechanism test's slot)
        "before"  [x_0 C pad.. x_1..]    prefix tuning, kept behind the first token (see below)
    The mask hides the padding wherever it sits, and positions count only unmasked tokens, so a
    prompt gets the same positions whatever its batch-mates are. The reference policy gets
    torch.zeros_like(C) here: zero tokens at the same positions (paper §4.1).

    Why not [C x] for "before": C starts at exactly 0 (W_out = 0). Tokens at the very front
    attend only to each other, so zero tokens keep a hidden state of exactly 0 through every
    layer, where each RMSNorm has slope 1/sqrt(eps) (316 for eps = 1e-5): the gradient reaching
    them grows ~316x per norm and overflows float32 within ~15 layers. On SmolLM2-135M (30
    layers) every update with a non-zero advantage had a NaN gradient, was skipped, and C stayed
    0 for ever (regression test in tests/test_adapter.py). Behind x_0 (the template's first
    token, the model's usual attention sink) C's hidden states are non-zero from the first
    attention layer on, as with "after"."""
    x = embed(prompt_ids)                                                   # (B, T, D)
    mask = prompt_mask.bool()
    if C is not None:
        C = C.to(x.dtype)
        ones = torch.ones(C.shape[:2], dtype=torch.bool, device=mask.device)
        if position == "after":
            x, mask = torch.cat([x, C], 1), torch.cat([mask, ones], 1)
        elif isinstance(position, int) and position > 0:  # C in front of the last k prompt tokens
            k = position
            x = torch.cat([x[:, :-k], C, x[:, -k:]], 1)                       # (B, T + m, D)
            mask = torch.cat([mask[:, :-k], ones, mask[:, -k:]], 1)
        elif position == "before":
            first = mask & (mask.long().cumsum(-1) == 1)  # (B, T) one-hot: x_0 of each row
            x0 = x[first].unsqueeze(1)                                      # (B, 1, D)
            x = torch.cat([x0, C, x], 1)                                    # (B, 1 + m + T, D)
            # x_0's old column becomes padding
            mask = torch.cat([ones[:, :1], ones, mask & ~first], 1)
        else:
            raise ValueError(f"--context-position must be 'after', 'before' or a number of tokens >= 1, "
                             f"got {position!r}")
    return x, mask, position_ids(mask)


def position_ids(mask):
    """Positions that skip padding: (mask.cumsum - 1) clamped at 0. Use it for every forward: a
    KV-cached rollout and a one-pass scorer that count left padding differently score different
    sequences."""
    return (mask.long().cumsum(-1) - 1).clamp(min=0)


# --------------------------------------------------------------------------------------------------
# The plain versions, to read first: every token runs the policy over the whole sequence, G copies of each
# prompt, LoRA unmerged, no KV cache. `sample` and `completion_logprobs` further down compute the same thing
# faster (one shared prefill, a KV cache, merged LoRA, a captured decode step on CUDA, the head in chunks);
# tests/test_adapter.py holds each pair equal.


@torch.no_grad()
def sample_plain(policy, prompt_ids, prompt_mask, C, G, max_new_tokens, temperature, eos_ids, pad_id,
                 position="after", uniforms=None):
    """G completions per prompt [B*G, max_new_tokens] from pi(. | [x || C]) (Eq. 3), one full forward a token:
    y_t = draw(pi(. | [x || C || y_<t])), padding after a row's EOS."""
    embed = policy.get_input_embeddings()
    x, mask, _ = policy_inputs(embed, prompt_ids.repeat_interleave(G, 0), prompt_mask.repeat_interleave(G, 0),
                               C=None if C is None else C.repeat_interleave(G, 0), position=position)  # (N, P', D)
    eos, tokens = torch.tensor(eos_ids, device=x.device), []
    done = torch.zeros(len(x), dtype=torch.bool, device=x.device)
    for t in range(max_new_tokens):
        logits = policy(inputs_embeds=x, attention_mask=mask, position_ids=position_ids(mask)).logits[:, -1]
        y = draw(logits, temperature, None if uniforms is None else uniforms[:, t:t + 1])   # (N,)
        y = torch.where(done, torch.full_like(y, pad_id), y)       # a finished row writes padding
        tokens.append(y)
        done = done | torch.isin(y, eos)
        x = torch.cat([x, embed(y)[:, None].to(x.dtype)], 1)       # (N, P' + t + 1, D)
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
    return torch.stack(tokens, 1)


def completion_logprobs_plain(policy, prompt_ids, prompt_mask, C, completion_ids, completion_mask, temperature,
                              position="after"):
    """log pi(y_t | [x || C], y_<t) [N, T] for G = N / B completions per prompt: one forward over G copies of
    [x || C || y], the logits that predict y read with a log-softmax."""
    G, T = len(completion_ids) // len(prompt_ids), completion_ids.shape[1]
    embed = policy.get_input_embeddings()
    x, mask, _ = policy_inputs(embed, prompt_ids.repeat_interleave(G, 0), prompt_mask.repeat_interleave(G, 0),
                               C=None if C is None else C.repeat_interleave(G, 0), position=position)  # (N, P', D)
    x = torch.cat([x, embed(completion_ids).to(x.dtype)], 1)                                 # (N, P' + T, D)
    mask = torch.cat([mask, completion_mask], 1)
    logits = policy(inputs_embeds=x, attention_mask=mask, position_ids=position_ids(mask)).logits
    return token_logprobs(logits[:, -T - 1:-1], completion_ids, temperature)                 # (N, T)


def encode_prompts(tok, prompts, device, split=""):
    """Token ids and mask of the policy's prompts [B, T]: every prompt ends at the last column, so
    completions follow directly, and its padding sits behind its first token
    (padding_behind_first_token). A chat template writes its own special tokens into the text; a
    model without one (a base model such as Gemma-3-270M, GPT-2) gets what its tokenizer adds to
    plain text, e.g. Gemma's <bos>, as the experts do (experts.py). Without its <bos> Gemma-3-270M
    scored 0.0 on the pocket task, with it 8.3 % on 12 items (a bug we had).

    split (--context-split): the text every prompt ends with that follows C. It is tokenised on its
    own and its tokens fill the last columns of every row, so C (context_slot) can go in front of
    them and every method, with or without C, reads the same tokens."""
    if split and not all(p.endswith(split) for p in prompts):
        raise ValueError(f"--context-split {split!r} must be how every prompt ends (the end of "
                         "--response-prefix)")
    tok.padding_side = "left"
    heads = [p[:len(p) - len(split)] for p in prompts]
    batch = tok(heads, return_tensors="pt", padding=True,
                add_special_tokens=not tok.chat_template)
    ids, mask = batch["input_ids"].to(device), batch["attention_mask"].bool().to(device)
    if split:
        tail = torch.tensor(tok(split, add_special_tokens=False)["input_ids"], device=device)  # (k,)
        ids = torch.cat([ids, tail.expand(len(ids), -1)], 1)                    # (B, T + k)
        mask = torch.cat([mask, torch.ones(len(ids), len(tail), dtype=torch.bool, device=device)], 1)
    return padding_behind_first_token(ids, mask)


def context_slot(tok, position, split=""):
    """Where C goes, as policy_inputs reads it: --context-position ("after", "before"), or with
    --context-split the number of the split's tokens, which follow C."""
    return len(tok(split, add_special_tokens=False)["input_ids"]) if split else position


def padding_behind_first_token(ids, mask):
    """Left padding moved behind each row's first real token, [B, T] -> [B, T]:

        [pad pad x0 x1 x2]  ->  [x0 pad pad x1 x2]

    Why: with left padding, a padding position is a query whose keys (itself and the padding
    before it) are all masked. Such a row of attention has nothing to attend to: CPU kernels
    return finite values for it, but CUDA's memory-efficient SDPA kernel returns NaN there, and
    the NaN reaches the real tokens through the next layer's products (transformers 5 no longer
    un-masks these rows). Behind x0, every padding query sees x0, and no row is empty. The real
    tokens see the same keys at the same positions (position_ids skips padding wherever it sits,
    the mask hides it), so their outputs are the same function; the last column is still every
    prompt's last token. tests/test_rollout.py counts empty rows in every attention call."""
    B, T = ids.shape
    n_pad = (T - mask.long().sum(-1))[:, None]                            # (B, 1)
    cols = torch.arange(T, device=ids.device)[None]                       # (1, T)
    src = torch.where(cols == 0, n_pad, torch.where(cols <= n_pad, cols - 1, cols))  # (B, T)
    src = src.clamp(max=T - 1)  # an all-padding row stays all padding
    return ids.gather(1, src), mask.gather(1, src)


def same_width(batches, pad_id):
    """[(ids [B_k, P_k], mask [B_k, P_k])] -> (ids, mask) [sum B_k, max P_k]: several micro-batches'
    prompts in one batch, the narrower ones widened by padding behind their first token, where
    padding_behind_first_token keeps it (the last column stays every prompt's last token)."""
    P = max(ids.shape[1] for ids, _ in batches)
    out_ids, out_mask = [], []
    for ids, mask in batches:
        extra = P - ids.shape[1]
        pad = ids.new_full((ids.shape[0], extra), pad_id)
        out_ids.append(torch.cat([ids[:, :1], pad, ids[:, 1:]], 1))
        out_mask.append(torch.cat([mask[:, :1], torch.zeros_like(pad, dtype=torch.bool), mask[:, 1:]], 1))
    return torch.cat(out_ids), torch.cat(out_mask)


def cut_padding(comp, logp, eos_ids, pad_id):
    """(comp, logp) [N, T] cut after their longest completion (its EOS included): what a decode loop
    of these rows alone would have returned. logp may be None."""
    is_eos = torch.isin(comp, torch.tensor(eos_ids, device=comp.device))       # (N, T)
    ends = torch.where(is_eos.any(1), is_eos.int().argmax(1) + 1, comp.shape[1])  # (N,) lengths
    T = int(ends.max()) if len(ends) else comp.shape[1]
    return comp[:, :T], None if logp is None else logp[:, :T]


def eos_token_ids(policy, tok):
    """Every id that ends a completion: the tokenizer's EOS and the generation config's
    (Qwen2.5-Instruct ends turns with <|im_end|> but lists <|endoftext|> too). Sorted, for
    completion_mask and sample."""
    ids = policy.generation_config.eos_token_id
    ids = [] if ids is None else [ids] if isinstance(ids, int) else list(ids)
    return sorted({tok.eos_token_id, *ids} - {None})


# --------------------------------------------------------------------------------------------------
# The shared prefill


def prefill(policy, prompt_ids, prompt_mask, C, G, position, share=True, keep=1, min_shared=16):
    """Run [x || C] once per prompt and make room for G completions of each. Returns (cache
    repeated G times, logits of y_0 [B*G, V], mask [B*G, P'], position of the last prefix token
    [B*G, 1]). repeat_interleave is differentiable, so with gradient on, every completion's
    gradient flows back through the cache into LoRA and C, and the prefix's activations are
    stored once.

    share: the leading input vectors that every prompt shares (system prompt, worked example, the
    question's fixed opening; C too where it is the same for every row) run once, at batch 1, and
    only each prompt's own tail runs at batch B: automatic prefix caching, as inference servers do
    it, in sampling, the re-draw, the reference and the loss pass alike (with gradient through the
    shared part: its cache is repeated B times, differentiably). Each row's real inputs (padding
    dropped) are [s_1..s_P, t_1..t_L]: P at most the shortest row's length - `keep`, so every row
    keeps its last `keep` inputs in its tail (support.harness.gold.greedy_and_gold crops that many
    columns). The new layout per row is [s_1..s_P, pad.., t_1..t_L]: the padding moves from the
    front to the middle. The mask hides it and positions count only real inputs, so every real
    input sees the same inputs at the same positions: the same function, another order of sums
    (the prefix's matmuls run with 1 row instead of B; tests/test_shared_prefix.py compares
    log-probs and gradients). Where fewer than `min_shared` inputs are shared (a single prompt, or
    C differs per row and sits in front) the prompts run whole, as with share=False."""
    embed = policy.get_input_embeddings()
    x, mask, pos = policy_inputs(embed, prompt_ids, prompt_mask, C, position=position)  # (B, P', D)
    rows = [x[b][mask[b]] for b in range(x.shape[0])] if share else []  # each row's real inputs
    P = shared_length(rows, keep)
    if len(rows) < 2 or P < min_shared:
        out = policy(inputs_embeds=x, attention_mask=mask, position_ids=pos, use_cache=True,
                     logits_to_keep=1)
        cache = cache_of(out)
    else:
        out = policy(inputs_embeds=rows[0][None, :P], position_ids=torch.arange(P, device=x.device)[None],
                     use_cache=True, logits_to_keep=1)                    # the shared part, batch 1
        cache = cache_of(out)
        cache.batch_repeat_interleave(len(rows))                          # (1, ...) -> (B, ...)
        T = max(len(r) for r in rows) - P                                 # the longest tail
        tails = x.new_zeros(len(rows), T, x.shape[-1])                    # (B, T, D), left-padded
        tail_mask = torch.zeros(len(rows), T, dtype=torch.bool, device=mask.device)
        for b, r in enumerate(rows):
            tails[b, T - (len(r) - P):] = r[P:]
            tail_mask[b, T - (len(r) - P):] = True
        mask = torch.cat([torch.ones_like(tail_mask[:, :1]).expand(-1, P), tail_mask], 1)  # (B, P+T)
        pos = position_ids(mask)
        out = policy(inputs_embeds=tails, attention_mask=mask, position_ids=pos[:, P:],
                     use_cache=True, logits_to_keep=1, **cache_kwargs(policy, cache))
        cache = cache_of(out)
    logits = out.logits[:, -1]
    if G > 1:
        cache.batch_repeat_interleave(G)                                  # (B, ...) -> (B*G, ...)
        logits, mask, pos = (t.repeat_interleave(G, 0) for t in (logits, mask, pos))
    return cache, logits, mask, pos[:, -1:]


def shared_length(rows, keep=1):
    """How many leading input vectors every row shares (rows: each row's real inputs [L_b, D]), at
    most the shortest row's length - keep."""
    if len(rows) < 2:
        return 0
    P = min(len(r) for r in rows) - keep
    for r in rows[1:]:
        P = min(P, int((r[:P] == rows[0][:P]).all(-1).long().cumprod(0).sum()))  # first mismatch
    return P


# --------------------------------------------------------------------------------------------------
# The rollout


@torch.no_grad()
def sample(policy, prompt_ids, prompt_mask, C, G, max_new_tokens, temperature, eos_ids, pad_id,
           position="after", greedy=False, return_logprobs=False, dtype=None, allowed=None,
           uniforms=None, share=True):
    """G completions per prompt from pi(. | [x || C]). Returns completion ids [B*G, T_new] (pad
    after EOS), and with return_logprobs the sampling log-probs [B*G, T_new] (tests compare them
    with the scoring pass; with dtype=bfloat16 or int8 they are the low-precision sampler's own,
    for the importance correction). Speed-ups: one prefill per prompt (not G); LoRA folded into the
    weights while sampling (lora.lora_merged: one matmul per layer instead of three, and no
    gradient is needed here); a preallocated KV cache; with dtype, the matmuls on a copy of the
    weights in that dtype (lib.low_precision).

    allowed (constrained decoding, e.g. a grammar): a function called before each draw with the
    last drawn tokens [B*G] (None before the first) that returns a bool [B*G, vocab] mask of the
    tokens allowed next; the others get logit -inf, so the draw, the greedy pick and the returned
    log-probs are those of the masked, renormalised softmax. Without it nothing changes.

    uniforms [B*G, max_new_tokens] in [0, 1): the numbers each row's draws use, token by token
    (train.py draws them per micro-batch from its own seed, so a row's completion does not depend
    on which other rows share its decode loop); None draws them from torch's generator.

    share: the prompts' common beginning runs once (prefill); False runs every prompt whole."""
    low = contextlib.nullcontext()
    if dtype not in (None, torch.float32):
        low = low_precision_linears(policy, dtype)
    # int8 keeps LoRA unmerged: its frozen copy is made once, the update added in float32. The captured decode
    # step reads the merged weights where it was captured: merged into the same buffers each step (keep), or
    # unmerged (static_decode.GRAPH_MERGED)
    graph = static_decode.decode_loop(prompt_ids.device) == "graph"
    unmerged = dtype == torch.int8 or (graph and not static_decode.GRAPH_MERGED)
    merge = contextlib.nullcontext() if unmerged else lora_merged(policy, keep=graph)
    with merge, low:
        start = prefill(policy, prompt_ids, prompt_mask, C, G=G, position=position, share=share)
        return decode(policy, *start, max_new_tokens, temperature, eos_ids, pad_id, greedy,
                      return_logprobs, allowed, uniforms)


@torch.no_grad()
def greedy_texts(model, tok, prompts, max_new_tokens):
    """Greedy completions of `prompts`, as text, from a frozen model that writes (a conductor's
    worker, output_collab's experts): one batch, padded behind each first token (encode_prompts:
    no attention row with every key masked), its common beginning run once (prefill, G = 1), then
    decode's argmax loop. Unlike HF generate, no generation config adds a repetition penalty: the
    same answers evaluate.py's greedy decoding gives."""
    ids, mask = encode_prompts(tok, prompts, model.device)
    eos_ids = eos_token_ids(model, tok)
    out = decode(model, *prefill(model, ids, mask, None, G=1, position="after"), max_new_tokens, 1.0,
                 eos_ids, tok.pad_token_id, greedy=True)              # (B, T): padding after each EOS
    return tok.batch_decode(out, skip_special_tokens=True)


# --------------------------------------------------------------------------------------------------
# The scoring pass


def completion_logprobs(policy, prompt_ids, prompt_mask, C, completion_ids, completion_mask,
                        temperature, position="after", allowed_mask=None, share=True):
    """log pi(y_t | [x || C], y_<t) for every completion token, fp32 [N, T].

    prompt_ids, prompt_mask [B, P] and C [B, m, D] have one row per *prompt*; completion_ids and
    completion_mask [N, T] hold G = N / B completions per prompt in consecutive blocks, as `sample`
    returns them (B = N, G = 1 is fine too).

    Speed-ups, each exact up to float rounding (tests/test_adapter.py compares log-probs and
    gradients with one plain forward over G copies of [x || C || y]):
      1. Shared prefix (`prefill`): P + G*T tokens per group instead of G*(P + T). The prompt is
         often longer than the completion (system prompt, worked example), so this roughly halves
         the policy and reference passes. With share, the beginning every prompt shares runs once
         for the whole batch too (share=False: once per prompt).
      2. Logits only for the completion positions: the prefix keeps one (it predicts y_0), and no
         [P, V] log-softmax over the prompt is ever built.
      3. The completions' logits one completion at a time (head_logprobs), never [N, T, V] at
         once, and with gradient recomputed in the backward pass instead of kept.

    allowed_mask [N, T, V] bool (constrained decoding): the tokens `sample`'s `allowed` let through
    at each step; the log-probs are then the masked, renormalised distribution's."""
    B, (N, T) = prompt_ids.shape[0], completion_ids.shape
    if B == 0 or N % B != 0:
        raise ValueError(f"{N} completions do not split into groups over {B} prompts")
    plain = policy.config.model_type in PLAIN_HEADS  # logits = lm_head(h): the head can run apart
    body = policy.base_model if plain else policy
    with mlps_recomputed(policy):
        cache, first, mask, pos = prefill(policy, prompt_ids, prompt_mask, C, G=N // B,
                                          position=position, share=share)
        mask = torch.cat([mask, completion_mask], 1)                     # (N, P' + T)
        pos = pos + completion_mask.long().cumsum(-1)  # (N, T) = (mask.cumsum - 1) there
        out = body(input_ids=completion_ids, attention_mask=mask, position_ids=pos, use_cache=True,
                   **({} if plain else {"logits_to_keep": T}), **cache_kwargs(body, cache))
    if not plain:  # a head with more than a linear layer (e.g. Gemma's logit soft-capping)
        logits = torch.cat([first[:, None], out.logits[:, :-1]], 1)  # (N, T, V) row t predicts y_t
        return token_logprobs(logits, completion_ids, temperature, allowed_mask)   # (N, T)
    y0 = None if allowed_mask is None else allowed_mask[:, :1]
    rest = None if allowed_mask is None else allowed_mask[:, 1:]
    return torch.cat([token_logprobs(first[:, None], completion_ids[:, :1], temperature, y0),   # (N, 1)
                      head_logprobs(policy.get_output_embeddings(), out.last_hidden_state[:, :-1],
                                    completion_ids[:, 1:], temperature, allowed_mask=rest)], 1)  # (N, T)


PLAIN_HEADS = ("llama", "qwen2", "qwen3", "mistral", "gpt2")  # model types whose logits are lm_head(h)
