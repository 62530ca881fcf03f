"""adapter.py: the Perceiver adapter (Eq. 6-11, 16), routing statistics (Eq. 15) and the [x || C] splice."""
import copy
import math

import pytest
import torch
import torch.nn as nn

from adapter import PerceiverAdapter, routing_stats
from lora import apply_lora, lora_disabled
from rollout import completion_logprobs, encode_prompts, policy_inputs, position_ids, sample

DIMS = [48, 32, 40]


def states(B=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, d, generator=g) for d in DIMS]


def test_shapes_and_attention_rows():
    torch.manual_seed(0)
    ad = PerceiverAdapter(DIMS, out_dim=64, latent_dim=32, num_latents=5, num_heads=4)
    C, A = ad(states())
    assert C.shape == (3, 5, 64) and A.shape == (3, 5, 3)
    torch.testing.assert_close(A.sum(-1), torch.ones(3, 5))
    assert torch.equal(C, torch.zeros_like(C))  # W_out = b_out = 0: C starts as a true no-op
    _, A2 = ad(states(seed=1))
    assert not torch.allclose(A, A2)  # attention depends on the experts' states, i.e. on the prompt


def test_matches_torch_multihead_attention():
    """Eq. 9-10 by hand == nn.MultiheadAttention with the same W_Q, W_K, W_V and an identity output projection."""
    torch.manual_seed(0)
    ad = PerceiverAdapter(DIMS, out_dim=16, latent_dim=32, num_latents=4, num_heads=4)
    mha = nn.MultiheadAttention(32, 4, bias=False, batch_first=True)
    nn.init.normal_(ad.out.weight, std=0.5)  # at init W_out = 0 and C = 0 whatever Eq. 10 computes
    with torch.no_grad():
        mha.in_proj_weight.copy_(torch.cat([ad.w_q.weight, ad.w_k.weight, ad.w_v.weight]))
        mha.out_proj.weight.copy_(torch.eye(32))
    h = states()
    V = torch.stack([W(x) for W, x in zip(ad.proj, h)], 1)
    ref, ref_A = mha(ad.latents.expand(3, -1, -1), V, V, need_weights=True, average_attn_weights=True)
    C, A = ad(h)
    torch.testing.assert_close(A, ref_A)
    torch.testing.assert_close(C, ad.out(ad.ffn(ad.latents + ref)))


def test_adapter_is_eq_6_to_11_and_16_written_out():
    """C and A by the paper's equations, one head at a time, with a random W_out and b_out (at init W_out = 0 makes
    C = 0 whatever the rest computes): Eq. 6-7 z_i = h_i W_i stacked into V; Eq. 9 Q = Q_lat W_Q, K = V W_K,
    V' = V W_V; Eq. 10 C' = FFN(Q_lat + softmax(Q K^T / sqrt(d_head)) V') with the heads side by side; Eq. 16
    FFN(x) = tanh(W2 tanh(W1 x)); Eq. 11 C = C' W_out + b_out; A the heads' mean."""
    torch.manual_seed(0)
    ad = PerceiverAdapter(DIMS, out_dim=16, latent_dim=32, num_latents=4, num_heads=4)
    nn.init.normal_(ad.out.weight, std=0.5)
    nn.init.normal_(ad.out.bias, std=0.5)
    h = states()
    W = {name: p.detach().T for name, p in ad.named_parameters() if name.endswith("weight")}  # x W, as written
    Q_lat, hs = ad.latents.detach(), 32 // 4
    V = torch.stack([h_i @ W[f"proj.{i}.weight"] for i, h_i in enumerate(h)], dim=1)       # (B, n, d)
    Q, K, V_ = Q_lat @ W["w_q.weight"], V @ W["w_k.weight"], V @ W["w_v.weight"]
    heads, A = [], 0
    for j in range(4):
        s = slice(j * hs, (j + 1) * hs)
        A_j = torch.softmax(Q[:, s] @ K[..., s].transpose(1, 2) / math.sqrt(hs), dim=-1)   # (B, m, n)
        heads.append(A_j @ V_[..., s])
        A = A + A_j / 4
    C_prime = torch.tanh(torch.tanh((Q_lat + torch.cat(heads, -1)) @ W["ffn.w1.weight"]) @ W["ffn.w2.weight"])
    C_want = C_prime @ W["out.weight"] + ad.out.bias.detach()
    C, A_got = ad(h)
    assert C.abs().mean() > 0.1  # W_out random: C is not zero
    torch.testing.assert_close(C, C_want)
    torch.testing.assert_close(A_got, A)


