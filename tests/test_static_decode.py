"""support/lib/static_decode.py: the decode loop with fixed shapes (the one a CUDA graph captures), run eagerly on the
CPU against rollout.decode's loop, the reference: the same tokens and log-probs from the same uniforms, rows that
end early cut alike, greedy alike, on the tiny policy with a LoRA that is not a no-op and on the paper policy's
layer shape (Qwen2.5-3B's widths and heads at one layer). Plus where rollout.decode sends each call."""
import copy
import json
import os

import pytest
import torch

import rollout
from lora import apply_lora
from support.lib import static_decode

SMOKE = ["--preset", "smoke", "--eval-items", "0"]


def lora_policy(spec, dtype=torch.float64):
    """The model with a LoRA whose B is not zero (so the unmerged products matter), in `dtype`."""
    from experts import load_model
    model, tok = load_model(spec)
    model = copy.deepcopy(model).to(dtype)
    apply_lora(model)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.05 * torch.randn(p.shape, generator=g))
    return model.eval(), tok


def both_loops(policy, tok, G=3, T=12, eos_ids=None, greedy=False, prompts=None):
    """(eager tokens, eager log-probs, static tokens, static log-probs) from two prefills of the same prompts."""
    prompts = prompts or ["What is 2 + 3?", "A longer question: what is 17 + 25, step by step?", "Hi"]
    ids, mask = rollout.encode_prompts(tok, prompts, "cpu")
    u = torch.rand(len(prompts) * G, T, generator=torch.Generator().manual_seed(1))
    eos = eos_ids if eos_ids is not None else rollout.eos_token_ids(policy, tok)
    out = []
    with torch.no_grad():
        for loop in (rollout.decode, static_decode.decode):
            start = rollout.prefill(policy, ids, mask, None, G, "after")
            out += loop(*[policy, *start], T, 1.0, eos, tok.pad_token_id, greedy=greedy, return_logprobs=True,
                        uniforms=u)
    return out


@pytest.mark.parametrize("dtype,atol", [(torch.float64, 1e-10), (torch.float32, 1e-4)])
def test_the_static_loop_draws_the_eager_loops_tokens_with_its_logprobs(dtype, atol):
    policy, tok = lora_policy("tiny:llama", dtype)
    tokens, logp, tokens_static, logp_static = both_loops(policy, tok)
    assert tokens.shape == tokens_static.shape == (9, 12)
    assert torch.equal(tokens, tokens_static)
    assert torch.allclose(logp, logp_static, atol=atol, rtol=0)


def test_rows_that_end_early_and_greedy_rows_are_cut_alike():
    """EOS ids that rows draw early: every row ends at its own step, the loops stop after the last one."""
    policy, tok = lora_policy("tiny:llama")
    eos = list(range(0, 260, 3))  # a third of the ids: the random policy writes one within a few tokens
    tokens, logp, tokens_static, logp_static = both_loops(policy, tok, T=40, eos_ids=eos)
    assert tokens.shape[1] < 40 and torch.equal(tokens, tokens_static)
    assert (tokens == tok.pad_token_id).any()  # some rows ended before the others
    assert torch.allclose(logp, logp_static, atol=1e-10, rtol=0)
    greedy = both_loops(policy, tok, T=10, greedy=True)
    assert torch.equal(greedy[0], greedy[2]) and torch.allclose(greedy[1], greedy[3], atol=1e-10, rtol=0)


@pytest.mark.parametrize("attention", ["sdpa", "grouped"])
def test_the_static_loop_on_the_paper_policys_layer_shape(attention):
    """Qwen2.5-3B's layer (hidden 2048, 16 query heads on 2 key/value heads of 128, q/k/v biases), one layer and a
    4,096-token vocabulary (the full 151,936 takes ~30 s to initialise on one core and changes no shape the loop
    handles); under transformers' SDPA and under support/lib/attention.py's grouped attention (train.py --attention,
    grouped on CUDA), which stacks the loop's [N, 1, 1, P + T] mask per group."""
    import transformers as tf
    from support.lib import shape_models
    cfg = shape_models.config("Qwen/Qwen2.5-3B-Instruct@1")
    V = 4096
    cfg.vocab_size, cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id = V, V - 4, V - 2, V - 1
    torch.manual_seed(0)
    policy = tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    tok = shape_models.tokenizer(V)
    apply_lora(policy)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    from support.lib import attention as attention_module
    attention_module.use(policy, attention)
    tokens, logp, tokens_static, logp_static = both_loops(policy.eval(), tok, G=2, T=6)
    assert torch.equal(tokens, tokens_static)
    assert torch.allclose(logp, logp_static, atol=1e-4, rtol=0)


def test_decode_sends_each_call_to_its_loop(monkeypatch, tiny_policy):
    """auto: the eager loop on a CPU (the bit-identical fixtures' path); static / graph: static_decode's, except
    under constrained decoding (`allowed`), which keeps the eager loop; graph refuses a CPU."""
    calls = []
    real = static_decode.decode
    monkeypatch.setattr(static_decode, "decode", lambda *a, **kw: calls.append(kw["graph"]) or real(*a, **kw))
    policy, tok = tiny_policy
    ids, mask = rollout.encode_prompts(tok, ["What is 2 + 3?"], "cpu")
    run = lambda **kw: rollout.sample(policy, ids, mask, None, 2, 4, 1.0, [tok.eos_token_id],  # noqa: E731
                                      tok.pad_token_id, **kw)
    run()
    assert calls == []
    monkeypatch.setattr(rollout, "DECODE", "static")
    a = run(uniforms=torch.full((2, 4), 0.5))
    run(allowed=lambda last: torch.ones(2, len(tok), dtype=torch.bool))
    assert calls == [False]
    monkeypatch.setattr(rollout, "DECODE", "eager")
    assert torch.equal(a, run(uniforms=torch.full((2, 4), 0.5)))
    monkeypatch.setattr(rollout, "DECODE", "graph")
    with pytest.raises(ValueError, match="CUDA"):
        run()


def test_a_training_step_samples_the_same_completions_with_either_loop(monkeypatch, tmp_path):
    """train.py end to end (the smoke preset, one step): the static loop's completions are the eager loop's."""
    import train
    samples = {}
    for loop in ("eager", "static"):
        monkeypatch.setattr(rollout, "DECODE", loop)
        out = str(tmp_path / loop)
        train.main(SMOKE + ["--steps", "1", "--out", out])
        samples[loop] = [json.loads(line) for line in open(os.path.join(out, "samples.jsonl"))]
    assert samples["eager"] == samples["static"]


@pytest.mark.cuda
def test_the_captured_graph_draws_the_static_loops_tokens_on_cuda():
    """On a GPU: the step captured once and replayed gives the tokens of the same loop run eagerly."""
    policy, tok = lora_policy("tiny:llama", torch.float32)
    policy = policy.cuda()
    ids, mask = rollout.encode_prompts(tok, ["What is 2 + 3?", "A longer question, 17 + 25?"], "cuda")
    u = torch.rand(6, 40, generator=torch.Generator().manual_seed(1)).cuda()
    out = []
    for graph in (False, True):
        start = rollout.prefill(policy, ids, mask, None, 3, "after")
        out.append(static_decode.decode(policy, *start, 40, 1.0, [-1], tok.pad_token_id, return_logprobs=True,
                                        uniforms=u, graph=graph))
    assert torch.equal(out[0][0], out[1][0])
    assert torch.allclose(out[0][1], out[1][1], atol=1e-4, rtol=0)
