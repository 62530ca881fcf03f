"""The speedrun's levers, each against a hand-computed case: truncated importance weights and the loss they
weight, the bfloat16 rollout copy (close to the float32 scoring pass, and gone on exit), dynamic sampling
(never trains on a group whose rewards are all equal), the format bonus (training only: evaluation never sees
it), the learning-rate schedule, and --eval-items' before/after line."""
import json
import math
import os

import numpy as np
import pytest
import torch

import evaluate
import grpo
import rewards
import rollout
import train

TINY = ["--team", "tiny", "--task", "chain_sum", "--device", "cpu", "--dataset-size", "32", "--system-prompt",
        "simple", "--latent-dim", "32", "--num-heads", "4", "--num-latents", "4", "--max-new-tokens", "3"]


# ---- truncated importance sampling ---------------------------------------------------------------------------

def test_truncated_is_weights_by_hand():
    logp_old = torch.log(torch.tensor([[0.5, 0.2, 0.9]]))
    logp_mu = torch.log(torch.tensor([[0.25, 0.4, 0.1]]))
    mask = torch.tensor([[True, True, False]])
    w = grpo.truncated_is_weights(logp_old, logp_mu, mask, cap=1.5)
    # 0.5 / 0.25 = 2 -> capped at 1.5; 0.2 / 0.4 = 0.5; padding -> 1 whatever the log-probs say
    assert torch.allclose(w, torch.tensor([[1.5, 0.5, 1.0]]))
    with pytest.raises(ValueError, match="cap"):
        grpo.truncated_is_weights(logp_old, logp_mu, mask, cap=0)


def test_importance_weights_scale_each_tokens_policy_gradient_and_not_the_kl():
    """mu = 1 (ratio 1), beta = 0: loss = -1/N sum_i 1/|o_i| sum_t w_it A_i, so dloss/dlogp_it = -w_it A_i /
    (|o_i| N). With beta > 0 the KL's gradient is the unweighted one."""
    torch.manual_seed(0)
    logp = torch.randn(2, 3, requires_grad=True)
    mask = torch.tensor([[True, True, True], [True, True, False]])
    adv, w = torch.tensor([1.0, -2.0]), torch.tensor([[0.5, 1.0, 2.0], [1.5, 0.25, 1.0]])
    loss, _ = grpo.grpo_loss(logp, logp.detach(), logp.detach(), adv, mask, beta=0.0, is_weight=w)
    loss.backward()
    n_tok = mask.sum(1, keepdim=True).float()
    expected = torch.where(mask, -w * adv[:, None] / (n_tok * 2), torch.zeros(2, 3))
    assert torch.allclose(logp.grad, expected)
    # the KL term: the same gradient with and without weights when the advantages are 0
    ref = torch.randn(2, 3)
    grads = []
    for weight in (None, w):
        x = logp.detach().clone().requires_grad_(True)
        grpo.grpo_loss(x, x.detach(), ref, torch.zeros(2), mask, beta=0.1, is_weight=weight)[0].backward()
        grads.append(x.grad)
    assert torch.equal(grads[0], grads[1])


# ---- the bfloat16 rollout copy -------------------------------------------------------------------------------

def test_bfloat16_rollout_copy_samples_close_to_the_float32_scoring_pass_and_is_gone_on_exit(tiny_policy):
    model, tok = tiny_policy
    ids, mask = rollout.encode_prompts(tok, ["Hello there", "What is 2 + 3?"], "cpu")
    x = torch.randn(2, 4, model.config.hidden_size)
    lin = next(m for m in model.modules() if isinstance(m, torch.nn.Linear))
    before = lin(x[0])
    torch.manual_seed(0)
    comp, logp_mu = rollout.sample(model, ids, mask, None, 4, 6, 1.0, [-1], tok.pad_token_id,
                                   return_logprobs=True, dtype=torch.bfloat16)
    assert "forward" not in vars(lin) and torch.equal(lin(x[0]), before)   # the float32 weights are back
    logp = rollout.completion_logprobs(model, ids, mask, None, comp, torch.ones_like(comp, dtype=torch.bool), 1.0)
    gap = (logp - logp_mu).abs().mean().item()
    assert 0 < gap < 0.05, gap   # bf16 has 8 bits of mantissa: near, not equal
    with rollout.low_precision_linears(model):
        assert lin(x[0]).dtype == torch.float32 and not torch.equal(lin(x[0]), before)


