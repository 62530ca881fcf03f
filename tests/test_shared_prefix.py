"""The beginning every prompt of a step shares runs once (rollout.prefill's share): in sampling, the re-draw, the
reference and the loss pass. The same function as running every prompt whole, in another order of sums: these
tests compare tokens, log-probs and gradients (into LoRA and C) of the two paths in float64, where a different
order of sums leaves ~1e-15, for no C (`single`), C after the prompt (`ours`, Eq. 3) and C in front of the
--context-split tokens. And they count what the policy's forward passes read: the shared part once."""
import os
import subprocess
import sys

import pytest
import torch

from grpo import completion_mask
from rollout import completion_logprobs, context_slot, encode_prompts, policy_inputs, prefill, sample

SYSTEM = "Answer with a number. Example: What is 3 + 4? <answer>7</answer> Now the question."
QUESTIONS = ["What is 17 + 25?", "Add 3 and 4.", "Compute 10 + 91, then stop."]
SPLIT = "</think>\n<answer>"


def prompts(tok, prefix="<think>"):
    return [tok.apply_chat_template([{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}],
                                    tokenize=False, add_generation_prompt=True) + prefix for q in QUESTIONS]


def inputs(tok, kind):
    """(ids, mask, C, slot) for `single` (no C), `ours` (C after the prompt) and `split` (C in front of the split)."""
    split = SPLIT if kind == "split" else ""
    ids, mask = encode_prompts(tok, prompts(tok, "<think>" + SPLIT), "cpu", split)
    torch.manual_seed(1)
    C = None if kind == "single" else (torch.randn(len(QUESTIONS), 4, 64, dtype=torch.float64) * 0.5)
    return ids, mask, C, context_slot(tok, "after", split)


@pytest.mark.parametrize("kind", ["single", "ours", "split"])
def test_shared_prefix_scoring_gives_the_logprobs_and_gradients_of_whole_prompts(policy64, kind):
    """The loss pass (with gradient through the shared part into LoRA and C) and the reference pass: log-probs and
    gradients of the shared path equal those of every prompt run whole, to float64 rounding."""
    model, tok = policy64
    ids, mask, C, slot = inputs(tok, kind)
    G, T = 3, 6
    torch.manual_seed(2)
    comp = torch.randint(3, 200, (len(ids) * G, T))
    comp[1, 2] = comp[5, 0] = tok.eos_token_id                     # early EOS: padding inside the batch
    cmask = completion_mask(comp, tok.eos_token_id)
    lora = [p for p in model.parameters() if p.requires_grad]

    def logp_and_grads(share):
        Cg = None if C is None else C.clone().requires_grad_()
        logp = completion_logprobs(model, ids, mask, Cg, comp, cmask, 0.8, slot, share=share)
        grads = torch.autograd.grad((logp * cmask).sum(), lora + ([] if Cg is None else [Cg]))
        return logp, grads

    logp, grads = logp_and_grads(True)
    want, want_grads = logp_and_grads(False)
    assert not mask.all() and not cmask.all()                      # padding on both sides was exercised
    torch.testing.assert_close(logp[cmask], want[cmask], rtol=0, atol=1e-12)
    for a, b in zip(grads, want_grads):  # token_logprobs' softmax is float32: ~5e-8 of the largest entry
        assert (a - b).abs().max() <= 1e-6 * b.abs().max()
    assert all(g.abs().sum() > 0 for g in grads)                   # the gradient reached LoRA (and C)


@pytest.mark.parametrize("kind", ["single", "ours", "split"])
def test_shared_prefix_sampling_draws_the_tokens_of_whole_prompts(policy64, kind):
    """The rollout from the same uniforms: the same completions token for token, their log-probs to rounding."""
    model, tok = policy64
    ids, mask, C, slot = inputs(tok, kind)
    u = torch.rand(len(ids) * 4, 10, generator=torch.Generator().manual_seed(5))
    out = [sample(model, ids, mask, C, 4, 10, 1.0, [tok.eos_token_id], tok.pad_token_id, slot,
                  return_logprobs=True, uniforms=u, share=share) for share in (True, False)]
    assert torch.equal(out[0][0], out[1][0])
    torch.testing.assert_close(out[0][1], out[1][1], rtol=0, atol=1e-12)


def test_the_shared_beginning_runs_once(policy64):
    """What the policy's forward passes read: with share, the common beginning once and each prompt's own tail,
    instead of every prompt whole (the shared part is most of the prompt here, as the system prompt and worked
    example are in the second verdict's)."""
    model, tok = policy64
    ids, mask, C, slot = inputs(tok, "ours")
    reads = {}
    hook = model.model.register_forward_pre_hook(
        lambda m, a, kw: reads[share].append(int(kw["position_ids"].numel())), with_kwargs=True)
    try:
        with torch.no_grad():
            for share in (True, False):
                reads[share] = []
                prefill(model, ids, mask, C, 2, slot, share=share)
    finally:
        hook.remove()
    shared_reads, whole_reads = reads[True], reads[False]
    x, m, _ = policy_inputs(model.get_input_embeddings(), ids, mask, C, slot)
    real = [x[b][m[b]] for b in range(len(x))]                     # each row's real inputs
    P = next(i for i in range(min(map(len, real))) if not all(torch.equal(r[i], real[0][i]) for r in real))
    assert whole_reads == [x.shape[0] * x.shape[1]]                # every prompt whole, padding included
    assert shared_reads[0] == P and P > 16                         # the common beginning once, at batch 1
    tail = max(map(len, real)) - P
    assert shared_reads[1] == len(real) * tail                     # then each prompt's own tail
    assert sum(shared_reads) < 0.6 * whole_reads[0]


def test_context_split_puts_C_in_front_of_the_splits_tokens():
    """--context-split: every row ends with the split's own tokens, C goes in front of them, and the reference's
    zero tokens sit at the same positions."""
    from lib.tiny_models import load as tiny_model
    model, tok = tiny_model("llama")
    ids, mask = encode_prompts(tok, prompts(tok, "<think>" + SPLIT), "cpu", SPLIT)
    k = context_slot(tok, "after", SPLIT)
    tail = tok(SPLIT, add_special_tokens=False)["input_ids"]
    assert k == len(tail) and all(row[-k:].tolist() == tail for row in ids)
    C = torch.randn(len(ids), 4, 64)
    embed = model.get_input_embeddings()
    x, m, pos = policy_inputs(embed, ids, mask, C, k)
    assert torch.equal(x[:, -k - 4:-k], C) and torch.equal(x[:, -k:], embed(ids[:, -k:]))
    assert m[:, -k - 4:].all() and torch.equal(pos[:, -1], m.sum(-1) - 1)
    with pytest.raises(ValueError, match="--context-split"):
        encode_prompts(tok, prompts(tok, "<think>"), "cpu", SPLIT)


def test_train_refuses_a_context_split_that_does_not_end_the_response_prefix(tmp_path):
    out = subprocess.run([sys.executable, "train.py", "--preset", "smoke", "--response-prefix", "<think>",
                          "--context-split", "</answer>", "--out", str(tmp_path / "run")],
                         capture_output=True, text=True, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert out.returncode == 2 and "--context-split" in out.stderr and not (tmp_path / "run").exists()
