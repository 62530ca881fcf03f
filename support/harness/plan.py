"""
A memory plan before a run: what each device of one process will hold, from the models' configs alone.

    python train.py --team default --device cuda --plan        # the paper's team: no download, no GPU needed
    python train.py --team pocket --worked-example --response-prefix "<think>" --context-position before \
        --batch-size 4 --grad-accum 1 --group-size 4 --max-new-tokens 48 --plan   # prints, writes nothing

The models are built on PyTorch's meta device (shapes without storage) by the code a run uses: the policy with
lora.apply_lora, the method with its own constructor (experts.load_model swapped for a meta loader while it
runs). So the parameter counts are exact, LoRA and g_phi included. A config comes from: tiny (built here),
pocket (the converted copy's config.json, else the GGUF file's header), a local folder or the hub cache, and for
the paper's hub models without a cache, lib/shape_models.HUB_CONFIGS (their published dimensions).

What is counted, per device of one process (under torchrun every process holds the same on its own devices):
  policy       its frozen weights at --dtype
  experts      their frozen weights at --dtype (on --expert-device if given), and the activations and KV cache
               of one forward over a micro-batch's prompts (no gradient)
  LoRA, g_phi  float32 weights + gradient + AdamW's two moments: 16 bytes a parameter
  rollout      one decode loop (train.sample_step: every micro-batch of the step, or --rollout-batch of them): a
               merged copy of the LoRA-wrapped weights (lora.lora_merged), the KV cache of its rows x (prompt + m +
               new tokens) (and one layer of the prefill's cache while its buffer is filled: lib/kv_cache.py),
               the float32 logits of one sampling step
  loss pass    one micro-batch with gradient: what autograd keeps (ACTIVATIONS_PER_TOKEN_LAYER per token and
               layer, the attention's keys and values: at the key/value heads' width with --attention grouped,
               copied to every query head with sdpa, which also holds the G-fold cache beside the copies; with
               grouped, each forward's stacked mask and SDPA's own output), the logits of y_0 and of one
               completion at a time
               (grpo.head_logprobs; every completion's where the head is more than a linear layer)
  runtime      on CPU, the resident memory of this very process (Python, torch, transformers imported, no model
               loaded), measured; on CUDA, the CUDA context, ~0.5 GiB (a common figure, not measured here)
peak = weights + LoRA/g_phi state + max(rollout, loss pass) + runtime.

Deviations / limits: an estimate, checked on CPU against a measured pocket run (results/scaling.md); the prompt
length is that of the first micro-batch when the policy's tokenizer is on disk, else 256 tokens; allocator
fragmentation and the CUDA caching allocator's slack are not modelled; gpt-oss-20b ships MXFP4 weights, counted
here at --dtype (bfloat16: ~2x what the MXFP4 file takes).

Try it on CPU:  python train.py --team tiny --device cpu --plan
"""
import contextlib
import os
import resource

import torch

import experts
import rollout
from lora import apply_lora, lora_layers
from lib import attention, shape_models, static_decode, tiny_models
from lib.shape_models import HUB_CONFIGS
from lib.state_store import StateStore, reads_stored_states, store_identity

GiB = 2 ** 30
# Saved-for-backward elements per token and layer of a Llama/Qwen-style decoder whose linear layers all carry
# LoRA (their frozen weights need no gradient, so only inputs are kept), at the activations' dtype (lora.LoRALinear
# computes in it; when it cast its input up to float32, a bfloat16 run kept ~2x this): the input of each RMSNorm (2 D), the
# inputs of the LoRA-wrapped projections (q/k/v share one: D; o_proj: D; the MLP's: D), the query (D): 6 D;
# the LoRA branches' rank-r intermediates are negligible. The MLP keeps nothing else: recompute.mlps_recomputed
# runs it again in the backward pass (before that it kept down_proj's input and SiLU's input, its output and the
# up projection, 4 I more; with them, on SmolLM2-135M, B 4, G 4, 211 + 48 tokens, saved_tensors_hooks measured
# 2.58 GiB of distinct saved storage besides the weights against 2.51 GiB counted). Keys and values are counted
# apart, over the whole sequence, at the key/value heads' count with --attention grouped (lib/attention.py
# reads them as the cache holds them) and at the query's head count with sdpa (transformers' SDPA path repeats
# grouped key/value heads before attention). tests/test_plan.py checks the count on the tiny policy, both ways.
ACTIVATIONS_PER_TOKEN_LAYER = lambda D: 6 * D  # noqa: E731
DEFAULT_PROMPT_TOKENS = 256
CUDA_CONTEXT = 0.5 * GiB

