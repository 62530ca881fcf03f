"""The task: data, prompts and rewards for n-Musketeers (GRPO with frozen expert LMs).

`load_entries` draws the paper's Reasoning Gym families (arithmetic, algorithmic, logic; paper §8, Listings
2-4, every dataset weight 1) or GSM8K. `build_prompt` is the policy's input x: reasoning-gym's "DeepSeekZero"
system prompt and the question through the chat template (§8). `extract_answer` takes the last
<answer>...</answer> block and `score` turns it into the reward r in [0, 1] of the GRPO objective (Eq. 4) with
the dataset's own `score_answer`.

Model outputs are untrusted input (DESIGN §4, trap 7): two reasoning-gym scorers hand the answer to
`sympy.parse_expr`, which is `eval`, one calls `eval` itself, some hang on crafted input, and complex_arithmetic
gives "nan" full marks. So each scorer kind has a whitelist (SCORERS is the survey), and every scorer that is
not a plain string comparison runs in a worker process, killed and restarted when an answer takes > `timeout`.

Deviations from the paper (which only names the datasets):
1. Splits: each question is hashed into "train" or "val" (`question_split`), so none is in both, and each
   split draws from its own seed range (`split_seed`). Seeds alone are not enough: with disjoint seeds 51 of
   300 self_reference and 81 of 300 jugs questions still recur in both splits. The price: about 2x generation.
2. Refused (whitelist) and timed-out answers score 0, and so does "nan" on complex_arithmetic. A refusal can,
   rarely, zero a correct answer written in an unusual form (e.g. "1e3" in a sympy task).
3. `extract_answer` uses `rfind`; reasoning-gym's regex is quadratic (68 s on 160 kB of "<answer>"). Same
   result on well-formed text; with nested tags we take the innermost last block.
4. Prompt options for the small "pocket" policy (DESIGN §3), off by default: another system prompt, a worked
   example, a response prefix such as "<think>". A template that rejects the system role gets the system text
   before the question; a tokenizer without a template gets "System: ...\n\nUser: ...\n\nAssistant: ".
5. GSM8K (no details in the paper): reward 1 if the answer equals the number after "####" numerically, else 0.
   Val = the 1,319 test items in file order; train is shuffled with the seed. The splits are fixed, so a larger
   `size` (the default 4,000 validation items, 16,000 training items) gets the whole split: one epoch.
6. A single dataset name (`--task chain_sum`) uses the config of its paper family if it has one.

Try it on CPU (about 5 s, no network):
    python rewards.py --task arithmetic --n 3
"""

import hashlib
from collections.abc import Sequence
import json
import math
import multiprocessing as mp
import os
import random
import re
import sys
import types
from decimal import Decimal
from pathlib import Path

# -----------------------------------------------------------------------------
# Tasks: paper §8, Listings 2-4 (reasoning-gym defaults plus these configs)

FAMILIES = {
    "arithmetic": {name: {} for name in [
        "complex_arithmetic", "intermediate_integration", "polynomial_equations", "polynomial_multiplication",
        "simple_geometry", "bitwise_arithmetic", "chain_sum", "decimal_arithmetic", "decimal_chain_sum"]},
    "algorithmic": {
        "ab": {}, "base_conversion": {}, "binary_alternation": {"p_solvable": 0.9},
        "binary_matrix": {"min_n": 2, "max_n": 6}, "caesar_cipher": {"max_words": 10}, "cryptarithm": {},
        "isomorphic_strings": {"max_string_length": 8}, "jugs": {"difficulty": 6},
        "rotate_matrix": {"min_n": 2, "max_n": 6},
        "string_manipulation": {"max_string_length": 15, "max_num_rules": 6}},
    "logic": {name: {} for name in [
        "aiw", "circuit_logic", "knights_knaves", "propositional_logic", "self_reference", "syllogism",
        "zebra_puzzles"]},
}
SPLITS = ("train", "val")
_SEED_SPAN = 10**9  # reasoning-gym seeds one split may use: [split_seed, split_seed + _SEED_SPAN)


def dataset_config(name):
    """The paper's config of a reasoning-gym dataset ({} = reasoning-gym defaults), deviation 6."""
    configs = [family[name] for family in FAMILIES.values() if name in family]
    return dict(configs[0]) if configs else {}


