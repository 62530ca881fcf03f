"""The device check's stand-in tokenizer (experiments/stand_in_tokenizer.py): Qwen2.5's pre-tokenizer with a subset of
its merges, so the paper's prompts have their real length on a GPU machine without a hub (the byte-level stand-in
made them ~4x longer). Hermetic checks of the file as it travels, and the ratio to a real Qwen2.5 tokenizer where
one is installed (the pocket Qwen2.5-Coder-1.5B, lib/pocket_models.py)."""
import os
import sys

import pytest

import rewards
from lib import shape_models
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "experiments"))
import stand_in_tokenizer as stand_in  # noqa: E402

# Qwen2.5's tokens for TEXT, written by Qwen2.5-Coder-1.5B-Instruct's tokenizer (transformers 5.24, 2026-11-28)
TEXT = "Calculate -871 * 12.5 + (3 - 7)? <think> ok </think>\n<answer>-10891.5</answer> numbers"
QWEN_TOKENS = ['Calculate', 'Ġ-', '8', '7', '1', 'Ġ*', 'Ġ', '1', '2', '.', '5', 'Ġ+', 'Ġ(', '3', 'Ġ-', 'Ġ', '7',
               ')?', 'Ġ<', 'think', '>', 'Ġok', 'Ġ</', 'think', '>Ċ', '<', 'answer', '>-', '1', '0', '8', '9', '1',
               '.', '5', '</', 'answer', '>', 'Ġnumbers']
QWEN = "Qwen/Qwen2.5-3B-Instruct"


def count(tok, questions):
    """Tokens of each prompt as train.py builds it (chat template, DeepSeekZero system prompt) and encodes it
    (rollout.encode_prompts: no special tokens added to a templated text)."""
    return [len(tok(rewards.build_prompt(tok, q), add_special_tokens=False)["input_ids"]) for q in questions]


def test_the_stand_in_has_the_policys_vocabulary_and_its_special_ids():
    V = shape_models.config(QWEN).vocab_size
    tok = stand_in.tokenizer(V)
    cfg = shape_models.config(QWEN)
    assert len(tok) == V
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (cfg.bos_token_id, cfg.eos_token_id,
                                                                         cfg.pad_token_id)
    assert len(tok("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]) == 3  # one special token


def test_the_stand_in_writes_qwens_tokens_for_a_question_and_the_answer_format():
    """Qwen's tokens where the subset keeps the merges (numbers, operators, the tags); where it does not, a few
    more tokens of the same text (here '>-' is '>', '-': a merge no reference text needed)."""
    tok = stand_in.tokenizer(151936)
    mine = tok.convert_ids_to_tokens(tok(TEXT, add_special_tokens=False)["input_ids"])
    k = QWEN_TOKENS.index(">-")
    assert mine[:k] == QWEN_TOKENS[:k] and mine[k:k + 2] == [">", "-"] and mine[k + 2:] == QWEN_TOKENS[k + 1:]


def test_any_text_round_trips_and_any_id_decodes():
    tok = stand_in.tokenizer(32768)  # Mistral's vocabulary: the merges and the specials fit
    for text in [TEXT, "Ünïcode ✓ 日本語\n\ttabs  and   spaces", rewards.WORKED_EXAMPLE]:
        assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text
    assert isinstance(tok.decode(list(range(0, 32768, 997))), str)
    with pytest.raises(ValueError, match="cannot hold"):
        stand_in.tokenizer(4096)


def test_the_paper_prompts_are_about_four_times_shorter_than_one_token_per_byte():
    """The hermetic half of the ratio: against the byte-level stand-in the device check used before (1,466-token
    prompts on the H200, ~4x Qwen's)."""
    questions = [e["question"] for e in rewards.load_entries("arithmetic", "train", 64, 0)]
    ours = count(stand_in.tokenizer(151936), questions)
    bytes_ = count(shape_models.tokenizer(151936), questions)
    assert 3.5 < sum(bytes_) / sum(ours) < 5


def test_token_counts_within_15_percent_of_a_real_qwen25_tokenizer():
    """The issue's bar: the stand-in's counts within 15 % of a real Qwen2.5 tokenizer's, on the arithmetic family's
    training prompts (256, seed 0) as train.py builds them. Measured 2026-11-28 with Qwen2.5-Coder-1.5B-Instruct's
    tokenizer: 233.1 tokens per prompt for both (ratio 1.0002; every prompt within 1 %; longest 367 = 367); the
    byte-level stand-in made 957.4 (4.11x). The merges were chosen on the validation split."""
    from transformers import AutoTokenizer
    try:
        from lib import pocket_models
        folder = pocket_models.converted_dir("qwen2.5-coder-1.5b-instruct")
        real = AutoTokenizer.from_pretrained(folder)
    except Exception as e:  # noqa: BLE001  the pocket Qwen is optional (requirements-pocket.txt)
        pytest.skip(f"no converted Qwen2.5 tokenizer here: {type(e).__name__}: {e}"[:200])
    questions = [e["question"] for e in rewards.load_entries("arithmetic", "train", 256, 0)]
    n_real, n_ours = count(real, questions), count(stand_in.tokenizer(151936), questions)
    ratio = sum(n_ours) / sum(n_real)
    assert 0.85 <= ratio <= 1.15, ratio
    assert all(0.85 <= a / b <= 1.15 for a, b in zip(n_ours, n_real))
    assert 0.85 <= max(n_ours) / max(n_real) <= 1.15  # the batch's width: what the KV cache is sized by
