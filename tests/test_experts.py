"""experts.py: pooling (Eq. 5, Table 2), padding, caching and the loaders, on the hermetic tiny team."""
import pytest
import torch

from experts import TEAMS, ExpertPool, expert_text, load_model

QS = ["What is 2 + 3?", "Rotate the matrix [[1, 2], [3, 4]] clockwise, then tell me the top row please.", "Hi"]


def manual_last(model, tok, question):
    """Eq. 5 by hand: one prompt, no padding, final layer, last token."""
    enc = tok(expert_text(tok, question), return_tensors="pt", add_special_tokens=not tok.chat_template)
    with torch.no_grad():
        return model.base_model(**enc).last_hidden_state[0, -1]


def test_widths_and_last_pooling_by_hand(tiny_pool):
    hs = tiny_pool.encode(QS)
    assert tiny_pool.dims == [48, 32, 40] and [h.shape for h in hs] == [(3, d) for d in (48, 32, 40)]
    for (model, tok), h in zip(tiny_pool.models, hs):
        for b, q in enumerate(QS):  # batched with left padding == alone without padding
            torch.testing.assert_close(h[b], manual_last(model, tok, q), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("pooling", ["last", "first_token", "first_layer", "mean"])
def test_padding_does_not_change_pooled_state(pooling):
    pool = ExpertPool(TEAMS["tiny"]["experts"], pooling=pooling)
    batched = pool.encode(QS)
    for i, h in enumerate(batched):
        for b, q in enumerate(QS):
            pool.cache.clear()
            torch.testing.assert_close(h[b], pool.encode([q])[i][0], rtol=1e-4, atol=1e-4)


def test_first_token_is_a_prompt_invariant_signature():
    """First-token pooling: a causal expert whose chat template starts with a fixed token ('<|im_start|>') has the
    same first-token state for every prompt. The bidirectional encoder (BERT) is the counter-example."""
    pool = ExpertPool(TEAMS["tiny"]["experts"], pooling="first_token")
    qwen, gpt2, bert = pool.encode(QS)
    assert torch.allclose(qwen[0], qwen[1], atol=1e-5) and torch.allclose(qwen[0], qwen[2], atol=1e-5)
    assert not torch.allclose(bert[0], bert[1], atol=1e-3)
    last = ExpertPool(TEAMS["tiny"]["experts"][:1]).encode(QS)[0]
    assert not torch.allclose(last[0], last[1], atol=1e-3)  # while the last token does carry the prompt


def test_cache_equals_fresh_computation_and_skips_forwards():
    pool = ExpertPool(TEAMS["tiny"]["experts"])
    first = pool.encode(QS)
    calls = list(pool.calls)
    again = pool.encode(QS[::-1])
    assert pool.calls == calls  # served from the cache
    fresh = ExpertPool(TEAMS["tiny"]["experts"]).encode(QS[::-1])
    for a, f, h in zip(again, fresh, first):
        torch.testing.assert_close(a, f)
        torch.testing.assert_close(a, h.flip(0))


def test_a_store_on_disk_serves_another_pool_the_very_states_it_computed(tmp_path):
    """--expert-cache: a second pool (another run) naming the folder reads each state back bit for bit and
    runs no forward; only the prompts it has not seen are computed, and a pool reading the experts another
    way (another depth) shares nothing."""
    first = ExpertPool(TEAMS["tiny"]["experts"], store=str(tmp_path)).encode(QS[:2])
    second = ExpertPool(TEAMS["tiny"]["experts"], store=str(tmp_path))
    again = second.encode(QS[:2][::-1])
    assert second.calls == [0, 0, 0]
    for a, h in zip(again, first):
        assert torch.equal(a, h.flip(0))
    second.encode(QS)  # one new prompt: one forward per expert, and on disk now
    assert second.calls == [1, 1, 1] and len(list(tmp_path.glob("*.pt"))) == 3 * len(QS)  # + one .width each
    deeper = ExpertPool(TEAMS["tiny"]["experts"], store=str(tmp_path), depth=0.5)
    deeper.encode(QS[:1])
    assert deeper.calls == [1, 1, 1] and not list(tmp_path.glob("*.tmp"))


def test_random_modes_are_drawn_not_cached():
    pool = ExpertPool(TEAMS["tiny"]["experts"][:1], pooling="random_token", seed=0)
    draws = torch.stack([pool.encode(QS[1:2])[0][0] for _ in range(6)])
    assert pool.calls == [6] and (draws - draws[0]).abs().amax(-1).max() > 1e-4


def test_bad_inputs_are_clear_errors():
    with pytest.raises(ValueError, match="--pooling"):
        ExpertPool(["tiny:qwen2"], pooling="median")
    with pytest.raises(ValueError, match="unknown tiny model"):
        load_model("tiny:mamba")
    with pytest.raises(ValueError, match="does not exist"):
        load_model("/no/such/folder/model")


def test_experts_are_frozen(tiny_pool):
    assert not any(p.requires_grad for m, _ in tiny_pool.models for p in m.parameters())
    assert all(not m.training for m, _ in tiny_pool.models)


def test_a_model_loaded_twice_shares_its_frozen_weights_and_keeps_them():
    """The pocket policy is also a pocket expert: the second load points its parameters at the first's
    tensors (experts.share_frozen_weights), so one copy sits in memory. The policy's LoRA, trained and
    merged into its weights for the rollout, must leave the expert's weights as they were, bit for bit."""
    from lora import apply_lora, lora_merged
    policy, _ = load_model("tiny:qwen2")
    expert, _ = load_model("tiny:qwen2")
    other, _ = load_model("tiny:qwen2", dtype=torch.float64)  # another dtype: another copy
    pairs = list(zip(policy.parameters(), expert.parameters()))
    assert all(p.data_ptr() == e.data_ptr() for p, e in pairs)
    assert other.dtype == torch.float64 and next(other.parameters()).data_ptr() != pairs[0][0].data_ptr()
    before = [e.detach().clone() for e in expert.parameters()]
    apply_lora(policy)
    for name, p in policy.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p)
    with lora_merged(policy):
        assert any(not torch.equal(e, b) for e, b in zip(policy.parameters(), before))  # merged
        assert all(torch.equal(e, b) for e, b in zip(expert.parameters(), before))
    assert all(torch.equal(e, b) for e, b in zip(expert.parameters(), before))
