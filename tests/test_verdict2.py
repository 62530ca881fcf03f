"""experiments/verdict2.py: every arm's flags are ones train.py accepts in the answer-only protocol, and the
pilot's table reads exact solve rates (score == 1), C − shuffled C and C's drift from the archived records."""
import os
import sys
from pathlib import Path

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "experiments"))
from verdict2 import HYPER, PILOT_LRS, PROMPT, TASK, pilot_arms, pilot_choice, pilot_table  # noqa: E402

from support.harness.checks import parse_args  # noqa: E402
from support.harness.gold import answer_bridge  # noqa: E402


def test_every_pilot_arm_parses_in_the_answer_only_protocol():
    for arm, flags in pilot_arms().items():
        args = parse_args(TASK + PROMPT + HYPER + flags + ["--seed", "0"])
        assert args.task == "gcd" and args.max_new_tokens == 8 and args.format_bonus == 0
        assert args.reward == "exact" and args.system_prompt == "direct" and args.worked_example
        assert answer_bridge(args.response_prefix) == ""       # the prefix opened the answer block
        assert args.steps * args.batch_size * args.group_size == 960   # 4x the first verdict's 240 completions
        if arm != "single":
            assert args.method == "ours" and args.experts == "pocket:qwen2.5-coder-1.5b-instruct"
            assert f"{args.router_lr:g}" == f"{float(arm.split('lr')[1]):g}"
    assert {a.split("lr")[1] for a in pilot_arms() if "lr" in a} == set(PILOT_LRS)


def record(with_c, shuffled=None, anchor=None, c_rms=(0.1, 0.3)):
    def cond(k, n=100):
        return {"score": k / n, "solve_rate": k / n, "gold_logprob": -1.0 + k / n}
    ev = {"score": with_c / 100, "solve_rate": with_c / 100}
    if shuffled is not None:
        ev["conditions"] = {"with_C": cond(with_c), "zero_C": cond(anchor), "shuffled_C": cond(shuffled)}
    metrics = [{"step": s, "reward": 0.1 * s, "zero_std_fraction": 0.5, "c_rms": c, "embed_rms": 0.1}
               for s, c in enumerate(c_rms, 1)]
    return {"eval": ev, "metrics": metrics, "cfg": {}}


def test_pilot_table_reads_each_lr_against_single_of_the_same_seed():
    runs = {"single": {0: record(10), 1: record(20)},
            "ours_strong_lr3e-4": {0: record(30, shuffled=20, anchor=5), 1: record(26, shuffled=25, anchor=5)}}
    md = pilot_table(runs)
    assert "| ours_strong_lr3e-4-s0 | 30 | 5 | 20 | +10 | +0.10 | 1.00 → 3.00 |" in md
    assert "| 3e-4 | [0, 1] | +20, +6 | +13.0 | +5.5 |" in md
    assert "| 1e-4 | [] | – | – | – |" in md                       # not run: no numbers made up
    assert "| single-s0 | 10 | – | – | – | – |" in md


def test_seven_seeds_can_pass_a_family_of_four_and_six_cannot():
    """results/verdict2/preregistration.md: 7 seeds because the family has 4 tests (and 6 seeds for the fallback
    family of 2)."""
    from lib.stats import holm, sign_flip_p
    best = {n: sign_flip_p([1.0] * n, "greater") for n in (6, 7)}
    assert min(holm([best[6]] * 4)) > 0.05                  # 4 / 64 = 0.0625
    assert max(holm([best[7]] * 4)) < 0.05                  # 4 / 128 = 0.031
    assert max(holm([best[6]] * 2)) < 0.05                  # the fallback: 2 / 64 = 0.031