def test_gradient_reaches_every_parameter():
    torch.manual_seed(0)
    ad = PerceiverAdapter(DIMS, out_dim=16, latent_dim=32, num_latents=4, num_heads=4)
    nn.init.normal_(ad.out.weight, std=0.1)  # at the real init the update to W_out comes first (like LoRA's B)
    C, A = ad(states())
    (C.pow(2).sum() + A[..., 0].sum()).backward()
    for name, p in ad.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_routing_stats_by_hand():
    A = torch.tensor([[[0.5, 0.5, 0.0], [1.0, 0.0, 0.0]]])  # B=1, m=2, n=3
    H, u = routing_stats(A)
    assert H == pytest.approx((math.log(2) + 0.0) / 2, abs=1e-6)
    assert u == pytest.approx([0.75, 0.25, 0.0])


def test_policy_inputs_layout():
    embed = nn.Embedding(10, 4)
    ids = torch.tensor([[0, 0, 5, 6], [7, 8, 9, 1]])
    mask = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]]).bool()
    C = torch.randn(2, 3, 4)
    x, m, pos = policy_inputs(embed, ids, mask, C, "after")
    assert x.shape == (2, 7, 4) and torch.equal(x[:, 4:], C)
    assert pos[0].tolist()[2:] == [0, 1, 2, 3, 4] and pos[1].tolist() == [0, 1, 2, 3, 4, 5, 6]
    x, m, pos = policy_inputs(embed, ids, mask, C, "before")  # [x_0 C pad.. x_1..]: C behind the first token
    assert x.shape == (2, 8, 4) and torch.equal(x[:, 1:4], C)
    assert torch.equal(x[:, 0], embed(torch.tensor([5, 7])))        # each row's first real token
    assert m[0].tolist() == [1, 1, 1, 1, 0, 0, 0, 1] and m[1].tolist() == [1, 1, 1, 1, 0, 1, 1, 1]
    assert [p for p, k in zip(pos[0].tolist(), m[0].tolist()) if k] == [0, 1, 2, 3, 4]
    assert [p for p, k in zip(pos[1].tolist(), m[1].tolist()) if k] == [0, 1, 2, 3, 4, 5, 6]
    with pytest.raises(ValueError, match="context-position"):
        policy_inputs(embed, ids, mask, C, "middle")


PROMPTS = ["What is 2 + 3?", "A much longer prompt: what is the sum of 17 and 25, and why?"]


@pytest.fixture(scope="module")
def lora_policy(tiny_policy):
    model, tok = tiny_policy
    model = copy.deepcopy(model)
    apply_lora(model)
    return model, tok


@pytest.mark.parametrize("position", ["after", "before"])
def test_step0_policy_equals_zero_context_reference(lora_policy, position):
    """LoRA (B = 0) and adapter at init give the reference's log-probs exactly: the reference is the frozen
    policy with zero tokens where C goes, and W_out = 0 makes C exactly zero (adapter.py deviation 2)."""
    model, tok = lora_policy
    torch.manual_seed(0)
    ad = PerceiverAdapter(DIMS, out_dim=model.config.hidden_size, latent_dim=32, num_latents=4, num_heads=4)
    C, _ = ad(states(B=2))
    ids, mask = encode_prompts(tok, PROMPTS, "cpu")
    comp = torch.randint(0, 200, (2, 6))
    cmask = torch.ones_like(comp, dtype=torch.bool)
    with torch.no_grad():
        logp = completion_logprobs(model, ids, mask, C, comp, cmask, 1.0, position)
        with lora_disabled(model):
            ref = completion_logprobs(model, ids, mask, torch.zeros_like(C), comp, cmask, 1.0, position)
        no_ctx = completion_logprobs(model, ids, mask, None, comp, cmask, 1.0, position)
        nn.init.normal_(ad.out.weight, std=1e-7)  # a "near-zero" random W_out is NOT a no-op: RMSNorm scales tiny tokens up
        tiny = completion_logprobs(model, ids, mask, ad(states(B=2))[0], comp, cmask, 1.0, position)
    assert torch.equal(logp, ref)
    assert (tiny - ref).abs().max() > 1e-5  # a 1e-7 perturbation moves log-probs ~1e-4: RMSNorm amplifies it
    assert (no_ctx - ref).abs().max() > 1e-3  # zero tokens are not neutral either: they take attention


