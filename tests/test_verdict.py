"""experiments/verdict.py's pre-registered analysis on synthetic records: the endpoints are taken seed by seed on
the same items, the family is tested one-sided and Holm-adjusted, and the verdict needs every endpoint of one
variant. Also why the design has 8 seeds: with 6, no Holm-adjusted p of an 8-test family can fall below 0.05;
and that README.md quotes the verdict the archived records give."""
import os
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "experiments"))
from verdict import FAMILY, analyse, costs, headline, markdown  # noqa: E402

from lib.stats import holm, sign_flip_p  # noqa: E402


def record(score, shuffled=None, strong=0.25, n=100, seed=0):
    """An archived run: per-item 0/1 scores with the given mean (first round(score * n) items right)."""
    k = int(round(score * n))
    items = {"with_C": {"score": [1.0] * k + [0.0] * (n - k)}}
    if shuffled is not None:
        j = int(round(shuffled * n))
        items["shuffled_C"] = {"score": [1.0] * j + [0.0] * (n - j)}
    metrics = [{"step": s, "utilization": [0.25, 0.25, 0.25, strong]} for s in range(1, 16)]
    return {"eval": {"score": k / n, "per_item": items}, "metrics": metrics, "cfg": {"seed": seed}}


def runs_with(effect, seeds=8, rng=np.random.default_rng(0)):
    runs = {a: {} for a in ("single", "soft_prompt", "ours", "ours_cf", "random")}
    for s in range(seeds):
        base = 0.3 + 0.1 * rng.random()
        runs["single"][s] = record(base, seed=s)
        runs["soft_prompt"][s] = record(base + 0.02, shuffled=base + 0.02, seed=s)
        runs["random"][s] = record(base - 0.1, shuffled=base - 0.1, strong=0.25, seed=s)
        runs["ours"][s] = record(base + effect, shuffled=base, strong=0.25 + effect, seed=s)
        runs["ours_cf"][s] = record(base, shuffled=base, strong=0.25, seed=s)
    return runs


def test_a_consistent_effect_over_8_seeds_passes_and_no_effect_does_not():
    rows, verdict = analyse(runs_with(0.15))
    fam = {r["name"]: r for r in rows if r["kind"] == "family"}
    assert [r["name"] for r in rows if r["kind"] == "family"] == [f[0] for f in FAMILY]
    assert fam["H1a"]["better"] == 8 and fam["H1a"]["p"] == 1 / 256
    assert fam["H1a"]["mean"] > 0.1 and fam["H2"]["mean"] > 0.1 and fam["H3"]["mean"] > 0.1
    assert all(fam[h]["p_holm"] < 0.05 for h in ("H1a", "H1b", "H2", "H3"))
    assert fam["H1a-cf"]["p_holm"] > 0.05                 # ours_cf equals single: no effect
    assert verdict.startswith("RL shapes collaboration")
    md = markdown(rows, verdict, runs_with(0.15))  # every seed +15 points: the interval is that point
    assert "| H1a | family | 8 | +15.0 ± 0.0 | [+15.0, +15.0] | 8 / 0 | 0.00391 | 0.0312 |" in md
    runs = runs_with(0.15)  # its base scores are drawn anew each time
    lines = headline(*analyse(runs), runs)
    assert lines[0].startswith("**Verdict: RL shapes collaboration here") and len(lines) == 6 + 2 + 1 + 5
    assert lines[1].startswith("- `ours` − `single`: +15.0 points [+15.0, +15.0], 8 / 0 seeds, Holm p = 0.0312;")
    single = [100 * r["eval"]["score"] for r in runs["single"].values()]
    assert f"| `single` | {np.mean(single):.1f} ± {np.std(single, ddof=1):.1f} | 8 |" in lines
    rows, verdict = analyse(runs_with(0.0))
    assert verdict.startswith("not shown")


