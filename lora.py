"""
Handwritten LoRA: the only trainable part of the policy pi_theta.

The paper trains "LoRA adapters [36] of rank 8" on a frozen Qwen2.5-3B-Instruct (§4.1). LoRA (Hu et
al. 2021) keeps a frozen weight W and learns a low-rank update:

    y = x W^T + b + (alpha / r) * x A^T B^T,      A in R^{r x in},  B in R^{out x r}

A starts random and B starts at zero, so the wrapped layer is an exact no-op at step 0 and the
policy starts as the reference policy (paper Eq. 4, pi_ref = the frozen initial policy).

What is here:
  LoRALinear          one wrapped nn.Linear
  apply_lora          freeze a model and wrap the named linear layers, returns the wrapped names
  lora_disabled       context manager: the base model (used for the reference log-probs)
  lora_merged         context manager: updates folded into copies of the weights (fast rollout;
                      keep=True: into the same buffers each time, for a captured decode step)
  lora_state_dict     the trainable tensors only (small checkpoints)
  save_peft           export in PEFT's on-disk format, so `peft.PeftModel.from_pretrained` loads it

Deviations from the paper: none known. The paper does not give alpha, dropout or target modules; we
use alpha = 2r = 16, no dropout, and all attention and MLP projections (the common choice for
Qwen/Llama).

Try it on CPU:  python -m pytest tests/test_lora.py -q
"""
import contextlib
import json
import math
import os

import torch
import torch.nn as nn

# Linear layers of Llama/Qwen/Gemma/Mistral/Phi-3 style decoders. GPT-2 style models use Conv1D
# instead of nn.Linear and are not supported as a policy (experts are never wrapped, so any model
# works as an expert).
DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                   "qkv_proj", "gate_up_proj")


class LoRALinear(nn.Module):
    """A frozen nn.Linear plus a trainable low-rank update (alpha / r) * B A."""

    def __init__(self, base: nn.Linear, rank: int = 8, alpha: float = 16.0):
        super().__init__()
        if rank < 1:
            raise ValueError(f"LoRA rank must be >= 1, got {rank}")
        self.base = base
        self.rank, self.alpha = rank, alpha
        self.scaling = alpha / rank
        # float32 whatever the frozen weight is: an Adam step of 3e-5 on a weight of 0.02 rounds to
        # nothing in bfloat16 (8 bits of mantissa, spacing 1.2e-4 there), so a bf16 LoRA would
        # silently stop learning
        dev = base.weight.device
        fp32 = dict(device=dev, dtype=torch.float32)
        self.lora_A = nn.Parameter(torch.empty(rank, base.in_features, **fp32))   # (r, in)
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, rank, **fp32))  # (out, r), B = 0
        # Same init as the LoRA paper's reference code and PEFT: A ~ Kaiming-uniform, B = 0 (update
        # is zero).
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
        self.enabled = True   # lora_disabled() flips this to get the base (reference) model
        self.merged = False   # inside lora_merged() the update lives in (a copy of) base.weight
        self.merged_weight = None  # lora_merged(keep=True)'s buffer for W + s B A, kept between merges

    def forward(self, x):
        y = self.base(x)
        if self.enabled and not self.merged:
            # (..., in) -> (..., r) -> (..., out); never forms the (out x in) product B A. Computed
            # in the activations' dtype, with A and B cast to it (their float32 masters get float32
            # gradients through the cast): casting x up instead made autograd keep a float32 copy
            # of every wrapped layer's input under bfloat16 weights, ~2x the activation memory
            A, B = self.lora_A.to(x.dtype), self.lora_B.to(x.dtype)
            y = y + self.scaling * ((x @ A.T) @ B.T)                          # (..., out)
        return y

    def delta_weight(self):
        return self.scaling * (self.lora_B @ self.lora_A)  # (out, in)


def apply_lora(model: nn.Module, rank: int = 8, alpha: float = 16.0,
               target_modules=DEFAULT_TARGETS) -> list:
    """Freeze every parameter of `model`, then wrap each nn.Linear whose last name part is in
    `target_modules`. Returns the dotted names of the wrapped modules (PEFT's naming)."""
    for p in model.parameters():
        p.requires_grad_(False)
    targets = set(target_modules)
    wrapped = []
    for name, module in list(model.named_modules()):
        if name.split(".")[-1] in targets and isinstance(module, nn.Linear):
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, child, LoRALinear(module, rank, alpha))
            wrapped.append(name)
    if not wrapped:
        raise ValueError(f"LoRA found no nn.Linear named any of {sorted(targets)} in "
                         f"{type(model).__name__}; pass target_modules that exist in this model")
    return wrapped


def lora_layers(model: nn.Module):
    return [(n, m) for n, m in model.named_modules() if isinstance(m, LoRALinear)]


