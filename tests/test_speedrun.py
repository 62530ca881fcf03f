"""The speedrun's levers, each against a hand-computed case: truncated importance weights and the loss they
weight, the bfloat16 rollout copy (close to the float32 scoring pass, and gone on exit), dynamic sampling
(never trains on a group whose rewards are all equal), the format bonus (training only: evaluation never sees
it), the learning-rate schedule, and --eval-items' before/after line. Then the race itself (experiments/speedrun.py):
the time to each target from a trace, medians with runs that never reached, the paired comparison, the strict
bonus paid alike by our reward path and TRL's, the rollout precision as a flag, resumption, and bad flags."""
import json
import math
import os
import sys

import numpy as np
import pytest
import torch

import grpo
import rewards
import rollout
import train
from lib import low_precision
from lib.optim import lr_factor
from support.harness.validation import score_items

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
    with low_precision.low_precision_linears(model):
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


def test_dynamic_sampling_trains_the_surrogate_on_groups_with_signal_and_the_kl_on_every_group(tmp_path):
    """Every group is trained; b.signal marks the groups whose rewards vary after the re-draws, and only they
    carry advantages, scaled by grpo.signal_scale so that the surrogate averages over them alone (here the
    "sequence" aggregation: n_all / n_signal, the step's completions over those in groups with signal)."""
    args, run = build_run(tmp_path, "--dynamic-sampling", "2")
    calls = []

    def score(items, completions):
        calls.append(len(completions))
        return every_other_prompt_is_flat(items, completions)
    rec, batches = train.grpo_step(0, run, args, score)
    G = args.group_size
    n_all = sum(len(b.comp) for b in batches)
    n_signal = sum(int(b.signal.sum()) * G for b in batches)
    assert n_all == args.grad_accum * args.batch_size * G and 0 < n_signal < n_all   # flat groups are trained too
    for b in batches:
        assert torch.equal(b.signal, ~grpo.flat_groups(b.r, G))
        assert len(b.comp) == len(b.adv) == len(b.logp_ref) == b.ids.shape[0] * G
        raw = grpo.group_advantages(b.r, G)
        assert torch.equal(b.adv.view(-1, G)[~b.signal], torch.zeros(int((~b.signal).sum()), G))
        assert torch.allclose(b.adv, raw * (n_all / n_signal))
    assert len(calls) > args.grad_accum                             # flat groups were drawn again
    assert rec["trained_group_fraction"] == n_signal / n_all < 1


def exact_kl_to_reference(run, args, items):
    """KL(pi_theta || pi_ref) of the next-token distributions, summed over the whole vocabulary, averaged over
    every position of the items' prompts: an exact measure, independent of grpo.py's sampled k3 estimate."""
    _, ids, mask = train.context_and_prompts(run, args, items)
    pos = (mask.long().cumsum(-1) - 1).clamp(min=0)
    policy = run.policy
    with torch.no_grad():
        logp = policy(input_ids=ids, attention_mask=mask, position_ids=pos).logits.float().log_softmax(-1)
        with train.lora_disabled(policy):
            logp_ref = policy(input_ids=ids, attention_mask=mask, position_ids=pos).logits.float().log_softmax(-1)
    kl = (logp.exp() * (logp - logp_ref)).sum(-1)                  # (B, P)
    return kl[mask.bool()].mean().item()


