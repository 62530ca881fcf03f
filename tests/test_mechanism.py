"""experiments/mechanism.py's fast paths (the stage-4 test of issue 33 rests on them), on the tiny random policy:
the shared-prefix log-probs and their gradient against rollout.completion_logprobs run row by row, the check with
one kept item, and --screen-from's refusal of another test's screen."""
import json
import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "experiments"))

import mechanism as M  # noqa: E402
import rollout  # noqa: E402
from experts import load_model  # noqa: E402
from grpo import completion_mask  # noqa: E402
from channel import pad_left  # noqa: E402

ITEMS = [(f"Find the greatest common divisor of {a} and {b}.", "1") for a, b in [(3, 7), (12, 35), (9, 4)]]


@pytest.fixture(scope="module")
def setting():
    torch.manual_seed(0)
    model, tok = load_model("tiny:llama")
    for p in model.parameters():
        p.requires_grad_(False)
    pol = M.PrefilledPolicy(model, tok, "after", fast=True)
    pol.set_prefix([q for q, _ in ITEMS])
    H = torch.randn(len(ITEMS), 16)
    adapter = M.ChannelAdapter([16], model.config.hidden_size, "standardize", [(H.mean(0), H.std(0))], "tanh", 0.0,
                               num_latents=4)
    g = M.Anchored(adapter, 0.02 * torch.randn(4, model.config.hidden_size))
    return pol, g, H


def test_the_fast_path_check_runs_with_one_kept_item(setting):
    pol, g, H = setting
    assert M.fast_path_check(pol, g, H[:1], ITEMS[:1], 2, 5) < 1e-4


def test_shared_prefix_logprobs_and_their_gradient_equal_the_row_by_row_scorer(setting):
    pol, g, H = setting
    G, qs = 3, [q for q, _ in ITEMS]
    with torch.no_grad():
        comp = M.sample(pol, qs, g(H)[0], G, 5, torch.Generator().manual_seed(1))
    cmask = completion_mask(comp, pol.eos)
    w = torch.randn(comp.shape)                       # any loss that weighs each token
    g.zero_grad()
    C = g(H)[0]
    fast = M.completion_logprobs(pol, qs, C, comp, cmask)
    (fast * w * cmask).sum().backward()
    grad_fast = [p.grad.clone() for p in g.parameters() if p.requires_grad]
    g.zero_grad()
    C = g(H)[0].repeat_interleave(G, 0)               # every row its own prompt, C and pre-fill
    ids, mask = pad_left([pol.prompt_ids(q) for q in qs for _ in range(G)], pol.pad)
    post = pol.post_ids()[None].expand(len(comp), -1)
    ref = rollout.completion_logprobs(pol.model, ids, mask, C, torch.cat([post, comp], 1),
                                      torch.cat([torch.ones_like(post, dtype=torch.bool), cmask], 1), 1.0,
                                      "after")[:, post.shape[1]:]
    (ref * w * cmask).sum().backward()
    grad_ref = [p.grad.clone() for p in g.parameters() if p.requires_grad]
    assert (fast - ref).abs()[cmask].max() < 1e-4
    for a, b in zip(grad_fast, grad_ref):
        assert torch.allclose(a, b, rtol=1e-3, atol=1e-6)


def test_screen_from_refuses_a_screen_of_other_items(tmp_path):
    a = M.parse(["--task", "gcd", "--screen-group", "16", "--max-new-tokens", "5", "--seed", "1",
                 "--data-seed", "0"])
    rec = {"config": {**vars(a), "seed": 0, "data_seed": None}, "screen": {"solved": [0.0] * 8, "seconds": 1.0}}
    path = tmp_path / "partial-x.json"
    path.write_text(json.dumps(rec))
    assert M.screen_from(str(path), a, 8, 0)["solved"] == [0.0] * 8
    with pytest.raises(SystemExit, match="data seed"):
        M.screen_from(str(path), a, 8, 1)
    with pytest.raises(SystemExit, match="items"):
        M.screen_from(str(path), a, 16, 0)
    with pytest.raises(SystemExit, match="not a record"):
        M.screen_from(str(tmp_path / "missing.json"), a, 8, 0)
