"""
The rollout's decode loop with every shape fixed, so that one decode step can be captured as a CUDA graph and
replayed: no host synchronisation inside a step, ~2,000 kernel launches a token turned into one graph launch.

rollout.decode's loop (the reference, and the path on a CPU) grows the mask by one column a token, reads
"has every row ended?" on the host, and leaves the attention mask to transformers, whose SDPA mask code reads a
device tensor on the host in every forward (transformers 5.17's masking_utils). Measured on an H200 (results/gpu.md):
~2,070 kernels a token at 74-93 ms a decode step, against a memory floor of a few ms. Here, as inference engines do
it (vLLM and nanochat keep a static KV cache and capture the decode step):

  - the KV cache at its final size [N, H_kv, P + T, d] (P the prefill's columns, T the new tokens), zeros, each
    layer's new key and value written at a column held in a device tensor (StaticLayer);
  - the attention mask at its final size [N, 1, 1, P + T], built here (transformers returns a 4-D mask as it is),
    the next column switched on in place; the positions advanced in place;
  - a device-side step counter that picks each row's uniform number and the output column;
  - the step (forward the last token, draw the next) captured once per decode call with torch.cuda.CUDAGraph after
    WARMUP eager steps, then replayed; "has every row ended?" read on the host every `sync_every` tokens, outside
    the captured step, and the all-padding tokens after it cut, as rollout.decode does;
  - LoRA as the model runs it: unmerged, its low-rank products inside the graph, no merged copy of the weights
    (rollout.sample merges LoRA before it calls decode; a caller that wants no copy calls prefill and decode).

The same numbers as rollout.decode: the keys not yet written are zeros and masked (softmax weight exactly 0), so a
token sees the same keys at the same positions; only the reductions run over a longer row (float rounding).
tests/test_static_decode.py runs this loop eagerly (graph=False) on the CPU against rollout.decode: the same tokens
and log-probs from the same uniforms. Constrained decoding (`allowed`) keeps rollout.decode's loop.

  supports(policy, cache)    whether this loop can run a model's decode (plain KV layers, full attention, RoPE)
  decode(...)                rollout.decode's arguments (no `allowed`), plus graph=True to capture the step
  StaticLayer                one layer of the KV cache at its final size, written at a device-side column

Try it on CPU:  python -m pytest tests/test_static_decode.py -q
"""
import torch
from transformers.cache_utils import DynamicLayer

from support.lib.kv_cache import cache_kwargs

MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")  # RoPE decoders whose forward takes a 4-D mask as it is
WARMUP = 2      # eager steps before the capture (cuBLAS handles, kernel choices); they are real steps
ALIGN = 8       # the cache's length rounded up to this (aligned rows for the fused attention kernels)


def supports(policy, cache):
    """True where this loop runs `policy`'s decode exactly as rollout.decode does."""
    cfg = policy.config
    full = all(t == "full_attention" for t in getattr(cfg, "layer_types", None) or ["full_attention"])
    return (cfg.model_type in MODEL_TYPES and full and len(cache.layers) > 0
            and all(type(layer) is DynamicLayer for layer in cache.layers))


class StaticLayer(DynamicLayer):
    """One layer of the KV cache at its final size [N, H_kv, length, d], zeros past the prefill: update() writes
    the new token's key and value at column `col` (a device tensor [1], shared by every layer and advanced by the
    loop) and returns the whole buffer, so every forward sees the same shapes and addresses."""

    def __init__(self, layer, length, col):
        super().__init__()
        (N, H, P, Dk), Dv = layer.keys.shape, layer.values.shape[-1]
        self.keys = layer.keys.new_zeros(N, H, length, Dk)  # zeros, not empty: 0 x NaN would reach the output
        self.values = layer.values.new_zeros(N, H, length, Dv)
        self.keys[:, :, :P], self.values[:, :, :P] = layer.keys, layer.values
        self.col = col
        self.dtype, self.device, self.is_initialized = layer.keys.dtype, layer.keys.device, True

    def update(self, key_states, value_states, *args, **kwargs):
        self.keys.index_copy_(2, self.col, key_states)                      # (N, H_kv, 1, d) at column col
        self.values.index_copy_(2, self.col, value_states)
        return self.keys, self.values


def draw(logits, temperature, u):
    """rollout.draw's inverse-CDF draw, logits [N, V], u [N, 1] -> [N] (the same ops: the same token)."""
    cdf = torch.softmax(logits / temperature, -1).cumsum(-1)               # (N, V)
    return torch.searchsorted(cdf, u * cdf[:, -1:], right=True).clamp(max=cdf.shape[1] - 1).squeeze(-1)


