"""lib/attention.py: grouped-query attention with each key/value head read once (train.py --attention grouped).
Parity with transformers' SDPA path (which repeats K and V per query head) in every pass the policy runs (the
prefill, the KV-cached decode steps, the scoring pass with its gradient), on models with grouped KV heads, in
float64 where another order of sums leaves ~1e-15; parity of the function itself with the attention formula; and
what it must never do: build a repeated K/V tensor, or read the mask on the host to decide a skip."""
import pytest
import torch

from conftest import with_lora64
from grpo import completion_mask
from rollout import completion_logprobs, encode_prompts, prefill, sample
from lib import attention

QUESTIONS = ["What is 17 + 25?", "Add 3 and 4, then stop.", "Hi"]  # different lengths: padding behind x_0


def four_per_group():
    """A Qwen2 with 8 query heads on 2 key/value heads (n_rep 4; the tiny team's models have 2) and the tiny
    tokenizer."""
    import transformers as tf
    from lib.tiny_models import tiny_tokenizer
    tok = tiny_tokenizer()
    config = tf.Qwen2Config(vocab_size=len(tok), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                            num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=4096,
                            pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(4)
    return tf.AutoModelForCausalLM.from_config(config), tok


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen2-n_rep-4"])
def model64(request):
    from lib.tiny_models import load as tiny_model
    model, tok = four_per_group() if request.param == "qwen2-n_rep-4" else tiny_model(request.param)
    assert attention.groups(model.config) > 1  # grouped KV heads: the case the old path repeats
    return with_lora64(model), tok


def batch(tok, D):
    """(ids, mask, C): prompts of different lengths, padded behind each first token, and context tokens."""
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
               for q in QUESTIONS]
    ids, mask = encode_prompts(tok, prompts, "cpu")
    assert not mask.all() and mask[:, 0].all()  # padding, behind the first token (padding_behind_first_token)
    torch.manual_seed(1)
    return ids, mask, torch.randn(len(ids), 4, D, dtype=torch.float64) * 0.5


@pytest.fixture
def both():
    """Run a function under the old path, then under grouped attention: [old's result, grouped's result]."""
    def run(model, fn):
        out = []
        for name in ("sdpa", "grouped"):
            attention.use(model, name)
            out.append(fn())
        attention.use(model, "sdpa")
        return out
    return run


@pytest.mark.parametrize("q", [3, 1])
@pytest.mark.parametrize("made_by", ["grouped_mask", "elsewhere"])
def test_the_function_is_the_attention_formula(q, made_by):
    """grouped_attention against softmax(q_h K_g^T s + M) V_g written out head by head, with a KV cache (the
    queries are the last q of k keys; q = 1: a decode step), padding in the middle, and its mask from grouped_mask
    (stacked, additive) or a bool [B, 1, q, k] mask built elsewhere (lib/static_decode.py builds its own)."""
    torch.manual_seed(0)
    B, H, H_kv, k, d = 2, 6, 2, 7, 5
    Q = torch.randn(B, H, q, d, dtype=torch.float64)
    K, V = torch.randn(B, H_kv, k, d, dtype=torch.float64), torch.randn(B, H_kv, k, d, dtype=torch.float64)
    seen = torch.ones(B, k, dtype=torch.bool)
    seen[1, 1:3] = False                                                      # row 1: two padding keys behind x_0
    causal = torch.arange(k)[None] <= torch.arange(q)[:, None] + (k - q)                  # (q, k)

    class Config:
        num_attention_heads, num_key_value_heads = H, H_kv

    M = attention.grouped_mask(B, q, k, config=Config, dtype=torch.float64, q_offset=k - q, attention_mask=seen) \
        if made_by == "grouped_mask" else (causal & seen[:, None])[:, None]                 # (B, 1, q, k) bool
    out, _ = attention.grouped_attention(torch.nn.Module(), Q, K, V, M, scaling=0.3)         # (B, q, H, d)
    for b in range(B):
        for h in range(H):
            g = h // (H // H_kv)
            s = Q[b, h] @ K[b, g].T * 0.3                                                    # (q, k)
            s = s.masked_fill(~(causal & seen[b][None]), -torch.inf)
            torch.testing.assert_close(out[b, :, h], torch.softmax(s, -1) @ V[b, g], rtol=0, atol=1e-14)


