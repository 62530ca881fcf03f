"""The task: data, prompts and rewards for n-Musketeers (GRPO with frozen expert LMs).

`load_entries` draws the paper's Reasoning Gym families (arithmetic, algorithmic, logic; paper §8,
Listings 2-4, every dataset weight 1) or GSM8K. `build_prompt` is the policy's input x:
reasoning-gym's "DeepSeekZero" system prompt and the question through the chat template (paper §8).
`extract_answer` takes the last <answer>...</answer> block and `score_batch` turns each answer into
the reward r in [0, 1] of the GRPO objective (Eq. 4) with the dataset's own `score_answer`. Model
outputs are untrusted input (some scorers `eval` them), so the scorers run in
lib/safe_scoring.py, which never executes model text and never blocks.

Deviations from the paper (which only names the datasets):
1. Splits: each question is hashed into "train" or "val" (`question_split`), so none is in both, and
   each split draws from its own seed range (`split_seed`). Seeds alone are not enough: with
   disjoint seeds 51 of 300 self_reference and 81 of 300 jugs questions still recur in both splits.
   The price: about 2x generation.
2. Refused and timed-out answers score 0, and so does "nan" on complex_arithmetic
   (lib/safe_scoring.py).
3. `extract_answer` uses `rfind`; reasoning-gym's regex is quadratic (68 s on 160 kB of "<answer>").
   Same result on well-formed text; with nested tags we take the innermost last block.
4. Prompt options for the small "pocket" policy, off by default: another system prompt, a worked
   example, a response prefix such as "<think>". Measured on 2-term chain_sum, 16 prompts x 4
   samples: with the paper's prompt SmolLM2-135M-Instruct wrote the answer tags in 0 of 64
   completions (every reward 0, no GRPO signal); with a worked example and "<think>", in 23 %. A
   template that rejects the system role gets the system text before the question; a tokenizer
   without a template gets "System: ...\n\nUser: ...\n\nAssistant: ".
5. GSM8K (no details in the paper; loaded by lib/gsm8k.py): reward 1 if the answer equals the
   number after "####" numerically, else 0. Val = the 1,319 test items in file order; train is shuffled with the seed.
   The splits are fixed, so a larger `size` (the default 4,000 validation items, 16,000 training
   items) gets the whole split: one epoch.
6. A single dataset name (`--task chain_sum`) uses the config of its paper family if it has one.
7. Training helpers, each a pure function so that --resume needs no state: `batch_indices` (the data
   order of (seed, step, micro-batch)), `policy_prompts` (x for a batch, shared by training and
   evaluation, so a fork's prompt change reaches both), `coin_rewards` (the random-reward
   control: a seeded coin per completion) and `draw_rewards` (a draw's rewards as the flags ask).

Try it on CPU (about 5 s, no network):
    python rewards.py --task arithmetic --n 3
"""

import hashlib
import json
import re
from collections.abc import Sequence

import numpy as np

from lib import gsm8k
# score_gsm8k lives beside the sandbox that calls it; rewards.score_gsm8k is the same function
from lib.safe_scoring import SCORERS, STATUSES, score_answers, score_gsm8k  # noqa: F401

# -----------------------------------------------------------------------------
# Tasks: paper §8, Listings 2-4 (reasoning-gym defaults plus these configs)

FAMILIES = {
    "arithmetic": {name: {} for name in [
        "complex_arithmetic", "intermediate_integration", "polynomial_equations",
        "polynomial_multiplication", "simple_geometry", "bitwise_arithmetic", "chain_sum",
        "decimal_arithmetic", "decimal_chain_sum"]},
    "algorithmic": {
        "ab": {}, "base_conversion": {}, "binary_alternation": {"p_solvable": 0.9},
        "binary_matrix": {"min_n": 2, "max_n": 6}, "caesar_cipher": {"max_words": 10},
        "cryptarithm": {},
        "isomorphic_strings": {"max_string_length": 8}, "jugs": {"difficulty": 6},
        "rotate_matrix": {"min_n": 2, "max_n": 6},
        "string_manipulation": {"max_string_length": 15, "max_num_rules": 6}},
    "logic": {name: {} for name in [
        "aiw", "circuit_logic", "knights_knaves", "propositional_logic", "self_reference",
        "syllogism",
        "zebra_puzzles"]},
}
SPLITS = ("train", "val")
_SEED_SPAN = 10**9  # reasoning-gym seeds one split may use: [split_seed, split_seed + _SEED_SPAN)
# a split of `size` items draws up to 20 * size + 1000 seeds (half the questions belong to the other split),
# which must stay inside its _SEED_SPAN, with a factor 2 to spare
MAX_DATASET_SIZE = _SEED_SPAN // 40 - 1


