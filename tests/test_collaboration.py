"""Measuring whether C carries expert information: the two bugs that corrupted the measurement (each test fails on
the code before its fix), the probes logged per step, the paired statistics of `evaluate.py --paired` against
hand-computed values, the oracle expert and the two controls (identical, soft_prompt), the random reward."""
import json
import os
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from baselines import METHODS, fit_state_norm
from support.harness.validation import derangement
from evaluate import paired_table
from support.harness.validation import SHUFFLE_NA
from lib.stats import paired_bootstrap_ci, paired_comparison, sign_test_p
from experts import TEAMS, ExpertPool
from adapter import varying_fraction
import rewards
from rewards import coin_rewards
from lib.optim import clip_gradients
from train import main, parse_args

TINY = ["--team", "tiny", "--task", "chain_sum", "--device", "cpu", "--dataset-size", "32", "--system-prompt",
        "simple", "--latent-dim", "32", "--num-heads", "4", "--num-latents", "4"]
QUESTIONS = ["What is 17 + 25?", "Add 3 and 4.", "Compute 10 + 91."]


def build(method, *flags):
    torch.manual_seed(0)
    args = parse_args(TINY + ["--method", method, *flags])
    return METHODS[method](TEAMS["tiny"], 64, args, "cpu", torch.float32)


def randomise_output(g):
    """W_out = 0 makes C = 0 whatever the states: give it values so that C shows what the states were."""
    with torch.no_grad():
        for name, p in g.named_parameters():
            if name.split(".")[-2:-1] == ["out"]:
                p.normal_(0, 0.5)


# ---- bug 1: random pooling must not draw again in the loss pass -------------------------------------------------

@pytest.mark.parametrize("method", ["ours", "no_xattn", "hard_routing"])
@pytest.mark.parametrize("pooling", ["random_token", "random_layer"])
def test_loss_pass_reuses_the_rollouts_pooled_states(method, pooling):
    """The story: with --pooling random_token / random_layer the loss pass drew another token or layer, so the
    gradient was taken under a C the completions were never sampled with (paper Table 2's ablations). The
    rollout's states now go back in with `reuse`. Without reuse the draw differs (so this test can fail)."""
    g = build(method, "--pooling", pooling)
    g.train(), randomise_output(g)
    torch.manual_seed(1)
    rollout = g(QUESTIONS * 3)
    again = g(QUESTIONS * 3)                                   # a fresh call draws new tokens / layers
    assert not torch.equal(rollout.C, again.C)
    loss_pass = g(QUESTIONS * 3, reuse=rollout)
    assert torch.equal(rollout.C, loss_pass.C)


# ---- bug 2: trainable parameters and optimiser state are float32 whatever the frozen weights are --------------

def test_lora_on_a_bfloat16_model_is_float32_and_a_small_adam_step_moves_it():
    """The story: LoRA's A and B took the frozen weight's dtype, bf16 on CUDA, where an Adam step of 3e-5 on a
    weight of 0.02 rounds to nothing (bf16 spacing at 0.02 is 1.2e-4): LoRA silently stopped learning."""
    from lora import LoRALinear
    layer = LoRALinear(torch.nn.Linear(16, 16).to(torch.bfloat16), rank=4)
    assert layer.lora_A.dtype == layer.lora_B.dtype == torch.float32
    with torch.no_grad():
        layer.lora_B.fill_(0.02)
    before = layer.lora_B.detach().clone()
    opt = torch.optim.AdamW([layer.lora_A, layer.lora_B], lr=3e-5, weight_decay=0)
    y = layer(torch.randn(8, 16, dtype=torch.bfloat16))
    assert y.dtype == torch.bfloat16                           # the forward stays in the frozen dtype
    y.float().pow(2).sum().backward()
    opt.step()
    assert (layer.lora_B != before).float().mean() > 0.9       # in bf16: 0 of 64 entries move


def test_train_with_bfloat16_frozen_weights_keeps_trainables_and_adam_state_float32(tmp_path):
    out = str(tmp_path / "bf16")
    main(TINY + ["--dtype", "bfloat16", "--steps", "2", "--batch-size", "2", "--grad-accum", "1", "--group-size",
                 "2", "--max-new-tokens", "4", "--out", out])
    state = torch.load(os.path.join(out, "checkpoint.pt"), weights_only=False)
    assert {t.dtype for t in state["lora"].values()} == {torch.float32}
    assert {t.dtype for t in state["method"].values() if t.is_floating_point()} == {torch.float32}
    adam = [t for s in state["optimizer"]["state"].values() for k, t in s.items() if k != "step"]
    assert adam and {t.dtype for t in adam} == {torch.float32}