@pytest.mark.parametrize("seed", [0, 1])
def test_dynamic_sampling_pulls_a_moved_policy_back_to_the_reference_when_every_group_is_flat(tmp_path, seed):
    """Regression (the collapse trap): --dynamic-sampling used to leave out flat groups together with their KL
    term, so a policy that had stopped writing answers (every reward 0, every group flat) had no loss at all:
    no update, nothing pulled it back to pi_ref, and the step logged no kl. Plain GRPO keeps the KL there. Here
    LoRA B is moved off 0 (pi_theta != pi_ref), every reward is 0, weight decay is off (it alone would shrink B):
    the step must have a gradient, log a finite kl > 0, and lower the exact KL to the reference."""
    args, run = build_run(tmp_path, "--dynamic-sampling", "1", "--method", "single", "--weight-decay", "0",
                          "--lr", "1e-3", "--seed", str(seed))
    g = torch.Generator().manual_seed(seed)
    for name, p in run.policy.named_parameters():
        if name.endswith("lora_B"):
            p.data = 0.05 * torch.randn(p.shape, generator=g)
    items = [it for micro in range(args.grad_accum) for it in train.micro_batch_inputs(run, args, 0, micro)[0]]
    kl_before = exact_kl_to_reference(run, args, items)
    rec, batches = train.grpo_step(0, run, args, lambda items, c: ([0.0] * len(c), {}))
    kl_after = exact_kl_to_reference(run, args, items)
    assert rec["zero_std_fraction"] == 1 and rec["trained_group_fraction"] == 0   # every group flat
    # a step toward pi_ref (before the fix the weights did not move: the KL stayed equal to the last bit; the 1 %
    # margin this asserted once held for the samples drawn then, 0.6 % for those of one decode loop per step)
    assert kl_after < kl_before, (kl_before, kl_after)
    assert math.isfinite(rec["kl"]) and rec["kl"] > 0.01, rec["kl"]  # kl is logged on an all-flat step
    assert rec["grad_norm"] > 0 and not rec["skipped_update"]
    assert rec["pg_loss"] == 0                                      # no advantage anywhere: the surrogate is 0


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
    monkeypatch.setattr(run.tok, "batch_decode", lambda ids, **k: shapes[:len(ids)])
    items = [{**run.train_items[i], "answer": "12"} for i in range(4)]
    monkeypatch.setattr(rollout, "sample", lambda *a, **k: comp)
    ids, mask = rollout.encode_prompts(run.tok, ["x"] * 4, "cpu")
    drawn = train.draw_and_score(run, args, items, ids, mask, None, (0, 0, 0), lambda it, c: ([0.0] * len(c), {}))
    assert drawn["r"].tolist() == [0.5, 0.0] * (2 * G)


def test_strict_format_bonus_needs_a_bonus(capsys):
    with pytest.raises(SystemExit) as exc:
        train.parse_args(["--team", "tiny", "--format-bonus-strict"])
    assert exc.value.code == 2 and "--format-bonus-strict" in capsys.readouterr().err


def test_format_bonus_reaches_the_training_reward_but_not_the_log_or_the_evaluation(tmp_path, monkeypatch):
    args, run = build_run(tmp_path, "--format-bonus", "0.5")
    comp = torch.randint(0, 50, (4 * args.group_size, 3))
    monkeypatch.setattr(run.tok, "batch_decode", lambda ids, **k: ["<answer>1</answer>"] * len(ids))
    items = [run.train_items[i] for i in range(4)]
    monkeypatch.setattr(rollout, "sample", lambda *a, **k: comp)
    ids, mask = rollout.encode_prompts(run.tok, ["x"] * 4, "cpu")
    drawn = train.draw_and_score(run, args, items, ids, mask, None, (0, 0, 0), lambda it, c: ([0.0] * len(c), {}))
    assert torch.equal(drawn["r"], drawn["task_r"] + 0.5) and torch.equal(drawn["task_r"], torch.zeros(len(comp)))

    def refuse(*a, **k):
        raise AssertionError("the format bonus reached the evaluation")
    monkeypatch.setattr(rewards, "format_bonus", refuse)
    items = [rewards.load_entries("chain_sum", "val", 2, 0)[i] for i in range(2)]
    per_item, _ = score_items(run.policy, run.tok, run.method, run.eos_ids, items, args)
    assert per_item["with_C"]["score"] == [0.0, 0.0]   # "<answer>1</answer>" is scored by the task alone


# ---- learning-rate schedule and the before/after line -------------------------------------------------------------

def test_lr_schedule_by_hand():
    assert [lr_factor(s, 10, "constant", 2) for s in (0, 1, 2, 9)] == [0.5, 1.0, 1.0, 1.0]
    assert lr_factor(2, 10, "cosine", 2) == 1.0
    assert math.isclose(lr_factor(6, 10, "cosine", 2), 0.5)       # halfway through the 8 decay steps
    assert math.isclose(lr_factor(9, 10, "cosine", 2), 0.5 * (1 + math.cos(math.pi * 7 / 8)))


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


