"""Tests for grpo.py. Expected values are worked out by hand below with plain python floats, not by calling
grpo.py again. CPU, hermetic, < 5 s:  python -m pytest tests/test_grpo.py -q"""
import math

import pytest
import torch
import torch.nn.functional as F

from grpo import completion_mask, flat_groups, group_advantages, grpo_loss, signal_scale, token_logprobs
from rollout import draw

e = math.exp

# ----------------------------------------------------------------------------- group_advantages

def test_group_advantages_by_hand():
    rewards = torch.tensor([1., 0, 0, 0, 1, 1, 0, 0, 1, 1, 1, 1])
    # group 1: mean 0.25, deviations (0.75, -0.25, -0.25, -0.25), unbiased var = (0.5625 + 3 * 0.0625) / 3
    #          = 0.25, std 0.5.  group 2: mean 0.5, deviations +-0.5, var = 4 * 0.25 / 3, std = sqrt(1/3).
    #          group 3: all equal -> 0.
    s2, eps = math.sqrt(1 / 3), 1e-6
    expected_raw = [0.75, -0.25, -0.25, -0.25, 0.5, 0.5, -0.5, -0.5, 0, 0, 0, 0]
    expected_scaled = [0.75 / (0.5 + eps), -0.25 / (0.5 + eps), -0.25 / (0.5 + eps), -0.25 / (0.5 + eps),
                       0.5 / (s2 + eps), 0.5 / (s2 + eps), -0.5 / (s2 + eps), -0.5 / (s2 + eps), 0, 0, 0, 0]
    adv = group_advantages(rewards, 4, scale=True, eps=eps)
    assert adv.shape == (12,) and adv.dtype == torch.float32
    assert adv.tolist() == pytest.approx(expected_scaled, abs=1e-6)
    assert group_advantages(rewards, 4, scale=False).tolist() == pytest.approx(expected_raw, abs=1e-7)
    for a in (adv, group_advantages(rewards, 4, scale=False)):
        assert a.view(3, 4).sum(dim=1).abs().max() < 1e-6       # zero mean in every group
    assert torch.equal(adv[8:], torch.zeros(4))                  # equal rewards -> exactly 0


def test_equal_rewards_give_exactly_zero_advantage():
    # Regression: in float32, eight rewards of 0.6 give r - mean = 6e-8 and std = 6e-8, so the plain formula
    # returns +0.056 for all eight (checked by hand below): a spurious, not even mean-zero, push.
    r = torch.full((8,), 0.6)
    naive = (r - r.mean()) / (r.std() + 1e-6)
    assert naive.abs().min() > 0.01                              # the bug this test guards against
    for scale in (True, False):
        for value in (0.6, 0.1, 1 / 3, 0.0, 1.0):
            adv = group_advantages(torch.full((16,), value), 8, scale=scale)
            assert torch.equal(adv, torch.zeros(16))


def test_flat_groups_by_hand():
    # G = 3: group 0 mixed, group 1 all 0, group 2 all 1 -> groups 1 and 2 are flat (advantage 0)
    r = torch.tensor([1., 0., 1., 0., 0., 0., 1., 1., 1.])
    assert flat_groups(r, 3).tolist() == [False, True, True]
    flat = group_advantages(r, 3).view(3, 3).eq(0).all(-1)  # the same groups as the advantage's zeros
    assert flat.tolist() == flat_groups(r, 3).tolist()


