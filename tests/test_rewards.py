"""Tests of rewards.py and lib/safe_scoring.py: the task lists, splits, prompts, answer extraction, scoring, and
scoring hostile output. CPU only, no network (GSM8K from a small file the test writes), about 30 s:
    python -m pytest tests/test_rewards.py -q
"""
import json
import sys
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import rewards  # noqa: E402
from lib import safe_scoring  # noqa: E402

reasoning_gym = pytest.importorskip("reasoning_gym")
ALL_DATASETS = [name for family in rewards.FAMILIES.values() for name in family]


def make_entry(name, seed=7):
    """One real reasoning-gym item with the paper config."""
    return reasoning_gym.create_dataset(name, seed=seed, size=1, **rewards.dataset_config(name))[0]


def gold(entry):
    """The gold answer; propositional_logic has none, its items carry a valid example conclusion instead."""
    return entry["answer"] if entry["answer"] is not None else entry["metadata"]["example_answer"]


def gsm8k_entry(answer="18"):
    return {"question": "q", "answer": answer, "metadata": {"source_dataset": "gsm8k"}}


def shared_questions(entries_a, entries_b):
    """The questions two lists of entries have in common."""
    return {e["question"] for e in entries_a} & {e["question"] for e in entries_b}


# ----------------------------------------------------------------------------- task lists and splits

def test_families_are_the_paper_listings():
    """Paper §8, Listings 2-4, copied by hand: an independent check of FAMILIES."""
    assert rewards.FAMILIES == {
        "arithmetic": {n: {} for n in ["complex_arithmetic", "intermediate_integration", "polynomial_equations",
                                       "polynomial_multiplication", "simple_geometry", "bitwise_arithmetic",
                                       "chain_sum", "decimal_arithmetic", "decimal_chain_sum"]},
        "algorithmic": {"ab": {}, "base_conversion": {}, "binary_alternation": {"p_solvable": 0.9},
                        "binary_matrix": {"min_n": 2, "max_n": 6}, "caesar_cipher": {"max_words": 10},
                        "cryptarithm": {}, "isomorphic_strings": {"max_string_length": 8},
                        "jugs": {"difficulty": 6}, "rotate_matrix": {"min_n": 2, "max_n": 6},
                        "string_manipulation": {"max_string_length": 15, "max_num_rules": 6}},
        "logic": {n: {} for n in ["aiw", "circuit_logic", "knights_knaves", "propositional_logic",
                                  "self_reference", "syllogism", "zebra_puzzles"]},
    }
    assert set(safe_scoring.SCORERS) == set(ALL_DATASETS) | {"gsm8k"}, "every scorer the tasks use is surveyed"


def test_system_prompt_names_are_reasoning_gyms():
    from reasoning_gym.utils import SYSTEM_PROMPTS

    assert rewards.SYSTEM_PROMPT_NAMES == tuple(SYSTEM_PROMPTS)


@pytest.mark.parametrize("family", list(rewards.FAMILIES))
def test_family_train_and_val_share_no_question(family):
    train = rewards.load_entries(family, "train", 30, seed=0)
    val = rewards.load_entries(family, "val", 30, seed=0)
    assert len(train) == len(val) == 30
    assert shared_questions(train, val) == set()
    for entry in [*train, *val]:
        assert {"question", "answer", "metadata"} <= set(entry)
        assert entry["metadata"]["source_dataset"] in rewards.FAMILIES[family]


def test_disjoint_seeds_alone_would_share_questions():
    """Regression: the first version split by seed only; self_reference then repeated ~17% of val in train."""
    def questions(seed):
        return {e["question"] for e in reasoning_gym.create_dataset("self_reference", seed=seed, size=300)}

    assert questions(rewards.split_seed(0, "train")) & questions(rewards.split_seed(0, "val")), "premise of the fix"
    train = rewards.load_entries("self_reference", "train", 300)
    val = rewards.load_entries("self_reference", "val", 300)
    assert shared_questions(train, val) == set()


def test_splits_are_deterministic_and_seeded():
    questions = [[e["question"] for e in rewards.load_entries("chain_sum", "train", 20, seed=s)] for s in (0, 0, 1)]
    assert questions[0] == questions[1] and questions[0] != questions[2]


def test_unknown_task_names_the_flag():
    with pytest.raises(ValueError, match="--task") as err:
        rewards.load_entries("arithmetics", "train", 4)
    message = str(err.value)
    assert "\n" not in message and all(name in message for name in ["arithmetic", "algorithmic", "logic", "gsm8k"])


