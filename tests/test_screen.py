"""experiments/screen.py: the rule that picks the testbed, the shared-prefix forward, a tiny end-to-end pass."""
import json
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "experiments"))
import screen  # noqa: E402


def row(single, alone, probe):
    """alone: {model: score}; probe: {model: [exact at the three depths]}."""
    return {"single": None if single is None else {"score": single},
            "alone": {m: {"score": s} for m, s in alone.items()},
            "probe": {m: {"exact": {str(k): v for k, v in zip((1, 2, 3), ex)}} for m, ex in probe.items()}}


def test_rule_picks_the_largest_probe_gap_among_eligible_tasks():
    rows = {
        # eligible, gap 0.30 - 0.10 = 0.20
        "a": row(0.30, {"smollm2": 0.2, "qwen1.5b": 0.60}, {"smollm2": [0.05, 0.10, 0.0], "qwen1.5b": [0.1, 0.3, 0.2]}),
        # eligible, gap 0.40 - 0.05 = 0.35: the winner
        "b": row(0.10, {"smollm2": 0.1, "gemma3": 0.35}, {"smollm2": [0.05, 0.0, 0.0], "minilm": [0.4, 0.1, 0.0]}),
        # larger gap, but single > 60 %
        "c": row(0.70, {"smollm2": 0.5, "qwen1.5b": 0.99}, {"smollm2": [0.0, 0.0, 0.0], "qwen1.5b": [0.9, 0.9, 0.9]}),
        # larger gap, but the best expert is only 19 points above single
        "d": row(0.20, {"smollm2": 0.1, "qwen1.5b": 0.39}, {"smollm2": [0.0, 0.0, 0.0], "qwen1.5b": [0.8, 0.8, 0.8]}),
        # the policy's own base alone does not count as an expert
        "e": row(0.10, {"smollm2": 0.90, "qwen1.5b": 0.2}, {"smollm2": [0.0, 0.0, 0.0], "qwen1.5b": [0.7, 0.7, 0.7]}),
        # single not run
        "f": row(None, {"smollm2": 0.1, "qwen1.5b": 0.9}, {"smollm2": [0.0, 0.0, 0.0], "qwen1.5b": [0.9, 0.9, 0.9]}),
    }
    chosen, v = screen.pick_testbed(rows)
    assert chosen == "b"
    assert v["a"]["eligible"] and v["b"]["eligible"]
    assert v["a"]["probe_gap"] == pytest.approx(0.20) and v["b"]["probe_gap"] == pytest.approx(0.35)
    assert [v[t]["eligible"] for t in "cdef"] == [False] * 4
    assert "single 70.0 > 60" in v["c"]["why"] and "< single + 20" in v["d"]["why"] and "< single + 20" in v["e"]["why"]
    assert v["f"]["why"] == "single did not run"
    # exactly at the thresholds: eligible
    edge = {"g": row(0.60, {"smollm2": 0.0, "qwen1.5b": 0.80}, {"smollm2": [0.0] * 3, "qwen1.5b": [0.1] * 3})}
    assert screen.pick_testbed(edge)[0] == "g"


def test_rule_says_none_when_nothing_qualifies():
    rows = {"c": row(0.70, {"smollm2": 0.5, "qwen1.5b": 0.99}, {"smollm2": [0.0] * 3, "qwen1.5b": [0.9] * 3})}
    chosen, _ = screen.pick_testbed(rows)
    assert chosen is None
    assert "none met the rule" in screen.markdown({"rows": rows, "meta": {"models": ["smollm2", "qwen1.5b"]}})


@pytest.mark.parametrize("name", ["tiny:llama", "tiny:qwen2"])
def test_shared_prefix_forward_matches_a_plain_forward(name):
    from experts import expert_text, load_model
    model, tok = load_model(name)
    questions = ["What is 3 + 4?", "What is 12 + 30?", "What is 7 - 9 + 1?"]
    H, L = screen.last_token_states(model, tok, questions, batch=2)
    assert sorted(H) == screen.depths(L)
    for i, q in enumerate(questions):
        ids = screen.tokenize(tok, [expert_text(tok, q)])[0]
        hs = model.base_model(input_ids=torch.tensor([ids]), output_hidden_states=True).hidden_states
        for k in H:
            torch.testing.assert_close(hs[k][0, -1], H[k][i], atol=1e-4, rtol=1e-4)
    prompts = [screen.rewards.build_prompt(tok, q, response_prefix="<answer>", **screen.SYSTEM) for q in questions]
    got = screen.greedy_answers(model, tok, prompts, 6, batch=2)
    for p, g in zip(prompts, got):
        ids = screen.tokenize(tok, [p])[0]
        ref = model.generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False, pad_token_id=tok.pad_token_id)
        ref_text = tok.decode(ref[0, len(ids):], skip_special_tokens=True)
        assert ref_text.startswith(g)


def test_probe_targets_and_baselines():
    ytr, yte, w = screen.probe_targets(["12", "-7", "12"], ["12", "3"])
    assert w == 3 and ytr.tolist() == [[0, 0, 1, 2], [1, 0, 0, 7], [0, 0, 1, 2]]
    b = screen.majority_baselines(["12", "-7", "12"], ["12", "3"], ytr, yte)
    assert b["majority_answer"] == "12" and b["majority_exact"] == 0.5
    assert screen.probe_targets(["1/2"], ["3"]) is None
    assert screen.close_answer("42\nmore") == "<answer>42</answer>"
    assert screen.close_answer("42</answer>") == "<answer>42</answer>"


def test_tiny_end_to_end(tmp_path):
    res = screen.main(["--team", "tiny", "--only", "chain_sum-2t-1to2d", "--phases", "1", "--n-eval", "4",
                       "--alone-tokens", "3", "--probe-train", "20", "--probe-test", "8", "--out", str(tmp_path)])
    r = res["rows"]["chain_sum-2t-1to2d"]
    assert sorted(r["alone"]) == ["llama", "qwen2"]          # the encoder gets the probe only
    assert sorted(r["probe"]) == ["bert", "llama", "qwen2"]
    assert all(len(p["exact"]) >= 2 for p in r["probe"].values())
    saved = json.load(open(tmp_path / "results.json"))
    assert saved["rows"]["chain_sum-2t-1to2d"]["alone"]["llama"]["n"] == 4
    assert (tmp_path / "table.md").read_text().count("chain_sum-2t-1to2d") >= 2
    # resumable: a second call finds every part done and recomputes nothing
    res2 = screen.main(["--team", "tiny", "--only", "chain_sum-2t-1to2d", "--phases", "1", "--n-eval", "4",
                        "--alone-tokens", "3", "--probe-train", "20", "--probe-test", "8", "--out", str(tmp_path)])
    assert res2["rows"]["chain_sum-2t-1to2d"]["alone"]["llama"]["seconds"] == r["alone"]["llama"]["seconds"]