def test_zero_context_in_front_of_a_deep_policy_has_a_finite_gradient():
    """Regression (found on SmolLM2-135M, 30 layers, --context-position before): with C = 0 exactly (W_out = 0
    at init) placed in front of the whole prompt, C's tokens see only each other, keep a hidden state of exactly
    0 in every layer, and each RMSNorm at 0 multiplies the gradient by 1/sqrt(eps): it overflowed to inf/NaN,
    every update with a non-zero advantage was skipped, and C stayed 0 for ever. policy_inputs now keeps the
    first prompt token in front ([x_0 C x_1..]); a 16-layer random Llama shows both sides of the story."""
    import transformers as tf
    from lib.tiny_models import tiny_tokenizer
    tok = tiny_tokenizer()
    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=16,
                         num_attention_heads=2, num_key_value_heads=2, rms_norm_eps=1e-5, initializer_range=0.3)
    model = tf.LlamaForCausalLM(cfg).eval()
    ids, mask = encode_prompts(tok, PROMPTS, "cpu")
    comp = torch.randint(3, 200, (2, 4))
    cmask = torch.ones_like(comp, dtype=torch.bool)

    def grad_of_C(layout):
        C = torch.zeros(2, 3, 16, requires_grad=True)
        if layout == "in front of everything":  # the old "before": [C pad.. x]
            x = torch.cat([C, model.get_input_embeddings()(ids)], 1)
            m = torch.cat([torch.ones(2, 3, dtype=torch.bool), mask], 1)
            logits = model(inputs_embeds=x, attention_mask=m, position_ids=position_ids(m)).logits
            logits.float().logsumexp(-1).sum().backward()
        else:
            completion_logprobs(model, ids, mask, C, comp, cmask, 1.0, "before").sum().backward()
        return C.grad

    assert not torch.isfinite(grad_of_C("in front of everything")).all()  # the bug
    g = grad_of_C("before")
    assert torch.isfinite(g).all() and g.abs().sum() > 0                    # the fix