# ---- probes --------------------------------------------------------------------------------------------------

def test_varying_fraction_by_hand():
    assert varying_fraction(torch.ones(4, 2, 3)) == 0                      # a soft prompt: nothing varies
    X = torch.tensor([[1.0, 3.0], [3.0, 3.0]])                             # column 1 varies: var 1, mean sq 5
    assert varying_fraction(X) == pytest.approx(1 / (5 + 9))
    assert varying_fraction(torch.tensor([[1.0], [-1.0]])) == pytest.approx(1.0)  # zero-mean: all varies


def test_clip_gradients_jointly_and_per_group_by_hand():
    def groups():
        a, b = torch.zeros(1, requires_grad=True), torch.zeros(1, requires_grad=True)
        a.grad, b.grad = torch.tensor([3.0]), torch.tensor([4.0])
        return [{"name": "lora", "params": [a]}, {"name": "g_phi", "params": [b]}]
    g = groups()
    total, norms = clip_gradients(g, 1.0)
    assert total == pytest.approx(5) and norms == pytest.approx({"lora": 3, "g_phi": 4})
    assert g[0]["params"][0].grad.item() == pytest.approx(0.6) and g[1]["params"][0].grad.item() == pytest.approx(0.8)
    g = groups()
    total, _ = clip_gradients(g, 1.0, per_group=True)
    assert total == pytest.approx(5)
    assert g[0]["params"][0].grad.item() == pytest.approx(1) and g[1]["params"][0].grad.item() == pytest.approx(1)


def test_metrics_have_the_probe_fields(tmp_path):
    out = str(tmp_path / "probes")
    main(TINY + ["--steps", "2", "--batch-size", "2", "--grad-accum", "2", "--group-size", "2", "--max-new-tokens",
                 "4", "--lr", "3e-2", "--router-lr", "3e-2", "--clip-per-group", "--out", out])
    rec = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    assert rec[0]["c_rms"] == 0 and rec[0]["c_varying"] is None           # W_out = 0: C = 0 at step 1
    for k in ("c_rms", "embed_rms", "grad_norm_lora", "grad_norm_g_phi", "entropy", "utilization"):
        assert isinstance(rec[1][k], (float, list)), k
    assert len(rec[1]["state_varying"]) == 3 and len(rec[1]["entropy_heads"]) == 4
    assert min(rec[1]["entropy_heads"]) <= rec[1]["entropy"] + 1e-6          # the head mean hides sharp heads


# ---- paired statistics ---------------------------------------------------------------------------------------

def test_sign_test_by_hand():
    assert sign_test_p(5, 0) == pytest.approx(2 / 32)          # 2 * P[Bin(5, 1/2) <= 0]
    assert sign_test_p(3, 1) == pytest.approx(2 * 5 / 16)      # 2 * (1 + 4) / 16
    assert sign_test_p(0, 0) == 1 and sign_test_p(2, 2) == 1
    assert sign_test_p(10, 2) == pytest.approx(2 * (1 + 12 + 66) / 4096)


def test_paired_comparison_by_hand():
    r = paired_comparison([1, 1, 0, 1, 0.5], [0, 1, 0, 0, 1])
    assert r["diff"] == pytest.approx((1 + 0 + 0 + 1 - 0.5) / 5)
    assert (r["better"], r["worse"], r["n"]) == (2, 1, 5) and r["p_sign"] == pytest.approx(1.0)
    assert r["ci95"][0] <= r["diff"] <= r["ci95"][1]


def test_bootstrap_interval_matches_the_t_interval_on_a_large_sample():
    d = np.random.default_rng(0).normal(0.3, 1.0, 2000)
    lo, hi = paired_bootstrap_ci(d)
    half = 1.96 * d.std(ddof=1) / np.sqrt(len(d))             # the normal-theory 95 % half-width
    assert lo == pytest.approx(d.mean() - half, abs=0.01) and hi == pytest.approx(d.mean() + half, abs=0.01)
    assert paired_bootstrap_ci([0.25] * 7) == [0.25, 0.25]


def test_shuffled_C_never_gives_an_item_its_own_C():
    for n in (2, 3, 10, 100):
        assert not (derangement(n, seed=n) == np.arange(n)).any()
    assert sorted(derangement(10)) == list(range(10))


