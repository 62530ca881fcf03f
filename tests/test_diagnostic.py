"""experiments/diagnostic.py: each arm is its verdict twin with one flag changed, and the pre-registered measures and
predictions read synthetic records as results/diagnostic/preregistration.md says."""
import json
import os
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "experiments"))
import diagnostic  # noqa: E402

from support.harness.checks import parse_args  # noqa: E402

TWIN = os.path.join(ROOT, "results", "verdict2", "runs", "ours_strong-s0", "config.json")
RUN_ONLY = {"out", "resume", "expert_cache", "team_models", "device_used", "processes", "steps"}


@pytest.mark.parametrize("arm, changed", [("paper_lr", {"lr": 1e-4}), ("frozen_policy", {"freeze_policy": True})])
def test_each_arm_is_its_twin_with_one_flag_changed(arm, changed):
    with open(TWIN) as f:
        twin = json.load(f)
    mine = vars(parse_args([*diagnostic.flags(arm, 0, 100), "--out", "/tmp/unused"]))
    differ = {k: mine[k] for k in twin if k not in RUN_ONLY and mine.get(k) != twin[k]}
    assert differ == changed and mine["steps"] == 100


def record(flat, g, shuffled, anchor=0.0, steps=300):
    """A run folder's content: `steps` metric lines with constant flat fraction and g_phi gradient, and paired
    evaluations at 100/200/300 with C − shuffled C = shuffled[k] points (exact)."""
    metrics = [{"step": i + 1, "zero_std_fraction": flat, "grad_norm_g_phi": g, "trained_group_fraction": 1 - flat,
                "answer_rate": 1.0, "c_rms": 1.0, "embed_rms": 1.0} for i in range(steps)]
    evals = {}
    for s, d in zip(diagnostic.CHECKPOINTS, shuffled):
        cond = {"with_C": {"solve_rate": 0.4 + d / 100, "gold_logprob": -1.0},
                "shuffled_C": {"solve_rate": 0.4, "gold_logprob": -1.5},
                "zero_C": {"solve_rate": 0.4 + (d - anchor) / 100, "gold_logprob": -1.2}}
        evals[s] = {"step": s, "conditions": cond}
    return {"metrics": metrics, "eval": evals, "timing": {}}


def test_measures_read_the_windows_and_the_checkpoints():
    m = diagnostic.measures(record(0.5, 0.2, (1, 3, 6), anchor=2))
    assert m["flat_early"] == m["flat_late"] == 0.5 and m["g_late"] == pytest.approx(0.2)
    assert m["signal"] == round(300 * 0.5 * 32)
    assert [round(m[f"shuffled_{s}"]) for s in (100, 200, 300)] == [1, 3, 6] and round(m["anchor_300"]) == 2
    assert m["shuffled_gold_300"] == pytest.approx(0.5)


def test_the_item_level_test_of_one_run_is_read_from_its_evaluation():
    rec = record(0.5, 0.2, (1, 3, 16))
    rec["eval"][300]["paired"] = {"with_C - shuffled_C": {"score": {"diff": 0.16, "ci95": [0.07, 0.25], "better": 20,
                                                                    "worse": 4, "p_sign": 0.0015, "n": 100}}}
    m = diagnostic.measures(rec)
    assert "shuffled_items_200" not in m and diagnostic.items(m.get("shuffled_items_200")) == "–"
    assert diagnostic.items(m["shuffled_items_300"]) == "[+7, +25], 20 / 4, p 0.0015"


def test_the_predictions_in_the_preregistrations_words():
    twin = diagnostic.measures(record(0.96, 0.007, (0, 0, 0)))
    explored = diagnostic.predictions("paper_lr", diagnostic.measures(record(0.6, 0.2, (1, 2, 5))), twin)
    assert all(explored.values()) and len(explored) == 4
    collapsed = diagnostic.predictions("paper_lr", diagnostic.measures(record(0.98, 0.001, (0, 0, 0))), twin)
    assert not any(collapsed.values())
    frozen = diagnostic.measures(record(0.95, 0.05, (0, 0, -1)))
    assert diagnostic.starvation(frozen) is True
    assert diagnostic.predictions("frozen_policy", frozen, twin) == {
        "flat fraction of first draws, steps 200-300, <= 0.70": False,
        "g_phi gradient median, steps 200-300, >= 0.1": False, "C - shuffled at step 300 > 0": False}
    for steps in (150, 200, 299):   # the window 200-300 is read only once it is whole
        early = diagnostic.predictions("paper_lr", diagnostic.measures(record(0.5, 0.3, (1, 0, 0), steps=steps)), twin)
        assert early["flat fraction of first draws, steps 200-300, <= 0.70"] is None, steps
        assert early["g_phi gradient median, steps 200-300, >= 0.1"] is None, steps