def test_pilot_choice_follows_the_written_rule():
    single = {0: record(10), 1: record(20)}

    def pilot(gains, shuffle_gap=5):
        runs = {"single": single}
        for lr, g in zip(PILOT_LRS, gains):
            runs[f"ours_strong_lr{lr}"] = {s: record(single[s]["eval"]["solve_rate"] * 100 + g,
                                                     shuffled=single[s]["eval"]["solve_rate"] * 100 + g - shuffle_gap,
                                                     anchor=5) for s in (0, 1)}
        return runs
    assert pilot_choice(pilot([3, 9, 10]))[0] == "3e-4"       # 1e-3 is best, 3e-4 within 2 points: the smaller
    assert pilot_choice(pilot([12, 9, 10]))[0] == "1e-4"
    assert pilot_choice(pilot([1, 0, -1], shuffle_gap=0))[0] == "no movement"
    runs = pilot([3, 9, 10])
    del runs["ours_strong_lr1e-3"][1]
    assert pilot_choice(runs)[0] is None                      # incomplete: no choice from part of the pilot


def test_run_once_trains_resumes_evaluates_and_skips(tmp_path, monkeypatch):
    """verdict.run_once, the queue step both verdict runners share: train (with --resume once the folder has a
    config), evaluate (paired where the arm has C), record the times; an evaluated run is skipped."""
    import verdict
    calls = []
    monkeypatch.setattr(verdict, "run", lambda cmd, log: calls.append(cmd) or 1.0)
    monkeypatch.setattr(verdict, "archive", lambda out, into: calls.append(["archive", out, into]))
    out = str(tmp_path / "ours-s0")
    os.makedirs(out)
    open(os.path.join(out, "config.json"), "w").write("{}")
    verdict.run_once(out, ["--seed", "0"], 100, True, "log", "into")
    assert calls[0] == ["train.py", "--seed", "0", "--out", out, "--resume"]
    assert calls[1] == ["evaluate.py", "--run", out, "--n", "100", "--paired"] and calls[2][0] == "archive"
    assert os.path.exists(os.path.join(out, "timing.json"))
    open(os.path.join(out, "eval_paired.json"), "w").write("{}")
    calls.clear()
    verdict.run_once(out, ["--seed", "0"], 100, True, "log", "into")
    assert calls == []


def test_the_verdicts_arms_parse_with_the_power_and_slot_of_amendment_2():
    """Amendment 2: router lr x steps at least the mechanism test's where its channel opened (3e-4 x 300), C in the
    ceiling's slot ("<think>" C "</think>\\n<answer>"), 6 seeds of two arms."""
    from verdict2 import VERDICT_SEEDS, verdict_plan
    plan = verdict_plan()
    assert [n for n, _ in plan[:2]] == ["single-s0", "ours_strong-s0"] and len(plan) == 2 * len(VERDICT_SEEDS) == 12
    for name, flags in plan:
        args = parse_args(flags)
        assert args.system_prompt == "DeepSeekZero" and args.worked_example and args.reward == "exact"
        assert args.response_prefix == "<think></think>\n<answer>" and args.context_split == "</think>\n<answer>"
        assert args.steps == 300 and args.save_every == 1 and args.max_new_tokens == 8
        if name.startswith("ours"):
            assert args.router_lr * args.steps >= 3e-4 * 300 and args.experts == "pocket:qwen2.5-coder-1.5b-instruct"


def items_record(with_c, shuffled=None, n=100, anchor=0):
    """A run's record whose per-item exact scores give `with_c` (and `shuffled`, `anchor`) right answers of n."""
    def scores(k):
        return {"score": [1.0] * k + [0.5] * (n - k), "gold_logprob": [-1.0] * n}  # 0.5: partial credit, not exact
    per_item = {"with_C": scores(with_c)}
    if shuffled is not None:
        per_item.update(zero_C=scores(anchor), shuffled_C=scores(shuffled))
    return {"eval": {"per_item": per_item, "score": 0.0, "solve_rate": with_c / n}, "metrics": [
        {"step": 1, "reward": 0.1, "zero_std_fraction": 0.5}], "cfg": {}}