# ---- the race itself (experiments/speedrun.py, experiments/speedrun_report.py) -----------------------------------

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "experiments"))
import speedrun  # noqa: E402
import speedrun_report  # noqa: E402


def trace(*points):
    return [{"step": s, "seconds": t, "score": x} for s, t, x in points]


def test_time_to_each_target_is_the_clock_at_the_first_score_at_or_above_it_and_null_when_never():
    evals = trace((1, 10.0, 0.1), (2, 21.0, 0.31), (3, 30.0, 0.2), (4, 42.0, 0.45), (6, 60.0, 0.5))
    assert speedrun_report.times_to_targets(evals, [0.3, 0.45, 0.6]) == {
        "0.3": {"seconds": 21.0, "step": 2},      # the first, though the score fell again at step 3
        "0.45": {"seconds": 42.0, "step": 4},     # "at or above": 0.45 reaches 0.45
        "0.6": None}
    assert speedrun_report.times_to_targets([], [0.3]) == {"0.3": None}


def test_median_counts_not_reached_as_slower_than_any_time_and_is_null_when_half_did_not_reach():
    median = speedrun_report.median_or_null
    assert median([30.0, None, 10.0, 20.0, None]) == 30.0     # 3 of 5 reached: the middle one is the slowest
    assert median([10.0, None, None, None, 20.0]) is None     # most did not reach
    assert median([10.0, 20.0, 30.0, None]) == 25.0
    assert median([10.0, 20.0, None, None]) is None           # half: one of the middle two did not reach
    assert median([]) is None


def race(times):
    """{seed: a run whose only target 0.3 was reached at `t` seconds (None: never)}."""
    return {str(s): {"targets": {"0.3": t and {"seconds": t, "step": 1}}, "seconds_per_step": 5.0, "evals": []}
            for s, t in enumerate(times)}


def test_per_contender_summary_and_the_paired_comparison_by_hand():
    ours, trl = race([10.0, 40.0, None, 20.0, None, 30.0]), race([20.0, 20.0, 50.0, 60.0, None, None])
    out = speedrun_report.analyse({"ours": ours, "trl": trl}, [0.3])
    o = out["contenders"]["ours"]["targets"]["0.3"]
    assert (o["median_seconds"], o["reached"], o["seeds"]) == ((30.0 + 40.0) / 2, 4, 6)
    assert o["seconds"] == {"0": 10.0, "1": 40.0, "2": None, "3": 20.0, "4": None, "5": 30.0}
    p = out["paired"]["ours vs trl"]["0.3"]
    assert p["ratio_of_medians"] == 35.0 / 55.0 and p["both_reached"] == 3
    assert p["ratios"] == {"0": 0.5, "1": 2.0, "3": 20.0 / 60.0}
    # differences -10, 20, -40 (mean -10): of the 8 sign flips, |sum| >= 30 for 70, 30, 50, 50, 30, 70
    assert p["mean_difference_seconds"] == -10.0 and p["p_sign_flip"] == 6 / 8
    # first to reach: ours on seeds 0, 3 and 5 (TRL never did), TRL on 1 and 2 (ours never did); seed 4 (neither)
    # is dropped: p = 2 P[Binomial(5, 1/2) <= 2] = 1
    assert (p["faster"], p["slower"], p["p_sign"]) == (3, 2, 1.0)
    assert "ours vs single" not in out["paired"]


def test_a_null_median_is_said_in_words_in_the_table():
    runs = {"ours": race([10.0, None, None]), "single": race([5.0, 6.0, None])}
    report = {"setup": {"measure": {"targets": [0.3], "items": 100, "max_steps": 60, "max_seconds": 1200,
                                    "rollout_dtype": "float32", "team": "tiny"}, "machine": {}, "versions": {}},
              **speedrun_report.analyse(runs, [0.3]), "runs": {k: {s: {**r, "commit": "abc"} for s, r in v.items()}
                                                               for k, v in runs.items()}}
    text = speedrun_report.markdown(report)
    assert "ours: the median is null because 2 of 3 seeds did not reach 30 %." in text
    assert "| single | 5 s (1) | 6 s (1) | not reached | 6 (2/3) |" in text