@pytest.mark.parametrize("position", ["after", "before"])
def test_left_padding_does_not_change_logprobs(lora_policy, position):
    model, tok = lora_policy
    C = torch.randn(2, 3, model.config.hidden_size) * 0.02
    comp = torch.randint(0, 200, (2, 5))
    cmask = torch.ones_like(comp, dtype=torch.bool)
    with torch.no_grad():
        ids, mask = encode_prompts(tok, PROMPTS, "cpu")  # the short prompt is left-padded here
        batched = completion_logprobs(model, ids, mask, C, comp, cmask, 1.0, position)
        ids1, mask1 = encode_prompts(tok, PROMPTS[:1], "cpu")
        alone = completion_logprobs(model, ids1, mask1, C[:1], comp[:1], cmask[:1], 1.0, position)
    assert mask[0].sum() < mask.shape[1]  # there really was padding
    torch.testing.assert_close(batched[0], alone[0], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("position", ["after", "before"])
def test_rollout_and_scoring_see_the_same_positions(lora_policy, position):
    """Positions: the KV-cached sampler and the one-pass scorer must give the same log-probs."""
    model, tok = lora_policy
    torch.manual_seed(1)
    C = torch.randn(2, 3, model.config.hidden_size) * 0.02
    ids, mask = encode_prompts(tok, PROMPTS, "cpu")
    comp, logp_sample = sample(model, ids, mask, C, 2, 8, 0.7, [tok.eos_token_id], tok.pad_token_id, position,
                               return_logprobs=True)
    from grpo import completion_mask
    cmask = completion_mask(comp, tok.eos_token_id)
    with torch.no_grad():
        logp = completion_logprobs(model, ids, mask, C, comp, cmask, 0.7, position)  # 2 prompts, G = 2
    torch.testing.assert_close(logp[cmask], logp_sample[cmask], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("position", ["after", "before"])
def test_shared_prefix_scoring_equals_one_plain_forward(lora_policy, position):
    """completion_logprobs runs [x || C] once per prompt and the G completions on its repeated KV cache.
    Reference: one ordinary forward over G full copies of [x || C || y] (left padding, padding-skipping
    positions), log-probs by F.cross_entropy. Log-probs and the gradients reaching LoRA and C must agree."""
    import torch.nn.functional as F
    from grpo import completion_mask
    model, tok = copy.deepcopy(lora_policy[0]), lora_policy[1]
    torch.manual_seed(3)
    for name, p in model.named_parameters():
        if p.requires_grad:  # LoRA B = 0 at init would hide a gradient path: make the update non-zero
            nn.init.normal_(p, std=0.05)
    G, T, D = 3, 7, model.config.hidden_size
    ids, mask = encode_prompts(tok, PROMPTS, "cpu")                  # (2, P), the first row left-padded
    C = (torch.randn(2, 3, D) * 0.5).requires_grad_()
    comp = torch.randint(3, 200, (2 * G, T))
    comp[1, 2], comp[4, 0] = tok.eos_token_id, tok.eos_token_id      # early EOS: padding inside the batch
    cmask = completion_mask(comp, tok.eos_token_id)
    lora = [p for p in model.parameters() if p.requires_grad]

    logp = completion_logprobs(model, ids, mask, C, comp, cmask, 0.8, position)    # (2G, T)
    g_shared = torch.autograd.grad(logp[cmask].sum(), [C] + lora)

    x, m, _ = policy_inputs(model.get_input_embeddings(), ids.repeat_interleave(G, 0),
                            mask.repeat_interleave(G, 0), C.repeat_interleave(G, 0), position)
    x = torch.cat([x, model.get_input_embeddings()(comp)], 1)        # (2G, P' + T, D)
    m = torch.cat([m, cmask], 1)
    logits = model(inputs_embeds=x, attention_mask=m, position_ids=position_ids(m)).logits[:, -T - 1:-1]
    ref = -F.cross_entropy(logits.reshape(-1, logits.shape[-1]) / 0.8, comp.reshape(-1),
                           reduction="none").view(2 * G, T)
    g_plain = torch.autograd.grad(ref[cmask].sum(), [C] + lora)

    assert mask[0].sum() < mask.shape[1] and not cmask.all()         # padding on both sides was exercised
    torch.testing.assert_close(logp[cmask], ref[cmask], rtol=1e-5, atol=1e-5)
    for a, b in zip(g_shared, g_plain):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    assert g_shared[0].abs().sum() > 0                               # the gradient reached C through the cache


@pytest.mark.parametrize("position", ["after", "before", 2])
def test_the_plain_sampler_and_scoring_pass_equal_the_fast_ones(lora_policy, position):
    """rollout.sample_plain and completion_logprobs_plain (one full forward a token / a pass: what the tutorial
    points at) against sample and completion_logprobs (shared prefill, KV cache, merged LoRA): the same tokens
    from the same uniforms, the same log-probs; and the plain log-probs against F.cross_entropy by hand. In
    float64, where the two orders of sums differ by ~1e-15 and no draw can land on the other side of a bound."""
    import torch.nn.functional as F
    from grpo import completion_mask
    from rollout import completion_logprobs_plain, sample_plain
    model, tok = copy.deepcopy(lora_policy[0]).double(), lora_policy[1]
    torch.manual_seed(4)
    for p in model.parameters():
        if p.requires_grad:  # a trained LoRA: merged and unmerged differ if the merge were wrong
            nn.init.normal_(p, std=0.05)
    G, T, D = 3, 6, model.config.hidden_size
    ids, mask = encode_prompts(tok, PROMPTS, "cpu")
    C = torch.randn(2, 3, D, dtype=torch.float64) * 0.5
    u = torch.rand(2 * G, T, dtype=torch.float64)
    eos = [tok.eos_token_id, 5, 9, 17]  # a few more ends: rows stop at different tokens
    fast = sample(model, ids, mask, C, G, T, 1.0, eos, tok.pad_token_id, position, uniforms=u)
    plain = sample_plain(model, ids, mask, C, G, T, 1.0, eos, tok.pad_token_id, position, uniforms=u)
    assert torch.equal(plain[:, :fast.shape[1]], fast)
    assert (plain[:, fast.shape[1]:] == tok.pad_token_id).all()  # the fast loop stops once every row ended
    cmask = completion_mask(plain, eos)
    want = completion_logprobs(model, ids, mask, C, plain, cmask, 0.8, position)
    got = completion_logprobs_plain(model, ids, mask, C, plain, cmask, 0.8, position)
    torch.testing.assert_close(got[cmask], want[cmask], rtol=1e-9, atol=1e-9)
    x, m, _ = policy_inputs(model.get_input_embeddings(), ids.repeat_interleave(G, 0), mask.repeat_interleave(G, 0),
                            C.repeat_interleave(G, 0), position)
    m = torch.cat([m, cmask], 1)
    logits = model(inputs_embeds=torch.cat([x, model.get_input_embeddings()(plain)], 1), attention_mask=m,
                   position_ids=position_ids(m)).logits[:, -T - 1:-1]
    ref = -F.cross_entropy(logits.reshape(-1, logits.shape[-1]) / 0.8, plain.reshape(-1), reduction="none")
    # token_logprobs returns float32 (grpo.py): the float64 reference within float32's rounding of values ~1-10
    torch.testing.assert_close(got[cmask], ref.view(2 * G, T)[cmask].float(), rtol=1e-6, atol=1e-6)


def test_completion_logprobs_rejects_ungrouped_rows(lora_policy):
    model, tok = lora_policy
    ids, mask = encode_prompts(tok, PROMPTS, "cpu")
    comp = torch.randint(3, 200, (3, 4))
    with pytest.raises(ValueError, match="groups"):
        completion_logprobs(model, ids, mask, None, comp, torch.ones_like(comp, dtype=torch.bool), 1.0)


def test_position_ids():
    m = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    assert position_ids(m).tolist() == [[0, 0, 0, 1, 2], [0, 1, 2, 3, 4]]


def test_a_policy_without_a_chat_template_gets_its_tokenizers_bos():
    """Regression: encode_prompts dropped the <bos> that a base model's tokenizer adds to plain text (Gemma-3-270M
    as the policy scored 0.0 without it). A chat template writes its own special tokens: nothing is added then."""
    from tokenizers import processors
    from lib.tiny_models import tiny_tokenizer
    for chat in (False, True):
        tok = tiny_tokenizer(chat=chat)
        bos = tok.bos_token_id
        tok._tokenizer.post_processor = processors.TemplateProcessing(single=f"{tok.bos_token} $A",
                                                                      special_tokens=[(tok.bos_token, bos)])
        ids, mask = encode_prompts(tok, ["Add 2 and 3.", "What is 14 + 9?"], "cpu")
        first = ids[mask].new_tensor([row[m][0] for row, m in zip(ids, mask)])   # each prompt's first real token
        assert (first == bos).all() != chat, chat
        assert len(ids[1][mask[1]]) == len(tok.encode("What is 14 + 9?", add_special_tokens=False)) + (not chat)


def test_recomputed_mlps_give_the_same_logprobs_and_gradients_bit_for_bit(lora_policy):
    """With gradient on, completion_logprobs keeps no MLP activations for the backward pass and runs the
    MLPs again there (lib.recompute.mlps_recomputed, memory). The log-probs and every gradient are the very same
    bits as with the activations kept (train.py --keep-activations sets model.recompute_mlps = False); the
    MLPs really do run twice, and once with the activations kept."""
    model, tok = copy.deepcopy(lora_policy[0]), lora_policy[1]
    torch.manual_seed(4)
    for p in model.parameters():
        if p.requires_grad:
            nn.init.normal_(p, std=0.05)
    ids, mask = encode_prompts(tok, PROMPTS, "cpu")
    C = (torch.randn(2, 3, model.config.hidden_size) * 0.5).requires_grad_()
    comp = torch.randint(3, 200, (4, 5))
    cmask = torch.ones_like(comp, dtype=torch.bool)
    params = [C] + [p for p in model.parameters() if p.requires_grad]
    calls = []
    model.model.layers[0].mlp.gate_proj.register_forward_hook(lambda *_: calls.append(1))

    def logp_and_grads():
        logp = completion_logprobs(model, ids, mask, C, comp, cmask, 0.9, "before")
        return logp.detach(), torch.autograd.grad(logp.sum(), params)

    logp, grads = logp_and_grads()
    assert len(calls) == 4  # prefill and completions, then both again in the backward pass
    model.recompute_mlps = False
    logp_kept, grads_kept = logp_and_grads()
    assert len(calls) == 6  # prefill and completions only
    assert torch.equal(logp, logp_kept)
    assert all(torch.equal(a, b) for a, b in zip(grads, grads_kept))
