"""The Conductor (neighbours/conductor.py): the workflow parser reads data and never code, the reward's three levels, the
workers' routing statistics, and a tiny-team run of train.py and evaluate.py."""
import json
import os
from types import SimpleNamespace

import pytest
import torch

import rewards
from neighbours import conductor as C
from neighbours import plumbing
from neighbours import workflow as W
from neighbours.workflow import parse_workflow

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
    'model_id = [\u00b2]\nsubtasks = ["a"]\naccess_list = [[]]',   # ² is a digit to isdigit, not to int():
    'model_id = ["Model \u00b2"]\nsubtasks = ["a"]\naccess_list = [[]]',   # both crashed the parser before
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
    assert [W.workflow_reward(p, s) for p, s in [(None, 1.0), (([0], ["a"], [[]]), 0.0), (([0], ["a"], [[]]), 1.0)]] \
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


LEVERS = [["--inner-epochs", "2"], ["--reward", "random"], ["--format-bonus", "0.1"], ["--dynamic-sampling", "2"],
          ["--rollout-dtype", "bfloat16"]]


@pytest.mark.parametrize("method,flags", [(m, f) for m in ("conductor", "rlae") for f in LEVERS
                                          if f[0] != "--reward"])  # both steps have the coin
def test_options_their_own_step_does_not_have_fail_loudly(method, flags, capsys):
    from neighbours import rlae
    parse_args = {"conductor": C.parse_args, "rlae": rlae.parse_args}[method]
    with pytest.raises(SystemExit) as e:
        parse_args(flags)
    assert e.value.code == 2 and capsys.readouterr().err.startswith(f"error: --method {method} runs its own step")


def test_a_fixed_plan_runs_for_every_question_without_the_policy(tiny_policy):
    """experiments/neighbour_controls.py's controls: with fixed_plan set, answer() runs that workflow for every
    question and never reads the policy (None here); a worker alone (subtask None) reads the question exactly as
    its own prompt would give it, so its answer is its plain greedy answer."""
    model, tok = tiny_policy
    cond = C.Conductor([(model, tok), (model, tok)], ["w0", "w1"], 2, 4, ("simple", False, ""))
    questions = ["What is 2 + 3?", "What is 10 + 1?"]
    example = parse_workflow(C.EXAMPLE_WORKFLOW, 2, 2)
    cond.fixed_plan = example
    assert cond.answer(None, None, questions, None) == cond.run_workflows(questions, [example] * 2)
    cond.fixed_plan = ([1], [None], [[]])
    alone = cond.answer(None, None, questions, None)
    assert alone == plain_greedy(model, tok, questions, 4)
    assert C.worker_message("Q?", None, []) == "Q?" and "Q?" in C.worker_message("Q?", "Solve.", [])


def plain_greedy(model, tok, questions, n, prefix=""):
    """Greedy answers one question at a time: rollout.sample's argmax loop after a plain prefill of each prompt."""
    import grpo
    import rollout
    eos, texts = rollout.eos_token_ids(model, tok), []
    for q in questions:
        ids, mask = rollout.encode_prompts(tok, [rewards.build_prompt(tok, q, "simple", True, prefix)], "cpu")
        ids, mask = (ids, mask) if prefix else rollout.encode_prompts(
            tok, [rewards.build_prompt(tok, q, "simple", False, "")], "cpu")
        out = rollout.sample(model, ids, mask, None, 1, n, 1.0, eos, tok.pad_token_id, greedy=True)
        texts += tok.batch_decode(out.masked_fill(~grpo.completion_mask(out, eos), tok.pad_token_id),
                                  skip_special_tokens=True)
    return [prefix + t for t in texts]


def test_a_batch_of_workers_prompts_shares_its_beginning_and_answers_as_each_alone(tiny_policy):
    """generate() runs a batch's common beginning once (rollout.prefill's share) and decodes greedily: the
    answers equal each prompt decoded by itself, and a prompt seen before is served from the cache."""
    model, tok = tiny_policy
    questions = ["What is 2 + 3?", "What is 10 + 1 + 7?", "What is 4?"]
    cond = C.Conductor([(model, tok)], ["w0"], 1, 6, ("simple", True, "<answer>"))
    assert cond.generate(0, questions) == plain_greedy(model, tok, questions, 6, "<answer>")
    cond.cache = {key: "cached" for key in cond.cache}
    assert cond.generate(0, questions[:1]) == ["cached"]