def test_paired_evaluation_scores_the_same_items_three_ways(tmp_path):
    """with_C and zero_C agree at init (W_out = 0): the paired difference is exactly 0, as it must be."""
    from types import SimpleNamespace
    from evaluate import evaluate
    out = str(tmp_path / "run")
    main(TINY + ["--steps", "1", "--batch-size", "2", "--grad-accum", "1", "--group-size", "2",
                 "--max-new-tokens", "4", "--out", out])
    cfg = SimpleNamespace(**json.load(open(os.path.join(out, "config.json"))))
    g = METHODS["ours"](cfg.team_models, 64, cfg, "cpu", torch.float32).state_dict()  # W_out = 0
    r = evaluate(cfg, 5, 2, None, g, conditions=("with_C", "zero_C", "shuffled_C"))
    assert set(r["per_item"]) == {"with_C", "zero_C", "shuffled_C"}
    assert all(len(r["per_item"][c]["score"]) == len(r["per_item"][c]["gold_logprob"]) == 5
               for c in ("with_C", "zero_C"))
    assert r["per_item"]["with_C"] == r["per_item"]["zero_C"]
    assert r["paired"]["with_C - zero_C"]["gold_logprob"]["diff"] == 0
    # at init every prompt gets the same C (zeros), so shuffling it is no test: the cell says n/a and why
    assert r["paired"]["with_C - shuffled_C"] == {"n/a": SHUFFLE_NA} and "n/a" in paired_table(r)


