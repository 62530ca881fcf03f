"""
GSM8K for rewards.TASKS: the rows {"question", "answer", "metadata"} of a split, from a local jsonl (--data-path)
or the hub's openai/gsm8k. Validation is the 1,319 test items in file order (the paper validates on the test
set); training is the train split shuffled with the seed. Both splits are fixed, so a larger size gets the whole
split. The answer is the number after "####"; the scorer is lib/safe_scoring.score_gsm8k.

Try it on CPU:  python -m pytest tests/test_rewards.py -q -k gsm8k
"""
import json
import random
from pathlib import Path


def load(split, size, seed, data_path):
    """GSM8K rows {'question', 'answer'} from a local jsonl (or a folder with train/test.jsonl)
    or the hub."""
    hub_split = {"train": "train", "val": "test"}[split]  # the paper validates on the test set
    if data_path is not None:
        path = Path(data_path)
        if path.is_dir():
            path = path / f"{hub_split}.jsonl"
        if not path.is_file():
            raise ValueError(f"--data-path {data_path}: expected a .jsonl or a folder with "
                             f"{hub_split}.jsonl")
        rows = read_file(path, data_path)
    else:
        try:
            import datasets

            hub = datasets.load_dataset("openai/gsm8k", "main", split=hub_split)
            rows = [dict(row) for row in hub]
        except Exception as err:
            raise ValueError(f"could not load openai/gsm8k from the hub ({type(err).__name__}); "
                             "pass --data-path to a local jsonl (one {\"question\", \"answer\"} "
                             "object per line, the answer ending in '#### N') or a folder with "
                             "train.jsonl and test.jsonl") from err
    rows = list(enumerate(rows))
    if split == "train":
        random.Random(seed).shuffle(rows)
    # fixed splits: at most all of it (deviation 5)
    size = len(rows) if size is None else min(size, len(rows))
    if size <= 0:
        raise ValueError(f"gsm8k: size must be positive or None, got {size}")
    return [{"question": row["question"], "answer": row["answer"].split("####")[-1].strip(),
             "metadata": {"source_dataset": "gsm8k", "source_index": i, "solution": row["answer"]}}
            for i, row in rows[:size]]



MAX_FILE_BYTES = 1 << 30  # GSM8K's train split is 4 MB
MAX_ROW_CHARS = 100_000  # a question and its answer: far beyond any policy's context (GSM8K's longest: ~1,000)


def read_file(path, data_path):
    """The rows of a GSM8K jsonl; ValueError naming --data-path and the line for one that is not a
    {"question": str, "answer": str} object, or longer than MAX_ROW_CHARS (a 1 MB question never ended its
    first step), or for a file above MAX_FILE_BYTES or not a plain file (a pipe would block)."""
    if not path.is_file() or path.stat().st_size > MAX_FILE_BYTES:
        raise ValueError(f"--data-path {data_path}: {path} is not a plain file of at most {MAX_FILE_BYTES} bytes")
    rows = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            if len(line) > MAX_ROW_CHARS:
                raise ValueError(f"--data-path {data_path}: line {n} of {path} is {len(line)} characters, above "
                                 f"{MAX_ROW_CHARS}: far beyond any policy's context")
            try:
                row = json.loads(line)
            except (ValueError, RecursionError):
                row = None
            if not (isinstance(row, dict) and isinstance(row.get("question"), str)
                    and isinstance(row.get("answer"), str)):
                raise ValueError(f"--data-path {data_path}: line {n} of {path} is not a JSON object with "
                                 "a question and an answer (strings)")
            rows.append(row)
    if not rows:
        raise ValueError(f"--data-path {data_path}: {path} holds no rows")
    return rows
