"""experiments/neighbours_learning.py end to end on the tiny team (2 steps, 3 items, 2 seeds; each part's process run
in this one, scored by a synthetic reward, so that scores differ): every run record archived, every row in the table,
the p values equal to a hand computation from the archived per-item scores, finished parts skipped, a killed training
resumed, bad input refused in one line with nothing written; and experiments/neighbours_table.py on hand-made records
of 3 seeds, where every number is known in advance."""
import json
import os
import runpy
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest

import rewards
import support.harness.run

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "experiments"))
import neighbours_learning as NL  # noqa: E402
import neighbours_table as NT  # noqa: E402

SEEDS = [0, 1]
FLAGS = ["--team", "tiny", "--workers", "", "--task", "chain_sum", "--task-config", "{}", "--seeds", "0", "1", "--n-eval", "3",
         "--single", "", "--train-flags=--steps 2 --batch-size 1 --group-size 2 --max-new-tokens 4 --dataset-size 8 "
         "--system-prompt simple --save-every 1 --device cpu"]
# the tiny team: generative experts tiny:qwen2, tiny:gpt2 (tiny:bert is an encoder), policy tiny:llama
PARTS = ["conductor", "conductor_random", "conductor_example", "conductor_alone_qwen2", "conductor_alone_gpt2",
         "rlae", "rlae_random", "rlae_uniform", "rlae_alone_qwen2", "rlae_alone_gpt2", "rlae_alone_llama"]
TRAINED = {"conductor", "conductor_random", "rlae", "rlae_random"}


def parity_reward(entries, completions):
    """A synthetic verifiable reward (the random tiny models never solve a task): 1 when the code points of the
    completion sum to an even number, so the runs' scores differ from each other."""
    r = [float(sum(map(ord, c)) % 2 == 0) for c in completions]
    return r, {"ok": len(r)}


def in_process(calls):
    """The driver's runner, without a new interpreter per part: the script runs here, as `python script ...`."""
    def runner(cmd, log):
        calls.append(cmd)
        argv, t0 = sys.argv, time.time()
        sys.argv = [os.path.join(ROOT, cmd[0]), *cmd[1:]]
        try:
            runpy.run_path(sys.argv[0], run_name="__main__")
        finally:
            sys.argv = argv
        return time.time() - t0
    return runner


def never(cmd, log):
    raise AssertionError(f"ran {cmd}: a finished part must be skipped")


@pytest.fixture(scope="module")
def experiment(tmp_path_factory):
    root = tmp_path_factory.mktemp("neighbours")
    where = ["--out", str(root / "runs"), "--results", str(root / "results")]
    calls = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(rewards, "score_batch", parity_reward)
        NL.main(FLAGS + where, runner=in_process(calls))
    return {"root": root, "where": where, "calls": calls, "archive": root / "results" / "runs",
            "table": json.load(open(root / "results" / "table.json")),
            "md": open(root / "results" / "table.md").read()}


def per_item(archive, part, seed):
    return json.load(open(archive / f"{part}-s{seed}" / "eval.json"))["per_item"]["with_C"]["score"]