@contextlib.contextmanager
def lora_disabled(model: nn.Module):
    """Run the frozen base model: `with lora_disabled(policy): ref_logits = policy(...)`.
    Restores each layer's previous state even if the body raises."""
    layers = [m for _, m in lora_layers(model)]
    before = [m.enabled for m in layers]
    for m in layers:
        m.enabled = False
    try:
        yield model
    finally:
        for m, state in zip(layers, before):
            m.enabled = state


@contextlib.contextmanager
def lora_merged(model: nn.Module, keep: bool = False):
    """Run with each enabled update folded into its weight, W' = W + (alpha/r) B A: one matmul
    per layer instead of three, ~15 % faster decoding for the rollout (no gradient is needed
    there). The frozen W is never modified: W' is a copy and W's own storage comes back on
    exit, bit for bit (W + D - D is not W in floating point, and the reference model must not
    drift). Costs one extra copy of the wrapped weights while inside. No gradient flows through
    W'.

    keep=False: W' is a new tensor each time, freed on exit. keep=True: W' is written into one
    buffer per layer that stays between calls (W copied in, D added, in place: the same values),
    so that a decode step captured once as a CUDA graph reads every step's W' at the address it
    was captured with (lib/static_decode.py); the copy is then held between rollouts
    instead of made and freed in each."""
    layers = [m for _, m in lora_layers(model) if m.enabled and not m.merged]
    frozen = [m.base.weight.data for m in layers]
    with torch.no_grad():
        for m, w in zip(layers, frozen):
            if not keep:
                m.base.weight.data = w + m.delta_weight().to(w.dtype)
            else:
                buf = m.merged_weight
                if buf is None or (buf.shape, buf.dtype, buf.device) != (w.shape, w.dtype, w.device):
                    buf = m.merged_weight = torch.empty_like(w)
                m.base.weight.data = buf.copy_(w).add_(m.delta_weight().to(w.dtype))  # (out, in)
            m.merged = True
    try:
        yield model
    finally:
        for m, w in zip(layers, frozen):
            m.base.weight.data, m.merged = w, False


def lora_state_dict(model: nn.Module) -> dict:
    """{'<module>.lora_A': tensor, '<module>.lora_B': tensor, ...}: everything LoRA trains,
    nothing else."""
    sd = {}
    for name, m in lora_layers(model):
        sd[f"{name}.lora_A"] = m.lora_A.detach().clone()
        sd[f"{name}.lora_B"] = m.lora_B.detach().clone()
    return sd


@torch.no_grad()
def load_lora_state_dict(model: nn.Module, state: dict):
    """Inverse of lora_state_dict. Fails on any missing, extra or mis-shaped tensor (a checkpoint
    from another model or another rank must not load half-way)."""
    ours = {f"{n}.lora_{ab}": getattr(m, f"lora_{ab}")
            for n, m in lora_layers(model) for ab in "AB"}
    missing, extra = set(ours) - set(state), set(state) - set(ours)
    if missing or extra:
        raise ValueError(f"LoRA checkpoint does not match the model: {len(missing)} missing, "
                         f"{len(extra)} unexpected tensors (e.g. {sorted(missing or extra)[0]})")
    for k, p in ours.items():
        if p.shape != state[k].shape:
            raise ValueError(f"LoRA checkpoint tensor {k} has shape {tuple(state[k].shape)}, "
                             f"model expects {tuple(p.shape)} (different rank or model?)")
        p.copy_(state[k])


def save_peft(model: nn.Module, folder: str, base_model_name_or_path: str = ""):
    """Write `adapter_config.json` + `adapter_model.safetensors` as PEFT does, so that
    `PeftModel.from_pretrained(base, folder)` reproduces this policy. PEFT stores
    `base_model.model.<module>.lora_A.weight` with the adapter name stripped."""
    from safetensors.torch import save_file
    layers = lora_layers(model)
    if not layers:
        raise ValueError("save_peft: the model has no LoRA layers")
    rank, alpha = layers[0][1].rank, layers[0][1].alpha
    tensors = {}
    for name, m in layers:
        for ab in "AB":
            weight = getattr(m, f"lora_{ab}").detach().float().contiguous().cpu()
            tensors[f"base_model.model.{name}.lora_{ab}.weight"] = weight
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path,
        "r": rank, "lora_alpha": alpha, "lora_dropout": 0.0, "bias": "none",
        "fan_in_fan_out": False,
        "target_modules": sorted({n.split(".")[-1] for n, _ in layers}), "inference_mode": True,
        "use_rslora": False, "use_dora": False, "init_lora_weights": True,
    }
    os.makedirs(folder, exist_ok=True)
    save_file(tensors, os.path.join(folder, "adapter_model.safetensors"))
    with open(os.path.join(folder, "adapter_config.json"), "w") as f:
        json.dump(config, f, indent=2)