def test_prefill_equals_sdpa(model64, both):
    """The rollout's prefill ([x || C] once per prompt, G = 2, the shared beginning once): the logits of y_0 and
    the KV cache it hands the decode loop."""
    model, tok = model64
    ids, mask, C = batch(tok, model.config.hidden_size)
    with torch.no_grad():
        old, new = both(model, lambda: prefill(model, ids, mask, C, 2, "after"))
    torch.testing.assert_close(new[1], old[1], rtol=0, atol=1e-12)
    for a, b in zip(old[0].layers, new[0].layers):
        torch.testing.assert_close(b.keys, a.keys, rtol=0, atol=1e-12)
        torch.testing.assert_close(b.values, a.values, rtol=0, atol=1e-12)


@pytest.mark.parametrize("share", [True, False])
def test_decode_equals_sdpa(model64, both, share):
    """KV-cached decode steps from the same uniforms: the same tokens, the same sampling log-probs."""
    model, tok = model64
    ids, mask, C = batch(tok, model.config.hidden_size)
    u = torch.rand(len(ids) * 3, 10, generator=torch.Generator().manual_seed(5))
    old, new = both(model, lambda: sample(model, ids, mask, C, 3, 10, 1.0, [tok.eos_token_id], tok.pad_token_id,
                                          return_logprobs=True, uniforms=u, share=share))
    assert torch.equal(new[0], old[0])
    torch.testing.assert_close(new[1], old[1], rtol=0, atol=1e-12)


@pytest.mark.parametrize("share", [True, False])
def test_scoring_and_its_gradient_equal_sdpa(model64, both, share):
    """The loss pass: log-probs of given completions (early EOS: padding after it), and the gradient into LoRA
    and C. The reference pass is the same function without gradient."""
    model, tok = model64
    ids, mask, C = batch(tok, model.config.hidden_size)
    G, T = 3, 6
    torch.manual_seed(2)
    comp = torch.randint(3, 200, (len(ids) * G, T))
    comp[1, 2] = comp[5, 0] = tok.eos_token_id
    cmask = completion_mask(comp, tok.eos_token_id)
    lora = [p for p in model.parameters() if p.requires_grad]

    def logp_and_grads():
        Cg = C.clone().requires_grad_()
        logp = completion_logprobs(model, ids, mask, Cg, comp, cmask, 0.8, share=share)
        return logp.detach(), torch.autograd.grad((logp * cmask).sum(), lora + [Cg])

    (logp, grads), (logp_g, grads_g) = both(model, logp_and_grads)
    torch.testing.assert_close(logp_g[cmask], logp[cmask], rtol=0, atol=1e-12)
    for a, b in zip(grads_g, grads):
        assert (a - b).abs().max() <= 1e-12 * b.abs().max()
    assert all(g.abs().sum() > 0 for g in grads_g)


def test_no_key_or_value_is_repeated(model64, monkeypatch):
    """Every pass with grouped attention: transformers' repeat_kv is never called, every SDPA call reads keys and
    values at the model's key/value head count, and the mask is never read on the host to decide whether it can be
    skipped (masking_utils._ignore_causal_mask_sdpa: a device-to-host sync per decode step on a GPU). The same
    passes on the old path trip both guards, so the guards can see what they guard."""
    import transformers.integrations.sdpa_attention as sdpa
    import transformers.masking_utils as masking
    model, tok = model64
    ids, mask, C = batch(tok, model.config.hidden_size)
    H_kv = model.config.num_key_value_heads
    calls, widths = [], []
    real_sdpa = torch.nn.functional.scaled_dot_product_attention

    def counting(*args, **kwargs):
        widths.append((args[1].shape[1], args[2].shape[1]))  # key and value heads
        return real_sdpa(*args, **kwargs)

    monkeypatch.setattr(sdpa, "repeat_kv", lambda *a: calls.append("repeat_kv") or a[0].repeat_interleave(a[1], 1))
    real_skip = masking._ignore_causal_mask_sdpa
    monkeypatch.setattr(masking, "_ignore_causal_mask_sdpa", lambda *a, **k: calls.append("skip") or real_skip(*a, **k))
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", counting)

    def every_pass():
        comp = sample(model, ids, mask, C, 2, 5, 1.0, [tok.eos_token_id], tok.pad_token_id)
        completion_logprobs(model, ids, mask, C, comp, completion_mask(comp, tok.eos_token_id), 1.0).sum().backward()

    attention.use(model, "sdpa")
    every_pass()
    assert "repeat_kv" in calls and "skip" in calls                                 # the old path does both
    calls.clear(), widths.clear()
    attention.use(model, "grouped")
    try:
        every_pass()
    finally:
        attention.use(model, "sdpa")
    assert calls == [] and widths and set(widths) == {(H_kv, H_kv)}


