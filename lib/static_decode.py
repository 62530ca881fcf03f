"""
The rollout's decode engine: from rollout.prefill's KV cache (the prompts run once, repeated G times), the loop that
writes the completions token by token. rollout.sample and rollout.greedy_texts call `decode` (rollout.decode, for
evaluate.py and support/harness/gold.py, which reuse one prefill); rollout.sample_plain is the plain version of the
same thing, and tests/test_adapter.py holds the two equal. Two loops, one call:

  - the eager loop (in `decode`, the reference, and the path on a CPU): the cache grows by a column a token (written
    in place, lib/kv_cache.py), "has every row ended?" read on the host every SYNC_EVERY tokens on a GPU (every
    token on a CPU), and the all-padding tokens written after the last row ended cut at the end;
  - the static loop (decode_static, CUDA's default: DECODE), the same loop with every shape fixed, so that one
    decode step can be captured as a CUDA graph once per run and replayed at every token of every step: no host
    synchronisation inside a step, ~2,000 kernel launches a token turned into one graph launch.

Why the static loop: the eager one grows the mask by one column a token, reads "has every row ended?" on the host,
and leaves the attention mask to transformers, whose SDPA mask code reads a device tensor on the host in every
forward (transformers 5.17's masking_utils). Measured on an H200 (results/gpu.md): ~2,070 kernels a token at 74-93
ms a decode step, against a memory floor of a few ms. Here, as inference engines do it (vLLM and nanochat keep a
static KV cache; vLLM and gpt-fast capture the decode step):

  - the KV cache at a fixed size [N, H_kv, L, d] (L >= P + T rounded up to ALIGN; P the prefill's columns, T the new
    tokens), each layer's new key and value written at a column held in a device tensor (StaticLayer);
  - the attention mask at the same size [N, 1, 1, L], built here (transformers returns a 4-D mask as it is), the
    next column switched on in place; the positions advanced in place;
  - a device-side step counter that picks each row's uniform number and the output column;
  - all of it in one Loop, filled in place by each call (fill), its tensors never replaced;
  - the step (forward the last token, draw the next) captured with torch.cuda.CUDAGraph by the first call, after
    WARMUP eager steps on the same side stream, into one memory pool (capture), and replayed by every later call of
    the same shape: HELD keeps each policy's Loop for the run. A call of another shape (rows, new tokens, more
    columns) builds a new Loop and captures again, and so does a call after a weight the graph reads was replaced
    by a new tensor (a graph reads the addresses it was captured with: the Loop compares them, `addresses`), so
    the weights must be updated in place: the optimiser does, and rollout.sample merges LoRA with
    lora_merged(keep=True), into the same buffers each step (or leaves it unmerged, its parameters read inside the
    graph: GRAPH_MERGED);
  - fail-soft: a capture or a replay that raises does not end the call: it goes on with the same step run eagerly
    (the same tokens), from where the device's step counter stands, prints why once on stderr, and the policy's
    later calls run the static loop eagerly; decode_path tells the run's metrics which loop ran and why;
  - "has every row ended?" read on the host every `sync_every` tokens, outside the captured step, and the
    all-padding tokens after it cut, as the eager loop does.

The same numbers as the eager loop: the keys not yet written are zeros and masked (softmax weight exactly 0), so a
token sees the same keys at the same positions; only the reductions run over a longer row (float rounding).
tests/test_static_decode.py runs the static loop eagerly (graph=False) on the CPU against the eager one: the same
tokens and log-probs from the same uniforms; and with a stand-in for `capture` the graph's path around it
(fail-soft, one capture for two steps with a LoRA update between, the addresses read). Constrained decoding
(`allowed`) keeps the eager loop. What a CPU cannot show (the graph itself) the `cuda` tests and
experiments/gpu_check.py do.

Memory: the Loop (its KV cache of N x L columns) and the merged weights stay allocated between steps, so the loss
pass runs beside them: the price of capturing once (a graph captured again in every call costs ~0.2-0.5 s a step).
support/harness/plan.py counts them as resident: the default team's --plan on CUDA says 45.0 GiB with LoRA merged
(4.4 GiB of KV cache and 5.2 GiB of merged weights kept), 39.8 GiB unmerged, 38.9 GiB for the eager loop.

  DECODE, GRAPH_MERGED       which loop runs (auto: graph on CUDA, else eager); LoRA merged or not in the graph
  decode_loop, decode_path   the loop DECODE names on a device; the loop a policy's last decode ran, and why
  decode(...)                the loop after prefill: the static one where it can run (supports), else eager
  decode_static(...)         decode's arguments (no `allowed`), plus graph=True to capture the step
  Loop, StaticLayer          the static loop's tensors at one shape; one layer of its KV cache
  capture(loop, held)        WARMUP eager steps then the step recorded as a CUDA graph: its replay
  HELD                       policy -> Held: its Loop, captured step, stream and pool, and why a graph failed

Try it on CPU:  python -m pytest tests/test_static_decode.py -q
"""
import sys
import time
import weakref
from dataclasses import dataclass
from typing import Any, Optional

