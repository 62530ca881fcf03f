"""What a run reports while it runs: tokens_per_s in each step's record (the step's completion tokens over its
wall seconds), and --track (support/track.py): TensorBoard's event file holds every scalar of metrics.jsonl, a
missing library is one line and exit code 2 before anything is written, and the tracker is closed however the
run ends."""
import json
import os

import pytest

import train

SMOKE = ["--preset", "smoke", "--eval-items", "0", "--steps", "2", "--device", "cpu"]


def letter_reward(items, completions):
    """1 if the completion starts with a lowercase ASCII letter: reward variance, so the numbers move."""
    return [1.0 if c[:1].isascii() and c[:1].islower() else 0.0 for c in completions], {"ok": len(completions)}


def metrics(out):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_tokens_per_s_counts_the_completion_tokens_of_the_step(tmp_path, monkeypatch):
    """tokens_per_s x seconds = the step's completions x their mean length (EOS counted, padding not): the same
    count from completion_length, an independent field. The tiny random policy rarely samples its EOS, so here
    one token in five ends a completion: lengths differ, and counting the padding behind the short ones (the
    width of the batch times its rows) would give more."""
    real = train.build_run

    def early_stops(args, device):
        run = real(args, device)
        run["eos_ids"] = list(range(0, run["policy"].config.vocab_size, 5))
        return run
    monkeypatch.setattr(train, "build_run", early_stops)
    out = str(tmp_path / "run")
    train.main(SMOKE + ["--out", out], score_batch=letter_reward)
    n = 2 * 4 * 1  # --batch-size 2 prompts x G = 4 x --grad-accum 1 (the smoke preset)
    ms = metrics(out)
    assert any(m["truncated_fraction"] < 1 for m in ms)  # some completions ended early: padding behind them
    for m in ms:
        assert m["tokens_per_s"] > 0
        assert m["tokens_per_s"] * m["seconds"] == pytest.approx(m["completion_length"] * n, rel=1e-9)