def test_signal_scale_by_hand():
    # one micro-batch, B = 2 groups of G = 2: group 0 has signal, group 1 is flat; completion lengths 3, 1 | 2, 2
    signal = torch.tensor([True, False])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [1, 1, 0], [1, 1, 0]], dtype=torch.bool)
    # "sequence": n_all / n_signal whatever the micro-batch holds: 8 / 2 = 4, 16 / 4 = 4, 6 / 6 = 1
    assert signal_scale(signal, mask, n_signal=2, n_all=8) == 4.0
    assert signal_scale(signal, mask, n_signal=4, n_all=16) == 4.0
    assert signal_scale(torch.tensor([True, True]), mask, n_signal=6, n_all=6) == 1.0   # no flat group: 1 exactly
    # "token": (n_all / n_signal) * (N_sig / N) * (U / U_sig) = (8 / 2) * (2 / 4) * (8 tokens / 4 tokens) = 4
    assert signal_scale(signal, mask, n_signal=2, n_all=8, aggregation="token") == pytest.approx(4.0)
    # (16 / 6) * (2 / 4) * (8 / 4) = 8 / 3
    assert signal_scale(signal, mask, n_signal=6, n_all=16, aggregation="token") == pytest.approx(8 / 3)
    # a micro-batch with no group with signal has advantages 0: its factor is 0, never a division by 0
    assert signal_scale(torch.tensor([False, False]), mask, n_signal=0, n_all=8) == 0.0
    assert signal_scale(torch.tensor([False, False]), mask, n_signal=2, n_all=8, aggregation="token") == 0.0
    with pytest.raises(ValueError, match="group"):
        signal_scale(torch.tensor([True, False, True]), mask, n_signal=2, n_all=8)


@pytest.mark.parametrize("aggregation", ["sequence", "token"])
def test_dynamic_sampling_gradient_is_dapo_surrogate_plus_kl_on_every_group(aggregation):
    """The loss of a micro-batch under --dynamic-sampling (train.py: advantages times signal_scale, one micro-batch
    here) has, per token, the gradient derived in grpo.signal_scale's docstring: the surrogate's -A_i / U_sig on the groups
    with signal (DAPO's normalisation over them alone) plus beta * (1 - exp(logp_ref - logp)) / U on every
    completion, the flat group's included. Checked against those formulas written out by hand."""
    torch.manual_seed(0)
    G, beta = 2, 0.1
    signal = torch.tensor([True, False])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [1, 1, 0], [1, 1, 0]], dtype=torch.bool)
    r = torch.tensor([1., 0., 1., 1.])                               # group 1 flat
    adv = group_advantages(r, G)                                     # (0.707.., -0.707.., 0, 0)
    logp = (torch.randn(4, 3) - 1).requires_grad_(True)
    logp_ref = logp.detach() + 0.3 * torch.randn(4, 3)               # the policy has moved away from pi_ref
    c = signal_scale(signal, mask, n_signal=2, n_all=4, aggregation=aggregation)
    loss, _ = grpo_loss(logp, logp.detach(), logp_ref, adv * c, mask, beta=beta, aggregation=aggregation)
    loss.backward()
    n_tok = mask.sum(1, keepdim=True).float()                        # |o_i|
    if aggregation == "sequence":   # DAPO: 1 / (N_sig |o_i|); KL: 1 / (N |o_i|)
        w_pg, w_kl = 1 / (2 * n_tok), 1 / (4 * n_tok)
    else:                           # DAPO: 1 / (tokens of the groups with signal) = 1 / 4; KL: 1 / (all 8 tokens)
        w_pg, w_kl = torch.full_like(n_tok, 1 / 4), torch.full_like(n_tok, 1 / 8)
    rows_signal = signal.repeat_interleave(G)[:, None]
    pg = torch.where(rows_signal, -adv[:, None] * w_pg, torch.zeros(4, 1))
    kl = beta * (1 - torch.exp(logp_ref - logp.detach())) * w_kl
    expected = torch.where(mask, pg + kl, torch.zeros(4, 3))
    assert torch.allclose(logp.grad, expected, atol=1e-6)
    # the flat group's gradient is the KL's alone, non-zero, and a descent step moves logp toward logp_ref
    flat = ~rows_signal.squeeze(1)
    step = -logp.grad[flat][mask[flat]]
    toward = (logp_ref - logp.detach())[flat][mask[flat]]
    assert step.abs().min() > 0 and (torch.sign(step) == torch.sign(toward)).all()


