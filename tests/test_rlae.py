"""RLAE (neighbours/rlae.py): the union vocabulary round-trips text and tokens across a byte-level and a SentencePiece-style
tokenizer, the mixture is a distribution and equals a member's when its weight is 1 (planted mistakes fail the
same checks), the Dirichlet log-prob matches torch's, the agent starts uniform and gets gradient, and a tiny-team
run of train.py and evaluate.py."""
import json
import os
from types import SimpleNamespace

import pytest
import torch

import grpo
import rewards
from neighbours import plumbing, rlae, union_vocab
from experts import TEAMS
from lib.tiny_models import tiny_tokenizer

TEXT = "12+ the\n\u00e9 \u00f6x 12"  # a merged piece, spaces, a newline, a 2-byte letter and one only bytes can spell


def spm_tokenizer():
    """A SentencePiece-style tokenizer built in memory: "\u2581" for a space, a few multi-character pieces, and
    <0xNN> byte tokens for everything else (byte fallback), like Gemma's."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast
    specials = ["<pad>", "<eos>", "<bos>", "<unk>"]
    pieces = ["\u2581", "1", "2", "12", "\u258112", "+", "a", "x", "\u2581the", "t", "h", "e", "\u00e9"]
    vocab = [(t, 0.0) for t in specials] + [(f"<0x{b:02X}>", -10.0) for b in range(256)] + \
            [(p, -1.0 - 0.1 * len(p)) for p in pieces]
    tk = Tokenizer(models.Unigram(vocab, unk_id=3, byte_fallback=True))
    tk.normalizer = normalizers.Replace(" ", "\u2581")
    tk.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    return PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>",
                                   unk_token="<unk>")


@pytest.fixture(scope="module")
def two_vocabs():
    toks = [tiny_tokenizer(), spm_tokenizer()]
    return toks, union_vocab.UnionVocab(toks, [{t.eos_token_id} for t in toks], [len(t) for t in toks])


def text_round_trip_failures(vocab, toks, text=TEXT):
    """Members whose own tokenisation of `text`, mapped to the union and decoded, is not `text` again."""
    bad = []
    for k, tok in enumerate(toks):
        units = [int(vocab.to_union[k][i]) for i in tok.encode(text, add_special_tokens=False)]
        if vocab.decode(units) != text:
            bad.append((k, vocab.decode(units)))
    return bad


def test_schemes_and_union_round_trips(two_vocabs):
    toks, vocab = two_vocabs
    assert vocab.schemes == ["bytelevel", "sentencepiece"]
    assert text_round_trip_failures(vocab, toks) == []
    # every union token, re-tokenised for every member, spells exactly its bytes (both have all 256 bytes)
    for u in range(1, len(vocab)):
        for k in range(2):
            ids = vocab.piece(k, u)
            assert ids and b"".join(vocab.member_bytes[k][i] for i in ids) == vocab.strings[u], (k, vocab.strings[u])
    # equal strings share one entry: the byte "1" of the byte-level tokenizer and the piece "1"
    one = [int(vocab.to_union[k][toks[k].convert_tokens_to_ids("1")]) for k in range(2)]
    assert one[0] == one[1] != -1
    # " 12" is one piece for the SentencePiece tokenizer and three bytes for the other: re-tokenised as such
    u = vocab.index[b" 12"]
    assert len(vocab.piece(1, u)) == 1 and len(vocab.piece(0, u)) == 3
    # a lone UTF-8 continuation byte is not text: it goes through byte tokens
    assert vocab.piece(1, vocab.index[b"\xb6"]) == [toks[1].convert_tokens_to_ids("<0xB6>")]
    # EOS of every member is union entry 0, other special tokens are dropped
    assert [int(vocab.to_union[k][t.eos_token_id]) for k, t in enumerate(toks)] == [0, 0]
    assert int(vocab.to_union[1][toks[1].convert_tokens_to_ids("<bos>")]) == -1


def test_a_union_that_reads_byte_level_tokens_as_text_fails_the_round_trip(monkeypatch):
    """The planted mistake: byte-level token strings taken literally ("\u0120the" for " the")."""
    monkeypatch.setattr(union_vocab, "token_scheme", lambda tok: "plain")
    toks = [tiny_tokenizer(), spm_tokenizer()]
    vocab = union_vocab.UnionVocab(toks, [{t.eos_token_id} for t in toks], [len(t) for t in toks])
    assert text_round_trip_failures(vocab, toks) != []


def sum_error(member_probs, vocab, K=2, N=5):
    """max |sum_y p(y) - 1| of the mixture over random logits and random weights."""
    torch.manual_seed(0)
    P = torch.stack([member_probs(vocab, k, 3 * torch.randn(N, len(vocab.to_union[k])), 1.0) for k in range(K)])
    w = torch.distributions.Dirichlet(torch.ones(K)).sample((N,))
    return (union_vocab.mixture(P, w).sum(-1) - 1).abs().max().item()


def test_mixture_is_a_distribution_and_a_planted_one_is_not(two_vocabs):
    _, vocab = two_vocabs
    assert sum_error(union_vocab.UnionVocab.member_probs, vocab) < 1e-5

    def not_renormalised(self, k, logits, temperature):  # the planted mistake: the dropped specials' mass is lost
        probs = torch.softmax(logits.float() / temperature, -1)
        m = self.to_union[k]
        keep = m >= 0
        return probs.new_zeros(probs.shape[0], len(self)).index_add_(1, m[keep], probs[:, keep])
    assert sum_error(not_renormalised, vocab) > 1e-3


def test_mixture_equals_a_member_when_its_weight_is_one(two_vocabs):
    toks, vocab = two_vocabs
    torch.manual_seed(1)
    logits = [torch.randn(3, len(t)) for t in toks]
    P = torch.stack([vocab.member_probs(k, z, 0.7) for k, z in enumerate(logits)])               # (K, N, U)
    for k in range(2):
        w = torch.nn.functional.one_hot(torch.full((3,), k), 2).float()
        assert torch.allclose(union_vocab.mixture(P, w), P[k], atol=1e-7)
    # and member k's union distribution is its own softmax over its kept tokens, moved to union ids (an
    # independent formula: renormalise first, then scatter)
    k, z = 1, logits[1]
    keep = vocab.to_union[k] >= 0
    own = torch.softmax(z[:, keep] / 0.7, -1)
    expect = torch.zeros(3, len(vocab)).index_add_(1, vocab.to_union[k][keep], own)
    assert torch.allclose(P[k], expect, atol=1e-6)


def test_dirichlet_logprob_matches_torch():
    alpha, w = torch.tensor([[0.5, 2.0, 3.0], [1.0, 1.0, 1.0]]), torch.tensor([[0.2, 0.3, 0.5], [0.1, 0.1, 0.8]])
    assert torch.allclose(rlae.dirichlet_logprob(alpha, w), torch.distributions.Dirichlet(alpha).log_prob(w), atol=1e-5)


@pytest.fixture(scope="module")
def tiny_rlae():
    args = SimpleNamespace(ensemble_span=4, max_new_tokens=8, system_prompt="simple", worked_example=False,
                           response_prefix="")
    return rlae.rlae(TEAMS["tiny"], 64, args, torch.device("cpu"), torch.float32)


def test_members_agent_start_and_gradient(tiny_rlae):
    m = tiny_rlae
    assert m.names == ["tiny:qwen2", "tiny:gpt2", "tiny:llama"]        # generative experts, then the policy
    torch.manual_seed(0)
    texts, traj = m.decode(["What is 1 + 2?", "What is 3 + 4?"], 2)
    N, J, K = traj["w"].shape
    assert (N, J, K) == (4, 2, 3) and len(texts) == 4
    assert torch.allclose(traj["w"].sum(-1), torch.ones(N, J))
    logp, alpha = m.span_logprobs(traj)
    assert torch.allclose(alpha, torch.full_like(alpha, rlae.ALPHA_INIT))   # no-op at init: uniform mean weights
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])
    loss, _ = grpo.grpo_loss(logp, logp.detach(), logp.detach(), adv, traj["span_mask"], beta=0.0)
    m.agent.zero_grad()
    loss.backward()
    g = m.agent.w2.weight.grad
    assert g is not None and torch.isfinite(g).all() and g.abs().sum() > 0


def test_greedy_answer_is_deterministic(tiny_rlae):
    a = tiny_rlae.answer(None, None, ["What is 5 + 6?"], None)
    assert a == tiny_rlae.answer(None, None, ["What is 5 + 6?"], None) and isinstance(a[0], str)


def test_fixed_weights_decode_one_member_alone_whatever_the_agent(tiny_rlae):
    """experiments/rlae_members.py's control: with weights (0, 1, 0) the greedy decoder picks member 1's most
    likely union token at every step, whatever the agent says, and the weights it records are the fixed ones."""
    m, q = tiny_rlae, ["What is 5 + 6?"]
    bias = m.agent.w2.bias.detach().clone()
    try:
        m.fixed_weights = torch.tensor([0.0, 1.0, 0.0])
        texts, traj = m.decode(q, 1, greedy=True)
        assert torch.equal(traj["w"], torch.tensor([0.0, 1.0, 0.0]).expand_as(traj["w"]))
        with torch.no_grad():
            m.agent.w2.bias.add_(torch.tensor([5.0, -5.0, 5.0]))  # an agent that would pick the others
        assert m.decode(q, 1, greedy=True)[0] == texts
        # the same text, token by token, from member 1's own distribution on the union vocabulary
        member = m.members[1]
        member.start([rewards.build_prompt(member.tok, q[0], *m.prompt_args)], 1)
        units = []
        for _ in range(m.max_new_tokens):
            u = int(m.vocab.member_probs(1, member.logits, 1.0).argmax(-1))
            units.append(u)
            if u == 0:
                break
            member.extend([m.vocab.piece(1, u)])
        assert m.vocab.decode(units) == texts[0]
    finally:
        m.fixed_weights = None
        with torch.no_grad():
            m.agent.w2.bias.copy_(bias)


def test_rlae_trains_and_evaluates_on_the_tiny_team(tmp_path):
    out = str(tmp_path / "r")
    rlae.main(["--task", "chain_sum", "--team", "tiny", "--device", "cpu", "--dataset-size", "16",
          "--system-prompt", "simple", "--steps", "2", "--batch-size", "2", "--grad-accum", "1", "--group-size", "2",
          "--max-new-tokens", "8", "--ensemble-span", "4", "--out", out])
    ms = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    assert [m["step"] for m in ms] == [1, 2]
    for m in ms:
        assert len(m["utilization"]) == 3 and abs(sum(m["utilization"]) - 1) < 1e-5
        assert 0 <= m["entropy"] <= torch.log(torch.tensor(3.0)).item() + 1e-6
        # tokens_per_s: the union-vocabulary units written (2 prompts x G 2) per second of the step
        assert m["tokens_per_s"] * m["seconds"] == pytest.approx(m["completion_length"] * 2 * 2, rel=1e-9)
    cfg = SimpleNamespace(**json.load(open(os.path.join(out, "config.json"))))
    state = torch.load(os.path.join(out, "checkpoint.pt"), weights_only=False)
    assert set(state["method"]) == {k for k, _ in state["method"].items() if k.startswith("agent.")}
    res = plumbing.score_run(*rlae.load_trained(cfg, state["lora"], state["method"]), cfg, 2, 2)
    assert res["n"] == 2 and res["method"] == "rlae"


def test_random_reward_pays_the_seeded_coins_and_never_scores(tmp_path):
    """--reward random (the control experiments/neighbours.py compares the weights with): each trajectory's reward
    is train.py's coin for (seed, step, micro-batch), the task's scorer is never called. The agent's mean weights
    are logged: exactly uniform at step 1 (no update yet; the drawn ones are not), and per item type equal to the
    step's with one type."""
    def no_scorer(items, texts):
        raise AssertionError("the random-reward control read the text")
    out = str(tmp_path / "coins")
    rlae.main(["--task", "chain_sum", "--team", "tiny", "--device", "cpu", "--dataset-size", "16", "--system-prompt",
               "simple", "--steps", "2", "--batch-size", "2", "--grad-accum", "1", "--group-size", "4",
               "--max-new-tokens", "4", "--ensemble-span", "2", "--seed", "3", "--reward", "random", "--out", out],
              score_batch=no_scorer)
    ms = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    for step, m in enumerate(ms):
        coins = rewards.coin_rewards(3, step, 0, 0, 8)
        assert m["reward"] == pytest.approx(sum(coins) / 8) and m["solve_rate"] == pytest.approx(sum(coins) / 8)
        assert list(m["agent_weights_by_source"]) == ["chain_sum"]
        assert m["agent_weights_by_source"]["chain_sum"] == pytest.approx(m["agent_weights"])
    assert ms[0]["agent_weights"] == pytest.approx([1 / 3] * 3, abs=1e-7) and ms[0]["utilization"] != ms[0]["agent_weights"]
    assert json.load(open(os.path.join(out, "config.json")))["reward"] == "random"


