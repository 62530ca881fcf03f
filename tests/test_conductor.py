"""The Conductor (neighbours/conductor.py): the workflow parser reads data and never code, the reward's three levels, the
workers' routing statistics, and a tiny-team run of train.py and evaluate.py."""
import json
import os
from types import SimpleNamespace

import pytest
import torch

from neighbours import conductor as C
from neighbours.conductor import parse_workflow

GOOD = 'model_id = [0, 1]\nsubtasks = ["Add the numbers.", "Check the sum and answer."]\naccess_list = [[], [0]]'

# Texts that contain code, or structure the format does not allow. A parser that evaluates model text (eval,
# or a permissive literal parser) accepts some of them; ours must refuse every one.
HOSTILE = [
    'model_id = [1+0]\nsubtasks = ["a"]\naccess_list = [[]]',                          # an expression
    'model_id = [len("a")]\nsubtasks = ["a"]\naccess_list = [[]]',                     # a call
    "model_id = [0]\nsubtasks = [__import__('os').getcwd()]\naccess_list = [[]]",     # an import
    'model_id = [0]\nsubtasks = ["a" + "b"]\naccess_list = [[]]',                      # string arithmetic
    'model_id = [(lambda: 0)()]\nsubtasks = ["a"]\naccess_list = [[]]',                # a lambda
    'model_id = [0]\nsubtasks = ["a"]\naccess_list = [list(range(0))]',                # a builtin call
    'model_id = [0]\nsubtasks = ["a"]\naccess_list = [[i for i in []]]',               # a comprehension
    'model_id = [0]\nsubtasks = ["a"]\naccess_list = [{0}]',                           # a set
    'model_id = [0]\nsubtasks = ["a"]\naccess_list = [()]',                            # a tuple
    'model_id = [-0]\nsubtasks = ["a"]\naccess_list = [[]]',                           # a signed number
    'model_id = [0]\nsubtasks = [f"{0}"]\naccess_list = [[]]',                         # an f-string
    'model_id = [0]\nsubtasks = [b"a"]\naccess_list = [[]]',                           # bytes
]
MALFORMED = [
    "",                                                                                # nothing
    "model_id = [0, 1]",                                                               # one list only
    'model_id = [0, 1]\nsubtasks = ["a"]\naccess_list = [[]]',                         # unequal lengths
    'model_id = [2]\nsubtasks = ["a"]\naccess_list = [[]]',                            # no worker 2
    'model_id = ["Model 7"]\nsubtasks = ["a"]\naccess_list = [[]]',                    # no worker 7
    'model_id = ["Bob"]\nsubtasks = ["a"]\naccess_list = [[]]',                        # not a worker name
    'model_id = [0]\nsubtasks = ["a"]\naccess_list = [[0]]',                           # may not read itself
    'model_id = [0, 1]\nsubtasks = ["a", "b"]\naccess_list = [[1], []]',               # reads a later step
    'model_id = [0, 1, 0]\nsubtasks = ["a", "b", "c"]\naccess_list = [[], [], []]',    # 3 steps > max 2
    'model_id = []\nsubtasks = []\naccess_list = []',                                  # no step
    'model_id = [0]\nsubtasks = [""]\naccess_list = [[]]',                             # an empty subtask
    'model_id = [0]\nsubtasks = [7]\naccess_list = [[]]',                              # a subtask that is no text
    'model_id = [0]\nsubtasks = ["a]\naccess_list = [[]]',                             # unterminated string
    'model_id = [0\nsubtasks = ["a"]\naccess_list = [[]]',                             # unterminated list
    'subtasks = ["a"]\nmodel_id = [0]\naccess_list = [[]]',                            # out of order
    'model_id = [0]\nsubtasks = ["a"]\naccess_list = ["some"]',                        # not "all"
    'model_id = [0]\nsubtasks = ["a"]\naccess_list = [[[[0]]]]',                       # nested too deep
    "model_id = [" + "[" * 5000 + "]" * 5000 + "]\nsubtasks = []\naccess_list = []",   # recursion bomb
    'model_id = [0]\nsubtasks = ["' + "x" * 10_000 + '"]\naccess_list = [[]]',         # a huge string
    'model_id = [1' + "0" * 5000 + ']\nsubtasks = ["a"]\naccess_list = [[]]',          # a huge number
]


def accepted(parse, texts):
    """The texts a parser accepts (returns something other than None, without raising)."""
    out = []
    for t in texts:
        try:
            if parse(t, 2, 2) is not None:
                out.append(t)
        except Exception:
            pass
    return out