@pytest.mark.parametrize("rewards, group_size", [
    (torch.zeros(7), 4),          # not divisible
    (torch.zeros(4), 1),          # no group baseline
    (torch.zeros(0), 4),          # empty
    (torch.zeros(2, 4), 4),       # not 1-D
    (torch.tensor([1., float("nan"), 0, 0]), 4),
])
def test_group_advantages_rejects_bad_input(rewards, group_size):
    with pytest.raises(ValueError):
        group_advantages(rewards, group_size)

# ----------------------------------------------------------------------------- grpo_loss

CLIP, BETA = 0.2, 0.04
LOGP = [[-1.0, -2.0, -0.5, 0.0], [-1.5, -0.3, -2.2, -0.7]]      # row 0 has 3 tokens, row 1 has 4
D = [[0.5, 0.1, -0.5, 0.0], [-0.5, 0.1, 0.3, 0.0]]              # logp - logp_old: ratio = exp(D), as with mu > 1
REF = [[-1.2, -1.9, -0.5, 0.0], [-1.0, -0.5, -2.0, -1.0]]
ADV = [1.0, -1.0]
MASK = [[True, True, True, False], [True, True, True, True]]
# Surrogate min(ratio * A, clip(ratio, 0.8, 1.2) * A), token by token:
SURR = [[1.2,          # e^0.5 = 1.65 > 1.2, A > 0: clipped to 1.2
         e(0.1),       # 1.105 inside [0.8, 1.2]
         e(-0.5)],     # 0.61 < 0.8 but A > 0: the clip only caps gains, min keeps 0.61
        [-0.8,         # e^-0.5 = 0.61 < 0.8, A < 0: -0.61 vs -0.8, clipped branch -0.8 chosen
         -e(0.1),      # inside
         -e(0.3),      # 1.35 > 1.2, A < 0: -1.35 vs -1.2, min keeps -1.35 (a worse step is never clipped)
         -1.0]]        # ratio 1
N_CLIPPED = 2


def kl_k3(ref, logp):
    return e(ref - logp) - (ref - logp) - 1


def expected(aggregation, beta=BETA):
    rows, klrows = [], []
    for i in range(2):
        n = sum(MASK[i])
        rows.append([-(SURR[i][t] - beta * kl_k3(REF[i][t], LOGP[i][t])) for t in range(n)])
        klrows.append([kl_k3(REF[i][t], LOGP[i][t]) for t in range(n)])
    if aggregation == "sequence":
        agg = lambda v: (sum(v[0]) / len(v[0]) + sum(v[1]) / len(v[1])) / 2
    else:
        agg = lambda v: (sum(v[0]) + sum(v[1])) / (len(v[0]) + len(v[1]))
    return agg(rows), agg(klrows)


def make_inputs(requires_grad=False):
    logp = torch.tensor(LOGP, requires_grad=requires_grad)
    logp_old = torch.tensor([[l - d for l, d in zip(lr, dr)] for lr, dr in zip(LOGP, D)])
    return logp, logp_old, torch.tensor(REF), torch.tensor(ADV), torch.tensor(MASK)


@pytest.mark.parametrize("aggregation", ["sequence", "token"])
def test_grpo_loss_by_hand_with_clipping(aggregation):
    loss, m = grpo_loss(*make_inputs(), clip_eps=CLIP, beta=BETA, aggregation=aggregation)
    want_loss, want_kl = expected(aggregation)
    assert loss.item() == pytest.approx(want_loss, abs=1e-5)
    assert m["kl"] == pytest.approx(want_kl, abs=1e-6)
    assert m["clip_fraction"] == pytest.approx(N_CLIPPED / 7)
    ratios = [e(D[0][0]), e(D[0][1]), e(D[0][2]), e(D[1][0]), e(D[1][1]), e(D[1][2]), 1.0]
    assert m["ratio_mean"] == pytest.approx(sum(ratios) / 7, abs=1e-6)
    assert m["pg_loss"] == pytest.approx(expected(aggregation, beta=0.0)[0], abs=1e-5)
    assert all(isinstance(v, float) for v in m.values())


