"""baselines.py (paper §4.1, Eq. 12-14) and evaluate.py's statistics, on the tiny team."""
import json
import os
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from baselines import METHODS, straight_through_gumbel
from support.harness.plot import plot_runs
from support.harness.report import summarize
from lib.stats import mean_std, permutation_p, ranks, spearman
from experts import TEAMS

ARGS = SimpleNamespace(pooling="last", seed=0, latent_dim=32, num_latents=4, num_heads=4, max_new_tokens=12)
QS = ["What is 2 + 3?", "Sort 3 1 2.", "Is it raining?", "Add 10 and 32."]


def build(name):
    torch.manual_seed(0)
    return METHODS[name](TEAMS["tiny"], 64, ARGS, "cpu", torch.float32)


def test_straight_through_gumbel_is_one_hot_forward_with_router_gradient():
    logits = torch.randn(5, 3, requires_grad=True)
    noise = -torch.empty(5, 3).exponential_().log()
    R = straight_through_gumbel(logits, noise)
    assert torch.equal(R.detach().sum(-1), torch.ones(5)) and set(R.detach().unique().tolist()) <= {0.0, 1.0}
    assert torch.equal(R.detach().argmax(-1), (logits + noise).argmax(-1))
    (R * torch.randn(5, 3)).sum().backward()
    assert logits.grad is not None and logits.grad.abs().sum() > 0


@pytest.mark.parametrize("tau", [1.0, 0.5])
def test_straight_through_gradient_is_the_softmax_gradient(tau):
    """Straight-through Gumbel-softmax: the forward is the one-hot, the backward the gradient of
    softmax((logits + noise) / tau) itself, whatever the loss."""
    torch.manual_seed(0)
    logits = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
    noise = -torch.empty(5, 3, dtype=torch.float64).exponential_().log()
    w = torch.randn(5, 3, dtype=torch.float64)
    loss = lambda R: (R * w).sum() + R[:, 0].pow(2).sum()  # noqa: E731  (not linear in R)
    hard = torch.nn.functional.one_hot((logits + noise).argmax(-1), 3).to(torch.float64)
    R = straight_through_gumbel(logits, noise, tau=tau)
    (st,) = torch.autograd.grad(loss(R), logits)
    soft = torch.softmax((logits + noise) / tau, dim=-1)
    (upstream,) = torch.autograd.grad(loss(hard.requires_grad_()), hard)  # dL/dR at the one-hot
    (want,) = torch.autograd.grad(soft, logits, grad_outputs=upstream)     # back through the softmax's Jacobian
    torch.testing.assert_close(R.detach(), hard.detach())
    torch.testing.assert_close(st, want)
    assert want.abs().max() > 1e-3


def test_hard_routing_runs_only_the_chosen_expert():
    m = build("hard_routing").train()
    ctx = m(QS)
    chosen = (m.head(m.encoder.encode(QS)[0]) + ctx.noise).argmax(-1)
    ran = [i for i, c in enumerate(m.pool.calls) if c > 0]
    assert sorted(set(chosen.tolist())) == ran  # experts nobody chose never ran a forward
    assert ctx.C.shape == (4, 1, 64) and ctx.A.shape == (4, 1, 3)
    again = m(QS, reuse=ctx)  # the loss pass reuses the rollout's Gumbel draw: same experts, same C
    torch.testing.assert_close(again.C, ctx.C)
    torch.nn.init.normal_(m.out.weight, std=0.1)  # at init W_out ~ 0 passes almost no gradient back
    m(QS, reuse=ctx).C.pow(2).sum().backward()
    assert m.head.weight.grad.abs().sum() > 0  # straight-through: the router head learns


def test_hard_routing_eval_is_argmax():
    m = build("hard_routing").eval()
    ctx = m(QS)
    assert ctx.noise is None
    chosen = m.head(m.encoder.encode(QS)[0]).argmax(-1)
    assert [i for i, c in enumerate(m.pool.calls) if c > 0] == sorted(set(chosen.tolist()))


def test_no_xattn_is_ffn_of_stacked_states():
    m = build("no_xattn")
    ctx = m(QS)
    V = torch.stack([W(h) for W, h in zip(m.proj, m.pool.encode(QS))], 1)
    torch.testing.assert_close(ctx.C, m.out(m.ffn(V)))
    assert ctx.C.shape == (4, 3, 64) and ctx.A is None