def test_parses_the_worked_example_and_its_variants():
    assert parse_workflow(GOOD, 2, 2) == ([0, 1], ["Add the numbers.", "Check the sum and answer."], [[], [0]])
    assert parse_workflow(C.EXAMPLE_WORKFLOW, 2, 2) is not None     # the prompt's own example parses
    # worker names, "all", single quotes, escapes, a trailing comma, spaces, and text after the lists
    text = ("model_id = ['Model 1', 0,]\n  subtasks=['Say \\'hi\\'', \"x\\n\"]\naccess_list = [[], 'all']\n"
            "Thanks! print('done')")
    assert parse_workflow(text, 2, 2) == ([1, 0], ["Say 'hi'", "x\n"], [[], [0]])
    assert parse_workflow('model_id = [1]\nsubtasks = ["Solve."]\naccess_list = ["all"]', 2, 2) == ([1], ["Solve."], [[]])


@pytest.mark.parametrize("text", HOSTILE + MALFORMED)
def test_malformed_or_code_is_refused(text):
    assert parse_workflow(text, 2, 2) is None


def test_a_parser_that_evaluates_model_text_fails_the_check():
    """The check above can fail: a parser that evaluates the lists (eval with a few builtins, which is what
    'parse with eval' amounts to) accepts code the real parser refuses."""
    def eval_parser(text, n_workers, max_steps):
        scope = {"__builtins__": {"len": len, "list": list, "range": range, "__import__": lambda *a: None}}
        exec(text.split("\n\n")[0], scope)                                   # the planted mistake
        return scope["model_id"], scope["subtasks"], scope["access_list"]
    assert accepted(parse_workflow, HOSTILE) == []
    assert len(accepted(eval_parser, HOSTILE)) >= 5


def test_reward_levels_and_worker_usage():
    assert [C.workflow_reward(p, s) for p, s in [(None, 1.0), (([0], ["a"], [[]]), 0.0), (([0], ["a"], [[]]), 1.0)]] \
        == [0.0, 0.5, 1.0]
    cond = C.Conductor([None, None, None], ["a", "b", "c"], 2, 4, ("simple", False, ""))
    A = cond.usage([([0, 2], ["x", "y"], [[], [0]]), None, ([1, 1], ["x", "y"], [[], []])])   # (2, 1, 3)
    assert torch.allclose(A.sum(-1), torch.ones(2, 1))
    assert A[0, 0].tolist() == [0.5, 0.0, 0.5] and A[1, 0].tolist() == [0.0, 1.0, 0.0]
    assert cond.usage([None, None]) is None


def test_workers_see_only_what_access_list_gives(tiny_policy):
    """Two workers (both the tiny policy): the second step's prompt carries the first answer only when allowed,
    and the output is the last step's answer."""
    model, tok = tiny_policy
    cond = C.Conductor([(model, tok), (model, tok)], ["w0", "w1"], 2, 3, ("simple", False, ""))
    seen = []
    cond.generate = lambda k, msgs: (seen.extend((k, m) for m in msgs), [f"answer of {k}" for _ in msgs])[1]
    out = cond.run_workflows(["Q1", "Q2", "Q3"], [([0, 1], ["first", "second"], [[], [0]]),
                                                 ([1, 0], ["first", "second"], [[], []]), None])
    assert out == ["answer of 1", "answer of 0", ""]
    q1, q2 = ([m for k, m in seen if "second" in m and q in m][0] for q in ("Q1", "Q2"))
    assert "Step 0: answer of 0" in q1 and "Earlier answers" not in q2


@pytest.mark.parametrize("method", ["conductor", "rlae"])
@pytest.mark.parametrize("flags", [["--inner-epochs", "2"], ["--reward", "random"], ["--format-bonus", "0.1"],
                                   ["--dynamic-sampling", "2"], ["--rollout-dtype", "bfloat16"]])
def test_options_their_own_step_does_not_have_fail_loudly(method, flags, capsys):
    from neighbours import rlae
    parse_args = {"conductor": C.parse_args, "rlae": rlae.parse_args}[method]
    with pytest.raises(SystemExit) as e:
        parse_args(flags)
    assert e.value.code == 2 and capsys.readouterr().err.startswith(f"error: --method {method} runs its own step")