def test_beta_defaults_to_zero_for_the_conductor_only():
    from train import parse_args
    assert C.parse_args([]).beta == 0.0 and C.parse_args([]).method == "conductor"
    assert parse_args(["--method", "ours"]).beta == 0.04
    assert C.parse_args(["--beta", "0.1"]).beta == 0.1


def test_conductor_trains_and_evaluates_on_the_tiny_team(tmp_path):
    """neighbours/conductor.py: 2 GRPO steps, its log fields, a checkpoint that evaluate.py scores."""
    out = str(tmp_path / "c")
    C.main(["--task", "chain_sum", "--team", "tiny", "--device", "cpu", "--dataset-size", "16",
          "--system-prompt", "simple", "--steps", "2", "--batch-size", "2", "--grad-accum", "1", "--group-size", "2",
          "--max-new-tokens", "8", "--out", out])
    ms = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    assert [m["step"] for m in ms] == [1, 2] and all(0 <= m["parse_rate"] <= 1 and m["kl"] == 0 for m in ms)
    for m in ms:  # tokens_per_s: the workflow tokens the policy wrote (2 prompts x G 2) per second of the step
        assert m["tokens_per_s"] * m["seconds"] == pytest.approx(m["completion_length"] * 2 * 2, rel=1e-9)
    cfg = SimpleNamespace(**json.load(open(os.path.join(out, "config.json"))))
    state = torch.load(os.path.join(out, "checkpoint.pt"), weights_only=False)
    res = plumbing.score_run(*C.load_trained(cfg, state["lora"], state["method"]), cfg, 2, 2)
    assert res["n"] == 2 and res["method"] == "conductor"


def test_report_draws_fig4_and_table_rows_for_conductor_and_rlae(tmp_path):
    """support/harness/report.py and plot.py: both methods get a table row and a Fig. 4 of their own (workers /
    members by name); a conductor step where nothing parsed has no utilisation and is a gap, not a crash."""
    pytest.importorskip("matplotlib")
    from support.harness.plot import plot_runs
    from support.harness.report import summarize
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


ANSWER_ONLY = "<think></think>\n<answer>"  # the second verdict's response prefix: the answer block already open


def test_a_workers_answer_includes_its_pre_filled_words(tiny_policy, monkeypatch):
    """With an answer-only response prefix the worker writes "7</answer>"; its answer, for the scorer and for the
    next worker, is the whole response "<think></think>\n<answer>7</answer>" (on the code before, the scorer read
    "7</answer>": no answer block, 0 on every item)."""
    model, tok = tiny_policy
    says = torch.tensor(tok("7</answer>", add_special_tokens=False)["input_ids"])  # what every worker writes
    monkeypatch.setattr(C.rollout, "decode", lambda model, cache, logits, *a, **kw: says.expand(len(logits), -1))
    cond = C.Conductor([(model, tok)] * 2, ["w0", "w1"], 2, 8, ("simple", False, ANSWER_ONLY))
    seen = []
    say = cond.generate
    cond.generate = lambda k, msgs: (seen.extend(msgs), say(k, msgs))[1]
    out = cond.run_workflows(["What is gcd(14, 21)?"], [([0, 1], ["Solve.", "Check."], [[], [0]])])
    assert out == [ANSWER_ONLY + "7</answer>"] and rewards.extract_answer(out[0]) == "7"
    assert "Step 0: <think></think>\n<answer>7</answer>" in seen[1]