def test_every_run_is_archived_with_its_records(experiment):
    archive = experiment["archive"]
    assert sorted(os.listdir(archive)) == sorted(f"{p}-s{s}" for p in PARTS for s in SEEDS)
    for part in PARTS:
        for s in SEEDS:
            d = archive / f"{part}-s{s}"
            cfg, ev = json.load(open(d / "config.json")), json.load(open(d / "eval.json"))
            assert cfg["seed"] == s and cfg["team"] == "tiny" and ev["n"] == 3 and len(per_item(archive, part, s)) == 3
            assert cfg["batch_size"] == 1 and cfg["max_new_tokens"] == 4    # --train-flags reached the controls too
            timing = json.load(open(d / "timing.json"))
            if part in TRAINED:
                steps = [json.loads(x) for x in open(d / "metrics.jsonl")]
                assert [m["step"] for m in steps] == [1, 2] and timing["train_seconds"] > 0 < timing["eval_seconds"]
                assert cfg["reward"] == ("random" if part.endswith("_random") else "exact")  # gcd's PROMPT
            else:
                assert not os.path.exists(d / "metrics.jsonl") and cfg["control"]["name"] == part
    conductor = [json.loads(x) for x in open(archive / "conductor-s0" / "metrics.jsonl")]
    assert all(m["parse_rate"] == 1 and abs(sum(m["utilization"]) - 1) < 1e-6 for m in conductor)  # constrained
    rlae = [json.loads(x) for x in open(archive / "rlae_random-s1" / "metrics.jsonl")]
    assert rlae[0]["agent_weights"] == pytest.approx([1 / 3] * 3) and len(rlae[1]["agent_weights"]) == 3
    # one process per trained part, its evaluation, and one per method's controls: 2 x (4 + 4 + 2)
    assert len(experiment["calls"]) == 20 and sum("--resume" in c for c in experiment["calls"]) == 0


def test_the_table_has_every_row_and_the_plots(experiment):
    md, results = experiment["md"], experiment["root"] / "results"
    for part in PARTS:
        assert f"\n| {part} | " in md
    labels = ["conductor − the worked example's workflow", "conductor − qwen2 alone", "conductor − gpt2 alone",
              "conductor − conductor trained on coins",
              "rlae − the uniform mixture", "rlae − qwen2 alone", "rlae − gpt2 alone", "rlae − llama alone",
              "rlae − rlae trained on coins", "rlae on coins − the uniform mixture"]
    assert sorted(r["label"] for r in experiment["table"]["comparisons"]) == sorted(labels)
    for label in labels:
        assert f"\n| {label} | 2 | " in md
    for row in ("parse_rate", "reward", "zero_std_fraction", "share of workflow steps: tiny:qwen2",
                "share of workflow steps: tiny:gpt2"):
        assert f"\n| {row} | " in md
    assert [w["member"] for w in experiment["table"]["rlae_weights_vs_coins"]] == ["tiny:qwen2", "tiny:gpt2",
                                                                                  "tiny:llama"]
    assert [w["member"] for w in experiment["table"]["conductor_choice_vs_coins"]] == ["tiny:qwen2", "tiny:gpt2"]
    assert "## The conductor's worker choice" in md and "## Exact solve rates (points)" in md
    assert set(experiment["table"]["cost"]) == set(PARTS) and experiment["table"]["total_seconds"] > 0
    pytest.importorskip("matplotlib")
    for name in ("conductor_chain_sum_tiny.png", "fig4_chain_sum_tiny_conductor.png", "fig4_chain_sum_tiny_rlae.png",
                 "rlae_weights_chain_sum_tiny.png"):
        assert os.path.exists(results / name) and name in experiment["table"]["plots"]


def test_p_values_are_the_hand_computed_sign_flips_of_the_archived_scores(experiment):
    """Two seeds, differences d0 and d1: the 4 sign flips give |mean| = |d0 + d1| / 2 twice and |d0 - d1| / 2 twice,
    so p = 1/2 when d0 and d1 have one sign (|d0 - d1| < |d0 + d1|) and 1 otherwise."""
    archive, ps = experiment["archive"], []
    for row in experiment["table"]["comparisons"]:
        a = [per_item(archive, row["a"], s) for s in SEEDS]
        b = [per_item(archive, row["b"], s) for s in SEEDS]
        d = [np.mean(x) - np.mean(y) for x, y in zip(a, b)]
        assert row["diffs"] == pytest.approx(d)
        assert row["p"] == (0.5 if d[0] * d[1] > 0 else 1.0)
        item = np.subtract(a, b)
        assert (row["items_better"], row["items_worse"]) == ((item > 0).sum(), (item < 0).sum())
        ps.append(row["p"])
    assert 0.5 in ps and 1.0 in ps    # the synthetic reward gives both kinds: the check above tested something