def dataset_config(name):
    """The paper's config of a reasoning-gym dataset ({} = reasoning-gym defaults), deviation 6."""
    configs = [family[name] for family in FAMILIES.values() if name in family]
    return dict(configs[0]) if configs else {}


def split_seed(seed, split):
    """Base seed of a split. The composite uses seeds base .. base + draws + datasets, so the
    ranges of all (seed, split) pairs are disjoint while a split makes fewer than _SEED_SPAN -
    100 draws."""
    return (2 * seed + SPLITS.index(split)) * _SEED_SPAN


def question_split(question):
    """'train' or 'val', fixed by the question text alone (sha256): no question can be in both
    splits."""
    return SPLITS[hashlib.sha256(question.encode("utf-8", "replace")).digest()[0] & 1]


def load_entries(task, split, size, seed=0, data_path=None, config=None):
    """`size` entries {'question', 'answer', 'metadata'} of a family, 'gsm8k' or one
    reasoning-gym dataset; metadata['source_dataset'] names the dataset that scores the entry.
    GSM8K: at most its whole split."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if task in TASKS:  # a task with its own data and scorer (gsm8k; a fork's)
        return TASKS[task][0](split, size, seed, data_path)
    from reasoning_gym.factory import DATASETS

    if task in FAMILIES:
        configs = FAMILIES[task]
    elif task in DATASETS and task != "composite":
        configs = {task: dataset_config(task)}
    else:
        raise ValueError(f"unknown --task {task!r}: use one of {', '.join([*FAMILIES, *TASKS])} "
                         "or a reasoning-gym dataset name (e.g. chain_sum)")
    if config:  # --task-config: JSON over the reasoning-gym defaults of one dataset
        if task not in configs or len(configs) != 1:
            raise ValueError("--task-config applies to a single reasoning-gym dataset, not to "
                             f"--task {task}")
        try:
            configs = {task: {**configs[task], **json.loads(config)}}
            DATASETS[task][1](**configs[task]).validate()
        except (ValueError, TypeError, AssertionError) as err:
            raise ValueError(f"--task-config {config!r} is not a valid {task} config: "
                             f"{err}") from None
    if not (isinstance(size, int) and 0 < size <= MAX_DATASET_SIZE):
        raise ValueError(f"a split holds 1 to {MAX_DATASET_SIZE} items, asked for {size!r}")
    from reasoning_gym.composite import CompositeConfig, CompositeDataset, DatasetSpec

    # we expect 2 per kept entry: half the questions belong to the other split
    max_draws = 20 * size + 1000
    specs = [DatasetSpec(name, 1.0, dict(config)) for name, config in configs.items()]
    composite_config = CompositeConfig(size=max_draws, seed=split_seed(seed, split), datasets=specs)
    composite = CompositeDataset(composite_config)
    return LazyEntries(composite, split, size, max_draws, task=task)


class LazyEntries(Sequence):
    """`size` entries of one split, generated in order on first access and kept. Generation is
    lazy because some datasets are slow (a zebra puzzle takes ~0.2 s: 16,000 up front would delay
    the first step by almost an hour), and a run of N steps only ever touches its first N x 32
    entries."""

    def __init__(self, composite, split, size, max_draws, task):
        self.composite, self.split, self.size = composite, split, size
        self.max_draws, self.task = max_draws, task
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
                raise ValueError(f"--task {self.task}: only {len(self.entries)} {self.split} "
                                 f"questions in {self.max_draws} draws")
            entry = self.composite[self.draws]
            self.draws += 1
            if question_split(entry["question"]) == self.split:
                self.entries.append(entry)
        return self.entries[i]


# Tasks with their own data and scorer, beside reasoning-gym's: NAME -> (load, score).
#   load(split, size, seed, data_path) -> entries {"question", "answer", "metadata": {"source_dataset": NAME}}
#       (split "train" or "val": keep them apart; size: how many; data_path: --data-path)
#   score(answer, entry) -> reward in [0, 1]; answer = the text inside <answer>...</answer> (a completion
#       without one scores 0 and never reaches it)
# A fork adds its own with one line, here or from its own file before train.main():
#   rewards.TASKS["mine"] = (load_mine, score_mine)            (tests/test_fork.py does exactly that)
# Its scorer runs in this process on model text: keep it to string work, never eval(). gsm8k is the example
# (its loader is lib/gsm8k.py; its scorer lib/safe_scoring.score_gsm8k, which the sandbox also knows).
TASKS = {"gsm8k": (gsm8k.load, score_gsm8k)}


def batch_indices(step, micro, batch_size, grad_accum, n_items, seed):
    """Data order, a pure function of (seed, position), so resume needs no state: the first epoch
    in order (reasoning-gym items are drawn at random and generated lazily, GSM8K is shuffled on
    load), every later epoch a fresh seeded permutation."""
    start = (step * grad_accum + micro) * batch_size
    out = []
    for k in range(start, start + batch_size):
        epoch, i = divmod(k, n_items)
        if epoch > 0:  # a fresh seeded permutation per epoch
            i = int(np.random.default_rng([seed, epoch]).permutation(n_items)[i])
        out.append(i)
    return out

# -----------------------------------------------------------------------------
# Prompt: system prompt + question through the chat template (paper §8, developer_prompt:
# DeepSeekZero)

# reasoning_gym's keys
SYSTEM_PROMPT_NAMES = ("DeepSeekZero", "default", "simple", "direct", "chain_of_draft")
WORKED_EXAMPLE = ("\nExample:\nUser: What is 3 + 4?\n"
                  "Assistant: <think>3 plus 4 is 7.</think>\n<answer>7</answer>\n")


def build_prompt(tokenizer, question, system_prompt="DeepSeekZero", worked_example=False,
                 response_prefix=""):
    """The text the policy continues: chat template with add_generation_prompt=True, then
    response_prefix."""
    from reasoning_gym.utils import SYSTEM_PROMPTS

    if system_prompt not in SYSTEM_PROMPTS:
        raise ValueError(f"unknown system prompt {system_prompt!r}: use one of "
                         f"{', '.join(SYSTEM_PROMPTS)}")
    system = SYSTEM_PROMPTS[system_prompt] + (WORKED_EXAMPLE if worked_example else "")
    # e.g. a base model: the plain format of deviation 4
    if getattr(tokenizer, "chat_template", None) is None:
        return f"System: {system.rstrip()}\n\nUser: {question}\n\nAssistant: {response_prefix}"
    from jinja2.exceptions import TemplateError

    messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    # templates such as Gemma's reject the system role: put it before the question
    except TemplateError:
        messages = [{"role": "user", "content": system + "\n\n" + question}]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return text + response_prefix



def policy_prompts(tok, questions, hints, args):
    """The policy's input text x for each question (hints: output_collab's expert hints, else
    None). Training and evaluation both call this, so a fork that changes the prompt changes it
    in both."""
    return [build_prompt(tok, q if h is None else q + h, args.system_prompt, args.worked_example,
                                 response_prefix=args.response_prefix) for q, h in zip(questions, hints)]


def responses(response_prefix, completions):
    """What the policy answered, as the scorers read it: the response prefix it was given (the first
    words of its response, pre-filled in the prompt) followed by what it wrote. With the default ""
    or "<think>" this is the completion's answer block unchanged; a prefix that opens the block,
    "<think></think>\n<answer>", makes answer-only completions ("7</answer>" scores as
    "<answer>7</answer>"): a few new tokens a completion instead of dozens."""
    return [response_prefix + c for c in completions]


def full_marks(scores):
    """--reward exact: 1 for a score of 1, 0 for anything less. Reasoning-gym's partial credit can pay
    an answer that is not the gold one (gcd pays 0.5 for any other number)."""
    return [float(s == 1) for s in scores]

# -----------------------------------------------------------------------------
# Answer extraction and reward

def extract_answer(text):
    """Content of the last complete <answer>...</answer> block, stripped; None if there is none.
    Linear time: the last opening tag before the last closing tag, up to the first closing tag
    after it."""
    if isinstance(text, bytes):  # invalid UTF-8 becomes U+FFFD
        text = text.decode("utf-8", "replace")
    text = "" if text is None else str(text)
    close = text.rfind("</answer>")
    start = text.rfind("<answer>", 0, close) if close >= 0 else -1
    if start < 0:
        return None
    start += len("<answer>")
    return text[start:text.find("</answer>", start)].strip()


def format_bonus(completions, bonus, golds=None):
    """--format-bonus, a training-only deviation: `bonus` for each completion with a non-empty
    answer block, else 0. It rewards the form, not the answer, so it gives a group reward
    variance before any answer is right; evaluation (evaluate.score_items) scores with the task's
    scorer alone and never calls this.

    The trap it sets: a policy can earn the bonus with any text in the block. On the pocket task
    one seed in three learned to open an answer block, write a wrong number and run on to the
    token limit, and stayed there for 15 steps. With `golds` (--format-bonus-strict) the bonus
    is paid only for the form of a real answer: the completion ends with its answer block, and
    where the gold answer is a number, the answer is one too."""
    if golds is None:
        return [float(bonus) if (extract_answer(c) or "") else 0.0 for c in completions]
    return [float(bonus) if answer_shaped(c, g) else 0.0 for c, g in zip(completions, golds)]


NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def answer_shaped(completion, gold):
    """Whether `completion` ends with a non-empty answer block shaped like `gold`'s (a number
    where the gold answer is one)."""
    answer = extract_answer(completion)
    if not answer or not str(completion).rstrip().endswith("</answer>"):
        return False
    return not NUMBER.fullmatch(str(gold).strip()) or bool(NUMBER.fullmatch(answer.replace(",", "")))


def coin_rewards(seed, step, micro, draw, n):
    """The random-reward control: n fair coins, a pure function of (seed, step, micro-batch,
    draw), so a resumed run draws the same ones (draw > 0: --dynamic-sampling's re-draws). The
    text is never read."""
    key = [seed, step, micro, 7] + ([draw] if draw else [])
    return np.random.default_rng(key).integers(0, 2, n).astype(float).tolist()


def draw_rewards(items, completions, args, key, score_batch):
    """The rewards of a draw of B items x G = --group-size completions (decoded, padding dropped), as train.py's
    flags ask for them: (task_r [B*G], the task's scorer `score_batch` (--reward exact: full marks or nothing) or
    the random-reward control's coins seeded by key = (step, micro-batch, draw); bonus [B*G], --format-bonus;
    counts, the scorer's). The scorers read `responses`: the response prefix, then what the policy wrote."""
    G, answered = args.group_size, responses(args.response_prefix, completions)
    if args.reward == "random":  # the coin and nothing else (config refuses --format-bonus with it)
        task_r = coin_rewards(args.seed, *key, len(answered))
        counts = {"no_answer": sum(extract_answer(t) is None for t in answered)}
    else:
        task_r, counts = score_batch([it for it in items for _ in range(G)], answered)
        if args.reward == "exact":  # full marks or nothing: partial credit pays no reward
            task_r = full_marks(task_r)
    golds = [it["answer"] for it in items for _ in range(G)] if args.format_bonus_strict else None
    return task_r, format_bonus(answered, args.format_bonus, golds), counts


def score_batch(entries, completions, timeout=2.0):
    """Rewards of a batch and counts {status: n, 'no_answer': n}, status in STATUSES. The answers
    are scored by safe_scoring.score_answers: model text never runs, and no single answer takes
    more than `timeout` seconds."""
    assert len(entries) == len(completions), \
        f"{len(entries)} entries but {len(completions)} completions"
    answers = [extract_answer(c) for c in completions]
    results = scored(entries, answers, timeout)
    counts = {status: sum(s == status for _, s in results) for status in STATUSES}
    counts["no_answer"] = sum(a is None for a in answers)
    return [r for r, _ in results], counts


def scored(entries, answers, timeout):
    """(reward, status) per extracted answer: reasoning-gym's and GSM8K's scorers (safe_scoring),
    and a fork's own tasks (TASKS) here. Every scoring path goes through this one function, so a
    task registered in TASKS is scored alike in training, evaluation and `python rewards.py`."""
    results = score_answers(entries, answers, timeout, dataset_config)
    for i, (entry, answer) in enumerate(zip(entries, answers)):
        name = (entry.get("metadata") or {}).get("source_dataset")
        if name in TASKS and name not in SCORERS and answer is not None:
            try:
                results[i] = (float(TASKS[name][1](answer, entry)), "ok")
            except Exception:  # noqa: BLE001  a scorer's bug costs the answer, not the run
                results[i] = (0.0, "error")
    return results


def safe_score(entry, completion, timeout=2.0):
    """(reward in [0, 1], status in STATUSES) of one completion."""
    return scored([entry], [extract_answer(completion)], timeout)[0]


def score(entry, completion):
    """Reward in [0, 1] of one completion: the reward r of the GRPO objective (Eq. 4)."""
    return safe_score(entry, completion)[0]


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="Rewards of a right, a wrong and a hostile "
                                     "answer.")
    parser.add_argument("--task", default="arithmetic",
                        help="a family, gsm8k, or a reasoning-gym dataset name")
    parser.add_argument("--n", type=int, default=3, help="number of validation items to show")
    parser.add_argument("--data-path", default=None,
                        help="gsm8k only: a local jsonl or a folder with them")
    args = parser.parse_args()
    assert args.n > 0, "--n must be positive"
    for entry in load_entries(args.task, "val", args.n, data_path=args.data_path):
        # propositional_logic has no gold
        gold = entry["metadata"].get("example_answer", entry["answer"])
        print(f"[{entry['metadata']['source_dataset']}] {entry['question'][-150:]!r}")
        for answer in (gold, "42", "__import__('os').system('echo pwned')"):
            reward, status = safe_score(entry, f"<answer>{answer}</answer>")
            print(f"  {answer[:40]!r:44} -> reward {reward:.3f} ({status})")
