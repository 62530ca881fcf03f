"""
Grouped-query attention that never repeats the keys and values: the policy's attention in every pass (the
rollout's prefill and decode steps, the reference pass, the loss pass), registered with transformers' attention
interface as "grouped" (train.py --attention).

Grouped-query attention (GQA, Ainslie et al. 2023): H query heads share H_kv key/value heads, n_rep = H / H_kv
query heads per group; head h reads group g = h // n_rep:

    o_h = softmax(q_h K_g^T * s + M) V_g                      s = 1/sqrt(d) (the model's scaling), M the mask

transformers' SDPA path (integrations/sdpa_attention.py) gives torch's scaled_dot_product_attention one key/value
head per query head: whenever a mask is passed (our passes always pass one: the padding), it copies K and V n_rep
times first (repeat_kv), in every layer (transformers 5.17, the GPU machine's, in every forward; 5.24 packs a
single-query decode step's heads itself, but still copies in the prefill and the loss pass). For the default team's
Qwen2.5-3B (16 heads, 2 KV heads) that is 8 copies: at 256 rows and ~1,538 keys, 36 layers x K and V x 256 x 16 x
1,538 x 128 x 2 bytes = 116 GB written per decode step (and read again), and in the loss pass autograd keeps the
copies (--plan: 17.3 GB at 4x long prompts). Here the n_rep query heads of a group are stacked along the query axis
instead, so one SDPA call over H_kv heads reads each group's K and V once:

    Q [B, H, q, d] -> [B, H_kv, n_rep * q, d]        row r * q + t: head g * n_rep + r at position t
    M [B, 1, q, k] -> [B, 1, n_rep * q, k]           the same rows stacked alike (grouped_mask, once per forward;
                                                     a decode step's one row broadcasts as it is)

Every output is the same dot products, softmax and weighted sum over the same keys; only the batching of the
matmuls changes, so values agree to float rounding (tests/test_attention.py: float64, forward and gradient, to
~1e-15). The mask is built once per forward by grouped_mask (registered under the same name with transformers'
mask interface), already stacked and additive (0 where a key is seen, -inf where not) in the activations' dtype, so
no layer converts or stacks it again and autograd keeps one copy for all layers. It is never skipped for SDPA's
is_causal flag: transformers decides that skip by reading a device tensor on the host (masking_utils.
_ignore_causal_mask_sdpa), a synchronisation in every decode step.

  use(model, name)       set a loaded model's attention: "grouped" (here) or "sdpa" (transformers', the old path)
  resolve(name, model, device)   --attention auto: "grouped" on CUDA for a model with grouped KV heads that runs
                         transformers' SDPA, else the model's own
  groups(config)         n_rep, query heads per key/value head
  grouped_attention      the function the attention interface calls: (module, query, key, value, mask, ...) ->
                         (output [B, q, H, d], None)
  grouped_mask           the function the mask interface calls: the stacked additive mask [B, 1, n_rep * q, k]

Deviations: none from the model's maths. Unsupported here (refused with an error): attention logit soft-capping,
attention sinks and position biases (Gemma 2, gpt-oss, T5), which transformers' SDPA path does not run either.
Why not torch's enable_gqa=True: with a mask, CUDA's fused kernels do not take it (transformers uses it only
without a mask), and the math kernel repeats K and V itself.

Try it on CPU:  python -m pytest tests/test_attention.py -q
"""
import torch

NAME = "grouped"


def groups(config):
    """n_rep: query heads per key/value head (1 for a model without grouped KV heads)."""
    H = getattr(config, "num_attention_heads", None) or 1
    return H // (getattr(config, "num_key_value_heads", None) or H)


