"""Every method and every pooling mode trains 2 steps and is scored by evaluate.py, on the
tiny team; every method's declaration (baselines.Kind) says what its module does; one pocket run checks the
same path with the real pretrained models."""
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from adapter import StateNorm
from baselines import METHODS, Kind
from evaluate import evaluate
from experts import TEAMS
from train import main, parse_args

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = ["--task", "chain_sum", "--device", "cpu", "--dataset-size", "32", "--system-prompt", "simple",
         "--steps", "2", "--batch-size", "2", "--grad-accum", "1", "--group-size", "2", "--max-new-tokens", "6",
         "--latent-dim", "32", "--num-heads", "4", "--num-latents", "4"]


def train_and_score(out, extra):
    main(SMALL + ["--out", out] + extra)
    cfg = SimpleNamespace(**json.load(open(os.path.join(out, "config.json"))))
    state = torch.load(os.path.join(out, "checkpoint.pt"), weights_only=False)
    assert state["step"] == 2
    result = evaluate(cfg, 3, 3, state["lora"], state["method"])
    assert result["n"] == 3 and 0 <= result["score"] <= 1 and 0 <= result["solve_rate"] <= result["score"] + 1e-9
    return [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]


def built(method):
    """The method's module on the tiny team, and its Context for two questions."""
    torch.manual_seed(0)
    g = METHODS[method](TEAMS["tiny"], 64, parse_args(SMALL + ["--team", "tiny", "--method", method]), "cpu",
                        torch.float32)
    return g, g(["What is 1 + 2?", "Add 3 and 4."])


@pytest.mark.parametrize("method", sorted(METHODS))  # a method added to baselines.py is tested here too
def test_every_method_trains_and_evaluates(tmp_path, method):
    ms = train_and_score(str(tmp_path / method), ["--team", "tiny", "--method", method])
    assert [m["step"] for m in ms] == [1, 2]
    assert ("entropy" in ms[0]) == (built(method)[1].A is not None)  # H is logged for a method with attention A


@pytest.mark.parametrize("method", sorted(METHODS))
def test_every_method_declares_what_it_does(method):
    """The flag checks, the plan and validation ask METHODS[name].kind before any model loads, never the name: a
    declaration that lied would let a bad flag through (or refuse a good one), so each is checked against the
    module it builds."""
    declared = METHODS[method].kind
    assert isinstance(declared, Kind)
    g, ctx = built(method)
    assert declared.tokens == (ctx.C is not None) == (g.context_tokens > 0)
    team = TEAMS["tiny"]
    assert (g.pool.names if hasattr(g, "pool") else None) == \
        {"team": team["experts"], "policy": [team["policy"]], None: None}[declared.experts]
    assert declared.router == hasattr(g, "encoder")
    assert declared.state_norm == isinstance(getattr(g, "norm", None), StateNorm)
    assert declared.hints == any(h is not None for h in ctx.hints)
    assert declared.answers == hasattr(g, "answer")


@pytest.mark.parametrize("pooling", ["first_token", "first_layer", "random_token", "random_layer"])
def test_every_pooling_mode_trains_and_evaluates(tmp_path, pooling):
    ms = train_and_score(str(tmp_path / pooling), ["--team", "tiny", "--pooling", pooling])
    assert len(ms[0]["utilization"]) == 3


def test_untrained_policy_is_scored(tmp_path):
    res = subprocess.run([sys.executable, "evaluate.py", "--untrained", "--task", "chain_sum", "--team", "tiny",
                          "--n", "3", "--max-new-tokens", "6", "--dataset-size", "8", "--out", str(tmp_path)],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    result = json.load(open(tmp_path / "untrained-chain_sum-tiny.json"))
    assert result["method"] == "untrained" and result["n"] == 3


@pytest.mark.pocket
def test_pocket_team_trains_one_step_and_evaluates(tmp_path):
    """The README's pocket command, shortened: real models, offline, on CPU."""
    out = str(tmp_path / "pocket")
    args = ["--task", "chain_sum", "--task-config", '{"min_terms": 2, "max_terms": 2, "max_digits": 2}',
            "--team", "pocket", "--worked-example", "--response-prefix", "<think>", "--context-position", "before",
            "--device", "cpu", "--dataset-size", "16", "--steps", "1", "--batch-size", "1", "--grad-accum", "1",
            "--group-size", "2", "--max-new-tokens", "16", "--out", out]
    res = subprocess.run([sys.executable, "train.py", *args], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-2000:]
    m = json.loads(open(os.path.join(out, "metrics.jsonl")).readline())
    assert len(m["utilization"]) == 3 and m["kl"] < 1e-6
    res = subprocess.run([sys.executable, "evaluate.py", "--run", out, "--n", "2"], cwd=ROOT, capture_output=True,
                         text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-2000:]
    assert json.load(open(os.path.join(out, "eval.json")))["n"] == 2