def test_a_missing_arm_makes_the_verdict_incomplete_not_negative():
    runs = runs_with(0.15)
    del runs["random"]
    rows, verdict = analyse(runs)
    assert verdict.startswith("incomplete")
    assert headline(rows, verdict, runs) == [  # no partial numbers in the README
        "**The verdict is running** (pre-registered: 8 arms × 8 seeds on lcm, one-sided exact sign-flip tests over "
        "seeds, Holm over 8): 32 of 64 runs archived; a partial table is no claim."]


def test_seven_of_eight_seeds_are_incomplete_not_negative():
    """Regression: the verdict read "not shown" as soon as every family test had two seeds, where the
    pre-registration says a missing seed of any arm leaves it incomplete, never negative."""
    runs = runs_with(0.0)
    del runs["ours_cf"][7]
    _, verdict = analyse(runs)
    assert verdict.startswith("incomplete")
    _, verdict = analyse(runs_with(0.0, seeds=7))
    assert verdict.startswith("incomplete")


def test_six_seeds_could_never_pass_an_eight_test_holm_family():
    """The smallest one-sided exact p with n seeds is 2^-n; Holm's first step multiplies it by the family's 8."""
    assert min(holm([sign_flip_p([1.0] * 6, "greater")] * 8)) > 0.05      # 8 / 64 = 0.125
    assert max(holm([sign_flip_p([1.0] * 8, "greater")] * 8)) < 0.05      # 8 / 256 = 0.031


def test_a_partial_table_prints_dashes_not_nan():
    """Seeds still running: a row with no seed reads "–", one seed gives its difference and no p."""
    runs = runs_with(0.15, seeds=1)
    rows, verdict = analyse(runs)
    md = markdown(rows, verdict, runs)
    assert "nan" not in md and verdict.startswith("incomplete")
    assert "| H1a | family | 1 | +15.0 | – | 1 / 0 | – (needs 2 seeds) | – |" in md


def test_costs_sum_every_timed_run_and_name_the_untimed(tmp_path):
    import json
    for name, t in [("single-s0", {"train_seconds": 1800, "eval_seconds": 600, "load_average_after": [1, 2, 3],
                                   "cpu": "AVX512"}),
                    ("ours-s0", {"train_seconds": 3600, "eval_seconds": 1200, "note": "resumed"}), ("random-s0", None),
                    ("ours-s1", {"eval_seconds": 360, "note": "training not timed"})]:
        (tmp_path / name).mkdir()
        if t:
            (tmp_path / name / "timing.json").write_text(json.dumps(t))
    md = costs(str(tmp_path))
    assert "| single-s0 | 1800 | 600 | 1.0, 2.0, 3.0 | AVX512 |  |" in md
    assert "| ours-s0 | 3600 | 1200 | – | – | resumed |" in md
    assert "| ours-s1 | – | 360 | – | – | training not timed |" in md
    assert ("Total: 2.10 core-hours over 3 timed runs (not counted: the unrecorded training or evaluation of "
            "ours-s1); without timing: random-s0.") in md


def test_runs_on_two_instruction_sets_are_marked_in_the_table():
    """A seed's run is another run on another CPU instruction set (float sums in another order): when the
    archive mixes them, every score says where it ran; when it does not, the table stays plain."""
    runs = runs_with(0.15, seeds=2)
    for arm in runs:
        for seed, rec in runs[arm].items():
            rec["cpu"] = "AVX2" if seed == 0 else "AVX512"
    md = markdown(*analyse(runs), runs)
    assert "(AVX2)" in md and "(AVX512)" in md and "ran on (AVX2, AVX512" in md
    for arm in runs:
        for rec in runs[arm].values():
            rec["cpu"] = "AVX2"
    md = markdown(*analyse(runs), runs)
    assert "(AVX2)" not in md