import torch
from transformers.cache_utils import DynamicLayer

from lib.kv_cache import cache_kwargs, cache_of, preallocate

MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")  # RoPE decoders whose forward takes a 4-D mask as it is
WARMUP = 2      # eager steps before the capture (cuBLAS handles, kernel choices); they are real steps
ALIGN = 16      # the cache's length rounded up to this: 16 bf16 keys are 32 bytes, the fused attention kernels'
                # aligned loads (8 was enough for none of flash's, efficient's or cuDNN's tiles to skip padding)


SYNC_EVERY = 16  # decode: on a GPU, ask whether every row has ended once per this many tokens
DECODE = "auto"  # decode's loop: "eager", "static" or "graph" (decode_static); auto: graph on CUDA, else eager
# the captured step reads LoRA merged into buffers kept for the run (one matmul a layer; Qwen2.5-3B's 5.2 GiB copy
# stays beside the loss pass: --plan 45.0 GiB for the default team) or, False, unmerged (its low-rank products inside
# the graph, ~6 kernels more a wrapped layer, no copy: --plan 39.8 GiB); experiments/gpu_check.py measures both
GRAPH_MERGED = True


def decode_loop(device):
    """The loop DECODE names on `device`: "eager", "static" or "graph" (auto: graph on CUDA, else eager)."""
    path = DECODE if DECODE != "auto" else "graph" if torch.device(device).type == "cuda" else "eager"
    if path == "graph" and torch.device(device).type != "cuda":
        raise ValueError(f"static_decode.DECODE = 'graph' needs a CUDA device, not {device}: on a CPU set 'static' "
                         "(the same loop, not captured) or 'eager'")
    return path


def decode_path(policy):
    """(the loop `policy`'s last decode ran: "eager", "static" or "graph"; why a captured graph failed, or None):
    the run's metrics record both (a graph that fails goes on as "static")."""
    held = HELD.get(policy)
    return (held.path, held.failed) if held else ("eager", None)


