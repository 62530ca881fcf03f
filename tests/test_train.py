"""train.py end to end on the tiny team: it learns (through LoRA, and through C alone), it resumes exactly,
and its CLI smoke run works as a subprocess."""
import json
import os
import subprocess
import sys

import pytest
import torch

from rewards import batch_indices
from train import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--team", "tiny", "--task", "chain_sum", "--device", "cpu", "--dataset-size", "64",
        "--system-prompt", "simple"]


def letter_reward(items, completions):
    """Synthetic verifiable reward: 1 if the completion starts with a lowercase ASCII letter. A random-init
    byte-level policy does so ~10 % of the time, so GRPO has signal from step 1."""
    r = [1.0 if c[:1].isascii() and c[:1].islower() else 0.0 for c in completions]
    return r, {"ok": len(r)}


def metrics(out):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def learn(tmp_path, extra, steps=16):
    out = str(tmp_path / "run")
    main(TINY + ["--steps", str(steps), "--batch-size", "4", "--grad-accum", "1", "--group-size", "8",
                 "--max-new-tokens", "2", "--beta", "0", "--out", out, "--save-every", "100"] + extra,
         score_batch=letter_reward)
    rewards = [m["reward"] for m in metrics(out)]
    return rewards, out


def test_it_learns_with_lora_and_adapter(tmp_path):
    rewards, _ = learn(tmp_path, ["--lr", "3e-2", "--router-lr", "3e-2"])
    first, last = sum(rewards[:4]) / 4, sum(rewards[-4:]) / 4
    assert last > first + 0.3, rewards


def test_it_learns_through_the_context_tokens_alone(tmp_path):
    """LoRA frozen: only g_phi trains, so any rise in reward must come through C. Gradient reaches every W_i.
    48 steps: with 24, the rise was 0.11 -> 0.23 on an AVX2 machine (other float sums than where the test was
    written), learning but short of the +0.3 asked; the bar is kept, the budget doubled."""
    from baselines import METHODS
    from experts import TEAMS
    from train import parse_args
    rewards, out = learn(tmp_path, ["--freeze-policy", "--router-lr", "3e-2", "--latent-dim", "32",
                                    "--num-heads", "4", "--num-latents", "4"], steps=48)
    first, last = sum(rewards[:4]) / 4, sum(rewards[-4:]) / 4
    assert last > first + 0.3, rewards
    args = parse_args(TINY + ["--latent-dim", "32", "--num-heads", "4", "--num-latents", "4"])
    torch.manual_seed(0)
    init = METHODS["ours"](TEAMS["tiny"], 64, args, "cpu", torch.float32).state_dict()
    trained = torch.load(os.path.join(out, "checkpoint.pt"), weights_only=False)
    for i in range(3):
        key = f"adapter.proj.{i}.weight"
        assert not torch.allclose(init[key], trained["method"][key]), key
    base = torch.load(os.path.join(out, "checkpoint.pt"), weights_only=False)["lora"]
    assert all(v.abs().sum() == 0 for k, v in base.items() if k.endswith("lora_B"))  # LoRA untouched


def test_resume_is_exact(tmp_path):
    common = TINY + ["--batch-size", "2", "--grad-accum", "2", "--group-size", "4", "--max-new-tokens", "6",
                     "--latent-dim", "32", "--num-heads", "4", "--num-latents", "4", "--save-every", "2"]
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    main(common + ["--steps", "4", "--out", a], score_batch=letter_reward)
    main(common + ["--steps", "2", "--out", b], score_batch=letter_reward)
    main(common + ["--steps", "4", "--out", b, "--resume"], score_batch=letter_reward)
    ma, mb = metrics(a), metrics(b)
    assert [m["step"] for m in mb] == [1, 2, 3, 4]
    for x, y in zip(ma, mb):
        for k in ("reward", "loss", "kl", "entropy", "completion_length", "grad_norm"):
            assert x[k] == pytest.approx(y[k], rel=1e-5, abs=1e-7), (k, x["step"])