def split_seed(seed, split):
    """Base seed of a split. The composite uses seeds base .. base + draws + datasets, so the ranges of all
    (seed, split) pairs are disjoint while a split makes fewer than _SEED_SPAN - 100 draws."""
    return (2 * seed + SPLITS.index(split)) * _SEED_SPAN


def question_split(question):
    """'train' or 'val', fixed by the question text alone (sha256): no question can be in both splits."""
    return SPLITS[hashlib.sha256(question.encode("utf-8", "replace")).digest()[0] & 1]


def shared_questions(entries_a, entries_b):
    """The questions two lists of entries have in common (tests assert that train and val share none)."""
    return {e["question"] for e in entries_a} & {e["question"] for e in entries_b}


def load_entries(task, split, size, seed=0, data_path=None, config=None):
    """`size` entries {'question', 'answer', 'metadata'} of a family, 'gsm8k' or one reasoning-gym dataset;
    metadata['source_dataset'] names the dataset that scores the entry. GSM8K: at most its whole split."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if task == "gsm8k":
        return _load_gsm8k(split, size, seed, data_path)
    from reasoning_gym.factory import DATASETS

    if task in FAMILIES:
        configs = FAMILIES[task]
    elif task in DATASETS and task != "composite":
        configs = {task: dataset_config(task)}
    else:
        raise ValueError(f"unknown --task {task!r}: use one of {', '.join([*FAMILIES, 'gsm8k'])} "
                         "or a reasoning-gym dataset name (e.g. chain_sum)")
    if config:  # --task-config: JSON over the reasoning-gym defaults of one dataset
        if task not in configs or len(configs) != 1:
            raise ValueError(f"--task-config applies to a single reasoning-gym dataset, not to --task {task}")
        try:
            configs = {task: {**configs[task], **json.loads(config)}}
            DATASETS[task][1](**configs[task]).validate()
        except (ValueError, TypeError, AssertionError) as err:
            raise ValueError(f"--task-config {config!r} is not a valid {task} config: {err}") from None
    assert isinstance(size, int) and 0 < size < _SEED_SPAN // 40, f"size must be a positive int, got {size!r}"
    from reasoning_gym.composite import CompositeConfig, CompositeDataset, DatasetSpec

    max_draws = 20 * size + 1000  # we expect 2 per kept entry: half the questions belong to the other split
    specs = [DatasetSpec(name, 1.0, dict(config)) for name, config in configs.items()]
    composite = CompositeDataset(CompositeConfig(size=max_draws, seed=split_seed(seed, split), datasets=specs))
    return LazyEntries(composite, split, size, max_draws, task)


class LazyEntries(Sequence):
    """`size` entries of one split, generated in order on first access and kept. Generation is lazy because
    some datasets are slow (a zebra puzzle takes ~0.2 s: 16,000 up front would delay the first step by
    almost an hour), and a run of N steps only ever touches its first N x 32 entries."""

    def __init__(self, composite, split, size, max_draws, task):
        self.composite, self.split, self.size, self.max_draws, self.task = composite, split, size, max_draws, task
        self.entries, self.draws = [], 0

    def __len__(self):
        return self.size

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(self.size))]
        if not -self.size <= i < self.size:
            raise IndexError(i)
        i %= self.size
        while len(self.entries) <= i:
            if self.draws == self.max_draws:
                raise ValueError(f"--task {self.task}: only {len(self.entries)} {self.split} questions in "
                                 f"{self.max_draws} draws")
            entry = self.composite[self.draws]
            self.draws += 1
            if question_split(entry["question"]) == self.split:
                self.entries.append(entry)
        return self.entries[i]


def _load_gsm8k(split, size, seed, data_path):
    """GSM8K rows {'question', 'answer'} from a local jsonl (or a folder with train/test.jsonl) or the hub."""
    hub_split = {"train": "train", "val": "test"}[split]  # the paper validates on the test set
    if data_path is not None:
        path = Path(data_path) / f"{hub_split}.jsonl" if Path(data_path).is_dir() else Path(data_path)
        if not path.is_file():
            raise ValueError(f"--data-path {data_path}: expected a .jsonl or a folder with {hub_split}.jsonl")
        with open(path, encoding="utf-8") as f:
            rows = [json.loads(line) for line in f if line.strip()]
    else:
        try:
            import datasets

            rows = [dict(row) for row in datasets.load_dataset("openai/gsm8k", "main", split=hub_split)]
        except Exception as err:
            raise ValueError(f"could not load openai/gsm8k from the hub ({type(err).__name__}); "
                             "pass --data-path to a local jsonl, e.g. ../shared/data/gsm8k") from err
    rows = list(enumerate(rows))
    if split == "train":
        random.Random(seed).shuffle(rows)
    size = len(rows) if size is None else min(size, len(rows))  # fixed splits: at most all of it (deviation 5)
    if size <= 0:
        raise ValueError(f"gsm8k: size must be positive or None, got {size}")
    return [{"question": row["question"], "answer": row["answer"].split("####")[-1].strip(),
             "metadata": {"source_dataset": "gsm8k", "source_index": i, "solution": row["answer"]}}
            for i, row in rows[:size]]


# -----------------------------------------------------------------------------
# Prompt: system prompt + question through the chat template (paper §8, developer_prompt: DeepSeekZero)

SYSTEM_PROMPT_NAMES = ("DeepSeekZero", "default", "simple", "direct", "chain_of_draft")  # reasoning_gym's keys
WORKED_EXAMPLE = "\nExample:\nUser: What is 3 + 4?\nAssistant: <think>3 plus 4 is 7.</think>\n<answer>7</answer>\n"


def build_prompt(tokenizer, question, system_prompt="DeepSeekZero", worked_example=False, response_prefix=""):
    """The text the policy continues: chat template with add_generation_prompt=True, then response_prefix."""
    from reasoning_gym.utils import SYSTEM_PROMPTS

    if system_prompt not in SYSTEM_PROMPTS:
        raise ValueError(f"unknown system prompt {system_prompt!r}: use one of {', '.join(SYSTEM_PROMPTS)}")
    system = SYSTEM_PROMPTS[system_prompt] + (WORKED_EXAMPLE if worked_example else "")
    if getattr(tokenizer, "chat_template", None) is None:  # e.g. a base model: the plain format of deviation 4
        return f"System: {system.rstrip()}\n\nUser: {question}\n\nAssistant: {response_prefix}"
    from jinja2.exceptions import TemplateError

    messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except TemplateError:  # templates such as Gemma's reject the system role: put it before the question
        messages = [{"role": "user", "content": system + "\n\n" + question}]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return text + response_prefix


# -----------------------------------------------------------------------------
# Answer extraction and reward

def extract_answer(text):
    """Content of the last complete <answer>...</answer> block, stripped; None if there is none. Linear time:
    the last opening tag before the last closing tag, up to the first closing tag after it."""
    if isinstance(text, bytes):  # invalid UTF-8 becomes U+FFFD
        text = text.decode("utf-8", "replace")
    text = "" if text is None else str(text)
    close = text.rfind("</answer>")
    start = text.rfind("<answer>", 0, close) if close >= 0 else -1
    if start < 0:
        return None
    start += len("<answer>")
    return text[start:text.find("</answer>", start)].strip()


def score(entry, completion):
    """Reward in [0, 1] of one completion (through safe_score: model text never runs, never blocks)."""
    return safe_score(entry, completion)[0]


_GSM8K_NUMBER = re.compile(r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)")


def _parse_number(text):
    """'1,234', '$18', '18.0', ' 18 ', '18.' -> Decimal; anything else -> None."""
    if len(text) > 1000:
        return None
    text = re.sub(r"[\s,$]", "", text).rstrip(".")
    return Decimal(text) if len(text) <= 64 and _GSM8K_NUMBER.fullmatch(text) else None


def _score_gsm8k(answer, entry):
    gold = _parse_number(entry["answer"])
    return float(gold is not None and _parse_number(answer) == gold)


# -----------------------------------------------------------------------------
# Safe scoring (DESIGN §4 trap 7). Survey of every scorer of the three families and GSM8K, read in the
# reasoning-gym 0.1.25 source: dataset -> (kind, what its score_answer does with the answer text). The kind
# picks the guard (GUARDS) and where the scorer runs. Not used: reasoning_gym.utils.extract_answer (deviation 3).

DEFAULT = "default: 1.0 on exact match, else len(gold)/len(answer) if the gold is a substring"
SCORERS = {
    "complex_arithmetic": ("complex", "strips outer brackets in an O(n^2) loop, complex(); 'nan' scores 1.0"),
    "intermediate_integration": ("sympy", "sympy.parse_expr = eval (runs code), then diff and simplify"),
    "polynomial_equations": ("number", "float() of each comma-separated part; nan/inf score 0"),
    "polynomial_multiplication": ("sympy", "sympy.parse_expr = eval (runs code), structural =="),
    "bitwise_arithmetic": ("number", "int(text, 0); eval() only of the item's own problem (trusted)"),
    "chain_sum": ("number", "Decimal() without commas, else substring credit"),
    "decimal_arithmetic": ("number", "Decimal() within a tolerance; NaN raises inside its try: 0"),
    "decimal_chain_sum": ("number", "Decimal() equality"),
    "binary_matrix": ("eval", "Python eval() of the text (runs code) when it is not an exact match"),
    "cryptarithm": ("number", "split on ',' and '=', int() of each digit"),
    "jugs": ("json", "json.loads (deep nesting -> RecursionError, caught), then replays the moves"),
    "propositional_logic": ("logic", "own recursive parser (O(n^2); RecursionError not caught), then a "
                                     "truth table over every distinct atom: 2^atoms dicts in one list"),
    "ab": ("string", "exact match"),
    "self_reference": ("string", "exact match"),
    "circuit_logic": ("string", "exact match, or match after strip()"),
    "zebra_puzzles": ("string", "exact match after lower()"),
    "knights_knaves": ("string", "lower/replace/split into (name, role) pairs: linear"),
    **{name: ("string", DEFAULT) for name in ["simple_geometry", "base_conversion", "binary_alternation", "aiw",
                                              "caesar_cipher", "isomorphic_strings", "rotate_matrix",
                                              "string_manipulation", "syllogism"]},
    "gsm8k": ("gsm8k", "this file: a regex and Decimal on at most 64 characters"),
}
STATUSES = ("ok", "refused", "error", "timeout")
IN_PROCESS_KINDS = ("string", "gsm8k")  # verified linear-time string work: scored here, no worker round trip
MAX_ANSWER_CHARS = 10_000  # for the worker kinds; no real answer of these tasks comes near it
MAX_FORMULA_CHARS = 1_000  # sympy and propositional logic: their parsers are quadratic or recursive
_SYMPY_CHARS = frozenset("0123456789+-*/^()., \t\nabcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")
_SYMPY_NAMES = frozenset("C E I pi oo sqrt exp log ln sin cos tan cot sec csc asin acos atan acot sinh cosh "
                         "tanh asinh acosh atanh Abs Integral".split())  # all names in 2,000 gold answers and more
_COMPLEX_CHARS = frozenset("0123456789.+-eEiIjJ() \t")  # no letters for 'nan' or 'inf'
_LIST_CHARS = frozenset("0123456789[], \t\n")  # a list of lists of non-negative ints, nothing else
_DENY = re.compile(r"__|\b(?:import|lambda|eval|exec|open|compile|getattr|globals|os|sys|subprocess)\b")


def _guard_sympy(answer, entry):
    """parse_expr is eval: digits, operators, brackets and whitelisted maths names only. No '_', quotes, '[',
    '=', or '.' before a letter (attribute access): no dunders, strings, subscripts, keywords or calls of
    anything but maths functions."""
    meta = entry["metadata"]
    names = _SYMPY_NAMES | set(meta.get("variables", [])) | {meta.get("variable", "x")}
    if len(answer) > MAX_FORMULA_CHARS or not set(answer) <= _SYMPY_CHARS:  # deep nesting: a SyntaxError
        return "not a short formula"
    if re.search(r"\.\s*[A-Za-z]", answer) or not set(re.findall(r"[A-Za-z]+", answer)) <= names:
        return "name outside the maths whitelist"
    return None


def _guard_logic(answer, entry):
    """Formulas over the item's own variables only: every atom is one variable, so the truth table has at most
    2^len(variables) rows, and the nesting stays far below the recursion limit."""
    variables, text = set(entry["metadata"]["variables"]), "".join(answer.split())
    if len(text) > MAX_FORMULA_CHARS or any(len(v) != 1 for v in variables):
        return "too long"
    depth, prev = 0, "op"  # what came before: 'op' (start, '(', '¬', binary operator) or 'term' (var, ')')
    for char in text:
        if char in variables or char in "¬(":
            ok, new = prev == "op", ("term" if char in variables else "op")
        elif char in ")∧∨→↔":
            ok, new = prev == "term", ("term" if char == ")" else "op")
        else:
            return "character outside the formula grammar"
        depth += (char == "(") - (char == ")")
        if not ok or not 0 <= depth <= 30:
            return "not a formula"
        prev = new
    return None if depth == 0 and prev == "term" else "not a formula"


GUARDS = {  # kind -> function(answer, entry): None if the answer may be scored, else why it is refused
    "number": lambda answer, entry: "too long" if len(answer) > MAX_ANSWER_CHARS else None,
    "json": lambda answer, entry: "too long" if len(answer) > MAX_ANSWER_CHARS else None,  # json runs no code
    "complex": lambda answer, entry: None if len(answer) <= MAX_ANSWER_CHARS and set(answer) <= _COMPLEX_CHARS
    else "not a complex number",
    "eval": lambda answer, entry: None if len(answer) <= MAX_ANSWER_CHARS and set(answer) <= _LIST_CHARS
    else "not a list of integers",
    "sympy": _guard_sympy,
    "logic": _guard_logic,
    # a dataset nobody surveyed: a deny-list is weaker than a whitelist, but the worker still bounds the time
    "unknown": lambda answer, entry: "too long or code-like" if len(answer) > MAX_ANSWER_CHARS
    or _DENY.search(answer) else None,
}


def _kind(name):
    if name in SCORERS:
        return SCORERS[name][0]
    from reasoning_gym.dataset import ProceduralDataset
    from reasoning_gym.factory import DATASETS

    return "string" if DATASETS[name][0].score_answer is ProceduralDataset.score_answer else "unknown"


def _make_scorer(name):
    """score_answer of the dataset built with its paper config, as in the composite that made the entry."""
    if name == "gsm8k":
        return _score_gsm8k
    from reasoning_gym import create_dataset

    return create_dataset(name, **dataset_config(name)).score_answer


def _call_scorer(cache, name, entry, answer):
    """(reward, status) of one answer that passed its guard; any exception scores 0 with 'error'."""
    try:
        if name not in cache:
            cache[name] = _make_scorer(name)
        reward = float(cache[name](answer, entry))
        return (0.0 if math.isnan(reward) else min(1.0, max(0.0, reward))), "ok"
    except Exception:  # includes RecursionError and MemoryError
        return 0.0, "error"


_LOCAL_SCORERS = {}  # scorers of the in-process kinds, built once per process


def _score_here(entry, answer):
    """(result, None) when the answer is scored, refused or broken here; (None, job) when the worker must."""
    try:
        name = entry["metadata"]["source_dataset"]
        if answer is None:
            return (0.0, "ok"), None
        answer = answer.encode("utf-8", "replace").decode("utf-8")  # lone surrogates -> '?'
        kind = _kind(name)
        if kind in IN_PROCESS_KINDS:
            return _call_scorer(_LOCAL_SCORERS, name, entry, answer), None
        if GUARDS[kind](answer, entry) is not None:
            return (0.0, "refused"), None
        return None, (name, entry, answer)
    except Exception:  # a malformed entry or an unregistered source_dataset
        return (0.0, "error"), None


def _worker_main(conn):
    """Worker process: receive a list of jobs, send one (reward, status) per job, in order."""
    import reasoning_gym  # noqa: F401  (preloaded by the forkserver; else imported here, before "ready")

    try:  # cap memory at start + 1 GiB (Linux): a memory bomb raises MemoryError instead of swapping the host
        import resource

        with open("/proc/self/statm") as f:
            limit = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE") + (1 << 30)
        resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))
    except (ImportError, OSError):
        pass  # elsewhere only the timeout bounds a bomb
    conn.send("ready")
    scorers = {}
    while True:
        try:
            jobs = conn.recv()
        except EOFError:
            return
        for name, entry, answer in jobs:
            conn.send(_call_scorer(scorers, name, entry, answer))


class _Worker:
    """One scoring process, killed and restarted when a single answer takes longer than `timeout`. forkserver
    is a clean process with reasoning-gym preloaded (not a fork of the torch trainer), so a restart costs
    ~10 ms instead of the 3.5 s import. The first start is not counted against any timeout."""

    def __init__(self):
        self.proc, self.conn = None, None

    def _start(self):
        method = "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn"  # spawn: Windows
        ctx = mp.get_context(method)
        if method == "forkserver":
            ctx.set_forkserver_preload(["reasoning_gym"])
        self.conn, child_conn = ctx.Pipe()
        self.proc = ctx.Process(target=_worker_main, args=(child_conn,), daemon=True, name="rewards-worker")
        main, sys.modules["__main__"] = sys.modules["__main__"], types.ModuleType("__main__")
        try:  # multiprocessing would re-run the caller's script in the child to rebuild __main__ (slow, and
            self.proc.start()  # fails for stdin or scripts without a main guard); the worker needs none of it
        finally:
            sys.modules["__main__"] = main
        child_conn.close()
        try:
            ready = self.conn.poll(120) and self.conn.recv() == "ready"
        except EOFError:
            ready = False
        if not ready:
            self.stop()
            raise RuntimeError("the reward worker process did not start (its error is printed above)")

    def stop(self):
        if self.proc is not None:
            self.proc.kill()
            self.proc.join()
            self.conn.close()
        self.proc, self.conn = None, None

    def run(self, jobs, timeout):
        """Results of all jobs: one round trip, plus one more after each answer that timed out."""
        results = []
        while len(results) < len(jobs):
            if self.proc is None or not self.proc.is_alive():
                self.stop()
                self._start()
            pending = jobs[len(results):]
            try:
                self.conn.send(pending)
            except OSError:  # it died since the check: give up on one job so that the loop always ends
                results.append((0.0, "error"))
                self.stop()
                continue
            for _ in pending:
                results.append(self._receive(timeout))
                if self.proc is None:  # killed: send the rest to a fresh worker
                    break
        return results

    def _receive(self, timeout):
        try:
            if self.conn.poll(timeout):
                return self.conn.recv()
            status = "timeout"
        except (EOFError, OSError):  # the worker died, e.g. killed by the OS
            status = "error"
        self.stop()
        return 0.0, status


_WORKER = _Worker()  # started on first use, not on import


def score_batch(entries, completions, timeout=2.0):
    """Rewards of a batch and counts {status: n, 'no_answer': n}. The answers the worker must score go in one
    round trip; no single answer takes more than `timeout` seconds."""
    assert len(entries) == len(completions), f"{len(entries)} entries but {len(completions)} completions"
    answers = [extract_answer(c) for c in completions]
    results, jobs, job_index = [], [], []
    for i, (entry, answer) in enumerate(zip(entries, answers)):
        result, job = _score_here(entry, answer)
        results.append(result)
        if job is not None:
            jobs.append(job)
            job_index.append(i)
    for i, result in zip(job_index, _WORKER.run(jobs, timeout) if jobs else []):
        results[i] = result
    counts = {status: sum(s == status for _, s in results) for status in STATUSES}
    counts["no_answer"] = sum(a is None for a in answers)
    return [r for r, _ in results], counts


def safe_score(entry, completion, timeout=2.0):
    """(reward in [0, 1], status in STATUSES) of one completion; model text never runs, never blocks."""
    rewards, counts = score_batch([entry], [completion], timeout)
    return rewards[0], next(status for status in STATUSES if counts[status])


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="Rewards of a right, a wrong and a hostile answer.")
    parser.add_argument("--task", default="arithmetic", help="a family, gsm8k, or a reasoning-gym dataset name")
    parser.add_argument("--n", type=int, default=3, help="number of validation items to show")
    parser.add_argument("--data-path", default=None, help="gsm8k only: a local jsonl or a folder with them")
    args = parser.parse_args()
    assert args.n > 0, "--n must be positive"
    from rewards import load_entries, safe_score  # the importable module: the worker finds its code by name

    for entry in load_entries(args.task, "val", args.n, data_path=args.data_path):
        gold = entry["metadata"].get("example_answer", entry["answer"])  # propositional_logic has no gold
        print(f"[{entry['metadata']['source_dataset']}] {entry['question'][-150:]!r}")
        for answer in (gold, "42", "__import__('os').system('echo pwned')"):
            print(f"  {answer[:40]!r:44} -> reward %.3f (%s)" % safe_score(entry, f"<answer>{answer}</answer>"))