@torch.no_grad()
def decode(policy, cache, logits, mask, pos, max_new_tokens, temperature, eos_ids, pad_id, greedy=False,
           return_logprobs=False, uniforms=None, graph=False, sync_every=16):
    """rollout.decode with fixed shapes (module docstring): from prefill's (cache, logits of y_0 [N, V], mask
    [N, P], position of the last prefix token [N, 1]), at most max_new_tokens per row. Returns the completion
    ids [N, T'] (pad_id after each row's EOS, cut after the last row's), with return_logprobs also their
    log-probs [N, T']. uniforms [N, max_new_tokens] in [0, 1): the numbers each row's draws use (None: drawn
    here, all at once). graph: capture one step as a CUDA graph and replay it (CUDA only). sync_every: tokens
    between two host reads of "has every row ended?" (1 on a CPU, where the read costs nothing)."""
    N, P = mask.shape
    T, dev = max_new_tokens, logits.device
    if graph and dev.type != "cuda":
        raise ValueError("graph=True needs a CUDA device: on a CPU the static loop runs eagerly (graph=False)")
    L = -(-(P + T) // ALIGN) * ALIGN
    col = torch.full((1,), P, dtype=torch.long, device=dev)                 # where the next token's K/V go
    t = torch.zeros(1, dtype=torch.long, device=dev)                        # the step: uniform and output column
    for i in range(len(cache.layers)):  # one layer at a time: the prefill's copy goes as the new one comes
        cache.layers[i] = StaticLayer(cache.layers[i], L, col)
    seen = torch.zeros(N, 1, 1, L, dtype=torch.bool, device=dev)            # (N, 1, 1, P + T) keys a query sees
    seen[:, 0, 0, :P] = mask
    pos = pos.clone()                                                       # (N, 1) position of the last token
    u = torch.rand(N, T, device=dev) if uniforms is None else uniforms.to(dev, torch.float32)
    eos = torch.tensor(eos_ids, device=dev)
    tokens = torch.full((N, T), pad_id, dtype=torch.long, device=dev)
    logps = torch.zeros(N, T, device=dev)
    done = torch.zeros(N, dtype=torch.bool, device=dev)
    last = torch.full((N,), pad_id, dtype=torch.long, device=dev)          # the token fed next
    scores = logits.float().clone()                                         # (N, V) the distribution of y_t
    kwargs = cache_kwargs(policy, cache)

    def pick():  # y_t from `scores`, written at column t
        nxt = scores.argmax(-1) if greedy else draw(scores, temperature, u.index_select(1, t))   # (N,)
        nxt = torch.where(done, pad_id, nxt)                                # finished rows emit padding
        tokens.index_copy_(1, t, nxt[:, None])
        if return_logprobs:
            logp = torch.log_softmax(scores / temperature, -1).gather(-1, nxt[:, None])         # (N, 1)
            logps.index_copy_(1, t, logp)
        done.logical_or_((nxt[:, None] == eos).any(-1))
        last.copy_(nxt)

    def step():  # feed y_t, then pick y_{t+1}
        seen.index_fill_(3, col, True)
        pos.add_(1)
        out = policy(input_ids=last[:, None], attention_mask=seen, position_ids=pos, use_cache=True,
                     logits_to_keep=1, **kwargs)
        scores.copy_(out.logits[:, -1])
        col.add_(1)
        t.add_(1)
        pick()

    pick()                                                                  # y_0, from the prefill's logits
    replay, n = step, 1
    if graph and T > WARMUP + 2:
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            for _ in range(WARMUP):
                step()
        torch.cuda.current_stream(dev).wait_stream(side)
        n += WARMUP
        captured = torch.cuda.CUDAGraph()
        with torch.cuda.graph(captured):                                    # recorded, not run
            step()
        replay = captured.replay
    every = 1 if dev.type == "cpu" else sync_every
    while n < T and not (n % every == 0 and bool(done.all())):
        replay()
        n += 1
    ended = (tokens[:, :n, None] == eos).any(-1).cummax(1).values.all(0)   # (n,) every row ended by step t
    if bool(ended.any()):  # cut the all-padding tokens written after every row had ended
        n = int(ended.int().argmax()) + 1
    return (tokens[:, :n], logps[:, :n]) if return_logprobs else tokens[:, :n]