# ---- dynamic sampling ------------------------------------------------------------------------------------------

def every_other_prompt_is_flat(items, completions):
    """Rewards with no variance for the prompts whose question ends in an even digit sum (all 0), a coin
    for the others: a deterministic split of the groups into flat and informative ones."""
    rng = np.random.default_rng(len(completions))
    r = [0.0 if sum(map(ord, it["question"])) % 2 == 0 else float(rng.integers(0, 2)) for it in items]
    return r, {"ok": len(r)}


def build_run(tmp_path, *flags):
    args = train.parse_args(TINY + ["--batch-size", "4", "--grad-accum", "2", "--group-size", "4",
                                    "--out", str(tmp_path / "run"), *flags])
    return args, train.build_run(args, torch.device("cpu"))


def test_dynamic_sampling_never_trains_on_a_flat_group(tmp_path):
    args, run = build_run(tmp_path, "--dynamic-sampling", "2")
    calls = []

    def score(items, completions):
        calls.append(len(completions))
        return every_other_prompt_is_flat(items, completions)
    rec, batches = train.grpo_step(0, run, args, score)
    G = args.group_size
    for b in batches:
        flat = train.flat_groups(b["r"], G)
        assert torch.equal(b["keep"], ~flat)                        # only groups with a signal are kept ...
        assert len(b["comp"]) == int(b["keep"].sum()) * G == len(b["adv"]) == b["ids"].shape[0] * G
        assert (b["adv"].view(-1, G) != 0).any(-1).all()            # ... and every kept group has advantages
    assert len(calls) > args.grad_accum                             # flat groups were drawn again
    assert rec["trained_group_fraction"] == torch.cat([b["keep"] for b in batches]).float().mean().item() < 1


def test_dynamic_sampling_with_no_signal_anywhere_leaves_the_weights_alone(tmp_path):
    args, run = build_run(tmp_path, "--dynamic-sampling", "1")
    before = {k: v.clone() for k, v in run["policy"].state_dict().items() if "lora" in k}
    rec, batches = train.grpo_step(0, run, args, lambda items, c: ([0.0] * len(c), {}))
    assert rec["trained_group_fraction"] == 0 and all(len(b["comp"]) == 0 for b in batches)
    after = {k: v for k, v in run["policy"].state_dict().items() if "lora" in k}
    assert all(torch.equal(before[k], after[k]) for k in before)


# ---- the format bonus ------------------------------------------------------------------------------------------

def test_format_bonus_by_hand():
    texts = ["<answer>7</answer>", "<answer> </answer>", "7", "<answer>7", "x <answer>8</answer> y"]
    assert rewards.format_bonus(texts, 0.2) == [0.2, 0.0, 0.0, 0.0, 0.2]


def test_strict_format_bonus_pays_only_for_the_form_of_a_real_answer():
    """The trap of the plain bonus: an answer block followed by more text, or holding words where
    the gold answer is a number, still earns it. The strict bonus pays neither."""
    texts = ["<think>4+3</think>\n<answer>7</answer>", "<answer>-1,200.5</answer> \n",
             "<answer>seven</answer>", "<answer>7</answer> and then more text", "<answer> </answer>",
             "<answer>7", "<answer>blue</answer>"]
    golds = ["7", "7", "7", "7", "7", "7", "blue"]
    assert rewards.format_bonus(texts, 0.1, golds) == [0.1, 0.1, 0.0, 0.0, 0.0, 0.0, 0.1]
    assert rewards.format_bonus(texts, 0.1) == [0.1, 0.1, 0.1, 0.1, 0.0, 0.0, 0.1]   # the plain one