def test_resume_says_where_it_starts(tmp_path, capfd):
    """--resume names the step it resumes at and the checkpoint it reads (before: nothing); in a run folder
    without a checkpoint (stopped before its first) it says that it starts at step 1, and does (before: silently)."""
    common = TINY + ["--batch-size", "1", "--grad-accum", "1", "--group-size", "2", "--max-new-tokens", "2",
                     "--latent-dim", "32", "--num-heads", "4", "--num-latents", "4", "--save-every", "2"]
    out, fresh = str(tmp_path / "run"), str(tmp_path / "fresh")
    main(common + ["--steps", "2", "--out", out], score_batch=letter_reward)
    capfd.readouterr()
    main(common + ["--steps", "3", "--out", out, "--resume"], score_batch=letter_reward)
    assert f"resuming at step 3 of 3 from {os.path.join(out, 'checkpoint.pt')}\n" in capfd.readouterr().err
    os.makedirs(fresh)  # what a run stopped before its first checkpoint leaves: its config.json
    with open(os.path.join(out, "config.json")) as f, open(os.path.join(fresh, "config.json"), "w") as g:
        g.write(f.read())
    main(common + ["--steps", "1", "--out", fresh, "--resume"], score_batch=letter_reward)
    assert f"--resume: no checkpoint in {fresh}: starting at step 1 of 1\n" in capfd.readouterr().err
    assert [m["step"] for m in metrics(out)] == [1, 2, 3] and [m["step"] for m in metrics(fresh)] == [1]


def test_data_order_is_a_permutation_per_epoch():
    first = [i for s in range(4) for i in batch_indices(s, 0, 4, 1, 16, seed=3)]
    second = [i for s in range(4, 8) for i in batch_indices(s, 0, 4, 1, 16, seed=3)]
    assert first == list(range(16))  # in order: lazily generated items are made once, in sequence
    assert sorted(second) == list(range(16)) and second != first  # then a seeded permutation per epoch
    assert second == [i for s in range(4, 8) for i in batch_indices(s, 0, 4, 1, 16, seed=3)]


def test_cli_smoke_run(tmp_path):
    """What the README promises: the tiny team trains 3 steps from the command line."""
    out = str(tmp_path / "smoke")
    cmd = [sys.executable, "train.py", *TINY, "--steps", "3", "--batch-size", "2", "--grad-accum", "1",
           "--group-size", "2", "--max-new-tokens", "8", "--latent-dim", "32", "--num-heads", "4", "--out", out]
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    ms = metrics(out)
    assert [m["step"] for m in ms] == [1, 2, 3]
    for k in ("reward", "loss", "kl", "seconds", "entropy", "utilization", "completion_length",
              "truncated_fraction", "zero_std_fraction", "scorer_failures"):
        assert k in ms[0], k
    assert len(ms[0]["utilization"]) == 3 and abs(sum(ms[0]["utilization"]) - 1) < 1e-5
    assert ms[0]["kl"] < 1e-6  # step 0: policy == reference
    assert os.path.exists(os.path.join(out, "checkpoint.pt"))
    assert os.path.exists(os.path.join(out, "lora_peft", "adapter_config.json"))
    assert "step 3/3" in res.stdout + res.stderr