def decode(policy, cache, logits, mask, pos, max_new_tokens, temperature, eos_ids, pad_id,
           greedy=False, return_logprobs=False, allowed=None, uniforms=None):
    """The token-by-token loop of rollout.sample, from what rollout.prefill returned (cache, logits of y_0 [N, V],
    mask [N, P], position of the last prefix token [N, 1]): draw (or argmax) a token per row, feed it, until every
    row has ended or max_new_tokens are written. Finished rows emit pad_id. Returns the completion ids [N, T'], with
    return_logprobs also their log-probs [N, T']; `allowed` and `uniforms` as rollout.sample's.

    "Has every row ended?" needs the GPU's answer on the host (a synchronisation that stalls the
    launch queue), so on a GPU it is asked every SYNC_EVERY tokens, and the tokens written after
    the last row ended (all padding) are cut at the end: the same output as asking every token.
    On CUDA the same loop runs with fixed shapes, its step captured as a CUDA graph (DECODE)."""
    path = decode_loop(logits.device)
    if path != "eager" and allowed is None and supports(policy, cache):
        return decode_static(policy, cache, logits, mask, pos=pos, max_new_tokens=max_new_tokens,
                             temperature=temperature, eos_ids=eos_ids, pad_id=pad_id, greedy=greedy,
                             return_logprobs=return_logprobs, uniforms=uniforms, graph=path == "graph",
                             sync_every=SYNC_EVERY)
    if policy in HELD:  # the metrics' record of the loop that ran
        HELD[policy].path = "eager"
    sync_every = 1 if logits.device.type == "cpu" else SYNC_EVERY
    preallocate(cache, max_new_tokens)  # each token written in place (lib/kv_cache.py)
    logits = logits.float()                                               # (B*G, vocab)
    eos = torch.tensor(eos_ids, device=logits.device)
    done = torch.zeros(logits.shape[0], dtype=torch.bool, device=logits.device)
    tokens, logps, ended = [], [], []
    for t in range(max_new_tokens):
        if allowed is not None:
            ok = allowed(tokens[-1] if tokens else None)                      # (B*G, vocab) bool
            logits = logits.masked_fill(~ok, -torch.inf)
        u = None if uniforms is None else uniforms[:, t:t + 1]               # (B*G, 1)
        nxt = logits.argmax(-1) if greedy else draw(logits, temperature, u)   # (B*G,)
        if allowed is not None:  # draw clamps to the last token if u rounds up (p ~ 1e-7)
            nxt = torch.where(ok.gather(-1, nxt[:, None]).squeeze(-1), nxt, logits.argmax(-1))
        nxt = torch.where(done, torch.full_like(nxt, pad_id), nxt)  # finished rows emit padding
        tokens.append(nxt)
        if return_logprobs:
            logp_all = torch.log_softmax(logits / temperature, -1)         # (B*G, vocab)
            logps.append(logp_all.gather(-1, nxt[:, None]).squeeze(-1))
        done = done | torch.isin(nxt, eos)
        ended.append(done)
        if (t + 1) % sync_every == 0 and done.all():
            break
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)      # (B*G, P' + t + 1)
        pos = pos + 1
        out = policy(input_ids=nxt[:, None], attention_mask=mask, position_ids=pos,
                     use_cache=True, **cache_kwargs(policy, cache))
        cache, logits = cache_of(out), out.logits[:, -1].float()
    if sync_every > 1:  # cut the all-padding tokens written after every row had ended
        all_ended = torch.stack(ended).all(1)                                  # (t,)
        n = int(all_ended.int().argmax()) + 1 if bool(all_ended.any()) else len(tokens)
        tokens, logps = tokens[:n], logps[:n]
    if return_logprobs:
        return torch.stack(tokens, 1), torch.stack(logps, 1)
    return torch.stack(tokens, 1)


def draw(logits, temperature, u=None):
    """One token per row from softmax(logits / temperature), logits [N, V] -> [N]. Inverse-CDF
    sampling: one uniform number per row (u [N, 1] in [0, 1), drawn here if not given), where
    torch.multinomial draws one exponential per vocabulary entry (~9 ms a step for 8 x 49k on 2
    CPU cores). A zero-probability token has an empty CDF interval and is never drawn. Every sampler
    draws with it: rollout.sample_plain, the eager loop, the static loop's captured step."""
    cdf = torch.softmax(logits.float() / temperature, -1).cumsum(-1)         # (N, V)
    if u is None:
        u = torch.rand(cdf.shape[0], 1, device=cdf.device)
    u = u * cdf[:, -1:]                                               # (N, 1) uniform in [0, total)
    return torch.searchsorted(cdf, u, right=True).clamp(max=cdf.shape[1] - 1).squeeze(-1)


# ----------------------------------------------------------------------------------------------------------------
# The static loop: fixed shapes, its step captured as a CUDA graph


