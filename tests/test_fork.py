"""Forking without traps: a context builder and a task of your own, registered from outside the core files (this
test file), run end to end through train.py and evaluate.py, and the plan counts the new builder's tokens."""
import json
import os
import sys

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import baselines  # noqa: E402
import evaluate  # noqa: E402
import rewards  # noqa: E402
import train  # noqa: E402
from support import plan  # noqa: E402

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
    import pytest
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
