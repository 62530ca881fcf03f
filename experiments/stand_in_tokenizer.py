"""
A stand-in for Qwen2.5's tokenizer that travels with the repository: prompts of real length for the device check.

The paper's models at real shapes (lib/shape_models.py) need a tokenizer, and a GPU machine of this project has
no model hub. The byte-level stand-in makes one token per byte: a paper prompt (DeepSeekZero system prompt, an
arithmetic question, the chat template) is ~4x longer in it than in Qwen2.5's tokenizer, so every figure measured
with it is for a harder run than a user's. This one is Qwen2.5's own tokenizer with part of its merge table:

  - Qwen2.5's pre-tokenizer (its split regex, then byte-level) and its byte alphabet, unchanged;
  - a subset of its byte-pair merges, in Qwen's order (stand_in_merges.txt beside this file): the FIRST merges by
    rank (the most frequent pairs of its training text: common words, spaces, punctuation) and every merge in the
    derivation of a token Qwen's tokenizer writes for the reference texts (the system prompts, the worked example,
    the chat template's words, questions of the three reasoning-gym families drawn from the *validation* split).
    BPE applies the lowest-ranked merge available; every merge Qwen applies to a word of the reference texts is in
    the subset, so those words get exactly Qwen's tokens; other words get Qwen's tokens or a few more.
  - token ids renumbered compactly (256 bytes, then the merges' tokens in rank order, then fillers `<|rNNNNN|>`
    up to the model's vocabulary), the four specials last, as shape_models.config numbers bos, eos and pad.

Measured against Qwen2.5-Coder-1.5B-Instruct's tokenizer (the same vocabulary and merges as every Qwen2.5 model)
on the arithmetic family's training prompts as train.py builds them (tests/test_stand_in_tokenizer.py, skipped
where that tokenizer is not installed): see the test for the ratio it asserts. The merges are data from Qwen2.5's
tokenizer (Apache-2.0, Alibaba Cloud).

  tokenizer(vocab_size, chat)   a PreTrainedTokenizerFast of exactly vocab_size ids (ChatML template when chat)
  write_merges(folder)          regenerate stand_in_merges.txt from a Qwen2.5 tokenizer folder (needs reasoning-gym)

Regenerate (where the pocket Qwen is converted):  python experiments/stand_in_tokenizer.py
Try it on CPU:  python -c "import sys; sys.path.insert(0, 'experiments'); import stand_in_tokenizer as s; print(s.tokenizer(151936)('What is 17 + 25?'))"
"""
import functools
import os

MERGES_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "stand_in_merges.txt")
# Qwen2.5's pre-tokenizer: contractions, letters (one leading non-letter), ONE digit, punctuation runs, spaces
SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"
         r"\s+(?!\S)|\s+")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<pad>"]  # as lib/shape_models.SPECIALS
FIRST = 8000  # merges kept by rank alone
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def read_merges(path=MERGES_FILE):
    """[(a, b), ...] in Qwen's rank order, from 'a b' lines after the header line (byte-level strings never hold
    a space; '#' is a byte token, so no other line is a comment)."""
    with open(path, encoding="utf-8") as f:
        return [tuple(line.rstrip("\n").split(" ")) for line in f.readlines()[1:]]


@functools.lru_cache(maxsize=None)
def tokenizer(vocab_size, chat=True):
    """Qwen2.5's pre-tokenizer and a subset of its merges (see the module docstring), exactly `vocab_size` ids:
    256 bytes, the merges' tokens, fillers, then SPECIALS as the last four ids. Too small a vocabulary for the
    merges (a model of < ~13k ids) raises ValueError: use the byte-level stand-in there."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    merges = read_merges()
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokens = alphabet + ["".join(m) for m in merges]
    n_fill = vocab_size - len(tokens) - len(SPECIALS)
    if n_fill < 0:
        raise ValueError(f"a vocabulary of {vocab_size} ids cannot hold the stand-in's {len(tokens)} tokens "
                         f"and {len(SPECIALS)} specials")
    vocab = {t: i for i, t in enumerate(tokens + [f"<|r{i}|>" for i in range(n_fill)] + SPECIALS)}
    tk = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tk.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(SPLIT), "isolated"),
                                                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tk.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|im_end|>" if chat else "<|endoftext|>",
                                  pad_token="<pad>", bos_token="<|endoftext|>", unk_token="<|endoftext|>",
                                  additional_special_tokens=["<|im_start|>"])
    if chat:
        tok.chat_template = CHATML
    return tok


def reference_texts(per_family=300):
    """What the merges are chosen on: every reasoning-gym system prompt, the worked example, the chat template's
    words, and `per_family` questions of each task family from the VALIDATION split (the check's prompts come
    from the training split, so the ratio is measured on texts the subset was not chosen on)."""
    from reasoning_gym.utils import SYSTEM_PROMPTS
    import rewards
    texts = list(SYSTEM_PROMPTS.values()) + [rewards.WORKED_EXAMPLE, "system\nuser\nassistant\n<think>"]
    for family in ("arithmetic", "algorithmic", "logic"):
        texts += [e["question"] for e in rewards.load_entries(family, "val", per_family, seed=1)]
    return texts


def write_merges(folder, path=MERGES_FILE, first=FIRST):
    """stand_in_merges.txt from a Qwen2.5 tokenizer folder: Qwen's first `first` merges and the derivations of
    every token it writes for reference_texts(), in Qwen's order."""
    import json
    from tokenizers import pre_tokenizers
    from transformers import AutoTokenizer
    real = AutoTokenizer.from_pretrained(folder)
    spec = json.load(open(os.path.join(folder, "tokenizer.json")))["model"]
    merges, vocab = [tuple(m) for m in spec["merges"]], spec["vocab"]
    rank = {m: k for k, m in enumerate(merges)}
    by_token = {a + b: (a, b) for a, b in merges}  # Qwen's table has one merge per token
    keep = set(range(first))

    def derive(t):  # the merges that build token t
        m = by_token.get(t)
        if m is not None and rank[m] not in keep:
            keep.add(rank[m])
            derive(m[0]), derive(m[1])
    for text in reference_texts():
        for t in real.convert_ids_to_tokens(real(text, add_special_tokens=False)["input_ids"]):
            if vocab.get(t, 0) >= 256:
                derive(t)
    made = set(pre_tokenizers.ByteLevel.alphabet()) | {a + b for k, (a, b) in enumerate(merges) if k in keep}
    assert all(a in made and b in made for k, (a, b) in enumerate(merges) if k in keep), "a merge lacks a part"
    with open(path, "w", encoding="utf-8") as f:
        f.write(f"# Qwen2.5's byte-level BPE merges, a subset in rank order (experiments/stand_in_tokenizer.py; "
                f"Apache-2.0, Alibaba Cloud): the first {first} and {len(keep) - first} more\n")
        f.writelines(f"{a} {b}\n" for k, (a, b) in enumerate(merges) if k in keep)
    tokenizer.cache_clear()
    return len(keep)


if __name__ == "__main__":
    import sys
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    from lib import pocket_models
    print(write_merges(pocket_models.converted_dir("qwen2.5-coder-1.5b-instruct")), "merges ->", MERGES_FILE)