def supports(policy, cache):
    """True where the static loop runs `policy`'s decode exactly as the eager loop does."""
    cfg = policy.config
    full = all(t == "full_attention" for t in getattr(cfg, "layer_types", None) or ["full_attention"])
    return (cfg.model_type in MODEL_TYPES and full and len(cache.layers) > 0
            and all(type(layer) is DynamicLayer for layer in cache.layers))


class StaticLayer(DynamicLayer):
    """One layer of the KV cache at a fixed size [N, H_kv, length, d], shaped like a prefill's `layer`: fill()
    copies a prefill's keys and values in front (zeros behind them); update() writes the new token's key and value
    at column `col` (a device tensor [1], shared by every layer and advanced by the loop) and returns the whole
    buffer, so every forward sees the same shapes and addresses."""

    def __init__(self, layer, length, col):
        super().__init__()
        (N, H, _, Dk), Dv = layer.keys.shape, layer.values.shape[-1]
        self.keys = layer.keys.new_zeros(N, H, length, Dk)  # zeros, not empty: 0 x NaN would reach the output
        self.values = layer.values.new_zeros(N, H, length, Dv)
        self.col = col
        self.dtype, self.device, self.is_initialized = layer.keys.dtype, layer.keys.device, True

    def fill(self, layer):
        P = layer.keys.shape[2]
        self.keys[:, :, :P], self.values[:, :, :P] = layer.keys, layer.values
        self.keys[:, :, P:], self.values[:, :, P:] = 0, 0                  # the last call's tokens go

    def update(self, key_states, value_states, *args, **kwargs):
        self.keys.index_copy_(2, self.col, key_states)                      # (N, H_kv, 1, d) at column col
        self.values.index_copy_(2, self.col, value_states)
        return self.keys, self.values


def addresses(policy):
    """Where the policy's weights are: a captured graph reads these addresses, whatever tensors sit there now."""
    return tuple(t.data_ptr() for t in [*policy.parameters(), *policy.buffers()])


class Loop:
    """The static loop's tensors at one shape (N rows, L columns, T new tokens) and the step that advances them.
    Built from the first call's prefill `cache` (its layers become StaticLayers of L columns); every call fills the
    same tensors in place (fill), so the step captured by one call reads the next call's numbers."""

    def __init__(self, policy, cache, shape, L, T, greedy, return_logprobs, temperature, eos_ids, pad_id):
        dev, N, V = cache.layers[0].keys.device, shape[0], shape[1]
        self.shape, self.L, self.weights = shape, L, addresses(policy)
        # a weak reference: HELD[policy] holds this Loop, which must not keep its policy (and the card's memory) alive
        self.policy = weakref.proxy(policy)
        self.greedy, self.return_logprobs, self.temperature = greedy, return_logprobs, temperature
        self.pad_id, self.replay = pad_id, None                             # replay: the captured step's
        self.col = torch.zeros(1, dtype=torch.long, device=dev)             # where the next token's K/V go
        self.t = torch.zeros(1, dtype=torch.long, device=dev)               # the step: uniform and output column
        self.layers = [StaticLayer(layer, L, self.col) for layer in cache.layers]
        self.cache = cache                                                  # the forward's cache: our layers
        self.kwargs = cache_kwargs(policy, cache)
        self.seen = torch.zeros(N, 1, 1, L, dtype=torch.bool, device=dev)   # (N, 1, 1, L) keys a query sees
        self.pos = torch.zeros(N, 1, dtype=torch.long, device=dev)          # (N, 1) position of the last token
        self.u = torch.zeros(N, T, device=dev)                              # (N, T) each draw's uniform number
        self.eos = torch.tensor(eos_ids, device=dev)
        self.tokens = torch.full((N, T), pad_id, dtype=torch.long, device=dev)
        self.logps = torch.zeros(N, T, device=dev)
        self.done = torch.zeros(N, dtype=torch.bool, device=dev)
        self.last = torch.full((N,), pad_id, dtype=torch.long, device=dev)  # the token fed next
        self.scores = torch.zeros(N, V, device=dev)                         # (N, V) the distribution of y_t

    def fill(self, cache, logits, mask, pos, u):
        """A call's prefill (cache, logits [N, V], mask [N, P], pos [N, 1]) and uniforms [N, T], in place."""
        P = mask.shape[1]
        for i, layer in enumerate(cache.layers):  # one layer at a time: the prefill's copy goes as it is read
            self.layers[i].fill(layer)
            cache.layers[i] = self.cache.layers[i] = self.layers[i]
        self.col.fill_(P)
        self.t.zero_()
        self.seen.zero_()
        self.seen[:, 0, 0, :P] = mask
        self.pos.copy_(pos)
        self.u.copy_(u)
        self.tokens.fill_(self.pad_id)
        self.logps.zero_()
        self.done.zero_()
        self.last.fill_(self.pad_id)
        self.scores.copy_(logits)

    def pick(self):
        """y_t from `scores`, written at column t."""
        nxt = self.scores.argmax(-1) if self.greedy else draw(self.scores, self.temperature,
                                                              self.u.index_select(1, self.t))   # (N,)
        nxt = torch.where(self.done, self.pad_id, nxt)                      # finished rows emit padding
        self.tokens.index_copy_(1, self.t, nxt[:, None])
        if self.return_logprobs:
            logp = torch.log_softmax(self.scores / self.temperature, -1).gather(-1, nxt[:, None])  # (N, 1)
            self.logps.index_copy_(1, self.t, logp)
        self.done.logical_or_((nxt[:, None] == self.eos).any(-1))
        self.last.copy_(nxt)

    def step(self):
        """Feed y_t, then pick y_{t+1}: what the graph captures."""
        self.seen.index_fill_(3, self.col, True)
        self.pos.add_(1)
        out = self.policy(input_ids=self.last[:, None], attention_mask=self.seen, position_ids=self.pos,
                          use_cache=True, logits_to_keep=1, **self.kwargs)
        self.scores.copy_(out.logits[:, -1])
        self.col.add_(1)
        self.t.add_(1)
        self.pick()