@pytest.fixture
def gsm8k_folder(tmp_path):
    """A GSM8K-format folder: train.jsonl (60 rows) and test.jsonl (20 rows), one {"question", "answer"} object
    per line, the worked solution ending in "#### N" as in openai/gsm8k. The first test row is GSM8K's first."""
    def row(i):
        a, b = 17 * i + 3, 1000 * (i % 3) + i
        return {"question": f"Item {i}: what is {a} + {b}?", "answer": f"{a} + {b} = <<{a}+{b}={a + b}>>{a + b}\n"
                f"#### {a + b:,}"}  # a gold of 1,000 or more with a comma: it must still match "1,021" and "1021"

    first = {"question": "Janet's ducks lay 16 eggs per day. She eats three for breakfast every morning and bakes "
             "muffins for her friends every day with four. She sells the remainder at the farmers' market daily "
             "for $2 per fresh duck egg. How much in dollars does she make every day at the farmers' market?",
             "answer": "Janet sells 16 - 3 - 4 = <<16-3-4=9>>9 duck eggs a day.\nShe makes 9 * 2 = $<<9*2=18>>18 "
             "every day at the farmer's market.\n#### 18"}
    for name, rows in [("train.jsonl", [row(i) for i in range(100, 160)]),
                       ("test.jsonl", [first] + [row(i) for i in range(1, 20)])]:
        (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in rows) + "\n", encoding="utf-8")
    return tmp_path


def test_gsm8k_from_a_local_folder_or_file(gsm8k_folder):
    val = rewards.load_entries("gsm8k", "val", None, data_path=gsm8k_folder)
    assert len(val) == 20 and val[0]["answer"] == "18" and val[0]["metadata"]["source_dataset"] == "gsm8k"
    assert val[1]["answer"] == "1,021" and val[1]["metadata"]["solution"].endswith("1021\n#### 1,021")
    assert rewards.load_entries("gsm8k", "val", 5, data_path=gsm8k_folder / "test.jsonl") == val[:5]
    train = [e["question"] for e in rewards.load_entries("gsm8k", "train", 50, seed=0, data_path=gsm8k_folder)]
    assert train != [e["question"] for e in rewards.load_entries("gsm8k", "train", 50, seed=1,
                                                                 data_path=gsm8k_folder)]
    assert not set(train) & {e["question"] for e in val}
    rewards_, counts = rewards.score_batch(val, [f"<answer>{e['answer']}</answer>" for e in val])
    assert rewards_ == [1.0] * 20 and counts["ok"] == 20
    assert rewards.score(val[1], "<answer>1021</answer>") == 1.0
    assert len(rewards.load_entries("gsm8k", "val", 4000, data_path=gsm8k_folder)) == 20  # the whole split, no more


def test_gsm8k_without_network_asks_for_data_path(monkeypatch):
    class NoHub:
        @staticmethod
        def load_dataset(*args, **kwargs):
            raise ConnectionError("no network")

    monkeypatch.setitem(sys.modules, "datasets", NoHub)
    with pytest.raises(ValueError, match="--data-path") as err:
        rewards.load_entries("gsm8k", "train", 10)
    assert "\n" not in str(err.value) and "jsonl" in str(err.value)


# ----------------------------------------------------------------------------- prompt

def tiny_tokenizer(chat_template):
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = models.WordLevel({"<unk>": 0}, unk_token="<unk>")
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(vocab))
    tokenizer.chat_template = chat_template
    return tokenizer


TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}<|end|>{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
NO_SYSTEM = ("{% if messages[0].role == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
             + TEMPLATE)  # like Gemma's


def test_build_prompt_uses_the_chat_template():
    from reasoning_gym.utils import SYSTEM_PROMPTS

    system = SYSTEM_PROMPTS["DeepSeekZero"]
    prompt = rewards.build_prompt(tiny_tokenizer(TEMPLATE), "What is 2+3?")
    assert prompt == f"<|system|>{system}<|end|><|user|>What is 2+3?<|end|><|assistant|>"
    prompt = rewards.build_prompt(tiny_tokenizer(TEMPLATE), "Q", worked_example=True, response_prefix="<think>")
    assert rewards.WORKED_EXAMPLE in prompt and prompt.endswith("<|assistant|><think>")
    prompt = rewards.build_prompt(tiny_tokenizer(NO_SYSTEM), "Q", system_prompt="direct")
    assert prompt == f"<|user|>{SYSTEM_PROMPTS['direct']}\n\nQ<|end|><|assistant|>"


def test_build_prompt_without_a_template_is_plain():
    prompt = rewards.build_prompt(tiny_tokenizer(None), "Q", system_prompt="simple", response_prefix="<think>")
    from reasoning_gym.utils import SYSTEM_PROMPTS

    assert prompt == f"System: {SYSTEM_PROMPTS['simple']}\n\nUser: Q\n\nAssistant: <think>"
    with pytest.raises(ValueError, match="DeepSeekZero"):
        rewards.build_prompt(None, "Q", system_prompt="nope")


# ----------------------------------------------------------------------------- extraction and scoring

@pytest.mark.parametrize("completion, expected", [
    ("<think>2+3=5</think>\n<answer>5</answer>", "5"),
    ("<think>...</think> the answer is 5", None),
    ("<answer>5", None),
    ("5</answer>", None),
    ("<answer>4</answer> wait, <answer> 5 </answer>", "5"),
    ("<answer>4</answer> then <answer>5", "4"),
    ("<answer></answer>", ""),
    ("<answer>\n  Yes \n</answer>", "Yes"),
    ("<answer>a<answer>b</answer>", "b"),
    ("<answer>a</answer>junk</answer>", "a"),
    (b"<answer>\xff7</answer>", "\ufffd7"),
    ("<answer>\udcff7</answer>", "\udcff7"),
    (None, None),
])
def test_extract_answer(completion, expected):
    assert rewards.extract_answer(completion) == expected


def test_extract_answer_is_linear_on_megabytes():
    """reasoning_gym.utils.extract_answer takes 68 s on 160 kB of '<answer>'; ours must stay far below 1 s."""
    start = time.time()
    for text in ["<answer>" * 500_000, "</answer>" * 500_000, "<answer>1</answer>" + "<answer>" * 500_000,
                 "<answer>" + "x" * 4_000_000 + "</answer>"]:
        rewards.extract_answer(text)
    assert time.time() - start < 1.0


@pytest.mark.parametrize("answer, gold, expected", [
    ("18", "18", 1.0), ("1,234", "1234", 1.0), ("1234", "1,234", 1.0), ("$18", "18", 1.0), ("18.0", "18", 1.0),
    (" 18 ", "18", 1.0), ("18.", "18", 1.0), ("-3", "-3", 1.0), ("0.5", ".5", 1.0),
    ("19", "18", 0.0), ("18 eggs", "18", 0.0), ("", "18", 0.0), ("1e3", "1000", 0.0), ("9" * 100, "18", 0.0),
])
def test_gsm8k_numeric_match(answer, gold, expected):
    assert rewards.score(gsm8k_entry(gold), f"<answer>{answer}</answer>") == expected


def test_gold_scores_one_and_wrong_scores_less_on_every_dataset():
    entries = [make_entry(name) for name in ALL_DATASETS] + [gsm8k_entry("18")]
    right = [f"<think>let me see</think>\n<answer>{gold(e)}</answer>" for e in entries]
    wrong = ["<think>hm</think><answer>wrong 123</answer>"] * len(entries)
    good_scores, counts = rewards.score_batch(entries, right)
    assert counts["ok"] == len(entries) and counts["no_answer"] == 0
    bad_scores, counts = rewards.score_batch(entries, wrong)  # a guard may refuse "wrong 123": fine, it is wrong
    assert counts["error"] == counts["timeout"] == 0
    for entry, good, bad in zip(entries, good_scores, bad_scores):
        assert (good, bad < 1.0) == (1.0, True), entry["metadata"]["source_dataset"]


def test_guards_pass_gold_answers():
    """A whitelist must not refuse correct answers: the gold of many items passes every guard."""
    for name in ["intermediate_integration", "polynomial_multiplication", "binary_matrix", "complex_arithmetic",
                 "propositional_logic", "jugs"]:
        kind = safe_scoring.SCORERS[name][0]
        size = 30 if name == "intermediate_integration" else 100
        for entry in reasoning_gym.create_dataset(name, seed=3, size=size, **rewards.dataset_config(name)):
            assert safe_scoring.GUARDS[kind](gold(entry), entry) is None, (name, gold(entry))


def test_missing_answer_and_malformed_entry():
    scores, counts = rewards.score_batch([gsm8k_entry(), {"metadata": {}}, {"metadata": {"source_dataset": "nope"}}],
                                         ["no tags here", "<answer>1</answer>", "<answer>1</answer>"])
    assert scores == [0.0, 0.0, 0.0]
    assert counts == {"ok": 1, "refused": 0, "error": 2, "timeout": 0, "no_answer": 1}


# ----------------------------------------------------------------------------- untrusted output (lib/safe_scoring.py)

def touch(path):
    return f"__import__('pathlib').Path('{path}').touch()"


def test_raw_scorers_are_exploitable(tmp_path):
    """Why safe_score exists: reasoning-gym's own scorers run model text and give 'nan' full marks."""
    for name in ["binary_matrix", "polynomial_multiplication", "intermediate_integration"]:
        entry, marker = make_entry(name), tmp_path / name
        reasoning_gym.get_score_answer_fn(name)(touch(marker), entry)
        assert marker.exists(), f"{name}: the raw scorer ran the answer"
        assert rewards.safe_score(entry, f"<answer>{touch(tmp_path / 'safe')}</answer>") == (0.0, "refused")
    assert not (tmp_path / "safe").exists()
    entry = make_entry("complex_arithmetic")
    assert reasoning_gym.get_score_answer_fn("complex_arithmetic")("nan", entry) == 1.0
    assert rewards.safe_score(entry, "<answer>nan</answer>") == (0.0, "refused")


def hostile_answers(marker):
    return {
        "code": touch(marker),
        "lambda": f"(lambda: {touch(marker)})()",
        "dunder": "().__class__.__base__.__subclasses__()",
        "exponent": "9**9**9**9",
        "nesting": "(" * 100_000 + "1" + ")" * 100_000,
        "lists": "[" * 100_000,
        "megabyte": "1" * 1_000_000,
        "surrogates": "\udcff\ud800 12 \udfff",
        "nan": "nan",
        "atoms": " ∧ ".join(f"p{i}" for i in range(40)),
    }


def expected_status(scorer_kind, answer_kind):
    if scorer_kind in safe_scoring.IN_PROCESS_KINDS:
        return "ok"  # plain string comparisons: harmless on anything
    if answer_kind in ("nesting", "lists", "megabyte"):
        return "refused"  # longer than any real answer
    if scorer_kind in ("sympy", "eval", "complex", "logic") and answer_kind in ("code", "lambda", "dunder"):
        return "refused"
    if scorer_kind == "sympy" and answer_kind == "exponent":
        return "timeout"
    return None  # "ok" (the scorer parses it safely and gives 0) or "refused": both fine


def test_hostile_answers_on_every_dataset(tmp_path):
    marker, timeout = tmp_path / "pwned", 1.0
    rewards.safe_score(make_entry("chain_sum"), "<answer>1</answer>")  # start the worker: not counted as scoring
    entries, completions = [], []
    for name in ALL_DATASETS + ["gsm8k"]:
        entry = make_entry(name) if name != "gsm8k" else gsm8k_entry()
        for answer_kind, answer in hostile_answers(marker).items():
            completion = f"<think>x</think><answer>{answer}</answer>"
            start = time.time()
            reward, status = rewards.safe_score(entry, completion, timeout=timeout)
            assert time.time() - start < timeout + 0.5, (name, answer_kind)
            assert 0.0 <= reward <= 1.0 and status in safe_scoring.STATUSES and status != "error", (name, answer_kind)
            kind = safe_scoring.SCORERS[name][0]
            assert status == (expected_status(kind, answer_kind) or status), (name, answer_kind)
            entries.append(entry)
            completions.append(completion)
    start = time.time()
    scores, counts = rewards.score_batch(entries, completions, timeout=timeout)  # the same in one batch
    assert time.time() - start < (counts["timeout"] + 1) * timeout + 5
    assert counts["timeout"] == 2 and counts["error"] == 0 and all(0.0 <= s <= 1.0 for s in scores)
    assert not marker.exists(), "model text ran as code"


def test_a_hanging_scorer_times_out_and_the_worker_recovers():
    entry = make_entry("polynomial_multiplication")
    assert rewards.safe_score(entry, f"<answer>{entry['answer']}</answer>") == (1.0, "ok")  # worker started
    start = time.time()
    assert rewards.safe_score(entry, "<answer>9**9**9**9</answer>", timeout=1.0) == (0.0, "timeout")
    assert time.time() - start < 1.5
    assert rewards.safe_score(entry, f"<answer>{entry['answer']}</answer>") == (1.0, "ok")
    safe_scoring._WORKER.proc.kill()  # a worker that died between batches (e.g. killed by the OS) is replaced
    safe_scoring._WORKER.proc.join()
    assert rewards.safe_score(entry, f"<answer>{entry['answer']}</answer>") == (1.0, "ok")


PROPERTY_ENTRIES = [make_entry(n) for n in ["chain_sum", "complex_arithmetic", "polynomial_multiplication",
                                            "binary_matrix", "jugs", "propositional_logic", "knights_knaves"]]
ANY_TEXT = st.text(alphabet=st.characters(exclude_categories=()), max_size=60)
TEXTS = ANY_TEXT | st.builds(lambda a, b: f"{a}<answer>{b}</answer>", ANY_TEXT,
                             ANY_TEXT | st.from_regex(r"[0-9x+*()\[\], .-]{0,30}", fullmatch=True))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=TEXTS | st.binary(max_size=40), index=st.integers(0, len(PROPERTY_ENTRIES)))
def test_property_extract_and_score_never_raise(text, index):
    answer = rewards.extract_answer(text)
    assert answer is None or isinstance(answer, str)
    entry = PROPERTY_ENTRIES[index] if index < len(PROPERTY_ENTRIES) else gsm8k_entry()
    reward, status = rewards.safe_score(entry, text, timeout=2.0)
    assert 0.0 <= reward <= 1.0 and status in safe_scoring.STATUSES