def test_aggregations_differ_on_uneven_masks():
    seq, tok = expected("sequence")[0], expected("token")[0]
    assert abs(seq - tok) > 1e-3                                 # the case above tells them apart
    l_seq, _ = grpo_loss(*make_inputs(), aggregation="sequence")
    l_tok, _ = grpo_loss(*make_inputs(), aggregation="token")
    assert abs(l_seq.item() - l_tok.item()) > 1e-3


@pytest.mark.parametrize("aggregation", ["sequence", "token"])
def test_mu_1_ratio_is_one_and_gradient_is_policy_gradient(aggregation):
    # mu = 1: logp_old = logp. ratio == 1, nothing clips, and d loss / d logp_it is
    # (-A_i + beta * (1 - exp(ref - logp))) / denominator, denominator = n_i * N ("sequence") or 7 ("token").
    # logp_old and logp_ref are passed WITH gradient on purpose: grpo_loss must detach them itself, or
    # exp(logp - logp_old) has zero gradient and the policy gradient silently vanishes.
    logp, _, ref, adv, mask = make_inputs(requires_grad=True)
    ref.requires_grad_()
    loss, m = grpo_loss(logp, logp, ref, adv, mask, beta=BETA, aggregation=aggregation)
    loss.backward()
    assert m["ratio_mean"] == 1.0 and m["clip_fraction"] == 0.0
    assert ref.grad is None
    for i in range(2):
        for t in range(4):
            denom = sum(MASK[i]) * 2 if aggregation == "sequence" else 7
            want = (-ADV[i] + BETA * (1 - e(REF[i][t] - LOGP[i][t]))) / denom if MASK[i][t] else 0.0
            assert logp.grad[i, t].item() == pytest.approx(want, abs=1e-6)


def test_mu_1_loss_is_near_zero_with_group_advantages():
    # mu = 1: with ratio 1 and beta = 0 the "sequence" loss is -mean(A) = 0 for group advantages.
    torch.manual_seed(0)
    adv = group_advantages(torch.tensor([1., 0, 0, 0, 1, 1, 0, 1]), 4)
    logp = -torch.rand(8, 5)
    mask = torch.ones(8, 5, dtype=torch.bool)
    loss, _ = grpo_loss(logp, logp, logp, adv, mask, beta=0.0)
    assert abs(loss.item()) < 1e-6


@pytest.mark.parametrize("aggregation", ["sequence", "token"])
def test_equal_rewards_and_no_kl_give_zero_gradient(aggregation):
    adv = group_advantages(torch.tensor([1., 1, 1, 1, 0.6, 0.6, 0.6, 0.6]), 4)
    torch.manual_seed(0)
    logp = (-torch.rand(8, 6)).requires_grad_()
    logp_old = logp.detach() + 0.3 * torch.randn(8, 6)           # mu > 1: ratios != 1, some would clip
    mask = torch.rand(8, 6) > 0.3
    loss, m = grpo_loss(logp, logp_old, -torch.rand(8, 6), adv, mask, beta=0.0, aggregation=aggregation)
    loss.backward()
    assert torch.equal(logp.grad, torch.zeros(8, 6))
    assert m["clip_fraction"] == 0.0


def test_kl_is_zero_when_policy_equals_reference():
    logp, logp_old, _, adv, mask = make_inputs()
    _, m = grpo_loss(logp, logp_old, logp.clone(), adv, mask, beta=1.0)
    assert m["kl"] == 0.0