@dataclass
class Held:
    """What a policy's decode keeps for the run (HELD[policy])."""
    loop: Optional[Loop] = None           # the tensors at the last graph call's shape, and its captured step
    stream: Any = None                    # the side stream of every warm-up and capture
    pool: Any = None                      # the captured steps' memory pool (one for the run)
    captures: int = 0                     # steps captured: 1 a run, unless a shape or a weight's address changed
    capture_seconds: float = 0.0          # the last capture's seconds, its warm-up steps included (synchronised)
    path: str = "eager"                   # the loop the last call ran: "eager", "static" or "graph"
    failed: Optional[str] = None          # why a capture or replay failed: the run then stays on "static"


HELD = weakref.WeakKeyDictionary()  # policy -> Held, for as long as the policy lives


def capture(loop, held):
    """WARMUP real steps of `loop`, then its step recorded as a CUDA graph, both on held's side stream (cuBLAS sets up its
    handle and workspace per stream: warming up on another stream left that set-up inside the capture) and into
    held's memory pool (one for the run, reused when a new shape is captured). -> (the graph's replay, WARMUP)."""
    if held.stream is None:
        held.stream, held.pool = torch.cuda.Stream(), torch.cuda.graph_pool_handle()
    held.stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(held.stream):
        for _ in range(WARMUP):
            loop.step()
    torch.cuda.current_stream().wait_stream(held.stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=held.pool, stream=held.stream):    # recorded, not run
        loop.step()
    return graph.replay, WARMUP