def test_every_contender_is_paid_the_strict_bonus_and_trls_reward_equals_ours(tmp_path, monkeypatch):
    """The same completions get the same reward from train.draw_and_score (single and ours) and from the TRL
    contender's reward function, each built from its own speedrun flags: an answer block with more text after it,
    or words where the gold is a number, earn no bonus in either."""
    a = speedrun.parse(["--team", "tiny"])
    args = {kind: train.parse_args(speedrun.run_config(kind, 0, a)["argv"] + ["--out", str(tmp_path / kind)])
            for kind in speedrun.CONTENDERS}
    assert all(x.format_bonus == 0.1 and x.format_bonus_strict for x in args.values())
    run = train.build_run(args["single"], torch.device("cpu"))
    items, G = [run.train_items[i] for i in range(4)], args["single"].group_size
    texts = [t for it in items for t in (f"<think>1</think>\n<answer>{it['answer']}</answer>",
                                         f"<answer>{it['answer']}</answer> and more", "<answer>1000</answer>",
                                         "<answer>eighty</answer>")]
    monkeypatch.setattr(run.tok, "batch_decode", lambda ids, **k: texts[:len(ids)])
    monkeypatch.setattr(rollout, "sample", lambda *a, **k: torch.randint(5, 50, (len(items) * G, 3)))
    ids, mask = rollout.encode_prompts(run.tok, ["x"] * len(items), "cpu")
    ours = train.draw_and_score(run, args["single"], items, ids, mask, None, (0, 0, 0), rewards.score_batch)["r"]
    trl = speedrun.trl_reward(items, args["trl"])([""] * len(texts), texts, [i for i in range(4) for _ in range(G)])
    assert torch.equal(ours, torch.tensor(trl, dtype=torch.float32))
    assert torch.allclose(ours, torch.tensor([1.1, 1.0, 0.1, 0.0] * 4))


def test_the_rollout_precision_is_a_flag_and_trl_records_what_it_ran():
    a = speedrun.parse(["--team", "tiny", "--rollout-dtype", "int8"])
    ours, trl = speedrun.run_config("ours", 3, a), speedrun.run_config("trl", 3, a)
    assert ours["rollout_dtype"] == "int8" and "--tis-cap" in ours["argv"] and "--dynamic-sampling" in ours["argv"]
    assert trl["rollout_dtype"] == "float32"
    assert not {"--rollout-dtype", "--tis-cap", "--dynamic-sampling"} & set(trl["argv"])
    assert "--rollout-dtype" not in speedrun.run_config("ours", 3, speedrun.parse(["--team", "tiny"]))["argv"]


def test_a_recorded_run_is_skipped_and_a_changed_one_runs_again(tmp_path, monkeypatch):
    """A tiny race, trained in this process: the report keeps each run's config, trace and commit; run again, it
    trains nothing; a run recorded with another config is trained again. Seeds alternate the contenders' order."""
    launched = []

    def in_process(folder, config, core):
        launched.append((config["kind"], config["seed"]))
        if config["kind"] == "single" and config["seed"] == 0:   # one real run of the tiny team
            speedrun.train_worker(folder, config)
        else:
            with open(os.path.join(folder, "evals.jsonl"), "w") as f:
                f.write("".join(json.dumps(e) + "\n" for e in trace((1, 3.0, 0.2), (2, 6.0, 0.35))))
        return True
    monkeypatch.setattr(speedrun, "launch", in_process)
    out = str(tmp_path / "speedrun.json")
    argv = ["--team", "tiny", "--contenders", "single", "ours", "--seeds", "0", "1", "--items", "4",
            "--max-steps", "2", "--out", out, "--runs", str(tmp_path / "runs")]
    speedrun.main(argv)
    assert launched == [("single", 0), ("ours", 0), ("ours", 1), ("single", 1)]
    with open(out) as f:
        report = json.load(f)
    real = report["runs"]["single"]["0"]
    assert [e["step"] for e in real["evals"]] == [1, 2] and real["targets"] == {"0.3": None, "0.45": None}
    assert real["config"]["argv"][-4:] == ["--seed", "0", "--steps", "2"] and real["commit"]
    assert report["runs"]["ours"]["1"]["targets"]["0.3"] == {"seconds": 6.0, "step": 2}
    assert report["contenders"]["ours"]["targets"]["0.3"]["median_seconds"] == 6.0
    assert os.path.exists(out.replace(".json", ".md")) and os.path.exists(out.replace(".json", ".png"))
    launched.clear()
    speedrun.main(argv)
    assert launched == []
    report["runs"]["ours"]["1"]["config"]["argv"][-1] = "99"   # recorded with another config
    with open(out, "w") as f:
        json.dump(report, f)
    speedrun.main(argv)
    assert launched == [("ours", 1)]