def test_a_second_run_skips_every_finished_part(experiment):
    before = {n: open(experiment["archive"] / n / "eval.json").read() for n in os.listdir(experiment["archive"])}
    NL.main(FLAGS + experiment["where"], runner=never)
    assert {n: open(experiment["archive"] / n / "eval.json").read() for n in before} == before
    assert open(experiment["root"] / "results" / "table.md").read().split("## Cost")[0] == \
        experiment["md"].split("## Cost")[0]


class Killed(BaseException):
    """What a SIGKILL does to the training in the middle of its step 2: nothing after it runs."""


def test_a_killed_training_resumes_from_its_checkpoint(tmp_path, monkeypatch):
    where = ["--out", str(tmp_path / "runs"), "--results", str(tmp_path / "results"), "--parts", "rlae",
             "--seeds", "0"]
    after_step = support.harness.run.after_step

    def killed_after_step_2(run, args, step, *rest, **kw):  # after step 2's update, before its log and checkpoint
        if step + 1 == 2:
            raise Killed
        return after_step(run, args, step, *rest, **kw)
    monkeypatch.setattr(support.harness.run, "after_step", killed_after_step_2)  # rlae.py imports it as it starts
    calls = []
    with pytest.raises(Killed):
        NL.main(FLAGS + where, runner=in_process(calls))
    run = tmp_path / "runs" / "rlae-s0"
    first = open(run / "metrics.jsonl").read()
    assert [json.loads(x)["step"] for x in first.splitlines()] == [1] and not os.path.exists(run / "eval.json")
    monkeypatch.undo()
    NL.main(FLAGS + where, runner=in_process(calls))
    assert "--resume" not in calls[0] and "--resume" in calls[1] and calls[2][1] == "evaluate"
    steps = open(run / "metrics.jsonl").read()
    assert steps.startswith(first) and [json.loads(x)["step"] for x in steps.splitlines()] == [1, 2]
    assert os.listdir(tmp_path / "results" / "runs") == ["rlae-s0"]


@pytest.mark.parametrize("flags, message", [
    (["--task-config", "{not json"], "--task-config must be a JSON object"),
    (["--seeds", "0", "0"], "--seeds: each seed once"),
    (["--seeds", "-1"], "--seeds: must be >= 0"),
    (["--train-flags=--lr -1"], "--lr: must be > 0"),
    (["--train-flags=--seed 3"], "--train-flags: --seed is set by this driver"),
    (["--team", "nosuch"], "--team: invalid choice"),
    (["--task", "nosuchtask"], "unknown --task 'nosuchtask'"),
    (["--parts", "everything"], "--parts: invalid choice"),
])
def test_bad_input_fails_in_one_line_and_writes_nothing(tmp_path, capsys, flags, message):
    with pytest.raises(SystemExit) as e:
        NL.main(FLAGS + flags + ["--out", str(tmp_path / "runs"), "--results", str(tmp_path / "results")],
                runner=never)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("error: ") and message in err and err.count("\n") == 1
    assert os.listdir(tmp_path) == []


def test_runs_of_another_protocol_in_out_are_refused_not_skipped(experiment, capsys):
    files = sorted(os.path.join(d, f) for d, _, fs in os.walk(experiment["root"]) for f in fs)
    with pytest.raises(SystemExit) as e:
        NL.main(FLAGS + ["--task-config", '{"min_terms": 2, "max_terms": 2}'] + experiment["where"], runner=never)
    err = capsys.readouterr().err
    assert e.value.code == 2 and "--task-config" in err and "choose another --out" in err and err.count("\n") == 1
    assert sorted(os.path.join(d, f) for d, _, fs in os.walk(experiment["root"]) for f in fs) == files