def register():
    """Make "grouped" a name transformers knows, for the attention and for its mask (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface
    AttentionInterface.register(NAME, grouped_attention)
    AttentionMaskInterface.register(NAME, grouped_mask)


def use(model, name):
    """Run `model`'s attention as `name`: "grouped" (this file) or any name transformers knows ("sdpa": the old
    path, kept for before/after comparisons). Returns the model."""
    if name == NAME:
        register()
        if model.config._attn_implementation not in ("sdpa", NAME):  # eager-only models: soft-capping, sinks, biases
            raise ValueError(f"--attention {NAME}: {type(model).__name__} runs "
                             f"{model.config._attn_implementation!r} attention, not SDPA; use --attention sdpa")
    model.set_attn_implementation(name)
    return model


def resolve(name, model, device):
    """--attention auto: "grouped" where it saves copies (a CUDA device, a model with n_rep > 1 whose attention
    is transformers' SDPA), else the model's own attention. On a CPU the old path stays the default: its numbers
    are the bit-identical fixtures' (tests/fixtures), and the grouped path, equal to rounding, sums in another
    order."""
    if name != "auto":
        return name
    own = model.config._attn_implementation
    gqa = groups(model.config) > 1 and own == "sdpa"
    return NAME if gqa and torch.device(device).type == "cuda" else own


def grouped_mask(batch_size, q_length, kv_length, config=None, dtype=torch.float32, **kwargs):
    """transformers' SDPA mask (causal and padding, bool [B, 1, q, k]), never skipped, with its rows stacked n_rep
    times as grouped_attention stacks the query heads, and additive in the activations' dtype:
    [B, 1, n_rep * q, k], 0 where a key is seen and -inf where it is not (SDPA's own conversion of a bool mask).
    None where transformers would use no mask at all (a bidirectional pass without padding)."""
    from transformers.masking_utils import sdpa_mask
    kwargs["allow_is_causal_skip"] = False  # skipping needs the mask's values on the host: a sync per step
    seen = sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length, **kwargs)
    if seen is None:
        return None
    B, _, q, k = seen.shape
    n_rep = groups(config) if config is not None else 1
    if q > 1:  # one query (a decode step): its row broadcasts over the n_rep stacked rows as it is
        seen = seen[:, :, None].expand(B, 1, n_rep, q, k).reshape(B, 1, n_rep * q, k)  # row r * q + t: row t
    return torch.zeros(seen.shape, dtype=dtype, device=seen.device).masked_fill_(~seen, -torch.inf)


def grouped_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
                      **kwargs):
    """softmax(q K^T * s + M) V per head, each group of n_rep query heads against its one key/value head:
    query [B, H, q, d], key [B, H_kv, k, d], value [B, H_kv, k, d_v], attention_mask [B, 1, n_rep * q, k]
    (grouped_mask's), [B, 1, q, k] (a 4-D mask built elsewhere, e.g. lib/static_decode.py's: stacked here
    where q > 1), [B, 1, 1, k] (one query) or None. Returns ([B, q, H, d_v], None),
    as transformers' attention functions do."""
    for name in ("softcap", "s_aux", "position_bias"):
        if kwargs.get(name) is not None:
            raise ValueError(f"--attention {NAME} does not run {name!r} (a model-specific attention term); "
                             "use --attention sdpa or the model's own attention")
    B, H, q, d = query.shape
    H_kv, k = key.shape[1], key.shape[2]
    n_rep = H // H_kv
    mask = attention_mask
    if mask is None:
        causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
        if causal and q > 1:  # the last q of the k keys are the queries: row t sees keys up to k - q + t
            t = torch.arange(q, device=query.device)[:, None] + (k - q)
            mask = torch.arange(k, device=query.device)[None] <= t                          # (q, k)
            mask = mask.repeat(n_rep, 1)[None, None]                                          # (1, 1, n_rep*q, k)
    elif mask.shape[-2] == q > 1 and n_rep > 1:  # not stacked yet (a 4-D mask built elsewhere)
        mask = mask.expand(mask.shape[0], 1, q, k).repeat(1, 1, n_rep, 1)                    # (B, 1, n_rep*q, k)
    if mask is not None and mask.dtype != torch.bool and mask.dtype != query.dtype:
        mask = mask.to(query.dtype)
    Q = query.reshape(B, H_kv, n_rep * q, d)                       # (B, H_kv, n_rep*q, d) heads of a group stacked
    out = torch.nn.functional.scaled_dot_product_attention(Q, key, value, attn_mask=mask, dropout_p=dropout,
                                                           scale=scaling)       # (B, H_kv, n_rep*q, d_v)
    # row r * q + t of group g is head g * n_rep + r at position t; one copy into o_proj's layout. SDPA keeps its
    # own output for the backward pass, so this copy is one [tokens, H * d_v] tensor more than the SDPA path keeps
    # (whose kernels write their output in o_proj's layout already): support/harness/plan.py counts it
    out = out.view(B, H_kv, n_rep, q, value.shape[-1]).permute(0, 3, 1, 2, 4)   # (B, q, H_kv, n_rep, d_v)
    return out.reshape(B, q, H, value.shape[-1]), None                          # (B, q, H, d_v)