def test_strict_format_bonus_reaches_the_training_reward(tmp_path, monkeypatch):
    args, run = build_run(tmp_path, "--format-bonus", "0.5", "--format-bonus-strict")
    G = args.group_size
    comp = torch.randint(0, 50, (4 * G, 3))
    shapes = ["<answer>12</answer>", "<answer>twelve</answer>"] * (2 * G)
    monkeypatch.setattr(run["tok"], "batch_decode", lambda ids, **k: shapes[:len(ids)])
    items = [{**run["train_items"][i], "answer": "12"} for i in range(4)]
    monkeypatch.setattr(rollout, "sample", lambda *a, **k: comp)
    ids, mask = rollout.encode_prompts(run["tok"], ["x"] * 4, "cpu")
    drawn = train.draw_and_score(run, args, items, ids, mask, None, (0, 0, 0), lambda it, c: ([0.0] * len(c), {}))
    assert drawn["r"].tolist() == [0.5, 0.0] * (2 * G)


def test_strict_format_bonus_needs_a_bonus(capsys):
    with pytest.raises(SystemExit) as exc:
        train.parse_args(["--team", "tiny", "--format-bonus-strict"])
    assert exc.value.code == 2 and "--format-bonus-strict" in capsys.readouterr().err


def test_format_bonus_reaches_the_training_reward_but_not_the_log_or_the_evaluation(tmp_path, monkeypatch):
    args, run = build_run(tmp_path, "--format-bonus", "0.5")
    comp = torch.randint(0, 50, (4 * args.group_size, 3))
    monkeypatch.setattr(run["tok"], "batch_decode", lambda ids, **k: ["<answer>1</answer>"] * len(ids))
    items = [run["train_items"][i] for i in range(4)]
    monkeypatch.setattr(rollout, "sample", lambda *a, **k: comp)
    ids, mask = rollout.encode_prompts(run["tok"], ["x"] * 4, "cpu")
    drawn = train.draw_and_score(run, args, items, ids, mask, None, (0, 0, 0), lambda it, c: ([0.0] * len(c), {}))
    assert torch.equal(drawn["r"], drawn["task_r"] + 0.5) and torch.equal(drawn["task_r"], torch.zeros(len(comp)))

    def refuse(*a, **k):
        raise AssertionError("the format bonus reached the evaluation")
    monkeypatch.setattr(rewards, "format_bonus", refuse)
    items = [rewards.load_entries("chain_sum", "val", 2, 0)[i] for i in range(2)]
    per_item, _ = evaluate.score_items(run["policy"], run["tok"], run["method"], run["eos_ids"], items, args)
    assert per_item["with_C"]["score"] == [0.0, 0.0]   # "<answer>1</answer>" is scored by the task alone


# ---- learning-rate schedule and the before/after line -------------------------------------------------------------

def test_lr_schedule_by_hand():
    assert [train.lr_factor(s, 10, "constant", 2) for s in (0, 1, 2, 9)] == [0.5, 1.0, 1.0, 1.0]
    assert train.lr_factor(2, 10, "cosine", 2) == 1.0
    assert math.isclose(train.lr_factor(6, 10, "cosine", 2), 0.5)       # halfway through the 8 decay steps
    assert math.isclose(train.lr_factor(9, 10, "cosine", 2), 0.5 * (1 + math.cos(math.pi * 7 / 8)))


def test_eval_items_prints_before_and_after_on_the_same_items(tmp_path, capsys):
    out = str(tmp_path / "run")
    train.main(TINY + ["--steps", "2", "--batch-size", "2", "--grad-accum", "1", "--group-size", "2",
                       "--lr-schedule", "cosine", "--warmup-steps", "1", "--eval-items", "3", "--out", out],
               score_batch=lambda items, c: ([0.0] * len(c), {}))
    line = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("validation")]
    assert len(line) == 1 and "before training 0.0 % -> after 0.0 %" in line[0], line
    with open(os.path.join(out, "validation.json")) as f:
        v = json.load(f)
    assert v["items"] == 3 and len(v["before"]) == len(v["after"]) == 3
    with open(os.path.join(out, "metrics.jsonl")) as f:
        lrs = [json.loads(ln)["lr"] for ln in f]
    assert lrs == [1e-4, 1e-4]   # warm-up step 0 at (0 + 1) / 1, then cosine at its start