def write(folder, rec, hours):
    os.makedirs(folder)
    with open(os.path.join(folder, "metrics.jsonl"), "w") as f:
        f.writelines(json.dumps(m) + "\n" for m in rec["metrics"])
    for s, e in rec["eval"].items():
        with open(os.path.join(folder, f"eval_paired-{s}.json"), "w") as f:
            json.dump(e, f)
    with open(os.path.join(folder, "timing.json"), "w") as f:
        json.dump({"train_seconds": hours * 3600}, f)


def test_a_third_seed_goes_to_an_arm_whose_seeds_disagree_within_the_budget(tmp_path):
    records = str(tmp_path)
    assert diagnostic.plan(records)[-1][0] == "frozen_policy-s1" and len(diagnostic.plan(records)) == 4
    write(os.path.join(records, "paper_lr-s0"), record(0.6, 0.2, (1, 2, 5)), 2.0)
    write(os.path.join(records, "paper_lr-s1"), record(0.98, 0.001, (0, 0, 0)), 2.0)
    write(os.path.join(records, "frozen_policy-s0"), record(0.6, 0.2, (1, 2, 5)), 2.0)
    assert diagnostic.third_seed_arms(records) == []              # decided only once all four are in
    write(os.path.join(records, "frozen_policy-s1"), record(0.6, 0.2, (1, 2, 5)), 2.0)
    assert diagnostic.third_seed_arms(records) == ["paper_lr"]    # P's seeds disagree, F's agree
    assert [n for n, _, _ in diagnostic.plan(records)][-1] == "paper_lr-s2"
    costly = str(tmp_path / "costly")                            # the same runs at 3.5 h each: 14 h spent already
    for name in ("paper_lr-s0", "paper_lr-s1", "frozen_policy-s0", "frozen_policy-s1"):
        write(os.path.join(costly, name), diagnostic.load_run(os.path.join(records, name)), 3.5)
    assert diagnostic.third_seed_arms(costly) == []


def test_the_results_prose_table_is_what_the_records_give():
    """results/diagnostic/README.md's table, recomputed from the committed records and the twins' (the same `measures`
    table.md uses): every finished run and its twin has its row; a number typed by hand that the records do not give
    fails here."""
    text = open(os.path.join(ROOT, "results", "diagnostic", "README.md")).read()
    records = os.path.join(ROOT, "results", "diagnostic", "runs")

    def cells(m):
        three = lambda key: " / ".join(  # noqa: E731
            "–" if m.get(f"{key}_{s}") is None else f"{m[f'{key}_{s}']:+.0f}".replace("-", "−")
            for s in diagnostic.CHECKPOINTS)
        return (f"| {m['flat_early']:.2f} → {m['flat_late']:.2f} | {m['g_early']:.3f} → {m['g_late']:.3f} | "
                f"{three('shuffled')} | {three('anchor')} | {m['exact_300']:.0f} % |")
    label = {"paper_lr": "P: LoRA lr 1e-4", "frozen_policy": "F: policy frozen"}
    done = [n for n in sorted(os.listdir(records)) if diagnostic.finished(records, n)]
    assert done, "no finished run in results/diagnostic/runs"
    rows = {}
    for name in done:
        arm, seed = name.rsplit("-s", 1)
        rows[f"s{seed} {label[arm]}"] = diagnostic.measures(diagnostic.load_run(os.path.join(records, name)))
        rows[f"s{seed} twin (LoRA lr 1e-3)"] = diagnostic.twin_measures(int(seed))
    for name, m in rows.items():
        assert f"| {name} {cells(m)}" in text, (name, cells(m))


def test_the_figures_windows_trail_and_skip_missing_steps():
    x = np.array([1.0, np.nan, 3.0, 5.0, 7.0])
    assert diagnostic.rolling(x, 2, np.nanmean).tolist() == [1.0, 1.0, 3.0, 4.0, 6.0]
    assert diagnostic.rolling(x, 3, np.nanmedian).tolist() == [1.0, 1.0, 2.0, 4.0, 5.0]