def test_output_collab_hint_block_within_budget(monkeypatch):
    """Eq. 12: one hint per decoder expert (the BERT encoder cannot write), greedy, at most the generation
    budget of new tokens each, in an [Expert Hints] block; the policy side adds no trainable parameters.
    Each decoder expert writes the hints of a whole batch in one decode loop, and a question asked again
    comes from the cache."""
    import rollout
    m = build("output_collab")
    calls = []
    decode = rollout.decode

    def spy(*a, **kw):
        out = decode(*a, **kw)
        calls.append(tuple(out.shape))  # (rows, new tokens)
        return out
    monkeypatch.setattr(rollout, "decode", spy)
    hints = m(QS[:2]).hints
    assert [rows for rows, _ in calls] == [2, 2] and max(new for _, new in calls) <= ARGS.max_new_tokens
    for h in hints:
        assert h.startswith("\n\n[Expert Hints]\nExpert 1: ") and "\nExpert 2: " in h and "Expert 3" not in h
    assert m(QS[1::-1]).hints == hints[::-1] and len(calls) == 2  # cached: no new generate call
    assert m(QS[:1]).C is None and not list(m.parameters())


def test_output_collab_batched_hints_equal_one_question_at_a_time(monkeypatch):
    """Padding and the attention mask make a batched greedy hint the same text as the hint written for the
    question alone (questions of different lengths, so the padding is real); and no attention call of the
    experts' writing sees a query row whose keys are all masked (the rows CUDA's memory-efficient kernel may
    fill with NaN; HF generate's left padding made them, before)."""
    from test_gpu_path import count_attention_rows
    count = count_attention_rows(monkeypatch)
    batched = build("output_collab")(QS).hints
    assert count["calls"] > 0 and count["empty"] == 0
    alone = build("output_collab")
    assert batched == [alone([q]).hints[0] for q in QS]


def test_single_has_no_context_and_no_parameters():
    m = build("single")
    assert m(QS).C is None and not list(m.parameters())


def test_spearman_with_ties_by_hand():
    # a = [1, 2, 2, 3] -> ranks [1, 2.5, 2.5, 4]; b = [4, 3, 3, 1] -> ranks [4, 2.5, 2.5, 1]: rho = -1
    assert ranks([1, 2, 2, 3]).tolist() == [1, 2.5, 2.5, 4]
    assert spearman([1, 2, 2, 3], [4, 3, 3, 1]) == pytest.approx(-1.0)
    # a = [1, 2, 3, 4], b = [1, 3, 2, 2]: ranks b = [1, 4, 2.5, 2.5]; centred a = [-1.5, -.5, .5, 1.5],
    # centred b = [-1.5, 1.5, 0, 0]: cov = 2.25 - 0.75 = 1.5; |a| = sqrt(5), |b| = sqrt(4.5) -> 1.5 / sqrt(22.5)
    assert spearman([1, 2, 3, 4], [1, 3, 2, 2]) == pytest.approx(1.5 / 22.5 ** 0.5)
    assert spearman([1, 1, 1], [1, 2, 3]) != spearman([1, 1, 1], [1, 2, 3])  # constant series: NaN


def test_mean_std_by_hand():
    m, s = mean_std([0.5, 0.7, 0.9])
    assert m == pytest.approx(0.7) and s == pytest.approx(0.2)  # sample std: sqrt((0.04 + 0 + 0.04) / 2)
    assert mean_std([0.3]) == (0.3, 0.0)


