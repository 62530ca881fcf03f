"""Real shapes, random weights: the paper's models built from their published dimensions, with no download.

A GPU machine without a model hub (or a CPU test) can still run the paper's own code path at the paper's own
sizes: the memory, the kernels and the timings of a step depend on the shapes, not on the values of the weights.
experts.load_model calls this file for `shape:NAME` specs, and `train.py --random-weights` turns every hub id of
the team into one:

    shape:Qwen/Qwen2.5-3B-Instruct        the full model (36 layers), random weights
    shape:Qwen/Qwen2.5-3B-Instruct@2      the same widths and vocabulary at 2 layers (CPU tests)

THE WEIGHTS ARE RANDOM: such a model writes random tokens and solves nothing. Every load says so on stderr.
The tokenizer is a stand-in of the model's real vocabulary size (byte-level: 256 byte tokens, the ChatML
specials, then filler tokens `<|rNNNNN|>` up to the vocabulary), so the embedding, the LM head and the logits
have their real sizes, and any sampled id decodes.

  HUB_CONFIGS   the paper's hub models' dimensions, copied by hand from each model's config.json on the hub
  config(name)  the transformers config of `NAME[@LAYERS]`
  load(name)    (model with random weights, stand-in tokenizer) on `device` in `dtype`, built there directly

Try it on CPU:  python -c "from support import shape_models as s; print(s.config('Qwen/Qwen2.5-3B-Instruct@2'))"
"""
import functools
import sys

import torch

# (kind, hidden size, layers, attention heads, key/value heads, intermediate size, vocabulary, tied embeddings)
HUB_CONFIGS = {
    "Qwen/Qwen2.5-3B-Instruct": ("qwen2", 2048, 36, 16, 2, 11008, 151936, True),
    "Qwen/Qwen2.5-Math-1.5B-Instruct": ("qwen2", 1536, 28, 12, 2, 8960, 151936, True),
    "Qwen/Qwen2.5-Coder-7B-Instruct": ("qwen2", 3584, 28, 28, 4, 18944, 152064, False),
    "meta-llama/Llama-3.2-3B-Instruct": ("llama", 3072, 28, 24, 8, 8192, 128256, True),
    "microsoft/Phi-3.5-mini-instruct": ("phi3", 3072, 32, 32, 32, 8192, 32064, False),
    "google/gemma-2-2b-it": ("gemma2", 2304, 26, 8, 4, 9216, 256000, True),      # head_dim 256
    "mistralai/Mistral-7B-Instruct-v0.3": ("mistral", 4096, 32, 32, 8, 14336, 32768, False),
    "openai/gpt-oss-20b": ("gpt_oss", 2880, 24, 64, 8, 2880, 201088, False),     # 32 experts, 4 per token
    "openai-community/gpt2": ("gpt2", 768, 12, 12, 12, 3072, 50257, False),
    "sentence-transformers/all-MiniLM-L6-v2": ("bert", 384, 6, 12, 12, 1536, 30522, False),
}
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<pad>"]


def split_name(name):
    """'ID@L' -> ('ID', L); 'ID' -> ('ID', None). Raises ValueError for an unknown ID or a bad L."""
    spec, _, layers = name.partition("@")
    if spec not in HUB_CONFIGS:
        raise ValueError(f"shape:{name}: no published dimensions for {spec!r}; known: {', '.join(HUB_CONFIGS)}")
    if layers and not (layers.isdigit() and int(layers) >= 1):
        raise ValueError(f"shape:{name}: the depth after '@' must be a whole number >= 1, got {layers!r}")
    return spec, int(layers) if layers else None


def config(name, layers=None):
    """The transformers config of a hub model from HUB_CONFIGS; `name` may end in '@L' (L layers)."""
    import transformers as tf
    spec, at = split_name(name)
    kind, D, L, H, KV, I, V, tied = HUB_CONFIGS[spec]
    L = layers or at or L
    specials = dict(vocab_size=V, bos_token_id=V - 4, eos_token_id=V - 2, pad_token_id=V - 1)  # see tokenizer()
    if kind == "gpt2":
        return tf.GPT2Config(n_embd=D, n_layer=L, n_head=H, **specials)
    if kind == "bert":
        return tf.BertConfig(hidden_size=D, num_hidden_layers=L, num_attention_heads=H, intermediate_size=I,
                             **specials)
    cls = {"qwen2": tf.Qwen2Config, "llama": tf.LlamaConfig, "phi3": tf.Phi3Config, "gemma2": tf.Gemma2Config,
           "mistral": tf.MistralConfig, "gpt_oss": tf.GptOssConfig}[kind]
    extra = {"head_dim": 256} if kind == "gemma2" else \
        {"head_dim": 64, "num_local_experts": 32, "num_experts_per_tok": 4} if kind == "gpt_oss" else {}
    return cls(hidden_size=D, num_hidden_layers=L, num_attention_heads=H, num_key_value_heads=KV,
               intermediate_size=I, tie_word_embeddings=tied, **specials, **extra)


@functools.lru_cache(maxsize=None)
def tokenizer(vocab_size, chat=True):
    """A byte-level tokenizer of exactly `vocab_size` ids: 256 bytes, fillers, then the 4 specials as the last
    ids (so they match config()'s bos/eos/pad). ChatML template when `chat`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    fillers = [f"<|r{i}|>" for i in range(vocab_size - len(alphabet) - len(SPECIALS))]
    vocab = {t: i for i, t in enumerate(alphabet + fillers + SPECIALS)}
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|im_end|>" if chat else "<|endoftext|>",
                                  pad_token="<pad>", bos_token="<|endoftext|>", unk_token="<|endoftext|>")
    if chat:
        tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                             "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    return tok


def load(name, device="cpu", dtype=torch.float32, head=True):
    """(model, tokenizer): random weights at the real shapes of `name` (see the module docstring), built on
    `device` in `dtype` directly (no host copy first). `head=False` builds a causal LM without its LM head (an
    expert that is only read, never generated from)."""
    import transformers as tf
    cfg = config(name)
    print(f"WARNING: shape:{name} has RANDOM weights at the real shapes ({cfg.num_hidden_layers} layers, "
          f"vocabulary {cfg.vocab_size}): for memory and speed checks only, it knows nothing", file=sys.stderr)
    encoder = cfg.model_type == "bert"
    cls = tf.AutoModel if encoder or not head else tf.AutoModelForCausalLM
    with torch.device(device):
        model = cls.from_config(cfg, dtype=dtype)
    tok = tokenizer(cfg.vocab_size, chat=not (encoder or cfg.model_type == "gpt2"))
    if cfg.eos_token_id != tok.eos_token_id:  # a base model (gpt2) ends with <|endoftext|>
        model.config.eos_token_id = tok.eos_token_id
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.eos_token_id = tok.eos_token_id
    return model, tok