def test_the_verdicts_table_tests_each_seed_and_says_nothing_until_complete():
    from verdict2 import VERDICT_SEEDS, verdict_outcome, verdict_rows
    single = {s: items_record(20) for s in VERDICT_SEEDS}
    ours = {s: items_record(25 + s, shuffled=21) for s in VERDICT_SEEDS}
    rows = verdict_rows({"single": single, "ours_strong": ours})
    h1a, h2 = rows
    assert h1a["per_seed"] == pytest.approx({s: 5.0 + s for s in VERDICT_SEEDS}) and h2["per_seed"][0] == pytest.approx(4.0)
    assert h1a["p"] == 1 / 64 and h1a["p_holm"] == 2 / 64       # every seed up: the smallest p, Holm over two
    assert verdict_outcome(rows, {"single": single, "ours_strong": ours}) == "shown"
    ours[3] = items_record(15, shuffled=21)                     # one seed below single and below shuffled C
    rows = verdict_rows({"single": single, "ours_strong": ours})
    assert rows[0]["p_holm"] > 0.05 and verdict_outcome(rows, {"single": single, "ours_strong": ours}) == "not shown"
    del ours[5]                 # 11 of 12, and a seed down in each test: 2 of 64 sign sets tie whatever seed 5 gives
    rows = verdict_rows({"single": single, "ours_strong": ours})
    assert verdict_outcome(rows, {"single": single, "ours_strong": ours}) == "not shown (fixed with 11 of 12 runs in)"
    ours[3] = items_record(28, shuffled=21)                     # every seed up again: seed 5 could still pass both
    rows = verdict_rows({"single": single, "ours_strong": ours})
    assert verdict_outcome(rows, {"single": single, "ours_strong": ours}).startswith("incomplete: 11 of 12")


def test_the_best_possible_p_bounds_every_completion_and_is_reached_by_large_ones():
    """best_possible_p(observed, n): no values of the n - k missing differences give a smaller one-sided sign-flip p;
    large positive ones reach it; with all n known it is the p itself. The archive's own case after 9 of 12 runs:
    H1a +53, +13, +9, -22 and H2 +0, +0, +11, +0 over 6 seeds can reach no less than 5/64 and 8/64."""
    import numpy as np

    from lib.stats import sign_flip_p
    from verdict2 import best_possible_p
    assert best_possible_p([53, 13, 9, -22], 6) == 5 / 64 and best_possible_p([0, 0, 11, 0], 6) == 8 / 64
    rng = np.random.default_rng(0)
    for _ in range(300):
        n = int(rng.integers(2, 8))
        k = int(rng.integers(0, n + 1))
        d = list(rng.integers(-30, 31, n).astype(float))
        bound = best_possible_p(d[:k], n)
        assert sign_flip_p(d, "greater") >= bound - 1e-12, (d, k)
        assert sign_flip_p(d[:k] + [1e6] * (n - k), "greater") == pytest.approx(bound), (d, k)
        if k == n:
            assert bound == pytest.approx(sign_flip_p(d, "greater"))


def test_a_claim_is_exclusive_and_a_dead_workers_claim_is_taken_over(tmp_path):
    from verdict2 import claim
    assert claim(str(tmp_path), "single-s0") and not claim(str(tmp_path), "single-s0")   # ours, live: held
    (tmp_path / "ours_strong-s0.claim").write_text("999999999")                          # no such process
    assert claim(str(tmp_path), "ours_strong-s0")
    assert (tmp_path / "ours_strong-s0.claim").read_text() == str(os.getpid())


def _claim_at_once(out, name, start, done, results):
    from verdict2 import claim
    start.wait()
    try:
        results.put(claim(out, name))
    except Exception as e:  # noqa: BLE001 - the race's failure is what this test reports
        results.put(repr(e))
    done.wait()  # the winner stays alive until all have tried, so its claim stays live


def test_workers_taking_over_one_dead_claim_at_once_leave_exactly_one_owner(tmp_path):
    """Two workers started together both find the stopped campaign's claim dead. Only one may take it over, and the
    other must neither crash (the claim it read is gone) nor remove the claim the winner has just written."""
    import multiprocessing as mp
    ctx = mp.get_context("fork")
    n = 6
    for round_ in range(8):
        name = f"ours_strong-s{round_}"
        (tmp_path / (name + ".claim")).write_text("999999999")  # a worker of a stopped campaign
        start, done, results = ctx.Barrier(n), ctx.Barrier(n), ctx.Queue()
        procs = [ctx.Process(target=_claim_at_once, args=(str(tmp_path), name, start, done, results))
                 for _ in range(n)]
        for p in procs:
            p.start()
        got = [results.get(timeout=60) for _ in range(n)]
        for p in procs:
            p.join(60)
        assert sorted(map(str, got)) == ["False"] * (n - 1) + ["True"], (round_, got)


