"""Forking without traps: a context builder and a task of your own, registered from outside the core files (this
test file), run end to end through train.py and evaluate.py, and the plan counts the new builder's tokens. A builder
declares what it is (baselines.Kind), and every check asks that, never the method's name."""
import json
import os
import sys

import pytest
import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import baselines  # noqa: E402
import evaluate  # noqa: E402
import rewards  # noqa: E402
import train  # noqa: E402
from adapter import StateNorm  # noqa: E402
from experts import TEAMS  # noqa: E402
from support.harness import build, plan  # noqa: E402

SMOKE = ["--preset", "smoke", "--eval-items", "2", "--steps", "2"]


class TwoTokens(nn.Module):
    """A throwaway context builder: two trainable tokens, the same for every prompt, scaled by the question's
    length (so C depends on the prompt). Only the contract: forward(questions) -> baselines.Context."""
    context_tokens = 2

    def __init__(self, out_dim):
        super().__init__()
        self.tokens = nn.Parameter(0.02 * torch.randn(2, out_dim))

    def forward(self, questions, answers=None, reuse=None):
        scale = torch.tensor([len(q) / 100 for q in questions])[:, None, None]
        return baselines.Context(scale * self.tokens, None, [None] * len(questions))


def two_tokens(team, out_dim, args, device, dtype):
    return TwoTokens(out_dim).to(device)


two_tokens.kind = baselines.Kind(tokens=True, experts=None)


def load_parity(split, size, seed, data_path):
    """A throwaway task with its own data: is n even?"""
    start = 0 if split == "train" else 10_000
    return [{"question": f"Is {n} even? Answer yes or no.", "answer": "yes" if n % 2 == 0 else "no",
             "metadata": {"source_dataset": "parity"}} for n in range(start + seed, start + seed + size)]


SCORED = []


def score_parity(answer, entry):
    SCORED.append(answer)
    return float(answer.strip().lower() == entry["answer"])


def test_a_method_and_a_task_of_your_own_run_end_to_end(tmp_path, monkeypatch):
    monkeypatch.setitem(baselines.METHODS, "two_tokens", two_tokens)
    monkeypatch.setitem(rewards.TASKS, "parity", (load_parity, score_parity))
    flags = SMOKE + ["--method", "two_tokens", "--task", "parity"]
    _, info = plan.estimate(train.parse_args(flags))
    assert info["context_tokens"] == 2
    out = str(tmp_path / "run")
    train.main(flags + ["--out", out])
    steps = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    assert [s["step"] for s in steps] == [1, 2] and steps[0]["c_rms"] > 0   # the new builder's C reached the log
    samples = [json.loads(line) for line in open(os.path.join(out, "samples.jsonl"))]
    assert samples[0]["question"].startswith("Is ") and samples[0]["answer"] in ("yes", "no")
    assert json.load(open(os.path.join(out, "validation.json")))["items"] == 2
    evaluate.main(["--run", out, "--n", "2"])
    assert json.load(open(os.path.join(out, "eval.json")))["method"] == "two_tokens"


def test_your_own_scorer_scores_the_answer_block():
    entries = load_parity("val", 2, 0, None)
    with pytest.MonkeyPatch.context() as m:
        m.setitem(rewards.TASKS, "parity", (load_parity, score_parity))
        got, counts = rewards.score_batch(entries, ["<answer>yes</answer>", "no answer block"])
    assert got == [1.0, 0.0] and counts["no_answer"] == 1 and counts["ok"] == 2 and SCORED[-1] == "yes"


def test_a_task_of_your_own_is_scored_by_rewards_score_too(monkeypatch):
    """Regression (a fork trap): a task registered in rewards.TASKS trained right (score_batch looked it up), but
    rewards.score / safe_score, which `python rewards.py --task NAME` prints, never did: the right answer scored 0
    with status "error"."""
    monkeypatch.setitem(rewards.TASKS, "parity", (load_parity, score_parity))
    entry = load_parity("val", 1, 0, None)[0]
    assert rewards.safe_score(entry, f"<answer>{entry['answer']}</answer>") == (1.0, "ok")
    assert rewards.score(entry, "<answer>maybe</answer>") == 0.0
    assert rewards.score_batch([entry], [f"<answer>{entry['answer']}</answer>"])[0] == [1.0]


class NoTokens(nn.Module):
    """A throwaway builder with no context tokens: C is None (the policy alone, as `single`)."""
    context_tokens = 0

    def forward(self, questions, answers=None, reuse=None):
        return baselines.Context(None, None, [None] * len(questions))