def test_the_figure_is_drawn_per_seed_from_the_records(tmp_path):
    pytest.importorskip("matplotlib")
    records = str(tmp_path / "runs")
    assert diagnostic.curves(records, str(tmp_path / "none.png")) is None   # no records: nothing drawn
    write(os.path.join(records, "paper_lr-s0"), record(0.6, 0.2, (1, 2, 5)), 2.0)
    write(os.path.join(records, "frozen_policy-s1"), record(0.9, 0.01, (0, 0, -1), steps=120), 2.0)
    path = diagnostic.curves(records, str(tmp_path / "curves.png"))
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_over_seeds_pairs_p_with_its_twin_and_reads_only_finished_runs(tmp_path):
    records = str(tmp_path)
    write(os.path.join(records, "paper_lr-s0"), record(0.6, 0.2, (1, 2, 5)), 2.0)
    write(os.path.join(records, "paper_lr-s1"), record(0.6, 0.2, (1, 2, 3)), 2.0)
    write(os.path.join(records, "frozen_policy-s0"), record(0.6, 0.2, (1, 2, -1)), 2.0)
    unfinished = record(0.6, 0.2, (9, 9, 9))
    del unfinished["eval"][300]
    write(os.path.join(records, "frozen_policy-s1"), unfinished, 1.0)
    twins = [diagnostic.twin_measures(s)["shuffled_300"] for s in (0, 1)]   # the verdict's: +0 and +0
    lines = diagnostic.over_seeds(records)
    assert lines[0] == (f"P − its twin, C − shuffled at step 300 over seeds 0, 1: mean {(8 - sum(twins)) / 2:+.1f} "
                        f"points ({5 - twins[0]:+.0f}, {3 - twins[1]:+.0f}), one-sided sign-flip p = 0.25")
    assert lines[1] == "F, C − shuffled at step 300 over seeds 0: mean -1.0 points (-1), one-sided sign-flip p = 1"
    nothing = str(tmp_path / "not yet")   # before the first record: a table of the twins alone, no error
    assert diagnostic.over_seeds(nothing) == [] and "third-seed arms by the rule: none" in diagnostic.table(nothing)


def test_the_flat_onset_is_the_first_whole_window_at_the_level():
    rec = {"metrics": [{"zero_std_fraction": 0.0}] * 50 + [{"zero_std_fraction": 1.0}] * 50}
    assert diagnostic.flat_onset(rec) == 73          # 23 of the 25 steps 49..73 are flat: 0.92 >= 0.90
    assert diagnostic.flat_onset({"metrics": [{"zero_std_fraction": 1.0}] * 24}) is None   # no whole window yet
    assert diagnostic.flat_onset({"metrics": [{"zero_std_fraction": 0.8}] * 300}) is None


def test_the_results_prose_quotes_the_analysis_of_the_records():
    """The predictions' outcomes, the lines over seeds and the exploratory onsets in results/diagnostic/README.md are
    what `--analyse` gives from the committed records, line for line."""
    text = open(os.path.join(ROOT, "results", "diagnostic", "README.md")).read()
    records = os.path.join(ROOT, "results", "diagnostic", "runs")
    lines = diagnostic.table(records).splitlines()
    start = lines.index("| run | prediction | outcome |")
    finished = lambda line: diagnostic.finished(records, line.split(" | ")[0].strip("| "))  # noqa: E731
    quoted = [line for line in lines[start + 2:lines.index("", start)] if finished(line)]   # a running run's: "–"
    quoted += diagnostic.over_seeds(records) + diagnostic.onsets(records) + [diagnostic.onset_split(records)]
    missing = [line for line in quoted if line not in text]
    assert not missing, missing


def test_the_onset_split_counts_the_settings_where_readers_went_flat_last(tmp_path, monkeypatch):
    def flat_from(step, shuffled):   # flat share 0 until `step`, 1 after; C − shuffled at 300
        rec = record(0.0, 0.1, (0, 0, shuffled))
        for m in rec["metrics"][step:]:
            m["zero_std_fraction"] = 1.0
        return rec
    twins, records = str(tmp_path / "twins"), str(tmp_path / "runs")
    monkeypatch.setattr(diagnostic, "TWINS", twins)
    write(os.path.join(twins, "ours_strong-s0"), flat_from(40, 0), 1.0)
    write(os.path.join(records, "paper_lr-s0"), flat_from(150, 12), 1.0)
    assert diagnostic.onset_split(records) == (
        "Of the 2 co-trained runs, 1 read C at step 300; they all went flat later than every other in 12 of 12 "
        "settings (flat level / window, steps): 0.80/10, 0.80/25, 0.80/50, 0.85/10, 0.85/25, 0.85/50, 0.90/10, "
        "0.90/25, 0.90/50, 0.95/10, 0.95/25, 0.95/50.")
    write(os.path.join(twins, "ours_strong-s1"), record(0.0, 0.1, (0, 0, 0)), 1.0)   # never flat, C unread
    assert diagnostic.onset_split(records).endswith("in 0 of 12 settings (flat level / window, steps): none.")