def test_the_worker_runs_what_is_unfinished_and_commits_each_record(tmp_path, monkeypatch):
    """A stopped campaign started again: archived runs are skipped, the others run (run_once resumes a run from its
    checkpoint), and each finished record is committed in the main checkout, only its own paths."""
    import subprocess
    from types import SimpleNamespace
    import verdict2
    repo = tmp_path / "main"
    records = repo / "results" / "verdict2" / "runs"
    records.mkdir(parents=True)
    git = lambda *a: subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *a], cwd=repo,  # noqa
                                    check=True, capture_output=True)
    git("init", "-q")
    (repo / "other.txt").write_text("staged, not the worker's")
    git("add", "other.txt")
    plan = verdict2.verdict_plan()
    for name, _ in plan[:3]:                                    # three runs archived before the stop
        write_record(records, name, items_record(50, shuffled=40) if name.startswith("ours") else items_record(0))
    ran = []

    def fake_run_once(out, flags, n_eval, has_context, log, into):
        ran.append(os.path.basename(out))
        write_record(Path(into), os.path.basename(out), items_record(50, shuffled=40) if has_context
                     else items_record(0))   # every seed up: the outcome stays open, every run is needed
    monkeypatch.setattr(verdict2, "run_once", fake_run_once)
    monkeypatch.setenv("GIT_AUTHOR_NAME", "t"), monkeypatch.setenv("GIT_AUTHOR_EMAIL", "t@t")
    monkeypatch.setenv("GIT_COMMITTER_NAME", "t"), monkeypatch.setenv("GIT_COMMITTER_EMAIL", "t@t")
    out = tmp_path / "runs"
    out.mkdir()
    verdict2.worker(SimpleNamespace(out=str(out), core=0, n_eval=100, commit_into=str(repo)), str(records))
    assert ran == [n for n, _ in plan[3:]] and not list(out.glob("*.claim"))
    log = subprocess.run(["git", "log", "--format=%s", "--name-only"], cwd=repo, capture_output=True, text=True).stdout
    assert log.count("verdict2: record of") == len(plan) - 3 and "other.txt" not in log
    assert "verdict2: 12 of 12 runs archived" in verdict2.status(str(records), str(out))


def test_the_wall_time_counts_every_process_of_a_resumed_run_and_a_pause_at_the_median(tmp_path):
    """A run stopped and resumed: timing.json holds only the last process's seconds (60 s here), so the table
    sums the steps' own seconds instead; one step 1000 s long was a SIGSTOP pause and counts at the median."""
    import json

    from verdict2 import step_costs
    d = tmp_path / "ours_strong-s1"
    d.mkdir()
    seconds = [10.0] * 9 + [1000.0]
    (d / "metrics.jsonl").write_text("".join(json.dumps({"step": i + 1, "seconds": s}) + "\n"
                                             for i, s in enumerate(seconds)))
    (d / "timing.json").write_text(json.dumps({"train_seconds": 60.0, "eval_seconds": 20.0, "cpu": "AVX2"}))
    md = step_costs(str(tmp_path))
    assert "| ours_strong-s1 | 100 | 1 | 60 | 20 |" in md, md
    assert f"Total: {120 / 3600:.2f} core-hours over 1 runs" in md