def merging_tokenizer():
    """The tiny byte-level tokenizer with two merges, "<" "/" -> "</" and ">" "</" -> "></", so that
    prompt + "</think>..." tokenises differently from prompt and bridge apart, as SmolLM2's does."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from lib.tiny_models import tiny_tokenizer
    base = tiny_tokenizer()
    vocab = dict(base.get_vocab())
    vocab.update({"</": len(vocab), "></": len(vocab) + 1})
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[("<", "/"), (">", "</")]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tk.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|im_end|>", pad_token="<pad>",
                                  bos_token="<|endoftext|>", unk_token="<|endoftext|>")
    tok.chat_template = base.chat_template
    return tok


def merging_policy(seed):
    """The tiny llama policy on merging_tokenizer(), with LoRA whose B is random (not the zeros of init), in
    eval mode: (tokenizer, policy)."""
    from lib.tiny_models import load as tiny_model
    from lora import apply_lora
    tok = merging_tokenizer()
    policy, _ = tiny_model("llama")
    policy.resize_token_embeddings(len(tok))
    apply_lora(policy, 4, 8)
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    return tok, policy.eval()


@pytest.mark.parametrize("position, with_C", [("before", True), ("before", False), ("after", True)])
def test_one_prefill_gives_the_greedy_answers_and_the_gold_logprobs(position, with_C):
    """support.harness.gold.greedy_and_gold shares the prefill between the greedy answer and the gold pass:
    its completions are bit for bit rollout.sample's, its log-probs gold_logprobs' to float
    rounding, also when the tokeniser merges the prompt's end with the bridge (k = 1 column run
    again) and when C sits after the prompt (the gold pass then runs on its own)."""
    from types import SimpleNamespace
    from support.harness.gold import answer_bridge, gold_logprobs, greedy_and_gold
    from grpo import completion_mask
    from rollout import encode_prompts, sample
    tok, policy = merging_policy(seed=1)
    args = SimpleNamespace(response_prefix="<think>", context_position=position, max_new_tokens=6)
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                       add_generation_prompt=True) + "<think>" for q in QUESTIONS]
    bridged = prompts[0] + answer_bridge("<think>")
    assert tok(bridged)["input_ids"] != tok(prompts[0])["input_ids"] + tok(
        answer_bridge("<think>"))["input_ids"], "the tokeniser must merge across the boundary"
    golds, eos = ["42", "7", "101"], [tok.eos_token_id]
    ids, mask = encode_prompts(tok, prompts, "cpu")
    C = torch.randn(3, 4, 64) if with_C else None
    with torch.no_grad():
        comp, gold = greedy_and_gold(policy, tok, ids, mask, C, prompts, golds, args, eos)
        want = sample(policy, ids, mask, C, 1, 6, 1.0, eos, tok.pad_token_id, position, greedy=True)
        want = want.masked_fill(~completion_mask(want, eos), tok.pad_token_id)
        want_gold = gold_logprobs(policy, tok, prompts, golds, C, args, "cpu")
    assert torch.equal(comp, want)
    assert gold == pytest.approx(want_gold, abs=1e-4) and min(want_gold) < -1  # not all ~0


@pytest.mark.parametrize("position, C_kind", [("before", None), ("before", "same"), ("after", "same"),
                                              ("after", "own"), ("before", "own")])
def test_a_shared_prefix_gives_the_answers_and_gold_logprobs_of_the_whole_prompt(position, C_kind):
    """rollout.prefill (its share, G = 1) runs the items' common beginning (here a long system prompt) once: the
    greedy answers equal the whole-prompt prefill's token for token and the gold log-probs to float
    rounding, with no C, a C the same for every item (in front or behind), a C of each item's own behind
    the prompt (the prompt's beginning is still shared), and two identical items. With each item's own C
    in front nothing is shared and it is the whole-prompt prefill, bit for bit."""
    from types import SimpleNamespace
    from support.harness.gold import greedy_and_gold
    from rollout import encode_prompts, prefill
    tok, policy = merging_policy(seed=2)
    args = SimpleNamespace(response_prefix="<think>", context_position=position, max_new_tokens=8)
    system = "Answer with a number. Example: What is 3 + 4? <answer>7</answer> Now the question."
    questions = QUESTIONS + [QUESTIONS[0]]
    prompts = [tok.apply_chat_template([{"role": "system", "content": system}, {"role": "user", "content": q}],
                                       tokenize=False, add_generation_prompt=True) + "<think>" for q in questions]
    golds, eos = ["42", "7", "101", "42"], [tok.eos_token_id]
    ids, mask = encode_prompts(tok, prompts, "cpu")
    torch.manual_seed(3)
    C = {None: None, "same": torch.randn(1, 4, 64).expand(4, 4, 64), "own": torch.randn(4, 4, 64)}[C_kind]
    with torch.no_grad():
        shared = prefill(policy, ids, mask, C, 1, position)
        comp, gold = greedy_and_gold(policy, tok, ids, mask, C, prompts, golds, args, eos, share_prefix=True)
        want, want_gold = greedy_and_gold(policy, tok, ids, mask, C, prompts, golds, args, eos)
    in_common = int(shared[2].all(0).long().cumprod(0).sum())  # leading columns real in every row
    if C_kind == "own" and position == "before":  # nothing in common behind x_0: the whole-prompt prefill
        assert torch.equal(shared[2], prefill(policy, ids, mask, C, 1, position)[2]) and in_common == 5
        assert torch.equal(comp, want) and gold == want_gold
        return
    assert in_common > 16 and not mask.all()  # the prompts differ in length: shared, padding moved
    assert torch.equal(comp, want) and (comp != tok.pad_token_id).sum() > 8
    assert gold == pytest.approx(want_gold, abs=1e-4) and min(want_gold) < -1


def test_shuffled_C_is_not_applicable_when_C_does_not_depend_on_the_prompt():
    """Regression: soft_prompt's "with C - shuffled C = 0.0" was reported as if it were a measurement; it is
    0 by construction, because its C is the same for every prompt."""
    from support.harness.validation import context_depends_on_prompt
    C = torch.randn(1, 4, 8).expand(5, 4, 8)
    assert not context_depends_on_prompt(C) and not context_depends_on_prompt(C[:1])
    C = C.clone()
    C[3, 2, 1] += 1e-6
    assert context_depends_on_prompt(C)
    g = build("soft_prompt")
    randomise_output(g)
    assert not context_depends_on_prompt(g(QUESTIONS).C)
    assert context_depends_on_prompt(torch.randn(3, 4, 64))


# ---- oracle and controls -------------------------------------------------------------------------------------

def test_oracle_expert_reads_the_gold_answer():
    pool = ExpertPool(["oracle:tiny:qwen2", "tiny:qwen2"])
    a = pool.encode(QUESTIONS, answers=["42", "7", "101"])
    b = pool.encode(QUESTIONS, answers=["41", "7", "100"])
    assert not torch.equal(a[0][0], b[0][0]) and torch.equal(a[0][1], b[0][1])  # the oracle sees the answer
    assert torch.equal(a[1], b[1])                                             # the plain expert does not
    with pytest.raises(ValueError, match="oracle"):
        pool.encode(QUESTIONS)


def test_identical_control_has_the_policy_as_its_only_expert():
    g = build("identical")
    assert g.pool.names == [TEAMS["tiny"]["policy"]]


def test_soft_prompt_is_the_same_for_every_prompt_and_zero_at_init():
    g = build("soft_prompt")
    C = g(QUESTIONS).C
    assert C.shape == (3, 4, 64) and torch.equal(C, torch.zeros_like(C))
    randomise_output(g)
    C = g(QUESTIONS).C
    assert C.abs().sum() > 0 and torch.equal(C[0], C[1]) and torch.equal(C[0], C[2])


def odd_length_reward(items, texts):
    """A synthetic reward with variance in every group of the tiny team: 1 for a completion of odd length."""
    return [float(len(t) % 2) for t in texts], {}


def test_bare_anchor_is_the_anchor_for_ever_and_only_lora_trains(tmp_path):
    """The control for "m newline tokens": C = the anchor at every step, g has nothing to train."""
    out = str(tmp_path / "bare")
    main(TINY + ["--method", "bare_anchor", "--context-anchor", "newline", "--steps", "2", "--batch-size", "3",
                 "--grad-accum", "1", "--group-size", "4", "--max-new-tokens", "6", "--lr", "1e-2", "--out", out],
         score_batch=odd_length_reward)
    state = torch.load(os.path.join(out, "checkpoint.pt"), weights_only=False)
    assert not any(p.requires_grad for p in build("bare_anchor").parameters())
    # W_out = 0 and b_out = 0 after training as at init: C = FFN(Q_lat) W_out + b_out + anchor = the anchor
    assert not state["method"]["out.weight"].any() and not state["method"]["out.bias"].any()
    assert state["method"]["out.anchor"].abs().sum() > 0                            # the newline embedding
    assert any(v.abs().sum() > 0 for k, v in state["lora"].items() if "lora_B" in k)  # LoRA did train


def test_random_reward_pays_the_coin_only_and_still_counts_answers(tmp_path):
    """Regression: --reward random added --format-bonus to the coin (not a pure random reward) and logged
    answer_rate = 1.0 whatever the text (the coin returned no counts). Now the reward is the coin alone, the
    scorer is never called, answer_rate is read off the completions, and a format bonus is refused."""
    from rewards import extract_answer
    out = str(tmp_path / "coin")

    def scorer_must_not_run(items, texts):
        raise AssertionError("the random-reward control read the text")

    main(TINY + ["--reward", "random", "--steps", "1", "--batch-size", "1", "--grad-accum", "1", "--group-size",
                 "4", "--max-new-tokens", "4", "--out", out], score_batch=scorer_must_not_run)
    rec = json.loads(open(os.path.join(out, "metrics.jsonl")).readline())
    texts = [json.loads(line)["completion"] for line in open(os.path.join(out, "samples.jsonl"))]
    assert len(texts) == 4                                           # one prompt, G = 4: every completion
    assert rec["reward"] == pytest.approx(np.mean(coin_rewards(0, 0, 0, 0, 4)))
    assert rec["answer_rate"] == pytest.approx(np.mean([extract_answer(t) is not None for t in texts]))
    with pytest.raises(SystemExit) as e:
        main(TINY + ["--reward", "random", "--format-bonus", "0.1", "--out", str(tmp_path / "bonus")])
    assert e.value.code == 2 and not os.path.exists(tmp_path / "bonus")


def test_random_reward_is_a_seeded_coin_that_ignores_the_text():
    a = coin_rewards(0, 3, 1, 0, 4000)
    assert a == coin_rewards(0, 3, 1, 0, 4000) and a != coin_rewards(0, 4, 1, 0, 4000)   # pure function of the step
    assert set(a) == {0.0, 1.0} and abs(np.mean(a) - 0.5) < 0.03


# ---- channel options: which layer is pooled, standardised states -----------------------------------------------

def test_expert_depth_pools_the_chosen_block_by_hand():
    from experts import expert_text
    pool = ExpertPool(["tiny:qwen2"], depth=0.5)                            # 2 blocks: block 1
    model, tok = pool.models[0]
    ids = tok(expert_text(tok, QUESTIONS[0]), return_tensors="pt", add_special_tokens=False)["input_ids"]
    want = model.base_model(input_ids=ids, output_hidden_states=True).hidden_states[1][0, -1]
    torch.testing.assert_close(pool.encode(QUESTIONS[:1])[0][0], want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="--expert-depth"):
        ExpertPool(["tiny:qwen2"], pooling="first_layer", depth=0.5)


def test_state_norm_standardises_the_calibration_states_and_travels_in_the_state_dict():
    g = build("ours", "--state-norm", "standardize")
    h = g.pool.encode(QUESTIONS * 4)
    assert all(torch.equal(a, b) for a, b in zip(g.norm(h), [x.float() for x in h]))  # identity before fit
    calibration = [{"question": q, "answer": None} for q in QUESTIONS * 4 + ["Another question?"] * 2]
    fit_state_norm(g, calibration, SimpleNamespace(state_norm_prompts=len(calibration)))  # build_run's, for every method
    z = g.norm(g.pool.encode(QUESTIONS * 4 + ["Another question?"] * 2))
    for x in z:
        torch.testing.assert_close(x.mean(0), torch.zeros(x.shape[1]), atol=1e-4, rtol=0)
        assert ((x.std(0) - 1).abs() < 1e-3).float().mean() > 0.9       # all but floored (near-constant) dims
    randomise_output(g)
    C = g(QUESTIONS).C
    fresh = build("ours")
    fresh.load_state_dict(g.state_dict())                                  # the statistics are buffers
    assert torch.equal(fresh(QUESTIONS).C, C)


def test_train_with_state_norm_and_a_middle_layer(tmp_path):
    out = str(tmp_path / "norm")
    main(TINY + ["--state-norm", "standardize", "--state-norm-prompts", "8", "--expert-depth", "0.5", "--steps", "1",
                 "--batch-size", "2", "--grad-accum", "1", "--group-size", "2", "--max-new-tokens", "4", "--out", out])
    state = torch.load(os.path.join(out, "checkpoint.pt"), weights_only=False)["method"]
    assert not torch.equal(state["norm.std0"], torch.ones_like(state["norm.std0"]))


def test_an_oracle_team_trains_and_is_scored_three_ways(tmp_path):
    """The channel test's path end to end on the tiny team: the oracle reads the gold answers in the rollout
    and in evaluation (train.py and evaluate.py pass them), the loss pass reuses the rollout's states."""
    from types import SimpleNamespace
    from evaluate import evaluate
    out = str(tmp_path / "oracle")
    main(TINY + ["--experts", "oracle:tiny:qwen2,tiny:gpt2", "--steps", "2", "--batch-size", "2", "--grad-accum",
                 "1", "--group-size", "2", "--max-new-tokens", "4", "--out", out])
    cfg = SimpleNamespace(**json.load(open(os.path.join(out, "config.json"))))
    state = torch.load(os.path.join(out, "checkpoint.pt"), weights_only=False)
    r = evaluate(cfg, 4, 2, state["lora"], state["method"], conditions=("with_C", "zero_C", "shuffled_C"))
    assert set(r["paired"]) == {"with_C - zero_C", "with_C - shuffled_C"}


# ---- --context-anchor: where C starts ------------------------------------------------------------------------

@pytest.mark.parametrize("position", ["after", "before"])
def test_an_anchored_C_moves_the_policy_smoothly_and_a_zero_one_jumps(position):
    """adapter.py deviation 4. The same random direction u of C at rms 1e-3 and 1e-2, added to zero tokens and to
    the anchor a (a token embedding): around 0 the policy's RMSNorm makes the two changes about equal (the
    step-1 jump), around a the change is small and grows about in proportion (a smooth start). At rms 0 both
    are exactly their reference: empty_context is what the reference policy and the C = 0 arm read."""
    from adapter import OutputProjection, empty_context, set_context_anchor
    from experts import load_model
    from rollout import completion_logprobs, encode_prompts
    policy, tok = load_model("tiny:llama")
    D = policy.config.hidden_size
    proj = OutputProjection(16, D)
    ids, mask = encode_prompts(tok, ["What is 2 + 3?", "Add 14 and 9."], "cpu")
    comp = torch.randint(3, 200, (2, 5), generator=torch.Generator().manual_seed(0))
    cmask = torch.ones_like(comp, dtype=torch.bool)
    u = torch.randn(2, 4, D, generator=torch.Generator().manual_seed(1))
    u = u / u.pow(2).mean().sqrt()

    def change(C, ref):
        with torch.no_grad():
            lp = completion_logprobs(policy, ids, mask, C, comp, cmask, 1.0, position)
            return (lp - completion_logprobs(policy, ids, mask, ref, comp, cmask, 1.0, position)).abs().mean().item()

    C0 = proj(torch.zeros(2, 4, 16))                                        # W_out = 0, no anchor: zeros
    assert torch.equal(C0, empty_context(proj, C0)) and not C0.any()
    set_context_anchor(proj, policy.get_input_embeddings().weight[tok.encode("\n", add_special_tokens=False)[-1]])
    A = proj(torch.zeros(2, 4, 16))                                         # W_out = 0, anchored: the anchor
    assert torch.equal(A, empty_context(proj, A)) and A.abs().sum() > 0
    zero = [change(C0 + e * u, C0) for e in (1e-3, 1e-2)]
    anchored = [change(A + e * u, A) for e in (1e-3, 1e-2)]
    assert zero[0] > 0.5 * zero[1]                      # around 0: a 10x smaller C is not a 10x smaller change
    assert anchored[1] > 4 * anchored[0]                # around the anchor: it is, about
    assert anchored[0] < 0.1 * zero[0], (zero, anchored)


def test_train_and_evaluate_with_an_anchored_context(tmp_path):
    """--context-anchor newline end to end: the anchor is the policy's embedding of "\\n", it travels in the
    checkpoint, and at W_out = 0 the with-C and "C = 0" arms both read it, so they agree exactly."""
    from types import SimpleNamespace
    from evaluate import evaluate, load_policy
    out = str(tmp_path / "anchored")
    main(TINY + ["--context-anchor", "newline", "--method", "soft_prompt", "--reward", "random", "--steps", "2", "--batch-size", "2",
                 "--grad-accum", "1", "--group-size", "2", "--max-new-tokens", "4", "--lr", "1e-2", "--out", out])
    cfg = SimpleNamespace(**json.load(open(os.path.join(out, "config.json"))))
    state = torch.load(os.path.join(out, "checkpoint.pt"), weights_only=False)
    policy, tok, _, _ = load_policy(cfg)
    newline = policy.get_input_embeddings().weight[tok.encode("\n", add_special_tokens=False)[-1]]
    assert torch.equal(state["method"]["out.anchor"], newline)
    fresh = METHODS["soft_prompt"](cfg.team_models, 64, cfg, "cpu", torch.float32).state_dict()
    fresh["out.anchor"] = newline                                           # W_out = 0, anchored
    r = evaluate(cfg, 4, 2, None, fresh, conditions=("with_C", "zero_C"))
    assert r["per_item"]["with_C"] == r["per_item"]["zero_C"]
    r = evaluate(cfg, 4, 2, state["lora"], state["method"], conditions=("with_C", "zero_C"))
    assert r["per_item"]["with_C"]["gold_logprob"] != r["per_item"]["zero_C"]["gold_logprob"]


# ---- --channel-weight: the channel-forcing term in the loop ---------------------------------------------------

def run_cf(tmp_path, name, method, *flags):
    out = str(tmp_path / name)
    main(TINY + ["--method", method, "--steps", "2", "--batch-size", "3", "--grad-accum", "1", "--group-size", "4",
                 "--max-new-tokens", "6", "--lr", "1e-2", "--router-lr", "1e-2", "--out", out, *flags],
         score_batch=odd_length_reward)
    state = torch.load(os.path.join(out, "checkpoint.pt"), weights_only=False)
    metrics = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    return state, [{k: v for k, v in m.items() if k not in ("seconds", "tokens_per_s")} for m in metrics]  # wall clock


def test_channel_weight_zero_is_plain_grpo_bit_for_bit_and_a_positive_weight_moves_g_phi(tmp_path):
    plain, m_plain = run_cf(tmp_path, "plain", "ours")
    zero, m_zero = run_cf(tmp_path, "zero", "ours", "--channel-weight", "0")
    cf, m_cf = run_cf(tmp_path, "cf", "ours", "--channel-weight", "1")
    assert m_plain == m_zero
    for part in ("lora", "method"):
        assert all(torch.equal(plain[part][k], zero[part][k]) for k in plain[part])
    assert "cf_loss" in m_cf[0] and "cf_loss" not in m_plain[0] and m_cf[0]["cf_fraction"] > 0
    assert m_cf[0]["reward"] == m_plain[0]["reward"]               # the same rollout: only the loss differs
    assert any(not torch.equal(cf["method"][k], plain["method"][k]) for k in plain["method"])  # g_phi moved


def test_channel_forcing_gives_no_gradient_when_C_is_the_same_for_every_prompt():
    """soft_prompt's C does not depend on the prompt, so its mismatched context is itself: l_i = l'_i as functions
    of the one shared C, and the term's gradient cancels; with a C that varies over prompts it does not."""
    import rollout
    from experts import load_model
    from grpo import channel_forcing_loss
    policy, tok = load_model(TEAMS["tiny"]["policy"], "cpu", torch.float32)
    ids, mask = rollout.encode_prompts(tok, QUESTIONS, "cpu")
    comp, comp_mask = torch.randint(5, 50, (6, 4)), torch.ones(6, 4, dtype=torch.bool)     # G = 2 per prompt
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0, 1.0, -1.0])
    g = build("soft_prompt")
    randomise_output(g)
    shared = g(QUESTIONS).C                                                     # (3, m, D), equal rows
    varying = shared.detach() + 0.5 * torch.randn_like(shared)
    varying.requires_grad_(True)
    for C, params in ((shared, [p for p in g.parameters() if p.requires_grad]), (varying, [varying])):
        logp = rollout.completion_logprobs(policy, ids, mask, C, comp, comp_mask, 1.0)
        logp_mis = rollout.completion_logprobs(policy, ids, mask, C.roll(-1, dims=0), comp, comp_mask, 1.0)
        loss, m = channel_forcing_loss(logp, logp_mis, adv, comp_mask)
        grads = torch.autograd.grad(loss, params)
        largest = max(gr.abs().max().item() for gr in grads)
        if C is shared:
            assert m["cf_margin"] == 0.0 and largest < 1e-6, largest
        else:
            assert largest > 1e-3, largest