def test_exact_reward_pays_nothing_for_partial_credit(tmp_path, monkeypatch):
    """--reward exact: a parsed workflow whose answer earns partial credit (gcd pays 0.5 for any other number)
    gets 0.5, the reward of a wrong answer, not 0.75; full marks still get 1. The code before refused the flag."""
    monkeypatch.setattr(C, "parse_workflow", lambda text, n_workers, max_steps: ([0], ["Solve it."], [[]]))
    half = lambda items, texts: ([0.5, 1.0] * (len(texts) // 2), {})  # noqa: E731
    out = str(tmp_path / "c")
    C.main(["--task", "chain_sum", "--team", "tiny", "--device", "cpu", "--dataset-size", "16", "--system-prompt",
            "simple", "--steps", "1", "--batch-size", "2", "--grad-accum", "1", "--group-size", "2",
            "--max-new-tokens", "4", "--workflow-decoding", "free", "--reward", "exact", "--out", out],
           score_batch=half)
    m = json.loads(open(os.path.join(out, "metrics.jsonl")).readline())
    assert m["reward"] == pytest.approx(0.75) and m["solve_rate"] == 0.5  # (0.5 + 1) / 2; task would pay 0.875


# ----------------------------------------------------------------------------------------------------------
# Constrained decoding (--workflow-decoding constrained): every workflow parses, the log-probs are the masked ones

QUESTIONS = ["What is 12 + 7?", "What is 3 + 40 + 5?"]


def constrained_draws(model, tok, K, S, max_chars, G, temperature, seed):
    """G constrained workflows for each of QUESTIONS: (prompt ids, mask, completions, comp_mask, allowed_mask,
    texts)."""
    import rollout
    cond = C.Conductor([None] * K, [f"w{k}" for k in range(K)], S, 8, ("simple", False, ""), "constrained",
                       max_chars)
    torch.manual_seed(seed)
    w = cond.write(model, tok, QUESTIONS, G, temperature, rollout.eos_token_ids(model, tok), 8)
    return w.ids, w.mask, w.comp, w.comp_mask, w.allowed_mask, w.texts


@pytest.mark.parametrize("K, S, max_chars", [(2, 2, 10), (3, 3, 6)])
def test_every_constrained_workflow_parses(tiny_policy, K, S, max_chars):
    """96 draws per setting (3 seeds x temperatures 1 and 3 x 2 questions x G = 8) from the random tiny policy,
    which unconstrained never writes a workflow: every one parses, obeys the rules (the parser checks lengths,
    worker ids and access lists), keeps its subtasks within --max-subtask-chars and ends with EOS in budget."""
    pytest.importorskip("llguidance", reason="constrained decoding needs requirements-conductor.txt")
    model, tok = tiny_policy
    lengths = set()
    for seed in range(3):
        for temperature in (1.0, 3.0):
            _, _, comp, comp_mask, allowed, texts = constrained_draws(model, tok, K, S, max_chars, 8, temperature,
                                                                      seed)
            assert allowed.shape == (*comp.shape, len(tok))
            assert (comp == tok.eos_token_id).any(-1).all()                    # every row reached its EOS
            for t in texts:
                plan = parse_workflow(W.CONDUCTOR_PREFIX + t, K, S)
                assert plan is not None, t
                assert all(1 <= len(s) <= max_chars for s in plan[1]), t
                lengths.add(len(plan[0]))
    assert lengths == set(range(1, S + 1))                       # the policy's draws reach every length


def test_constrained_logprobs_are_the_masked_distributions(tiny_policy):
    """The log-probs GRPO uses (rollout.completion_logprobs with the recorded masks), the sampler's own (rollout.sample
    with `allowed`) and an independent computation (one plain forward over [x || y], the logits outside the mask set
    to -inf by hand, log_softmax at T) agree; steps the grammar forces have log-prob 0; and renormalising over the
    allowed tokens can only raise a token's probability."""
    pytest.importorskip("llguidance", reason="constrained decoding needs requirements-conductor.txt")
    import copy

    import rollout
    from lora import apply_lora
    model, tok = copy.deepcopy(tiny_policy[0]), tiny_policy[1]
    apply_lora(model)
    torch.manual_seed(5)
    for p in model.parameters():
        if p.requires_grad:                                           # a LoRA that is not a no-op
            torch.nn.init.normal_(p, std=0.05)
    T, G = 1.3, 4
    ids, mask, comp, comp_mask, allowed, _ = constrained_draws(model, tok, 2, 2, 6, G, T, seed=1)
    logp = rollout.completion_logprobs(model, ids, mask, None, comp, comp_mask, T, allowed_mask=allowed)

    full_ids = torch.cat([ids.repeat_interleave(G, 0), comp], 1)                           # (N, P + T)
    full_mask = torch.cat([mask.repeat_interleave(G, 0), comp_mask], 1)
    with torch.no_grad():
        logits = model(input_ids=full_ids, attention_mask=full_mask,
                       position_ids=rollout.position_ids(full_mask)).logits[:, ids.shape[1] - 1:-1]   # (N, T, V)
    masked = (logits / T).masked_fill(~allowed, float("-inf"))
    ref = torch.log_softmax(masked, -1).gather(-1, comp.unsqueeze(-1)).squeeze(-1)         # (N, T)
    torch.testing.assert_close(logp[comp_mask], ref[comp_mask], rtol=1e-5, atol=1e-5)

    forced = allowed.sum(-1) == 1                                                           # (N, T)
    assert (forced & comp_mask).any() and (logp[forced & comp_mask] == 0).all()
    free = rollout.completion_logprobs(model, ids, mask, None, comp, comp_mask, T)
    assert (logp[comp_mask] >= free[comp_mask] - 1e-6).all() and (logp[comp_mask] > free[comp_mask] + 1e-3).any()

    # the sampler's log-probs (same seed, same draws) are the masked ones too
    cond = C.Conductor([None, None], ["w0", "w1"], 2, 8, ("simple", False, ""), "constrained", 6)
    eos = rollout.eos_token_ids(model, tok)
    cond.write(model, tok, QUESTIONS, 1, T, eos, 8)                                        # builds the grammar tok
    masks = W.WorkflowMasks(cond.grammar_tok[1], W.workflow_grammar(2, 2, 6), comp.shape[0], len(tok), eos)
    torch.manual_seed(1)
    comp2, logp_old = rollout.sample(model, ids, mask, None, G, len(W.longest_workflow(2, 2, 6)) + 1, T, eos,
                                     tok.pad_token_id, return_logprobs=True, allowed=masks)
    assert torch.equal(comp2, comp)
    torch.testing.assert_close(logp_old[comp_mask], logp[comp_mask], rtol=1e-5, atol=1e-5)
    assert torch.equal(masks.allowed_mask(comp.shape[1], "cpu"), allowed)


def test_free_decoding_is_rollout_sample_as_it_was(tiny_policy):
    """--workflow-decoding free draws exactly what rollout.sample draws without a mask (the paper's mode; on the
    machine of its fixture, tests/fixtures/record_metrics.py --check holds the conductor's run bit for bit over 3
    training steps)."""
    import rollout
    model, tok = tiny_policy
    cond = C.Conductor([None, None], ["w0", "w1"], 2, 8, ("simple", False, ""), "free")
    eos = rollout.eos_token_ids(model, tok)
    ids, mask = rollout.encode_prompts(tok, [C.conductor_prompt(tok, q, 2, 2) for q in QUESTIONS], "cpu")
    torch.manual_seed(0)
    w = cond.write(model, tok, QUESTIONS, 3, 1.0, eos, 8)
    torch.manual_seed(0)
    assert w.allowed_mask is None and torch.equal(w.ids, ids) and torch.equal(w.comp, rollout.sample(
        model, ids, mask, None, 3, 8, 1.0, eos, tok.pad_token_id))


def test_workflow_grammar_text():
    """The grammar spells out one alternative per length, the workers as integers and each step's access lists."""
    g = W.workflow_grammar(3, 2, 40)
    assert 'start: w1 | w2' in g and 'wid: "0" | "1" | "2"' in g and "{0,39}" in g
    assert 'access0: "[]" | "\\"all\\""' in g and 'access1: "[]" | "\\"all\\"" | "[0]"' in g
    assert parse_workflow(W.CONDUCTOR_PREFIX + W.longest_workflow(3, 2, 40), 3, 2) is not None
    bits = torch.tensor([[-1, 5]], dtype=torch.int32)                  # all of 0..31, then tokens 32 and 34
    assert W.unpack_bits(bits, 40).nonzero()[:, 1].tolist() == list(range(32)) + [32, 34]


@pytest.mark.parametrize("flags, message", [
    (["--max-subtask-chars", "501"], "--max-subtask-chars 501 is above the parser's limit of 500"),
    (["--workflow-decoding", "greedy"], "--workflow-decoding: invalid choice"),
    (["--max-subtask-chars", "0"], "--max-subtask-chars"),
])
def test_bad_decoding_flags_fail_in_one_line(flags, message, capsys):
    with pytest.raises(SystemExit) as e:
        C.parse_args(flags)
    err = capsys.readouterr().err
    assert e.value.code == 2 and message in err and err.count("\n") == 1


def test_constrained_without_llguidance_says_how_to_get_it(monkeypatch, capsys):
    monkeypatch.setattr(C, "have_llguidance", lambda: False)
    with pytest.raises(SystemExit) as e:
        C.parse_args([])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "pip install -r requirements-conductor.txt" in err and err.count("\n") == 1
    assert C.parse_args(["--workflow-decoding", "free"]).workflow_decoding == "free"


def test_constrained_conductor_trains_on_the_tiny_team(tmp_path):
    """The default mode: every workflow of the step parses, the workers run them, the worker-choice distribution
    is logged, and with rewards that differ GRPO's gradient reaches LoRA."""
    pytest.importorskip("llguidance", reason="constrained decoding needs requirements-conductor.txt")
    right = lambda items, texts: ([float(i % 2) for i in range(len(texts))], {})  # noqa: E731  half right
    out = str(tmp_path / "c")
    C.main(["--task", "chain_sum", "--team", "tiny", "--device", "cpu", "--dataset-size", "16",
            "--system-prompt", "simple", "--steps", "1", "--batch-size", "2", "--grad-accum", "1", "--group-size",
            "4", "--max-new-tokens", "4", "--max-subtask-chars", "8", "--out", out], score_batch=right)
    m = json.loads(open(os.path.join(out, "metrics.jsonl")).readline())
    assert m["parse_rate"] == 1 and m["truncated_fraction"] == 0 and len(m["utilization"]) == 2
    assert m["grad_norm_lora"] > 0 and m["reward"] == pytest.approx(0.75)


@pytest.mark.pocket
def test_constrained_masks_with_the_pocket_policys_tokenizer():
    """The pocket policy's real tokenizer (SmolLM2, 49,152 tokens, multi-character tokens that can straddle the
    grammar's pieces, e.g. '"]'): 32 rows drawn from peaked random logits (fixed per row) through WorkflowMasks,
    with the forward pass left out, all parse and end with EOS within longest_workflow's budget."""
    pytest.importorskip("llguidance", reason="constrained decoding needs requirements-conductor.txt")
    import llguidance.hf

    from experts import load_model
    _, tok = load_model("pocket:smollm2-135m-instruct")
    import rollout
    K, S, L, N, V = 2, 2, 30, 32, len(tok)
    masks = W.WorkflowMasks(llguidance.hf.from_tokenizer(tok, n_vocab=V, eos_token=[tok.eos_token_id]),
                            W.workflow_grammar(K, S, L), N, V, [tok.eos_token_id])
    torch.manual_seed(0)
    base, last, rows = torch.randn(N, V) * 4, None, []
    for _ in range(len(W.longest_workflow(K, S, L)) + 1):
        last = rollout.draw(base.masked_fill(~masks(last), float("-inf")), 1.0)          # (N,)
        rows.append(last)
    comp = torch.stack(rows, 1)
    for row in comp.tolist():
        assert tok.eos_token_id in row
        text = tok.decode(row[:row.index(tok.eos_token_id)])
        assert parse_workflow(W.CONDUCTOR_PREFIX + text, K, S) is not None, text


def test_random_reward_pays_the_seeded_coins_and_runs_no_worker(tmp_path, monkeypatch):
    """--reward random (the control for the worker choice): each workflow's reward is train.py's coin for (seed,
    step, micro-batch); no worker runs and the scorer is never called. The code before refused the flag."""
    def no_scorer(items, texts):
        raise AssertionError("the random-reward control read an answer")
    monkeypatch.setattr(C.Conductor, "run_workflows", lambda *a: (_ for _ in ()).throw(AssertionError("ran")))
    monkeypatch.setattr(C, "parse_workflow", lambda text, n_workers, max_steps: ([0], ["Solve it."], [[]]))
    out = str(tmp_path / "coins")
    C.main(["--task", "chain_sum", "--team", "tiny", "--device", "cpu", "--dataset-size", "16", "--system-prompt",
            "simple", "--steps", "2", "--batch-size", "2", "--grad-accum", "1", "--group-size", "4",
            "--max-new-tokens", "4", "--workflow-decoding", "free", "--seed", "3", "--reward", "random",
            "--out", out], score_batch=no_scorer)
    ms = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    for step, m in enumerate(ms):
        assert m["reward"] == pytest.approx(sum(rewards.coin_rewards(3, step, 0, 0, 8)) / 8)


@pytest.mark.parametrize("reward", ["task", "exact"])
def test_rlae_weight_curves_draw_the_task_trained_agent_beside_coins(reward):
    """rlae_weights_*.png: the agents trained on the task (its own reward or --reward exact: full marks only) are
    the solid lines, the coin-trained ones dashed. A run trained on exact was left out of the plot before."""
    plt = pytest.importorskip("matplotlib.pyplot")
    from support.harness.plot import rlae_weight_curves

    def run(r, w):
        return {"cfg": {"method": "rlae", "task": "gcd", "team": "pocket", "reward": r}, "finished": True,
                "metrics": [{"step": s, "agent_weights": [w, 1 - w], "utilization_names": ["q", "s"]}
                            for s in (1, 2)]}
    (name, fig), = rlae_weight_curves([run(reward, 0.6), run("random", 0.45)], plt)
    lines = {line.get_label(): (line.get_linestyle(), list(line.get_ydata())) for line in fig.axes[0].get_lines()}
    assert lines["q, task reward (1)"] == ("-", [0.6, 0.6]) and lines["q, coins (1)"] == ("--", [0.45, 0.45])
    plt.close(fig)