def test_the_readme_quotes_the_second_verdict_the_archive_gives():
    """README.md quotes results/verdict2/headline.md whole between its markers, and that file is what --analyse
    writes from the archived records. While the campaign is incomplete the file may only say that it runs, with a
    count no larger than the archive's (the campaign commits records between analyses; a partial table is no
    claim); once all 12 runs are archived, or the outcome is fixed before (futility), it must be exactly what the
    records give."""
    from verdict import load
    from verdict2 import RESULTS, quoted_headline, verdict_headline, verdict_plan, verdict_rows
    runs = load(os.path.join(RESULTS, "runs"))
    lines = verdict_headline(verdict_rows(runs), runs)
    with open(os.path.join(RESULTS, "headline.md")) as f:
        written = f.read().splitlines()
    done = sum(len(v) for v in runs.values())
    if done < len(verdict_plan()) and written[0].startswith("**The second verdict is running**"):
        count = int(written[0].split(": ")[-1].split(" of ")[0].split()[-1])
        assert count <= done and written == [lines[0].replace(f" {done} of ", f" {count} of "), *lines[1:]], written
    else:
        assert written == lines, "results/verdict2/headline.md is stale: run verdict2.py --verdict --analyse"
    with open(os.path.join(ROOT, "README.md")) as f:
        assert quoted_headline(f.read())[0] == written, "README.md's second verdict differs from its headline.md"


def test_the_second_verdicts_headline_says_nothing_until_complete_then_each_test():
    """Synthetic records: with 2 of 12 runs the headline is the count alone; with all 12 it names the outcome and
    each test of the family with its interval, the seeds each way and the Holm p."""
    from verdict2 import VERDICT_SEEDS, verdict_headline, verdict_rows
    part = {"single": {0: items_record(0)}, "ours_strong": {0: items_record(50, shuffled=40)}}
    assert verdict_headline(verdict_rows(part), part) == [
        "**The second verdict is running** (pre-registered, amendment 2: `single` and `ours_strong` × 6 seeds on gcd, "
        "H1a and H2, one-sided exact sign-flip tests over seeds, Holm over 2): 2 of 12 runs archived; a partial "
        "table is no claim.", "Until all 12 are in, that RL shapes collaboration here is **not shown**."]
    full = {"single": {s: items_record(0) for s in VERDICT_SEEDS},
            "ours_strong": {s: items_record(50, shuffled=40) for s in VERDICT_SEEDS}}
    lines = verdict_headline(verdict_rows(full), full)
    assert lines[0].startswith("**Second verdict: shown** (") and "12 of 12 runs" in lines[0]
    assert lines[1].startswith("- H1a, `ours_strong` − `single`: +50.0 points [")
    assert lines[1].endswith("6 / 0 seeds, Holm p = 0.0312"), lines[1]
    assert lines[2].startswith("- H2, `ours_strong` with its C − shuffled C: +10.0 points [")
    assert lines[2].endswith("6 / 0 seeds, Holm p = 0.0312"), lines[2]
    assert lines[3] == "" and lines[4].startswith("What it can say: RL shapes collaboration here: "), lines[3:]
    del full["single"][5], full["ours_strong"][5]
    full["single"][4] = items_record(60)                        # seed 4 down in H1a, and equal to shuffled C in H2
    full["ours_strong"][4] = items_record(40, shuffled=40, anchor=40)   # every item the same, whatever C is
    lines = verdict_headline(verdict_rows(full), full)
    assert lines[0].startswith("**Second verdict: not shown, fixed with 10 of 12 runs in** (pre-registered"), lines[0]
    assert lines[1] == ("- H1a, `ours_strong` − `single`: +36.0 points over 5 seeds (+50, +50, +50, +50, -20); the "
                        "best p 6 seeds can give: 2/64 = 0.0312, Holm 0.0625"), lines[1]
    assert lines[2] == ("- H2, `ours_strong` with its C − shuffled C: +8.0 points over 5 seeds (+10, +10, +10, +10, "
                        "+0); the best p 6 seeds can give: 2/64 = 0.0312, Holm 0.0625"), lines[2]
    assert lines[3] == "" and lines[4].startswith("What it can say: the pre-registered tests cannot reach"), lines[4]
    assert lines[4].endswith(" In 1 of 5 seeds `ours_strong` scored every item the same with its C, with the anchor "
                             "and with another item's C (a reading chosen after the data were in): there its "
                             "difference from `single` does not pass through C at evaluation."), lines[4]