def test_summarize_builds_the_table(tmp_path):
    for seed, score in enumerate([0.5, 0.7, 0.9]):
        run = tmp_path / f"ours-s{seed}"
        os.makedirs(run)
        json.dump({"method": "ours", "task": "chain_sum", "team": "tiny", "steps": 3}, open(run / "config.json", "w"))
        json.dump({"score": score, "solve_rate": score / 2}, open(run / "eval.json", "w"))
        json.dump({"score": score - 0.1, "solve_rate": 0.0}, open(run / "eval_no_context.json", "w"))
        with open(run / "metrics.jsonl", "w") as f:
            for step, (r, h) in enumerate([(0.1, 1.0), (0.2, 0.9), (0.3, 0.8)]):
                f.write(json.dumps({"step": step + 1, "reward": r, "entropy": h}) + "\n")
    for seed, score in enumerate([0.3, 0.5]):
        run = tmp_path / f"single-s{seed}"
        os.makedirs(run)
        json.dump({"method": "single", "task": "chain_sum", "team": "tiny", "steps": 3}, open(run / "config.json", "w"))
        json.dump({"score": score, "solve_rate": score}, open(run / "eval.json", "w"))
        open(run / "metrics.jsonl", "w").write(json.dumps({"step": 3, "reward": 0.0}) + "\n")
    naive = tmp_path / "naive-s0"  # another team, still training: a row of its own, no eval, no rho yet
    os.makedirs(naive)
    json.dump({"method": "ours", "task": "chain_sum", "team": "pocket-naive", "steps": 30},
              open(naive / "config.json", "w"))
    with open(naive / "metrics.jsonl", "w") as f:
        for step, (r, h) in enumerate([(0.1, 0.8), (0.2, 0.9), (0.3, 1.0)]):
            f.write(json.dumps({"step": step + 1, "reward": r, "entropy": h}) + "\n")
    table, rho = summarize([str(tmp_path)], str(tmp_path / "out"))
    assert table.splitlines()[0] == ("| method | chain_sum score | chain_sum solved | chain_sum score, C = 0 | "
                                     "chain_sum score − single's | seeds |")
    # 0.7 - 0.4; by hand, 3 of the 10 ways to split {.5 .7 .9 .3 .5} into 3 + 2 differ by 0.3 or more
    assert "| ours | 70.0 ± 20.0 | 35.0 ± 10.0 | 60.0 ± 20.0 | +30.0 (p = 0.30) | 3 |" in table
    assert "| single | 40.0 ± 14.1 | 40.0 ± 14.1 | – | – | 2 |" in table and "pocket-naive" not in table
    assert rho["mean"] == pytest.approx(-1.0) and len(rho["per_run"]) == 3
    assert rho["by_method"]["ours"]["reward_H"] == {"mean": pytest.approx(-1.0), "std": 0.0, "runs": 3}
    assert rho["by_method"]["ours"]["step_H"]["mean"] == pytest.approx(-1.0)
    assert rho["by_method"]["ours"]["reward_H_given_step"] is None  # reward = step here: nothing is left


def test_summarize_shows_paired_columns(tmp_path):
    for seed, (d, p) in enumerate([(0.10, 0.01), (0.20, 0.2)]):
        run = tmp_path / f"ours-s{seed}"
        os.makedirs(run)
        json.dump({"method": "ours", "task": "chain_sum", "team": "tiny", "steps": 3}, open(run / "config.json", "w"))
        json.dump({"score": 0.5, "solve_rate": 0.5}, open(run / "eval.json", "w"))
        cmp = {"score": {"diff": d, "p_sign": p}, "gold_logprob": {"diff": 1.0, "p_sign": p}}
        json.dump({"paired": {"with_C - zero_C": cmp, "with_C - shuffled_C": cmp}}, open(run / "eval_paired.json", "w"))
        open(run / "metrics.jsonl", "w").write(json.dumps({"step": 3, "reward": 0.0}) + "\n")
    table, _ = summarize([str(tmp_path)], str(tmp_path / "out"))
    assert "chain_sum with C − C = 0 (paired) | chain_sum with C − shuffled C (paired)" in table.splitlines()[0]
    assert "| +15.0 ± 7.1 (p < 0.05 in 1/2) | +15.0 ± 7.1 (p < 0.05 in 1/2) |" in table


def test_partial_spearman_equals_the_correlation_of_rank_residuals():
    """Independent reference: regress the ranks of x and of y on the ranks of z, correlate the residuals."""
    from lib.stats import partial_spearman, ranks
    rng = np.random.default_rng(0)
    z = np.arange(30.0)
    x, y = z + rng.normal(0, 8, 30), -z + rng.normal(0, 8, 30)
    Z = np.stack([np.ones(30), ranks(z)], 1)
    res = [r - Z @ np.linalg.lstsq(Z, r, rcond=None)[0] for r in (ranks(x), ranks(y))]
    assert partial_spearman(x, y, z) == pytest.approx(np.corrcoef(*res)[0, 1], abs=1e-12)