def test_the_family_on_seeds_of_one_instruction_set_is_printed_when_runs_mix_them():
    """Amendment 2: with runs on two instruction sets, the family's mean differences on the seeds whose arms all
    ran on one of them are printed as exploratory."""
    from verdict import one_cpu_seeds
    runs = runs_with(0.15, seeds=3)
    for arm in runs:
        for seed, rec in runs[arm].items():
            rec["cpu"] = "AVX2" if seed < 2 else "AVX512"
    runs["single"][1]["cpu"] = "AVX512"  # seed 1 mixes them
    assert one_cpu_seeds(runs) == [0, 2]
    md = markdown(*analyse(runs), runs)
    assert "seeds whose arms all ran on one instruction set: 0, 2;" in md and "H1a +15.0 (2)" in md


def test_the_readme_quotes_the_verdict_the_archive_gives():
    """README.md's verdict line is the first line of results/verdict/headline.md, and that file is what
    --analyse writes from the archived runs: neither can fall behind the records."""
    from verdict import RESULTS, headline, load
    runs = load(os.path.join(RESULTS, "runs"))
    lines = headline(*analyse(runs), runs)
    with open(os.path.join(RESULTS, "headline.md")) as f:
        assert f.read().splitlines() == lines, "results/verdict/headline.md is stale: run verdict.py --analyse"
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    assert lines[0] in readme.splitlines(), "README.md's verdict differs from results/verdict/headline.md"


def test_int8_learning_pairs_each_seed_item_by_item(tmp_path):
    """experiments/int8_learning.py's table on two synthetic seeds, its numbers worked out by hand."""
    import json

    from int8_learning import analyse as int8_table

    def write(folder, items, seconds, gap=None):
        os.makedirs(folder)
        json.dump({"score": float(np.mean(items)), "per_item": {"with_C": {"score": items}}},
                  open(os.path.join(folder, "eval.json"), "w"))
        extra = {} if gap is None else {"rollout_logp_gap": gap, "is_weight_clipped_fraction": 0.02}
        with open(os.path.join(folder, "metrics.jsonl"), "w") as f:
            for s in seconds:
                f.write(json.dumps({"seconds": s, **extra}) + "\n")
            if gap is not None:  # a step that trained nothing logs no gap: left out of the mean, not a KeyError
                f.write(json.dumps({"seconds": float(np.median(seconds))}) + "\n")
        json.dump({"cpu": "AVX512"}, open(os.path.join(folder, "timing.json"), "w"))

    f32, res = tmp_path / "f32", tmp_path / "int8"
    write(f32 / "single-s2", [1, 0, 0, 0], [40, 50, 60])       # 25 %, median 50 s a step
    write(res / "runs" / "single_int8-s2", [1, 1, 1, 0], [20, 25, 90], gap=0.2)  # 75 %: 2 items better
    write(f32 / "single-s4", [1, 1, 0, 0], [30, 30, 30])       # 50 %
    write(res / "runs" / "single_int8-s4", [0, 1, 0, 0], [15, 15, 15], gap=0.2)  # 25 %: 1 item worse
    md = int8_table(str(res), str(f32))
    assert "| 2 | 25.0 | 75.0 | +50.0 [" in md and "| 2 / 0 | 50.0 | 25.0 | 0.200 | 2.0 % | AVX512 / AVX512 |" in md
    assert "| 4 | 50.0 | 25.0 | -25.0 [" in md and "| 0 / 1 | 30.0 | 15.0 |" in md
    # over seeds: mean of +50 and -25, sd sqrt(((37.5)^2 + (37.5)^2) / 1) = 53.0; one seed each way;
    # the sign-flip p over {+50, -25}: all 4 sign patterns have |mean| >= 12.5 (12.5 or 37.5) -> p = 1
    assert "int8 − float32 +12.5 ± 53.0 points (no 95 % interval over fewer than 6 seeds); 1 / 1 seeds" in md
    assert "p = 1 (two-sided)" in md and "2.00×, 2.00× (median 2.00×)" in md