def test_the_verdicts_table_gives_each_tests_best_possible_p_beside_its_p(tmp_path):
    """The table's outcome line and, per test, the best p its 6 seeds can still give and their Holm p."""
    from verdict2 import verdict_markdown
    runs = {"single": {s: items_record(0) for s in range(4)},
            "ours_strong": {s: items_record(d, shuffled=10) for s, d in enumerate((53, 13, 9))}}
    runs["single"][3] = items_record(22)
    runs["ours_strong"][3] = items_record(0, shuffled=0)   # H1a +53, +13, +9, -22; H2 +43, +3, -1, +0
    md = verdict_markdown(runs, str(tmp_path))
    assert "**not shown (fixed with 8 of 12 runs in).**" in md, md
    assert ("| H1a: `ours_strong` − single | 4 | +53, +13, +9, -22 | +13.2 ± 30.8 | – | 0.312 | 0.5 | "
            "0.0781 (0.125) |") in md
    assert ("| H2: `ours_strong` − shuffled C | 4 | +43, +3, -1, +0 | +11.3 ± 21.2 | – | 0.25 | 0.5 | "
            "0.0625 (0.125) |") in md


def test_the_verdicts_table_names_each_seeds_instruction_sets_and_the_mixed_pairs():
    """A seed whose two arms ran on different CPUs (the machine replaced between sessions) is named in the table."""
    from verdict2 import instruction_sets
    runs = {"single": {0: items_record(0), 3: items_record(0)}, "ours_strong": {0: items_record(5), 3: items_record(5)}}
    for arm, seed, cpu in (("single", 0, "AVX512"), ("ours_strong", 0, "AVX512"), ("single", 3, "AVX512"),
                           ("ours_strong", 3, "AVX2")):
        runs[arm][seed]["cpu"] = cpu
    lines = instruction_sets(runs)
    assert lines[0] == ("Instruction sets (each run's timing.json): s0: `single` AVX512, `ours_strong` AVX512 · "
                        "s3: `single` AVX512, `ours_strong` AVX2."), lines[0]
    assert lines[1].startswith("Seeds whose two arms ran on different instruction sets: 3 ("), lines[1]
    del runs["ours_strong"][3]  # a seed with one arm archived is not a mixed pair yet
    assert instruction_sets(runs)[1].startswith("Seeds whose two arms ran on different instruction sets: none ("), runs


def test_analyse_puts_the_headline_between_the_readmes_markers_and_refuses_a_readme_without_them(tmp_path):
    from verdict2 import HEADLINE_BEGIN, HEADLINE_END, quote_headline, quoted_headline
    readme = tmp_path / "README.md"
    begin = HEADLINE_BEGIN + " (written by ...); a test holds them equal -->"
    readme.write_text(f"# x\n\n{begin}\n**The second verdict is running**: 7 of 12.\nUntil ...\n"
                      f"{HEADLINE_END}\n\nrest\n")
    quote_headline(str(readme), ["**Second verdict: not shown** (...).", "- H1a ...", "", "What it can say: ..."])
    assert readme.read_text() == (f"# x\n\n{begin}\n**Second verdict: not shown** (...).\n- H1a ...\n\n"
                                  f"What it can say: ...\n{HEADLINE_END}\n\nrest\n")
    assert quoted_headline(readme.read_text())[0] == ["**Second verdict: not shown** (...).", "- H1a ...", "",
                                                      "What it can say: ..."]
    for broken in ("# x\nno marker\n", f"# x\n{begin}\nno end\n", f"{HEADLINE_END}\n{begin}\n"):
        readme.write_text(broken)
        with pytest.raises(ValueError, match="expected one line starting"):
            quote_headline(str(readme), ["**Second verdict: shown**"])
        assert readme.read_text() == broken  # nothing written