def test_beta_defaults_to_zero_for_the_conductor_only():
    from train import parse_args
    assert C.parse_args([]).beta == 0.0 and C.parse_args([]).method == "conductor"
    assert parse_args(["--method", "ours"]).beta == 0.04
    assert C.parse_args(["--beta", "0.1"]).beta == 0.1


def test_conductor_trains_and_evaluates_on_the_tiny_team(tmp_path):
    """neighbours/conductor.py: 2 GRPO steps, its log fields, a checkpoint that evaluate.py scores."""
    from evaluate import evaluate
    out = str(tmp_path / "c")
    C.main(["--task", "chain_sum", "--team", "tiny", "--device", "cpu", "--dataset-size", "16",
          "--system-prompt", "simple", "--steps", "2", "--batch-size", "2", "--grad-accum", "1", "--group-size", "2",
          "--max-new-tokens", "8", "--out", out])
    ms = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    assert [m["step"] for m in ms] == [1, 2] and all(0 <= m["parse_rate"] <= 1 and m["kl"] == 0 for m in ms)
    cfg = SimpleNamespace(**json.load(open(os.path.join(out, "config.json"))))
    state = torch.load(os.path.join(out, "checkpoint.pt"), weights_only=False)
    res = evaluate(cfg, 2, 2, state["lora"], state["method"], build=C.conductor)
    assert res["n"] == 2 and res["method"] == "conductor"


def test_report_draws_fig4_and_table_rows_for_conductor_and_rlae(tmp_path):
    """support/report.py: both methods get a table row and a Fig. 4 of their own (workers / members by name); a conductor
    step where nothing parsed has no utilisation and is a gap, not a crash."""
    pytest.importorskip("matplotlib")
    from support.report import plot_runs, summarize
    for method in ("conductor", "rlae"):
        run = tmp_path / method
        os.makedirs(run)
        json.dump({"method": method, "task": "chain_sum", "team": "tiny", "steps": 3, "num_latents": 4,
                   "team_models": {"experts": ["a", "b", "enc"]}}, open(run / "config.json", "w"))
        json.dump({"score": 0.25, "solve_rate": 0.25}, open(run / "eval.json", "w"))
        with open(run / "metrics.jsonl", "w") as f:
            for step in (1, 2, 3):
                row = {"step": step, "reward": step / 10, **({"parse_rate": step / 4, "mean_steps": 1.5}
                                                              if method == "conductor" else {})}
                if not (method == "conductor" and step == 2):
                    row.update(entropy=0.5, utilization=[0.7, 0.3], utilization_names=["w0", "w1"])
                f.write(json.dumps(row) + "\n")
    table, _ = summarize([str(tmp_path)], str(tmp_path / "out"))
    assert "| conductor | 25.0 |" in table and "| rlae | 25.0 |" in table
    names = sorted(os.path.basename(p) for p in plot_runs([str(tmp_path)], str(tmp_path / "out")))
    assert "fig4_chain_sum_tiny_conductor.png" in names and "fig4_chain_sum_tiny_rlae.png" in names
    assert "conductor_chain_sum_tiny.png" in names                      # the parse-rate curve


def test_parsed_workflows_run_the_workers_and_move_the_policy(tmp_path, monkeypatch):
    """The random tiny policy never writes a workflow that parses, so plant one for every other completion: the
    workers run, the rewards take their three levels, and GRPO's gradient reaches LoRA."""
    calls = {"n": 0}

    def every_other(text, n_workers, max_steps):
        calls["n"] += 1
        return ([calls["n"] % n_workers], ["Solve it."], [[]]) if calls["n"] % 2 else None
    monkeypatch.setattr(C, "parse_workflow", every_other)
    right = lambda items, texts: ([float(i % 2) for i in range(len(texts))], {})  # noqa: E731  half right
    out = str(tmp_path / "c")
    C.main(["--task", "chain_sum", "--team", "tiny", "--device", "cpu", "--dataset-size", "16",
          "--system-prompt", "simple", "--steps", "1", "--batch-size", "2", "--grad-accum", "1", "--group-size", "4",
          "--max-new-tokens", "6", "--out", out], score_batch=right)
    m = json.loads(open(os.path.join(out, "metrics.jsonl")).readline())
    assert m["parse_rate"] == 0.5 and m["mean_steps"] == 1 and len(m["utilization"]) == 2
    assert m["grad_norm_lora"] > 0 and m["solve_rate"] > 0 and m["reward"] == pytest.approx((0.5 + 1) / 2 / 2)