def model_config(spec):
    """The transformers config of a model spec, without loading weights (see the module docstring)."""
    from transformers import AutoConfig
    spec = spec.removeprefix(experts.ORACLE)
    if spec.startswith("tiny:"):
        return tiny_models.load(spec[5:])[0].config  # a few thousand weights: built for real
    if spec.startswith("pocket:"):
        from lib import pocket_models
        folder = pocket_models.converted_dir(spec[7:])
        if (folder / "config.json").exists():
            return AutoConfig.from_pretrained(folder)
        where, gguf, _ = pocket_models.locate_pocket_model(spec[7:])
        return AutoConfig.from_pretrained(where, gguf_file=gguf) if gguf else AutoConfig.from_pretrained(where)
    if spec.startswith("shape:"):
        return shape_models.config(spec[6:])
    if spec in HUB_CONFIGS:
        return shape_models.config(spec)
    try:
        return AutoConfig.from_pretrained(spec, local_files_only=True)
    except OSError:
        raise ValueError(f"--plan: no config for {spec!r} on disk (a local folder, the hub cache or the table "
                         "in support/harness/plan.py)") from None


def meta_model(spec, device=None, dtype=torch.float32, head=True):
    """(model on the meta device, None): a stand-in for experts.load_model (head=False: an expert that is only
    read, built without its LM head, as experts.load_model builds it)."""
    import transformers as tf
    config = model_config(spec)
    with torch.device("meta"):
        encoder = config.model_type in experts.ENCODER_TYPES
        cls = tf.AutoModel if encoder or not head else tf.AutoModelForCausalLM
        model = cls.from_config(config, dtype=dtype)
    for p in model.parameters():
        p.requires_grad_(False)
    return model.eval(), None


@contextlib.contextmanager
def loading_on_meta():
    real = experts.load_model
    experts.load_model = meta_model
    try:
        yield
    finally:
        experts.load_model = real


def count(params):
    return sum(p.numel() for p in {id(p): p for p in params}.values())  # tied weights once


def prompt_tokens(args, team):
    """Tokens of the longest prompt of the first micro-batch (the rollout pads to it), when the policy's
    tokenizer and the task's items are at hand; else DEFAULT_PROMPT_TOKENS."""
    try:
        import rewards
        from rewards import batch_indices, policy_prompts
        spec = team["policy"]
        if spec.startswith("tiny:"):
            tok = tiny_models.tiny_tokenizer()
        elif spec.startswith("shape:"):  # the stand-in: one token per byte, ~4x a real tokenizer's count
            tok = shape_models.tokenizer(shape_models.config(spec[6:]).vocab_size)
        elif spec.startswith("pocket:"):
            from lib import pocket_models
            from transformers import AutoTokenizer
            tok = AutoTokenizer.from_pretrained(pocket_models.converted_dir(spec[7:]))
        else:
            from transformers import AutoTokenizer
            tok = AutoTokenizer.from_pretrained(spec, local_files_only=True)
        items = rewards.load_entries(args.task, "train", args.dataset_size, args.seed,
                                     data_path=args.data_path,
                                     config=args.task_config)
        idx = batch_indices(0, 0, args.batch_size, args.grad_accum, n_items=len(items), seed=args.seed)
        qs = [items[i]["question"] for i in idx]
        return max(len(tok(p, add_special_tokens=False)["input_ids"]) for p in policy_prompts(tok, qs, [None] * len(qs), args)), True
    except Exception:  # no tokenizer or no data here: a typical reasoning-gym prompt with the system prompt
        return DEFAULT_PROMPT_TOKENS, False


def shape(config):
    """(D, layers, heads, kv heads, head dim, intermediate, vocab) of a decoder or encoder config."""
    D = getattr(config, "hidden_size", None) or config.n_embd
    L = getattr(config, "num_hidden_layers", None) or config.n_layer
    H = getattr(config, "num_attention_heads", None) or config.n_head
    KV = getattr(config, "num_key_value_heads", None) or H
    hd = getattr(config, "head_dim", None) or D // H
    I = getattr(config, "intermediate_size", None) or getattr(config, "n_inner", None) or 4 * D
    return D, L, H, KV, hd, I, config.vocab_size