def no_tokens(team, out_dim, args, device, dtype):
    return NoTokens()


no_tokens.kind = baselines.Kind(tokens=False, experts=None)


def no_model_loads(*args, **kwargs):
    raise AssertionError("a model loaded before the flags were refused")


def test_a_method_of_your_own_without_context_tokens_refuses_channel_weight(tmp_path, monkeypatch, capsys):
    """Regression (a fork trap): --channel-weight was refused by method name (single, output_collab and the
    neighbours), so a new builder with no context tokens passed the checks, loaded the models and died in the
    first step with a traceback (TypeError: object of type 'NoneType' has no len(), in train.py's channel term).
    Now the check asks the builder's declaration: one line, exit code 2, before any model loads."""
    monkeypatch.setitem(baselines.METHODS, "no_tokens", no_tokens)
    monkeypatch.setattr(build, "load_model", no_model_loads)
    out = str(tmp_path / "run")
    with pytest.raises(SystemExit) as e:
        train.main(SMOKE + ["--method", "no_tokens", "--channel-weight", "0.5", "--out", out])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and err[0].startswith("error: --channel-weight")
    assert "no_tokens has no context tokens" in err[0] and not os.path.exists(out)


class NormedStates(nn.Module):
    """A throwaway builder that reads the team's experts and standardises their states with adapter.StateNorm,
    bringing no fitting code of its own: one token per expert, W_i applied to the standardised h_i."""

    def __init__(self, pool, out_dim):
        super().__init__()
        self.pool, self.norm = pool, StateNorm(pool.dims)
        self.proj = nn.ModuleList([nn.Linear(d_i, out_dim, bias=False) for d_i in pool.dims])
        self.context_tokens = len(pool.dims)

    def forward(self, questions, answers=None, reuse=None):
        states = baselines.pooled_states(self.pool, questions, answers, reuse)
        C = torch.stack([0.01 * W(h) for W, h in zip(self.proj, self.norm(states))], 1)  # (B, n, out_dim)
        return baselines.Context(C, None, [None] * len(questions), states=states)


def normed_states(team, out_dim, args, device, dtype):
    return NormedStates(baselines.expert_pool(team["experts"], args, device, dtype), out_dim).to(device)


normed_states.kind = baselines.Kind(tokens=True, experts="team", state_norm=True)


def test_state_norm_works_for_a_method_of_your_own_that_declares_it(tmp_path, monkeypatch):
    """Regression (a fork trap): --state-norm standardize asked hasattr(method, "fit_state_norm"), which only
    ours and no_xattn defined (each its own copy), so a new builder with a StateNorm of its own was refused after
    the models loaded ("--method normed_states has no expert states to standardise"). Now baselines.fit_state_norm
    fits the .norm of any method that declares state_norm, from its .pool's states."""
    monkeypatch.setitem(baselines.METHODS, "normed_states", normed_states)
    out = str(tmp_path / "run")
    train.main(SMOKE + ["--method", "normed_states", "--state-norm", "standardize", "--state-norm-prompts", "8",
                        "--out", out])
    norm = torch.load(os.path.join(out, "checkpoint.pt"), weights_only=False)["method"]
    for i in range(len(TEAMS["tiny"]["experts"])):  # fitted: the identity's zeros and ones are gone
        assert norm[f"norm.mean{i}"].abs().sum() > 0 and not torch.equal(norm[f"norm.std{i}"],
                                                                           torch.ones_like(norm[f"norm.std{i}"]))
    assert [json.loads(line)["step"] for line in open(os.path.join(out, "metrics.jsonl"))] == [1, 2]


def test_a_method_that_declares_no_experts_needs_no_expert_weights(tmp_path, monkeypatch):
    """A builder that reads none of the team's experts trains and is evaluated with the experts' weights absent:
    the model checks ask its declaration (the list of such methods used to be names: single, soft_prompt,
    bare_anchor, identical)."""
    monkeypatch.setitem(baselines.METHODS, "two_tokens", two_tokens)
    monkeypatch.setitem(TEAMS, "tiny", {**TEAMS["tiny"], "experts": [str(tmp_path / "no-such-expert")]})
    out = str(tmp_path / "run")
    train.main(SMOKE + ["--method", "two_tokens", "--eval-items", "0", "--out", out])
    evaluate.main(["--run", out, "--n", "2"])
    assert json.load(open(os.path.join(out, "eval.json")))["n"] == 2