def test_the_reading_says_what_each_outcome_of_the_family_can_and_cannot_say():
    """The pre-registration's reading of each case: both tests, H1a alone (the interface, not the expert), H2
    alone (reads C, gains nothing shown), neither."""
    from verdict2 import verdict_reading

    def rows(h1a, h2):
        return [{"name": "H1a", "p_holm": h1a}, {"name": "H2", "p_holm": h2}]
    both, h1a, h2, neither = (verdict_reading(rows(*p)) for p in ((0.03, 0.03), (0.03, 0.5), (0.5, 0.03), (0.5, 0.5)))
    assert both.startswith("What it can say: RL shapes collaboration here: ")
    assert h1a.startswith("What it can say: `ours_strong` beats the policy alone, but reading its own item's C is "
                          "not shown: the gain may be the trainable interface")
    assert h2.startswith("What it can say: the policy reads its own item's C, but gains nothing shown over")
    assert neither.startswith("What it can say: neither test is shown")
    assert all("What it cannot: the routing question" in x for x in (both, h1a, h2, neither))
    assert verdict_reading(rows(0.05, 0.03)) == h2  # Holm p < 0.05, strictly, as pre-registered


def test_status_says_each_started_runs_step_and_the_hours_its_steps_have_left(tmp_path):
    """A run claimed by a live process is in progress, with its last step and the time its steps have left at the
    median of its recent steps; a started run whose process is gone is left, and resumes from its checkpoint."""
    import json

    from verdict2 import VERDICT_STEPS, status, verdict_plan
    records, out = tmp_path / "records", tmp_path / "runs"
    records.mkdir(), out.mkdir()
    (a, _), (b, _) = verdict_plan()[:2]
    for name, seconds in ((a, [40.0] * 5 + [30.0] * 25), (b, [20.0] * 10)):
        (out / name).mkdir()
        (out / name / "metrics.jsonl").write_text("".join(json.dumps({"step": i + 1, "seconds": x}) + "\n"
                                                          for i, x in enumerate(seconds)))
    (out / (a + ".claim")).write_text(str(os.getpid()))         # a live process holds a
    lines = status(str(records), str(out)).splitlines()
    assert lines[0].startswith(f"verdict2: 0 of 12 runs archived; in progress: {a}; left: {b}, "), lines[0]
    assert lines[1] == (f"  {a}: step 30 of {VERDICT_STEPS}, 30 s a step lately (median of the last 20): "
                        f"~{(VERDICT_STEPS - 30) * 30 / 3600:.1f} h of steps left"), lines[1]
    assert lines[2].startswith(f"  {b}: step 10 of {VERDICT_STEPS} (stopped: resumes there), 20 s a step"), lines[2]
    assert len(lines) == 3  # the runs not started say nothing more


def write_record(records, name, rec):
    """An archived run's record on disk, as run_once leaves it: its evaluation, config and metrics."""
    import json
    d = records / name
    d.mkdir(parents=True)
    (d / ("eval_paired.json" if name.startswith("ours") else "eval.json")).write_text(json.dumps(rec["eval"]))
    (d / "config.json").write_text("{}")
    (d / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in rec["metrics"]))


def test_once_the_outcome_is_fixed_a_seed_with_no_archived_run_is_not_started(tmp_path, monkeypatch):
    """Seeds 0-3 fix the outcome (H1a +50, +50, +50, -20: no completion gets below 2/64 each way, Holm 0.0625).
    Seed 4's `single` is archived, so its `ours_strong` is still run, to give it its pair; seed 5 has no run and is
    not started: the worker skips it and --status says why. While the outcome is open, every run is needed."""
    from types import SimpleNamespace
    import verdict2
    records, out = tmp_path / "records", tmp_path / "runs"
    out.mkdir()
    for seed, (ours, single, shuffled) in enumerate(((50, 0, 40), (50, 0, 40), (50, 0, 40), (40, 60, 40))):
        write_record(records, f"single-s{seed}", items_record(single))
        write_record(records, f"ours_strong-s{seed}", items_record(ours, shuffled=shuffled))
    write_record(records, "single-s4", items_record(30))
    assert verdict2.not_needed(str(records)) == {"single-s5", "ours_strong-s5"}
    ran = []
    monkeypatch.setattr(verdict2, "run_once", lambda out, *a: ran.append(os.path.basename(out)))
    verdict2.worker(SimpleNamespace(out=str(out), core=0, n_eval=100, commit_into=None), str(records))
    assert ran == ["ours_strong-s4"], ran
    lines = verdict2.status(str(records), str(out)).splitlines()
    assert lines[0] == ("verdict2: 9 of 12 runs archived; in progress: none; left: ours_strong-s4; not needed (the "
                        "outcome is fixed, futility): single-s5, ours_strong-s5"), lines[0]
    open_records = tmp_path / "open"
    for seed in range(4):                                       # every seed up: seeds 4 and 5 could still pass it
        write_record(open_records, f"single-s{seed}", items_record(0))
        write_record(open_records, f"ours_strong-s{seed}", items_record(50, shuffled=40))
    assert verdict2.not_needed(str(open_records)) == set()