@pytest.mark.parametrize("aggregation", ["sequence", "token"])
def test_padding_does_not_change_loss_or_gradients(aggregation):
    logp, logp_old, ref, adv, mask = make_inputs(requires_grad=True)
    loss, m = grpo_loss(logp, logp_old, ref, adv, mask, aggregation=aggregation)
    loss.backward()
    # Same data, the padded slot and 3 appended columns filled with -inf / NaN / +inf, mask False there.
    garbage = [float("-inf"), float("nan"), float("inf")]
    pad = lambda x, fill: torch.cat([x.detach(), torch.full((2, 3), fill)], dim=1)
    logp_p = pad(logp, garbage[0])
    logp_p[0, 3] = float("nan")
    logp_p.requires_grad_()
    mask_p = torch.cat([mask, torch.zeros(2, 3, dtype=torch.bool)], dim=1)
    loss_p, m_p = grpo_loss(logp_p, pad(logp_old, garbage[1]), pad(ref, garbage[2]), adv, mask_p,
                            aggregation=aggregation)
    loss_p.backward()
    assert loss_p.item() == pytest.approx(loss.item(), abs=1e-7)
    assert torch.allclose(logp_p.grad[:, :4], logp.grad, atol=1e-8)
    assert torch.equal(logp_p.grad[:, 4:], torch.zeros(2, 3)) and logp_p.grad[0, 3] == 0
    for k in m:
        assert m_p[k] == pytest.approx(m[k], abs=1e-7)


def test_empty_completion_is_finite():
    logp, logp_old, ref, adv, mask = make_inputs(requires_grad=True)
    mask3 = torch.cat([mask, torch.zeros(1, 4, dtype=torch.bool)])       # a third completion, 0 tokens
    cat = lambda x: torch.cat([x.detach(), torch.full((1, 4), float("nan"))])
    logp3 = cat(logp).requires_grad_()
    loss, m = grpo_loss(logp3, cat(logp_old), cat(ref), torch.tensor(ADV + [0.5]), mask3)
    loss.backward()
    # token count clamped to 1: the empty row adds 0 and still counts in N = 3
    assert loss.item() == pytest.approx(expected("sequence")[0] * 2 / 3, abs=1e-5)
    assert torch.isfinite(logp3.grad).all() and all(math.isfinite(v) for v in m.values())
    loss0, m0 = grpo_loss(logp3, cat(logp_old), cat(ref), torch.tensor(ADV + [0.5]),
                          torch.zeros(3, 4, dtype=torch.bool), aggregation="token")
    assert loss0.item() == 0.0 and all(math.isfinite(v) for v in m0.values())


def test_grpo_loss_rejects_bad_input():
    logp, logp_old, ref, adv, mask = make_inputs()
    with pytest.raises(ValueError, match="aggregation"):
        grpo_loss(logp, logp_old, ref, adv, mask, aggregation="mean")
    with pytest.raises(ValueError, match="bool"):
        grpo_loss(logp, logp_old, ref, adv, mask.float())
    with pytest.raises(ValueError, match="shape"):
        grpo_loss(logp[:, :3], logp_old, ref, adv, mask)
    with pytest.raises(ValueError, match="advantages"):
        grpo_loss(logp, logp_old, ref, adv[:1], mask)

# ----------------------------------------------------------------------------- completion_mask

T_, F_ = True, False


def test_completion_mask_first_eos_inclusive():
    ids = torch.tensor([[5, 2, 7, 2, 9],      # EOS at 1, a second at 3
                        [2, 4, 4, 4, 4],      # EOS first
                        [5, 6, 7, 8, 9],      # no EOS: all kept (truncated at max-new-tokens)
                        [5, 6, 7, 8, 2]])     # EOS last
    assert completion_mask(ids, 2).tolist() == [[T_, T_, F_, F_, F_], [T_, F_, F_, F_, F_],
                                                [T_, T_, T_, T_, T_], [T_, T_, T_, T_, T_]]
    assert completion_mask(ids, 2).dtype == torch.bool