@pytest.mark.parametrize("argv, flag", [
    (["--targets", "0.45", "0.3"], "--targets"), (["--targets", "1.5"], "--targets"), (["--targets", "0"], "--targets"),
    (["--seeds", "1", "1"], "--seeds"), (["--seeds", "-1"], "--seeds"),
    (["--rollout-dtype", "fp16"], "--rollout-dtype"), (["--levers", "dynamic sampling"], "--levers"),
    (["--ablations", "--levers", "low-precision rollout + TIS"], "--levers"),
    (["--max-steps", "0"], "--max-steps"), (["--trl-seeds", "1", "--contenders", "ours"], "--trl-seeds")])
def test_a_bad_flag_exits_2_with_one_line_naming_it(argv, flag, capsys):
    with pytest.raises(SystemExit) as exc:
        speedrun.parse(["--team", "tiny"] + argv)
    err = capsys.readouterr().err.strip()
    assert exc.value.code == 2 and len(err.splitlines()) == 1 and flag in err, err


def test_a_report_of_another_measure_is_refused(tmp_path, capsys):
    out = tmp_path / "speedrun.json"
    out.write_text(json.dumps({"setup": {"target": 0.3}, "runs": {}}))   # the first speedrun's report: one target
    with pytest.raises(SystemExit) as exc:
        speedrun.main(["--team", "tiny", "--dry-run", "--out", str(out)])
    err = capsys.readouterr().err.strip()
    assert exc.value.code == 2 and len(err.splitlines()) == 1 and "--out" in err


def test_worst_case_cost_by_hand():
    # 30 s a step, a 100 s budget: the clock passes it after step 4; evaluated after 1, 2, 3, 4; loaded once
    assert speedrun.worst_case_seconds(30, 60, 100) == 4 * 30 + 4 * speedrun.EVAL_SECONDS + speedrun.LOAD_SECONDS
    assert speedrun.worst_case_seconds(30, 6, 1e9) == 6 * 30 + 5 * speedrun.EVAL_SECONDS + speedrun.LOAD_SECONDS


def test_samples_jsonl_reward_means_what_metrics_jsonl_reward_means(tmp_path, monkeypatch):
    """`reward` is the task's reward in both logs; the reward GRPO trained on (with --format-bonus) is
    samples.jsonl's `reward_with_bonus`, a second name, never the same name with another meaning."""
    monkeypatch.setattr(rewards, "format_bonus", lambda texts, bonus, golds=None: [bonus] * len(texts))
    out = tmp_path / "run"
    train.main(["--preset", "smoke", "--eval-items", "0", "--steps", "1", "--format-bonus", "0.5", "--out", str(out)])
    metrics = [json.loads(line) for line in open(out / "metrics.jsonl")]
    samples = [json.loads(line) for line in open(out / "samples.jsonl")]
    assert metrics[0]["reward"] == 0.0 and samples                      # the tiny team never solves chain_sum
    assert all(s["reward"] == 0.0 and s["reward_with_bonus"] == 0.5 for s in samples)