def test_token_aggregation_normalises_per_micro_batch_as_documented(tmp_path, monkeypatch):
    """--loss-aggregation token is DAPO's token mean over one micro-batch, not over the step: train.py
    backpropagates each micro-batch's grpo_loss / --grad-accum, so the step's loss is
        L = 1/M sum_m 1/U_m sum_{i, t in m} l_it,    l_it = -(S_it - beta KL_it), U_m: micro-batch m's tokens
    and a token of a micro-batch with fewer tokens weighs more than under one mean over the step's tokens.
    Before, grpo.py's docstring and the flag's help did not say so (a fork summing the step's tokens instead
    would also have to rescale grpo.signal_scale under --dynamic-sampling)."""
    import grpo
    import train
    from support.harness.config import build_parser
    help_of = {a.dest: a.help for a in build_parser()._actions}
    assert "per micro-batch" in grpo.__doc__ and "per micro-batch" in help_of["loss_aggregation"]
    args = train.parse_args(TINY + ["--batch-size", "2", "--grad-accum", "2", "--group-size", "4", "--beta", "0.5",
                                    "--max-new-tokens", "6", "--loss-aggregation", "token", "--latent-dim", "32",
                                    "--num-heads", "4", "--num-latents", "4", "--out", str(tmp_path / "run")])
    run = train.build_run(args, torch.device("cpu"))
    V = run.policy.get_output_embeddings().weight.shape[0]
    run.eos_ids = sorted(set(run.eos_ids) | set(range(0, V, 4)))  # a quarter of the tokens end a completion: uneven
    inputs, backwards = [], []
    loss_of, backward = grpo.grpo_loss, torch.Tensor.backward
    monkeypatch.setattr(grpo, "grpo_loss", lambda **kw: inputs.append(kw) or loss_of(**kw))
    monkeypatch.setattr(torch.Tensor, "backward", lambda self, *a, **k: backwards.append(self.item()) or
                        backward(self, *a, **k))
    train.grpo_step(0, run, args, lambda items, texts: ([len(t) % 2 for t in texts], {}))  # rewards that vary
    per_token, units = [], []
    for kw in inputs:  # mu = 1: ratio 1, no clip, so S_it = A_i; KL_it = k3 of logp_ref - logp
        d = kw["logp_ref"] - kw["logp"].detach()
        l_it = -(kw["advantages"][:, None] - args.beta * (d.exp() - d - 1))          # (N, T)
        per_token.append(l_it[kw["mask"]].sum().item()), units.append(int(kw["mask"].sum()))
    assert len(inputs) == len(backwards) == 2 and units[0] != units[1], units  # two micro-batches, uneven
    per_micro_batch = sum(s / u for s, u in zip(per_token, units)) / 2
    per_step = sum(per_token) / sum(units)
    assert sum(backwards) == pytest.approx(per_micro_batch, rel=1e-5, abs=1e-6)
    assert abs(per_micro_batch - per_step) > 1e-4  # the two normalisations differ here


@pytest.mark.parametrize("position", ["after", "before"])
def test_the_reference_pass_is_lora_off_with_zero_tokens_where_c_was(position):
    """Eq. 4's pi_ref (train.reference_logprobs): the initial policy, LoRA off, fed zero tokens at C's positions.
    Checked in a trained state, LoRA's B and C both non-zero, where feeding C or leaving LoRA on reads other
    log-probs (at init both are zero and any of the three would pass)."""
    from types import SimpleNamespace
    from conftest import with_lora64
    from rollout import completion_logprobs, encode_prompts
    from lib.tiny_models import load as tiny_model
    from train import reference_logprobs
    policy, tok = tiny_model("llama")
    policy = with_lora64(policy)                                     # LoRA with a random B
    base = tiny_model("llama")[0].double().eval()                    # the same weights (seeded by name), no LoRA
    ids, mask = encode_prompts(tok, ["What is 2 + 3?", "Sort 3 1 2, then add 10 and 32."], "cpu")
    G, T, D = 3, 5, policy.config.hidden_size
    torch.manual_seed(1)
    C = torch.randn(2, 4, D, dtype=torch.float64)                    # (B, m, D) a trained C
    comp = torch.randint(3, 200, (2 * G, T))
    comp_mask = torch.ones_like(comp, dtype=torch.bool)
    run = SimpleNamespace(method=torch.nn.Module(), policy=policy, position=position)  # a g without an anchor
    args = SimpleNamespace(temperature=1.0, no_shared_prefix=False)
    got = reference_logprobs(run, args, ids, mask, C=C, comp=comp, comp_mask=comp_mask)
    with torch.no_grad():
        zeros = torch.zeros_like(C)
        want = completion_logprobs(base, ids, mask, zeros, comp, comp_mask, 1.0, position)
        fed_C = completion_logprobs(base, ids, mask, C, comp, comp_mask, 1.0, position)
        lora_on = completion_logprobs(policy, ids, mask, zeros, comp, comp_mask, 1.0, position)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert (fed_C - want).abs().max() > 1e-2 and (lora_on - want).abs().max() > 1e-2  # the check has teeth