def test_permutation_p_by_hand():
    assert permutation_p([1, 2, 3], [4, 5, 6]) == pytest.approx(0.1)  # only the observed split and its mirror
    assert permutation_p([1], [2, 3]) == pytest.approx(2 / 3)  # |1 - 2.5| = |3 - 1.5| = 1.5 >= 1.5, |2 - 2| = 0
    assert permutation_p([0.5, 0.5], [0.5, 0.5]) == 1.0


def test_plot_runs_draws_every_figure_from_finished_runs(tmp_path):
    pytest.importorskip("matplotlib")
    for method, seed, steps in [("ours", 0, 6), ("ours", 1, 6), ("single", 0, 6), ("ours", 2, 30)]:
        run = tmp_path / f"{method}-s{seed}"
        os.makedirs(run)
        json.dump({"method": method, "task": "chain_sum", "team": "tiny", "steps": steps, "num_latents": 4,
                   "team_models": {"experts": ["a", "b"]}}, open(run / "config.json", "w"))
        with open(run / "metrics.jsonl", "w") as f:
            for step in range(1, 7):  # the third ours run stopped at step 6 of 30: left out of the curves
                row = {"step": step, "reward": step / 10, "entropy": 0.69 - step / 100, "utilization": [0.6, 0.4],
                       "c_rms": step / 100, "embed_rms": 0.05, "c_varying": 0.01, "grad_norm_g_phi": 2.0,
                       "grad_norm_lora": 0.1, "entropy_heads": [0.6, 0.69]}
                f.write(json.dumps(row if method == "ours" else {"step": step, "reward": 0.1}) + "\n")
        if method == "ours" and seed < 2:
            json.dump({"score": 0.5}, open(run / "eval.json", "w"))
            json.dump({"score": 0.4}, open(run / "eval_no_context.json", "w"))
    written = plot_runs([str(tmp_path)], str(tmp_path / "out"))
    names = sorted(os.path.basename(p) for p in written)
    assert names == ["fig4_chain_sum_tiny.png", "fig5.png", "probes_chain_sum_tiny.png", "reward_chain_sum.png"]
    for p in written:
        assert open(p, "rb").read(8) == b"\x89PNG\r\n\x1a\n"


def test_hierarchical_bootstrap_sees_the_spread_between_seeds():
    """Two seeds that disagree completely: each item bootstrap alone would be a point, the seed level is not."""
    from lib.stats import hierarchical_bootstrap_ci
    assert hierarchical_bootstrap_ci([np.ones(50), -np.ones(50)]) == [-1.0, 1.0]  # seed draws AA, AB/BA, BB
    assert hierarchical_bootstrap_ci([np.full(20, 0.25), np.full(30, 0.25)]) == [0.25, 0.25]


def test_summarize_compares_with_single_on_the_same_items(tmp_path):
    rng = np.random.default_rng(0)
    for seed in range(2):
        base = rng.integers(0, 2, 40).astype(float)
        for method, scores in (("single", base), ("ours", np.minimum(base + (np.arange(40) < 8), 1))):
            run = tmp_path / f"{method}-s{seed}"
            os.makedirs(run)
            json.dump({"method": method, "task": "chain_sum", "team": "tiny", "steps": 3, "seed": seed},
                      open(run / "config.json", "w"))
            json.dump({"score": scores.mean(), "solve_rate": scores.mean(),
                       "per_item": {"with_C": {"score": scores.tolist()}}}, open(run / "eval.json", "w"))
            open(run / "metrics.jsonl", "w").write(json.dumps({"step": 3, "reward": 0.0}) + "\n")
    table, _ = summarize([str(tmp_path)], str(tmp_path / "out"))
    row = next(line for line in table.splitlines() if line.startswith("| ours |"))
    cells = [c.strip() for c in row.split("|")]
    # by hand: ours = single + 1 on the first 8 items where single had 0
    gains = []
    rng = np.random.default_rng(0)
    for seed in range(2):
        base = rng.integers(0, 2, 40)
        gains.append(((base[:8] == 0).sum()) / 40)
    assert cells[-3].startswith(f"{100 * np.mean(gains):+.1f} [")
    assert cells[-3].endswith("] (descriptive)")  # 2 seeds: the interval is not the test
    lo, hi = (float(x) for x in cells[-3].split("[")[1].split("]")[0].split(","))
    assert lo <= 100 * np.mean(gains) <= hi