def test_completion_mask_several_eos_ids():
    ids = torch.tensor([[5, 3, 7, 2, 9], [5, 6, 2, 3, 9], [1, 1, 1, 1, 1]])
    assert completion_mask(ids, [2, 3]).tolist() == [[T_, T_, F_, F_, F_], [T_, T_, T_, F_, F_],
                                                     [T_, T_, T_, T_, T_]]
    assert completion_mask(ids, (2, 3)).tolist() == completion_mask(ids, [2, 3]).tolist()


def test_completion_mask_when_eos_is_pad():
    # pad_token_id == eos_token_id == 0 (common): the generated EOS is kept, the padding after it is not.
    # A mask "ids != pad" would drop the EOS and the policy would never be rewarded for stopping.
    ids = torch.tensor([[4, 5, 0, 0, 0], [4, 5, 6, 7, 0], [4, 5, 6, 7, 8]])
    assert completion_mask(ids, 0).tolist() == [[T_, T_, T_, F_, F_], [T_, T_, T_, T_, T_],
                                                [T_, T_, T_, T_, T_]]


@pytest.mark.parametrize("eos", [None, [], "2", 2.0, [2, None]])
def test_completion_mask_rejects_bad_eos(eos):
    with pytest.raises(ValueError):
        completion_mask(torch.tensor([[1, 2, 3]]), eos)

# ----------------------------------------------------------------------------- token_logprobs

@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.3])
def test_token_logprobs_matches_cross_entropy(temperature):
    # Both sides are float32 log-softmaxes of the same numbers; they differ only in summation order, which
    # for |logp| ~ 10 and V = 1000 is ~1e-6: atol 1e-5.
    torch.manual_seed(0)
    N, T, V = 3, 5, 1000
    logits = (3 * torch.randn(N, T, V)).requires_grad_()
    tokens = torch.randint(V, (N, T))
    got = token_logprobs(logits, tokens, temperature)
    want = -F.cross_entropy((logits / temperature).reshape(-1, V), tokens.reshape(-1), reduction="none")
    assert got.dtype == torch.float32 and got.shape == (N, T)
    assert torch.allclose(got, want.view(N, T), atol=1e-5, rtol=0)
    g_got, = torch.autograd.grad(got.sum(), logits)
    g_want, = torch.autograd.grad(want.sum(), logits)
    assert torch.allclose(g_got, g_want, atol=1e-6, rtol=0)