def test_auto_is_grouped_on_cuda_for_grouped_heads_only():
    """--attention auto: grouped on CUDA for a model with n_rep > 1 that runs SDPA; the model's own attention on
    a CPU (the bit-identical fixtures' numbers) and for a model without grouped heads (nothing to repeat)."""
    from lib.tiny_models import load as tiny_model
    llama, gpt2 = tiny_model("llama")[0], tiny_model("gpt2")[0]
    assert attention.resolve("auto", llama, "cuda") == "grouped"
    assert attention.resolve("auto", llama, torch.device("cpu")) == "sdpa"
    assert attention.resolve("auto", gpt2, "cuda") == gpt2.config._attn_implementation
    assert attention.resolve("sdpa", llama, "cuda") == "sdpa" and attention.resolve("grouped", llama, "cpu") == "grouped"


def test_grouped_refuses_a_model_that_does_not_run_sdpa():
    from lib.tiny_models import load as tiny_model
    model = tiny_model("llama")[0]
    model.set_attn_implementation("eager")
    with pytest.raises(ValueError, match="--attention"):
        attention.use(model, "grouped")


def test_train_runs_the_policy_with_the_attention_it_names(tmp_path, monkeypatch):
    """train.py --attention grouped: the policy's every attention call goes through grouped_attention (one step of
    the smoke preset); --attention sdpa: none does."""
    import train
    seen = []
    real = attention.grouped_attention
    monkeypatch.setattr(attention, "grouped_attention", lambda *a, **k: seen.append(1) or real(*a, **k))
    for name in ("sdpa", "grouped"):
        seen.clear()
        train.main(["--preset", "smoke", "--steps", "1", "--attention", name, "--out", str(tmp_path / name)])
        assert bool(seen) == (name == "grouped")


@pytest.mark.cuda
def test_on_cuda_the_grouped_call_equals_sdpa_and_holds_less():
    """One attention call at the default team's loss-pass shape (32 rows, Qwen2.5-3B's 16 heads on 2, 128 queries
    after 1,474 cached keys, bfloat16, padding behind the first token) on the GPU: the output of transformers' SDPA
    path to bfloat16 rounding, with less memory allocated at its peak (the SDPA path's 8-fold K/V copies are
    ~2 x 32 x 16 x 1,602 x 128 x 2 bytes = 0.42 GB)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    dev, dt = torch.device("cuda"), torch.bfloat16
    B, H, H_kv, q, k, d = 32, 16, 2, 128, 1602, 128
    g = torch.Generator(device=dev).manual_seed(0)
    Q = torch.randn(B, H, q, d, device=dev, dtype=dt, generator=g)
    K, V = (torch.randn(B, H_kv, k, d, device=dev, dtype=dt, generator=g) for _ in range(2))
    seen = torch.ones(B, k, dtype=torch.bool, device=dev)
    seen[::2, 1:200] = False                                             # padding behind x_0 in every other row

    class Config:
        num_attention_heads, num_key_value_heads = H, H_kv

    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal = H // H_kv, True
    old_mask = attention.grouped_mask(B, q, k, config=None, dtype=dt, q_offset=k - q, attention_mask=seen) > -1
    new_mask = attention.grouped_mask(B, q, k, config=Config, dtype=dt, q_offset=k - q, attention_mask=seen)
    peaks, outs = [], []
    for fn, M in ((sdpa_attention_forward, old_mask), (attention.grouped_attention, new_mask)):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        outs.append(fn(module, Q, K, V, M, scaling=d ** -0.5)[0])
        torch.cuda.synchronize()
        peaks.append(torch.cuda.max_memory_allocated() - base)
    torch.testing.assert_close(outs[1].float(), outs[0].float(), rtol=0, atol=2e-2)
    assert peaks[1] < peaks[0], f"peak allocated: grouped {peaks[1] / 2**20:.0f} MiB, sdpa {peaks[0] / 2**20:.0f} MiB"