def test_answer_only_completions_are_scored_with_the_prefix_that_opened_the_answer(tmp_path, monkeypatch):
    """--response-prefix '<think></think>\\n<answer>': the policy writes only "7</answer>". The scorers must
    read the prefix with it (rewards.responses), in training and in evaluation, and the gold log-prob must not
    open a second answer block (answer_bridge). Before the fix every such completion scored as "no answer"."""
    from rewards import extract_answer, responses
    from support.harness.gold import answer_bridge
    prefix = "<think></think>\n<answer>"
    assert answer_bridge(prefix) == "" and answer_bridge("<answer>") == ""
    assert answer_bridge("<think>") == "</think>\n<answer>" and answer_bridge("") == "<answer>"
    assert answer_bridge("<think>ok</think>\n") == "<answer>"
    assert extract_answer(responses(prefix, ["7</answer>"])[0]) == "7"
    assert responses("<think>", ["a</think>\n<answer>3</answer>"]) == ["<think>a</think>\n<answer>3</answer>"]
    seen = []

    def spy(items, texts):
        seen.extend(texts)
        return [0.0] * len(texts), {}

    out = str(tmp_path / "answer-only")
    main(TINY + ["--response-prefix", prefix, "--steps", "1", "--batch-size", "2", "--grad-accum", "1",
                 "--group-size", "2", "--max-new-tokens", "3", "--eval-items", "0", "--out", out], score_batch=spy)
    completions = [json.loads(line)["completion"] for line in open(os.path.join(out, "samples.jsonl"))]
    assert seen and all(t.startswith(prefix) for t in seen)
    assert len(seen) == 4 and completions and {prefix + c for c in completions} <= set(seen)
    seen.clear()                                  # evaluation (--eval-items) scores with rewards.score_batch
    monkeypatch.setattr(rewards, "score_batch", spy)
    main(TINY + ["--response-prefix", prefix, "--steps", "1", "--batch-size", "1", "--grad-accum", "1",
                 "--group-size", "2", "--max-new-tokens", "3", "--eval-items", "2", "--out", out + "-eval"],
         score_batch=lambda items, texts: ([0.0] * len(texts), {}))
    assert len(seen) >= 2 and all(t.startswith(prefix) for t in seen)


def test_exact_reward_pays_full_marks_only(tmp_path):
    """--reward exact: a scorer's partial credit (reasoning-gym's gcd pays 0.5 for "12" when the answer is 2)
    becomes 0, full marks stay 1; --reward task keeps the scorer's numbers."""
    def halves(items, texts):
        return [[0.5, 1.0, 0.0, 0.5][k % 4] for k in range(len(texts))], {}

    rewards_of = {}
    for kind in ("task", "exact"):
        out = str(tmp_path / kind)
        main(TINY + ["--reward", kind, "--steps", "1", "--batch-size", "1", "--grad-accum", "1", "--group-size",
                     "4", "--max-new-tokens", "3", "--eval-items", "0", "--out", out], score_batch=halves)
        rewards_of[kind] = json.loads(open(os.path.join(out, "metrics.jsonl")).readline())["reward"]
    assert rewards_of == {"task": pytest.approx(0.5), "exact": pytest.approx(0.25)}