def test_a_worker_started_by_hand_unpinned_or_on_many_threads_is_refused(monkeypatch):
    """A worker started without the campaign's taskset and OMP_NUM_THREADS=1 would run a pre-registered run on
    other cores and threads (another order of sums): it is refused with one line naming both."""
    from verdict2 import worker_problem
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert "cores [0, 1]" in worker_problem(1)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {1})
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert "OMP_NUM_THREADS=None" in worker_problem(1)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert worker_problem(1) is None and worker_problem(0) is not None


def test_the_verdicts_prose_is_what_its_records_give():
    """Each figure results/verdict2/README.md states beyond table.md, recomputed from the archived records
    (experiments/verdict2_facts.py). Its story: the page said "fixed after 9 of 12 runs" (H2 alone was fixed after
    4), "single-s0 wrote an answer in every completion until step ~290" (0.31 at step 211), "read C in 1 seed of 5"
    (C moved the gold log-prob against the anchor in 3 more) and gave cost ranges with the pauses counted."""
    import verdict2_facts as facts
    runs = facts.load(facts.RECORDS)
    text = " ".join(open(os.path.join(ROOT, "results", "verdict2", "README.md")).read().split())
    assert facts.first_record_fixing("H2", runs) == 4 and facts.first_record_fixing("H1a", runs) == 9
    assert facts.best_p_after(4, runs)["H2"] == 4 / 64
    assert facts.best_p_after(9, runs) == {"H1a": 5 / 64, "H2": 8 / 64}
    assert "H2 alone could not pass from the 4th record on" in text
    assert "after the 9th (ours_strong-s3) neither" in text
    c = facts.collapse_facts(runs)
    assert (c["spike_step"], round(c["spike_kl"], 1), c["low_steps"], c["below_one_21_289"], c["zero_from"]) == \
        (207, 44.8, [210, 211, 212], 13, 292)
    assert "below 1 at 13 of steps 21–289 and fell to 0.31–0.38 at steps 210–212" in text
    assert f"{c['low_rates'][0]:.2f}–{c['low_rates'][1]:.2f}" == "0.31–0.38"
    assert "a KL spike of 44.8 (step 207)" in text
    assert c["s1_low_steps"] == [122, 123, 124, 125, 126, 127]
    assert "(answer rate 0.00–0.28 at steps 122–127)" in text
    anchor = facts.c_against(runs)
    moved = [s for s in (0, 1, 3, 4) if anchor[s][1] < 1e-4]
    assert moved == [0, 3, 4] and [round(anchor[s][0], 2) for s in moved] == [-0.19, -0.19, 0.67]
    assert "(−0.19, −0.19, +0.67 nats; sign test over items p = 3e-10, 5e-13, 3e-5; seed 1: +0.77, p 0.37)" in text
    assert [round(anchor[s][2], 2) for s in (0, 1, 3, 4)] == [0.27, 1.0, 1.0, 0.92]
    hours = facts.arm_hours()
    assert [round(x, 2) for x in hours["single"][:2]] == [1.12, 2.55]
    assert [round(x, 2) for x in hours["ours_strong"][:2]] == [1.41, 3.63]
    assert round(hours["ours_strong"][2], 1) == 4.8
    assert "single 1.12–2.55 h a run, ours_strong 1.41–3.63 h; 4.8 h for ours_strong-s3" in text