@torch.no_grad()
def decode_static(policy, cache, logits, mask, pos, max_new_tokens, temperature, eos_ids, pad_id, greedy=False,
                  return_logprobs=False, uniforms=None, graph=False, sync_every=16):
    """decode's loop with fixed shapes (module docstring): from prefill's (cache, logits of y_0 [N, V], mask
    [N, P], position of the last prefix token [N, 1]), at most max_new_tokens per row. Returns the completion
    ids [N, T'] (pad_id after each row's EOS, cut after the last row's), with return_logprobs also their
    log-probs [N, T']. uniforms [N, max_new_tokens] in [0, 1): the numbers each row's draws use (None: drawn
    here, all at once). graph: replay the step captured by an earlier call of this shape, or capture it (CUDA;
    a failure goes on eagerly, see the module docstring). sync_every: tokens between two host reads of "has every
    row ended?" (1 on a CPU, where the read costs nothing)."""
    (N, P), T, dev = mask.shape, max_new_tokens, logits.device
    held = HELD.setdefault(policy, Held())
    graph = graph and held.failed is None and T > WARMUP + 2
    shape = (N, logits.shape[-1], T, greedy, return_logprobs, temperature, tuple(eos_ids), pad_id,
             tuple((layer.keys.shape[1], layer.keys.shape[3], layer.values.shape[3], layer.keys.dtype)
                   for layer in cache.layers))                             # all but the prompt's width P
    loop = held.loop if graph else None
    # a new Loop (and capture) for a new shape, a longer prompt than the Loop has room for (a new longest one: a few
    # times a run), or a weight the graph reads that is no longer where it was
    if loop is None or loop.shape != shape or loop.L < P + T or loop.weights != addresses(policy):
        if graph:
            held.loop = None                                                # the old tensors go first
        loop = Loop(policy, cache, shape, L=-(-(P + T) // ALIGN) * ALIGN, T=T, greedy=greedy,
                    return_logprobs=return_logprobs, temperature=temperature, eos_ids=eos_ids, pad_id=pad_id)
        if graph:
            held.loop = loop
    loop.fill(cache, logits.float(), mask, pos, torch.rand(N, T, device=dev) if uniforms is None else uniforms)
    loop.pick()                                                             # y_0, from the prefill's logits
    n, replaying = 1, False
    if graph:
        try:
            if loop.replay is None:
                sync(dev)
                t0 = time.perf_counter()
                loop.replay, warm = capture(loop, held)
                sync(dev)
                held.captures, held.capture_seconds, n = held.captures + 1, time.perf_counter() - t0, n + warm
            replaying = True
        except Exception as e:  # noqa: BLE001  fail-soft: the same loop goes on eagerly
            n = fall_back(held, loop, "capture", e)
    held.path = "graph" if replaying else "static"
    every = 1 if dev.type == "cpu" else sync_every
    while n < T and not (n % every == 0 and bool(loop.done.all())):
        try:
            loop.replay() if replaying else loop.step()
            n += 1
        except Exception as e:  # noqa: BLE001  fail-soft: the same loop goes on eagerly
            if not replaying:
                raise
            n, replaying, held.path = fall_back(held, loop, "replay", e), False, "static"
    tokens = loop.tokens[:, :n]
    ended = (tokens[:, :, None] == loop.eos).any(-1).cummax(1).values.all(0)  # (n,) every row ended by step t
    if bool(ended.any()):  # cut the all-padding tokens written after every row had ended
        n = int(ended.int().argmax()) + 1
    tokens, logps = loop.tokens[:, :n].clone(), loop.logps[:, :n].clone()  # the next call refills the loop's
    return (tokens, logps) if return_logprobs else tokens


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def fall_back(held, loop, where, error):
    """A capture or replay that raised: say why once, drop the graph (its memory with it), and return how many
    tokens the loop holds (the device's step counter + 1: a step that did not run is run again, eagerly)."""
    held.failed = f"{where}: {type(error).__name__}: {error}"[:500]
    print(f"static_decode: the CUDA graph's {where} failed ({held.failed}); the decode goes on with the same "
          "loop run eagerly (the same tokens, slower), for the rest of this run", file=sys.stderr, flush=True)
    loop.replay, held.loop = None, None
    if loop.t.device.type == "cuda":
        sync(loop.t.device)
        torch.cuda.empty_cache()  # an out-of-memory error inside the capture leaves its pool's blocks behind
    return int(loop.t.item()) + 1