def precomputed(args, pool, name, device, dtype):
    """Whether the run will read this expert's states from --expert-cache instead of loading it (train.py
    --precompute-states wrote them). The pool was built on the meta device, so it looked for states filed under
    "meta": ask the store under the device the run will use."""
    if not args.expert_cache or not os.path.isdir(args.expert_cache):
        return False
    identity = store_identity(name, device, dtype, pool.pooling, depth=pool.depth, max_length=pool.max_length)
    return reads_stored_states(StateStore(args.expert_cache, identity), pool.pooling, pool.heads)


def estimate(args, world_size=1):
    """{device: {part: bytes}} for one process, and the assumptions used."""
    from baselines import METHODS, kind
    team = experts.team_models(args)
    name = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    expert_device = torch.device(args.expert_device) if args.expert_device else device
    dtype = experts.frozen_dtype(args.dtype, device)
    nbytes = torch.finfo(dtype).bits // 8
    with loading_on_meta():
        policy, _ = meta_model(team["policy"], dtype=dtype)
        method = METHODS[args.method](team, policy.config.hidden_size, args, "meta", dtype)
    apply_lora(policy, args.lora_rank, args.lora_alpha)
    merged = sum(m.base.weight.numel() for _, m in lora_layers(policy))  # lora_merged's copies
    lora = 0 if args.freeze_policy else count(p for p in policy.parameters() if p.requires_grad)
    g_phi = count(p for p in method.parameters() if p.requires_grad)
    frozen = count(p for p in policy.parameters() if not p.requires_grad)
    declared = kind(args.method)  # which frozen models it reads, and whether it writes hints (baselines.Kind)
    pools = ([method.pool] if declared.experts else []) + ([method.encoder] if declared.router else [])
    expert_models = [e[0] for pool in pools for name, e in zip(pool.names, pool.models)
                     if e is not None and not precomputed(args, pool, name, expert_device, dtype=dtype)]
    P, measured = prompt_tokens(args, team)
    B, G, T = args.batch_size, args.group_size, args.max_new_tokens
    n = len(pools[0].models) if pools else 0
    ctx = method.context_tokens  # m: each method says how many context tokens it makes (baselines.py)
    if declared.hints:  # the hints are text in the prompt: up to --max-new-tokens per expert
        P += n * args.max_new_tokens
    Pc = P + ctx                                                        # prompt + context tokens
    D, L, H, KV, hd, I, V = shape(policy.config)
    kv_token = L * 2 * KV * hd * nbytes                                 # one token's keys and values, all layers
    # one decode loop samples --rollout-batch micro-batches (0: all of a process's share of the step)
    per_process = -(-args.grad_accum // world_size)
    R = B * G * min(args.rollout_batch or per_process, per_process)      # rows of one decode loop
    # the decode buffers, and one layer of the G-fold prefill cache while its buffer is filled (kv_cache.preallocate)
    cache = R * (Pc + T) * kv_token + R * Pc * kv_token // L
    rollout_parts = {"merged LoRA weights": merged * nbytes,
                     "KV cache": cache,
                     "logits of a step": 3 * R * V * 4}                 # float32 logits, softmax, cdf
    # the decode step captured once per run (CUDA's static_decode.DECODE, lib/static_decode.py) reads its KV cache
    # and the merged weights (lora_merged(keep=True)) at fixed addresses: they stay allocated between steps, beside
    # the loss pass; only the prefill's one layer stays a transient
    # (static_decode.GRAPH_MERGED False: LoRA unmerged inside the graph, no merged copy at all)
    held = {}
    if device.type == "cuda" and static_decode.decode_loop(device) == "graph":
        held = {"decode graph: KV cache": R * (Pc + T) * kv_token}
        rollout_parts["KV cache"] -= held["decode graph: KV cache"]
        merged_copy = rollout_parts.pop("merged LoRA weights")
        if static_decode.GRAPH_MERGED:
            held["decode graph: merged LoRA weights"] = merged_copy
    act = ACTIVATIONS_PER_TOKEN_LAYER(D) * L * nbytes
    grouped = attention.resolve(args.attention, policy, device) == attention.NAME
    kv_saved = L * 2 * (KV if grouped else H) * hd * nbytes             # keys and values as attention keeps them
    kv = (B * G * (Pc + T) + B * Pc) * kv_saved  # the scoring forward's and the prefill's (at most B rows)
    if not grouped:  # the SDPA path keeps its copies; the G-fold cache itself lives beside them until the pass ends
        kv += B * G * Pc * kv_token
    if policy.config.model_type in rollout.PLAIN_HEADS:  # grpo.head_logprobs
        # y_0's rows (the prefill's output, float32), and one completion's logits at a time: the head's output, its
        # float32 copy and their gradient, computed again in the backward pass
        logits = B * G * V * (nbytes + 4) + T * V * (nbytes + 8)
    else:  # the head's [N, T, V] output, a copy, the float32 rows kept for the backward pass
        logits = B * G * T * V * (2 * nbytes + 4)
    # --attention grouped: each forward's mask, its rows stacked per query head of a group, additive, kept once for
    # every layer (lib/attention.grouped_mask): the prefill's (whole prompts; a shared beginning runs at batch 1)
    # and the scoring forward's. SDPA's bool masks are converted inside each layer's call instead (not counted).
    n_rep = H // KV
    masks = n_rep * (B * Pc * Pc + B * G * T * (Pc + T)) * nbytes if grouped else 0
    # --attention grouped: SDPA's output, kept for its backward pass, is not o_proj's input (a copy into the heads'
    # order is), one [tokens, D] tensor a layer more than the SDPA path keeps
    outputs = (B * Pc + B * G * T) * D * L * nbytes if grouped else 0
    loss = {"activations": (B * Pc + B * G * T) * act,
            "keys and values": kv,
            "attention masks": masks,
            "attention outputs": outputs,
            "logits": logits,
            "one MLP recomputed": (B * Pc + B * G * T) * 4 * I * nbytes}  # in the backward pass, one layer at a time
    per_expert = []
    for m in expert_models:
        d, l, _, kv, ehd, i, _ = shape(m.config)
        per_expert.append(B * P * (l * 2 * kv * ehd + 2 * d + 2 * i) * nbytes)   # its cache + one layer's work
    plan = {}
    pol = plan.setdefault(str(device), {})
    pol["policy weights"] = frozen * nbytes
    pol["LoRA + grad + AdamW"] = 16 * lora
    pol["g_phi + grad + AdamW"] = 16 * g_phi
    pol.update(held)
    ex = plan.setdefault(str(expert_device), {})
    ex["expert weights"] = ex.get("expert weights", 0) + count(p for m in expert_models for p in m.parameters()) * nbytes
    ex["expert forward"] = ex.get("expert forward", 0) + (max(per_expert) if per_expert else 0)
    pol["rollout (one decode loop)"] = sum(rollout_parts.values())
    pol["loss pass (one micro-batch)"] = sum(loss.values())
    for d in {str(device), str(expert_device)}:
        plan[d]["runtime"] = CUDA_CONTEXT if d.startswith("cuda") else \
            resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024   # Linux: kilobytes
    info = dict(prompt_tokens=P, prompt_measured=measured, context_tokens=ctx, dtype=str(dtype).split(".")[-1],
                params=dict(policy=frozen, experts=count(p for m in expert_models for p in m.parameters()),
                            lora=lora, g_phi=g_phi), rollout=rollout_parts, loss=loss, processes=world_size,
                attention=f"{'grouped' if grouped else 'sdpa'}: keys and values at {KV if grouped else H} of {H} heads")
    return plan, info


def peak(parts):
    """Everything resident at once: the larger of the rollout and the loss pass, not both."""
    phases = ("rollout (one decode loop)", "loss pass (one micro-batch)")
    return sum(v for k, v in parts.items() if k not in phases) + max([parts.get(k, 0) for k in phases])


def main(args, world):
    if world.rank != 0:
        return None
    plan, info = estimate(args, world.size)
    p = info["params"]
    print(f"memory plan: --team {args.team} --method {args.method}, {info['dtype']} frozen weights; parameters: "
          f"policy {p['policy'] / 1e9:.3f} B, experts {p['experts'] / 1e9:.3f} B, LoRA {p['lora'] / 1e6:.2f} M, "
          f"g_phi {p['g_phi'] / 1e6:.2f} M")
    print(f"one micro-batch: {args.batch_size} prompts x G {args.group_size}, prompt {info['prompt_tokens']} tokens"
          f" ({'measured on the first micro-batch' if info['prompt_measured'] else 'assumed'}) + "
          f"{info['context_tokens']} context + {args.max_new_tokens} new; attention {info['attention']}")
    for device, parts in plan.items():
        print(f"{device}: peak ~{peak(parts) / GiB:.2f} GiB")
        for k, v in parts.items():
            print(f"  {k:30s} {v / GiB:8.3f} GiB")
    if world.size > 1:
        print(f"each of the {world.size} processes holds the above on its own device(s)")
    return None