def test_answers_include_the_pre_filled_words_and_exact_pays_full_marks_only(tmp_path):
    """With an answer-only response prefix, every text RLAE scores (training and evaluation) starts with the
    pre-filled "<think></think>\n<answer>", so a member writing "7</answer>" is read as the answer 7; and --reward
    exact turns partial credit into 0. On the code before: texts without the prefix, and --reward exact refused."""
    seen = []

    def half(items, texts):
        seen.extend(texts)
        return [0.5, 1.0] * (len(texts) // 2), {}
    out = str(tmp_path / "x")
    prefix = "<think></think>\n<answer>"
    rlae.main(["--task", "chain_sum", "--team", "tiny", "--device", "cpu", "--dataset-size", "16", "--system-prompt",
               "simple", "--response-prefix", prefix, "--steps", "1", "--batch-size", "1", "--grad-accum", "1",
               "--group-size", "4", "--max-new-tokens", "4", "--ensemble-span", "2", "--reward", "exact",
               "--out", out], score_batch=half)
    m = json.loads(open(os.path.join(out, "metrics.jsonl")).readline())
    assert seen and all(t.startswith(prefix) for t in seen)
    assert m["reward"] == pytest.approx(0.5)  # (0 + 1) / 2: the 0.5s paid nothing
    cfg = SimpleNamespace(**json.load(open(os.path.join(out, "config.json"))))
    state = torch.load(os.path.join(out, "checkpoint.pt"), weights_only=False)
    assert all(t.startswith(prefix) for t in load_trained_answers(cfg, state))


def load_trained_answers(cfg, state):
    """The trained run's greedy answers to two questions, as evaluate.py gets them (RLAE.answer)."""
    _, _, method, _ = rlae.load_trained(cfg, state["lora"], state["method"])
    return method.answer(None, None, ["What is 1 + 2?", "What is 3 + 4?"], cfg)


def test_members_prefill_without_an_all_masked_attention_row(tiny_rlae, monkeypatch):
    """Each member's prompts are padded behind their first token (rollout.encode_prompts) and their common
    beginning runs once (rollout.prefill's share): no attention row has every key masked, the rows CUDA's
    memory-efficient kernel may fill with NaN. The left-padded start before had such rows for every padded prompt."""
    from test_gpu_path import count_attention_rows
    count = count_attention_rows(monkeypatch)
    torch.manual_seed(0)
    texts, _ = tiny_rlae.decode(["What is 1 + 2?", "What is 30 + 4 + 5 + 6 + 70?"], 2)
    assert count["calls"] > 0 and count["empty"] == 0 and len(texts) == 4
