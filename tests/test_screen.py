"""experiments/screen.py: the rule that picks the testbed, the shared-prefix forward, a tiny end-to-end pass."""
import json
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "experiments"))
import screen  # noqa: E402


def row(single, alone, probe, layers=3):
    """single / alone: lists of per-item scores (alone: {model: list}); probe: {model: [exact at the three depths]},
    stored as results.json does, under hidden-state indices 1, 2, 3 of a model with `layers` = 3."""
    return {"single": None if single is None else {"score": sum(single) / len(single), "per_item": single},
            "alone": {m: {"score": sum(s) / len(s), "per_item": s} for m, s in alone.items()},
            "probe": {m: {"exact": {str(k): v for k, v in zip((1, 2, 3), ex)}, "layers": layers}
                      for m, ex in probe.items()}}


def scores(exact, partial=0, n=10):
    """n per-item scores: `exact` items scored 1, `partial` scored 0.5, the rest 0."""
    return [1.0] * exact + [0.5] * partial + [0.0] * (n - exact - partial)


def test_rule_reads_the_arms_expert_at_the_arms_depth_with_exact_scores():
    """The corrected rule. Under the first rule (best probe of any expert at any depth, mean scores) the traps c, d
    and f could win (it picked f here) and e, eligible on exact rates only, could not; here e wins."""
    rows = {
        # eligible: qwen 8/10 alone vs single 2/10; gap at the final state 0.50 - 0.20 = 0.30
        "a": row(scores(2), {"qwen1.5b": scores(8)}, {"smollm2": [0.3, 0.1, 0.2], "qwen1.5b": [0.1, 0.2, 0.5]}),
        # eligible with a smaller gap: 0.30 - 0.10 = 0.20
        "b": row(scores(1), {"qwen1.5b": scores(9)}, {"smollm2": [0.0, 0.0, 0.1], "qwen1.5b": [0.0, 0.0, 0.3]}),
        # trap 1: MiniLM's probe is far above the policy's, Qwen's is not (the first verdict's lcm)
        "c": row(scores(1), {"qwen1.5b": scores(9)}, {"smollm2": [0.0, 0.0, 0.1], "qwen1.5b": [0.0, 0.0, 0.1],
                                                       "minilm": [0.9, 0.9, 0.9]}),
        # trap 2: Qwen's probe is high only at depth 1/3, which the arms do not read
        "d": row(scores(1), {"qwen1.5b": scores(9)}, {"smollm2": [0.0, 0.0, 0.1], "qwen1.5b": [0.9, 0.0, 0.1]}),
        # single's partial credit: 1 exact + 8 halves, mean 0.5 but exact 0.1; qwen 0.6 exact is >= 0.1 + 0.2
        # (on mean scores 0.6 < 0.5 + 0.2 would rule it out): eligible, and the largest gap, 0.9: the testbed
        "e": row(scores(1, 8), {"qwen1.5b": scores(6)}, {"smollm2": [0.0] * 3, "qwen1.5b": [0.0, 0.0, 0.9]}),
        # trap 4: qwen's mean score passes (2 exact + 8 halves = 0.6) but its exact rate 0.2 < single 0.1 + 0.2
        "f": row(scores(1), {"qwen1.5b": scores(2, 8)}, {"smollm2": [0.0] * 3, "qwen1.5b": [0.0, 0.0, 0.9]}),
        # single > 60 % exact
        "g": row(scores(7), {"qwen1.5b": scores(10)}, {"smollm2": [0.0] * 3, "qwen1.5b": [0.0, 0.0, 0.9]}),
        # single not run, gap larger than the chosen one's: open (it could still become the testbed)
        "h": row(None, {"qwen1.5b": scores(9)}, {"smollm2": [0.0] * 3, "qwen1.5b": [0.0, 0.0, 0.95]}),
        # single not run, gap smaller: undecided, but it cannot change the choice
        "i": row(None, {"qwen1.5b": scores(9)}, {"smollm2": [0.0] * 3, "qwen1.5b": [0.0, 0.0, 0.1]}),
        # qwen alone below 20 %: ruled out without a single
        "j": row(None, {"qwen1.5b": scores(1)}, {"smollm2": [0.0] * 3, "qwen1.5b": [0.0, 0.0, 0.9]}),
    }
    chosen, v = screen.pick_testbed(rows)
    assert chosen == "e" and v["e"]["single"] == 0.1 and v["e"]["probe_gap"] == pytest.approx(0.9)
    assert v["a"]["eligible"] and v["b"]["eligible"] and v["a"]["probe_gap"] == pytest.approx(0.30)
    assert v["a"]["single"] == 0.2 and v["a"]["expert_alone"] == 0.8
    assert [v[t]["eligible"] for t in "cdfghij"] == [False] * 7
    assert "<=" in v["c"]["why"] and "<=" in v["d"]["why"]
    assert v["f"]["expert_alone"] == 0.2 and "< single" in v["f"]["why"]
    assert "single 70.0 > 60" in v["g"]["why"]
    assert v["h"]["open"] and v["h"]["why"].startswith("undecided") and not v["i"]["open"]
    assert "cannot reach" in v["j"]["why"] and not v["j"]["open"]
    # without e, a wins over b (gap 0.30 against 0.20)
    assert screen.pick_testbed({t: r for t, r in rows.items() if t != "e"})[0] == "a"
    # the arms read another depth: then trap 2 is the one with the largest gap there
    assert screen.pick_testbed(rows, depth=1 / 3)[0] == "d"
    # exactly at the thresholds: eligible (single 60 %, qwen alone = single + 20 points)
    edge = {"k": row(scores(6), {"qwen1.5b": scores(8)}, {"smollm2": [0.0] * 3, "qwen1.5b": [0.1] * 3})}
    assert screen.pick_testbed(edge)[0] == "k"


def test_rule_says_none_when_nothing_qualifies_and_costs_what_is_missing():
    rows = {"g": row(scores(7), {"qwen1.5b": scores(10)}, {"smollm2": [0.0] * 3, "qwen1.5b": [0.9] * 3}),
            "h": row(None, {"qwen1.5b": scores(9)}, {"smollm2": [0.0] * 3, "qwen1.5b": [0.0, 0.0, 0.8]})}
    rows["g"]["single"]["seconds"], rows["g"]["alone"]["qwen1.5b"]["seconds"] = 600.0, 90.0
    chosen, v = screen.pick_testbed(rows)
    assert chosen is None and v["h"]["open"]
    need, cost = screen.rerun_seconds(rows, v)
    assert need == {"h": (["single"], 600.0)} and cost["alone"] == 90.0
    table = screen.markdown({"rows": rows, "meta": {"models": ["smollm2", "qwen1.5b"]}})
    assert "none met the rule" in table and "| h | single | 0.17 | yes |" in table


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