def test_token_logprobs_bf16_is_computed_in_fp32():
    # bf16 -> fp32 is exact, so the reference (cross_entropy on the upcast logits) sees the same numbers:
    # the same 1e-5 tolerance holds. Doing the softmax in bf16 instead is off by > 1e-2 here.
    torch.manual_seed(0)
    N, T, V, temperature = 3, 5, 1000, 0.7
    logits = (3 * torch.randn(N, T, V)).bfloat16()
    tokens = torch.randint(V, (N, T))
    got = token_logprobs(logits, tokens, temperature)
    want = -F.cross_entropy(logits.float().reshape(-1, V) / temperature, tokens.reshape(-1), reduction="none")
    assert got.dtype == torch.float32
    assert torch.allclose(got, want.view(N, T), atol=1e-5, rtol=0)
    in_bf16 = torch.log_softmax(logits / temperature, dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    assert (in_bf16.float() - want.view(N, T)).abs().max() > 1e-2


def test_token_logprobs_rejects_bad_input():
    with pytest.raises(ValueError):
        token_logprobs(torch.randn(2, 3, 5), torch.zeros(2, 3, dtype=torch.long), temperature=0.0)
    with pytest.raises(ValueError):
        token_logprobs(torch.randn(2, 3, 5), torch.zeros(2, 4, dtype=torch.long))


# ----------------------------------------------------------------------------- sampling

@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_draw_follows_softmax(temperature):
    """The rollout's inverse-CDF sampler against the plain maths: frequencies of 40,000 draws match
    softmax(logits / T) (4 standard errors), and a token of probability 0 is never drawn."""
    logits = torch.tensor([[2.0, 0.0, -1.0, float("-inf"), 1.0]])
    p = [e(x / temperature) if x != float("-inf") else 0.0 for x in logits[0].tolist()]
    p = [x / sum(p) for x in p]
    torch.manual_seed(0)
    n = 40_000
    tokens = draw(logits.expand(n, -1), temperature)
    freq = torch.bincount(tokens, minlength=5).double() / n
    for k in range(5):
        assert abs(freq[k].item() - p[k]) <= 4 * math.sqrt(p[k] * (1 - p[k]) / n) + 1e-12, (k, freq[k], p[k])
    assert freq[3] == 0


# ---- the channel-forcing term (train.py --channel-weight) ----------------------------------------------------

def test_channel_forcing_value_and_gradient_by_hand():
    """Two completions of 2 and 1 tokens, advantages (+1, -0.5): only the first is in P. l = mean log-prob over
    its tokens: l_true = (-1 - 3) / 2 = -2, l_mis = (-2 - 3) / 2 = -2.5, so L = softplus(-0.5) = log(1 + e^-0.5)
    and dL/dlogp_t = -sigma(-0.5) / 2 on each true token, +sigma(-0.5) / 2 on each mismatched one."""
    from grpo import channel_forcing_loss
    mask = torch.tensor([[True, True], [True, False]])
    logp = torch.tensor([[-1.0, -3.0], [-0.5, float("nan")]], requires_grad=True)
    logp_mis = torch.tensor([[-2.0, -3.0], [-9.0, 0.0]], requires_grad=True)
    loss, m = channel_forcing_loss(logp, logp_mis, torch.tensor([1.0, -0.5]), mask)
    assert loss.item() == pytest.approx(math.log(1 + math.exp(-0.5)))
    assert m["cf_margin"] == pytest.approx(0.5) and m["cf_fraction"] == 0.5
    loss.backward()
    s = 1 / (1 + math.exp(0.5))                                                  # sigma(-0.5)
    assert torch.allclose(logp.grad, torch.tensor([[-s / 2, -s / 2], [0.0, 0.0]]))
    assert torch.allclose(logp_mis.grad, torch.tensor([[s / 2, s / 2], [0.0, 0.0]]))
    # no completion with A > 0: the term is 0 and so is its gradient
    loss, m = channel_forcing_loss(logp.detach().requires_grad_(), logp_mis, torch.tensor([0.0, -1.0]), mask)
    assert loss.item() == 0 and math.isnan(m["cf_margin"])


def test_channel_forcing_matches_a_two_way_cross_entropy():
    """The same value from an independent formula: F.cross_entropy over the pair (l_i, l'_i) with target 0."""
    from grpo import channel_forcing_loss
    torch.manual_seed(0)
    logp, logp_mis = -torch.rand(6, 5) * 3, -torch.rand(6, 5) * 3
    mask = torch.rand(6, 5) > 0.3
    mask[:, 0] = True
    adv = torch.tensor([1.0, -1.0, 0.5, 0.0, 2.0, -0.1])
    loss, _ = channel_forcing_loss(logp, logp_mis, adv, mask)
    n = mask.sum(1)
    l_true, l_mis = (logp * mask).sum(1) / n, (logp_mis * mask).sum(1) / n
    pos = adv > 0
    ref = F.cross_entropy(torch.stack([l_true, l_mis], 1)[pos], torch.zeros(int(pos.sum()), dtype=torch.long))
    assert loss.item() == pytest.approx(ref.item(), rel=1e-6)
    with pytest.raises(ValueError):
        channel_forcing_loss(logp, logp_mis[:, :4], adv, mask)