def test_the_command_line_fails_in_one_line_and_a_failed_part_names_its_log(tmp_path):
    done = subprocess.run([sys.executable, os.path.join(ROOT, "experiments", "neighbours_learning.py"), "--analyse",
                           "--results", str(tmp_path / "none")], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "no archived run" in done.stderr
    assert NL.run_process(["-c", "print('hello')"], str(tmp_path / "log.txt")) > 0
    with pytest.raises(SystemExit) as e:
        NL.run_process(["-c", "import sys; sys.exit(3)"], str(tmp_path / "log.txt"))
    assert e.value.code == 1 and open(tmp_path / "log.txt").read() == "hello\n"


# ----------------------------------------------------------------------------------------------------------
# The analysis on hand-made records: 3 seeds, 10 items, differences chosen in advance


def write_run(folder, part, seed, right, n=10, weights=None, **cfg):
    d = folder / f"{part}-s{seed}"
    os.makedirs(d)
    base = {"task": "lcm", "task_config": '{"min_numbers": 2}', "team": "pocket", "system_prompt": "DeepSeekZero",
            "worked_example": True, "response_prefix": "<think>", "context_position": "before", "max_new_tokens": 48,
            "steps": 3, "batch_size": 4, "group_size": 4, "lr": 1e-3, "router_lr": 1e-3, "seed": seed,
            "method": part.split("_")[0]}
    json.dump({**base, **cfg}, open(d / "config.json", "w"))
    json.dump({"n": n, "score": right / n, "solve_rate": right / n, "per_item": {"with_C": {"score": [1.0] * right + [0.0] * (n - right)}}},
              open(d / "eval.json", "w"))
    if weights:
        with open(d / "metrics.jsonl", "w") as f:
            for step, w in enumerate([[0.5, 0.5]] + weights, 1):
                f.write(json.dumps({"step": step, "reward": 0.5, "seconds": 2.0, "agent_weights": w,
                                    "utilization": w, "utilization_names": ["m0", "m1"]}) + "\n")
        json.dump({"train_seconds": 6.0, "eval_seconds": 4.0}, open(d / "timing.json", "w"))


def test_the_analysis_of_three_hand_made_seeds(tmp_path, monkeypatch, capsys):
    """conductor − example: differences +0.1, +0.2, +0.4. Their 8 sign flips sum to +-0.7, +-0.5, +-0.3, +-0.1, so
    only the 2 flips of size 0.7 reach the observed: p = 2/8 = 0.25. rlae − uniform: +0.3, +0.1, -0.1; sums +-0.5,
    +-0.3 (twice) and +-0.1: 6 of 8 reach 0.3, p = 0.75. The agent's end weight of m0 (mean of steps 2-4): 0.6, 0.7,
    0.9 under the task reward, 0.5 under coins: moved +0.1, +0.2, +0.4 against 0, p = 0.25."""
    runs, single = tmp_path / "results" / "runs", tmp_path / "verdict"
    for s, (cond, rlae, w) in enumerate([(3, 6, 0.6), (4, 4, 0.7), (6, 2, 0.9)]):
        write_run(runs, "conductor", s, cond), write_run(runs, "conductor_example", s, 2)
        write_run(runs, "rlae", s, rlae, weights=[[w, 1 - w]] * 3), write_run(runs, "rlae_uniform", s, 3)
        write_run(runs, "rlae_random", s, 3, weights=[[0.5, 0.5]] * 3, reward="random")
        write_run(single, "single", s, 1, n=10 if s < 2 else 9, steps=15)  # seed 2's single: other items
    md = NT.analyse(str(tmp_path / "results"), str(single))
    rows = {r["label"]: r for r in json.load(open(tmp_path / "results" / "table.json"))["comparisons"]}
    assert rows["conductor − the worked example's workflow"]["diffs"] == pytest.approx([0.1, 0.2, 0.4])
    assert rows["conductor − the worked example's workflow"]["p"] == 0.25
    assert rows["rlae − the uniform mixture"]["p"] == 0.75 and rows["rlae − rlae trained on coins"]["p"] == 0.75
    assert rows["conductor − single (the verdict's)"]["seeds"] == [0, 1]                # seed 2 was other items
    assert "| conductor − the worked example's workflow | 3 | +10.0, +20.0, +40.0 | +23.3 ± 15.3 | 3 / 0 | 0.25 |" in md
    m0 = NT.moved_against_coins(NT.load(str(runs)), "rlae")[0]
    assert m0["diffs"] == pytest.approx([0.1, 0.2, 0.4]) and m0["p"] == 0.25
    cost = json.load(open(tmp_path / "results" / "table.json"))["cost"]
    assert cost["rlae"]["seconds_per_step"] == 2.0 and cost["rlae"]["total_seconds"] == 30.0
    monkeypatch.setitem(sys.modules, "matplotlib", None)        # no matplotlib: the table still, no plots
    os.remove(tmp_path / "results" / "table.md")
    NT.analyse(str(tmp_path / "results"), str(single))
    assert json.load(open(tmp_path / "results" / "table.json"))["plots"] == []
    assert "## Plots" in open(tmp_path / "results" / "table.md").read() and "matplotlib" in capsys.readouterr().err


def test_exact_runs_are_compared_on_full_marks_and_the_worker_choice_against_coins(tmp_path):
    """Runs trained on --reward exact are compared on the exact solve rate: an item with partial credit (0.5)
    counts 0. conductor: 6 items right + 2 at 0.5 per seed, example 3 right: +0.3 each seed (on the task's score
    it would be +0.4). The worker choice: m0's share of steps goes 0.5 -> 0.8 under the task reward and 0.5 -> 0.4
    under coins: moved +0.3 against -0.1, task - coins +0.4 on each of 6 seeds: two-sided p 2/64. The
    pre-registered C1 and C2 (one-sided 1/64 each, Holm over the two 2/64 = 0.031) are shown; R1 and R2 have no
    runs; with 3 seeds the same data would be incomplete."""
    results = tmp_path / "results"
    runs = results / "runs"
    for s in range(6):
        write_run(runs, "conductor", s, 6, weights=[[0.8, 0.2]] * 3, reward="exact")
        json.dump({"n": 10, "score": 0.7, "solve_rate": 0.6,
                   "per_item": {"with_C": {"score": [1.0] * 6 + [0.5] * 2 + [0.0] * 2}}},
                  open(runs / f"conductor-s{s}" / "eval.json", "w"))
        write_run(runs, "conductor_example", s, 3, reward="exact")
        write_run(runs, "conductor_random", s, 3, weights=[[0.4, 0.6]] * 3, reward="random")
    open(results / "preregistration.md", "w").write("# the tests\n")
    md = NT.analyse(str(results))
    table = json.load(open(results / "table.json"))
    rows = {r["label"]: r for r in table["comparisons"]}
    assert table["primary"] == "exact solve rate" and table["scores"]["conductor"]["5"] == 0.6
    assert rows["conductor − the worked example's workflow"]["diffs"] == pytest.approx([0.3] * 6)
    m0 = table["conductor_choice_vs_coins"][0]
    assert m0["member"] == "m0" and m0["diffs"] == pytest.approx([0.4] * 6) and m0["p"] == 2 / 64
    assert "| m0 | +0.300 ± 0.000 | -0.100 ± 0.000 | " in md
    tests = {t["test"]: t for t in table["preregistered"]}
    assert [tests[t]["p_one_sided"] for t in ("C1", "C2")] == [1 / 64] * 2
    assert [tests[t]["p_holm"] for t in ("C1", "C2")] == [2 / 64] * 2
    assert [tests[t]["decision"] for t in ("C1", "C2", "R1", "R2")] == ["shown", "shown"] + \
        ["incomplete (0 of 6 seeds)"] * 2
    for s in range(3, 6):
        for part in ("conductor", "conductor_example", "conductor_random"):
            shutil.rmtree(runs / f"{part}-s{s}")
    NT.analyse(str(results))
    tests = {t["test"]: t for t in json.load(open(results / "table.json"))["preregistered"]}
    assert tests["C1"]["decision"] == "incomplete (3 of 6 seeds)" and tests["C1"]["p_one_sided"] == 1 / 8
