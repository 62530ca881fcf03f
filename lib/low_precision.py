"""
The rollout's low-precision copy of the policy's linear layers (train.py --rollout-dtype bfloat16 / int8):
decoding G completions is memory-bound on CPU, and a copy with half or a quarter of the bytes samples faster.
Only the sampler uses it; the scoring pass (the log-probs that enter the GRPO ratio) stays float32, and
train.py logs the sampler-policy gap and can correct for it (grpo.truncated_is_weights).

  low_precision_linears   (context manager) every nn.Linear multiplies with a bfloat16 or int8 copy
  cast_linear             one layer's forward with weight and input cast to bfloat16
  int8_linear             one layer's forward as int8 x int8 products in int32, rescaled to float32
  int8_weight             the prepacked 7-bit weight, quantised once and kept on the module

Try it on CPU:  python -m pytest tests/test_rollout_int8.py -q
"""
import contextlib

import torch
import torch.nn.functional as F


@contextlib.contextmanager
def low_precision_linears(model, dtype=torch.bfloat16):
    """Inside: every nn.Linear (the LM head included) multiplies with a low-precision copy of its
    weight; activations come out in their own dtype, so attention, norms and the softmax stay
    float32. Decoding is memory-bound, and the 576 x 49,152 LM head alone reads 113 MB per token
    in float32. Two copies:
      bfloat16  half the bytes, the copy taken on entry (inside lora_merged, so it holds W + BA).
                Measured 1.55x faster decoding of the pocket policy on one AVX512-BF16 core, but
                ~3x slower on a CPU without bf16 instructions (AVX2), which emulates them.
      int8      a quarter of the bytes and int8 products (int8_linear). The frozen W is
                quantised once and kept; LoRA's update is not merged but added beside it in
                float32 by LoRALinear, so the sampler always holds the current LoRA.
    The sampling distribution then differs slightly from the float32 scoring pass: train.py logs
    the gap and can correct for it (grpo.truncated_is_weights)."""
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    for m in linears:  # an instance attribute
        m.forward = int8_linear(m) if dtype == torch.int8 else cast_linear(m, dtype)
    try:
        yield model
    finally:
        for m in linears:
            del m.forward  # the class's forward again


def cast_linear(linear, dtype):
    """x -> linear(x) with the weight and input cast to `dtype`, the output in x's dtype."""
    w = linear.weight.detach().to(dtype)
    b = None if linear.bias is None else linear.bias.detach().to(dtype)
    return lambda x: F.linear(x.to(w.dtype), w, b).to(x.dtype)


def int8_linear(linear):
    """x -> linear(x) with int8 x int8 products summed in int32 (PyTorch's fbgemm/oneDNN dynamic
    int8 kernel, torch.ops.quantized.linear_dynamic), rescaled to float32:
      weight  7 bits per output row, w_q = round(w / s), s = max|w_row| / 63; quantised once and
              kept on the module (int8_weight)
      input   8 bits per row: each row is divided by its own max|x| first, so the kernel's one
              scale per tensor becomes one per row, and the output multiplied back.
    Why 7-bit weights: AVX2's int8 multiply-add sums pairs of u8 x s8 products into int16, and
    255 * 127 * 2 overflows it; 255 * 63 * 2 does not. (The kernel's own remedy, 7-bit inputs,
    gave a larger error; with 8 bits for both, the overflows made the pocket policy's log-probs
    wrong by 9 nats per token.) Measured on the pocket policy (16 completions x 48 tokens):
    mean |log pi_int8 - log pi_float32| 0.18 nats per token, 0.08 of it from the LM head.

    Why not torchao (the maintained home of int8 in PyTorch): on this project's CPU (AVX2, one
    thread, 8 rows) torchao 0.18's int8 dynamic-activation layer took 223 ms and its int8
    weight-only layer 155 ms for the LM head product that takes 32 ms in float32 and 3.8 ms
    here; it has no fast CPU path outside torch.compile. PyTorch warns that its quantised
    tensors (torch.quantize_per_channel, which this kernel's packing takes) are deprecated: when
    they go, this function is the one to change. CPU only."""
    packed, b = int8_weight(linear), linear.bias

    def forward(x):                                                         # (..., in)
        a = x.abs().amax(-1, keepdim=True).float().clamp(min=1e-12)        # (..., 1)
        y = torch.ops.quantized.linear_dynamic(x.float() / a, packed, False) * a   # (..., out)
        return (y if b is None else y + b.float()).to(x.dtype)
    return forward


def int8_weight(linear):
    """The prepacked 7-bit copy of linear.weight, made on first use and kept on the module as
    long as the weight is the same tensor, unmodified (its storage and version counter): frozen
    weights are quantised once per run, ~1.8 s for the pocket policy."""
    w = linear.weight
    if w.device.type != "cpu":
        raise ValueError(f"--rollout-dtype int8 runs on CPU only, the weights are on {w.device}")
    key = (w.data_ptr(), w._version)
    if getattr(linear, "_int8", (None,))[0] != key:
        w = w.detach().float()                                              # (out, in)
        s = (w.abs().amax(1) / 63).clamp(min=1e-12).double()               # (out,)
        zero = torch.zeros(w.shape[0], dtype=torch.long)
        w_q = torch.quantize_per_channel(w, s, zero, 0, torch.qint8)       # (out, in) in [-63, 63]
        linear._int8 = (key, torch.ops.quantized.linear_prepack(w_q, None))
    return linear._int8[1]
