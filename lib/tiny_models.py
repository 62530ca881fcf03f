"""Tiny team: random-init few-layer models of four families and widths, built in memory from configs.

What the tests run on: hermetic (no download, no file), seconds on a CPU, and the same name always gives the same
weights. experts.load_model calls this file for `tiny:NAME` specs, as it calls pocket_models.py for `pocket:NAME`.
Functions only; importing it does nothing.

    python -c "from support import tiny_models as tm; m, t = tm.load('llama'); print(m.config.hidden_size)"

  load(name)              (model, tokenizer) of llama (the tiny policy), qwen2, gpt2 (no chat template) or bert
  tiny_tokenizer(chat)    the byte-level tokenizer they share (256 byte tokens + 4 specials), ChatML when chat
"""
import zlib

import torch


def tiny_tokenizer(chat=True):
    """A byte-level tokenizer built in memory (256 byte tokens + specials): no download, any
    text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<pad>"]
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet) + specials)}
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    eos = "<|im_end|>" if chat else "<|endoftext|>"
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token=eos, pad_token="<pad>",
                                  bos_token="<|endoftext|>", unk_token="<|endoftext|>")
    if chat:  # ChatML, as Qwen and SmolLM2 use
        tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
                             "{{ m['content'] }}<|im_end|>\n{% endfor %}"
                             "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    return tok


NAMES = ("llama", "qwen2", "gpt2", "bert")  # load's configs


def load(name):
    """Random-init few-layer models of different families and widths; the same name gives the
    same weights."""
    import transformers as tf
    tok = tiny_tokenizer(chat=name != "gpt2")
    V = len(tok)
    ids = dict(vocab_size=V, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
               bos_token_id=tok.bos_token_id)
    configs = {
        # the tiny policy: a wider init (0.2, not 0.02) so its LM head can express a peaked
        # distribution and LoRA has room to move it: at 0.02 the logits span ~0.3 nats and no reward
        # could rise in a test
        "llama": tf.LlamaConfig(**ids, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                num_attention_heads=4, num_key_value_heads=2,
                                max_position_embeddings=4096, initializer_range=0.2),
        "qwen2": tf.Qwen2Config(**ids, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                                num_attention_heads=4, num_key_value_heads=2,
                                max_position_embeddings=4096),
        "gpt2": tf.GPT2Config(**ids, n_embd=32, n_layer=2, n_head=2, n_positions=4096),
        "bert": tf.BertConfig(**ids, hidden_size=40, intermediate_size=80, num_hidden_layers=2,
                              num_attention_heads=2, max_position_embeddings=4096),
    }
    assert set(configs) == set(NAMES), "NAMES lists load's configs"
    if name not in configs:
        raise ValueError(f"unknown tiny model {name!r}; choose from {sorted(configs)}")
    config = configs[name]
    with torch.random.fork_rng():
        torch.manual_seed(zlib.crc32(name.encode()))
        cls = tf.BertModel if name == "bert" else tf.AutoModelForCausalLM
        model = cls.from_config(config) if cls is tf.AutoModelForCausalLM else cls(config)
    return model, tok
