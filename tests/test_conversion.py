"""lib/pocket_models.py converts a GGUF file once, in a child process, whatever way Python was started.

The conversion used to run in a multiprocessing spawn, which re-imports the parent's __main__ from its path:
from `python -` it failed ("converting ... failed in its process": there is no file "<stdin>"), and a script
without an `if __name__ == "__main__"` guard ran its own top again in the child, which then failed too. Here
a tiny Llama GGUF (built by the test with the gguf package, a dependency of the core) is loaded through
load_gguf from a script read on stdin, from a script file without a main guard, and from `python -c` (a
notebook's __main__ has no file either), each with a cache of its own, so that each converts. CPU, no model
download, ~10 s per way."""
import os
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = """print("top of the user's script")
import sys
sys.path.insert(0, {root!r})
from lib import pocket_models
model, tok = pocket_models.load_gguf({gguf!r})
print("loaded", type(model).__name__, model.config.hidden_size, tok("a b").input_ids)
"""


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    """A 1-layer Llama (width 16) with an 8-token SentencePiece-style vocabulary, float32, as GGUF."""
    import gguf
    path = str(tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf")
    d, ff, V = 16, 32, 8
    w = gguf.GGUFWriter(path, "llama")
    w.add_context_length(64), w.add_embedding_length(d), w.add_block_count(1), w.add_feed_forward_length(ff)
    w.add_head_count(2), w.add_head_count_kv(2), w.add_layer_norm_rms_eps(1e-5), w.add_rope_dimension_count(d // 2)
    w.add_vocab_size(V), w.add_tokenizer_model("llama")
    w.add_token_list(["<unk>", "<s>", "</s>", "\u2581", "a", "b", "1", "2"])
    w.add_token_scores([0.0] * V), w.add_token_types([2, 3, 3, 1, 1, 1, 1, 1])
    w.add_bos_token_id(1), w.add_eos_token_id(2), w.add_unk_token_id(0)
    rng = np.random.default_rng(0)
    tensors = {"token_embd.weight": (V, d), "output.weight": (V, d), "blk.0.attn_q.weight": (d, d),
               "blk.0.attn_k.weight": (d, d), "blk.0.attn_v.weight": (d, d), "blk.0.attn_output.weight": (d, d),
               "blk.0.ffn_gate.weight": (ff, d), "blk.0.ffn_up.weight": (ff, d), "blk.0.ffn_down.weight": (d, ff)}
    for name, shape in tensors.items():
        w.add_tensor(name, (0.02 * rng.standard_normal(shape)).astype(np.float32))
    for name in ("output_norm.weight", "blk.0.attn_norm.weight", "blk.0.ffn_norm.weight"):
        w.add_tensor(name, np.ones(d, np.float32))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    return path


@pytest.mark.parametrize("way", ["python - (stdin)", "a script without a main guard", "python -c"])
def test_gguf_conversion_works_however_python_was_started(way, tiny_gguf, tmp_path):
    script = SCRIPT.format(root=ROOT, gguf=tiny_gguf)
    env = {**os.environ, "NMUSK_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    if way.startswith("python -"):
        cmd, stdin = [sys.executable, "-"], script
    if way.startswith("a script"):
        (tmp_path / "user_script.py").write_text(script)
        cmd, stdin = [sys.executable, str(tmp_path / "user_script.py")], None
    if way == "python -c":
        cmd, stdin = [sys.executable, "-c", script], None
    done = subprocess.run(cmd, input=stdin, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("top of the user's script") == 1  # the child did not run the user's script
    assert "loaded LlamaForCausalLM 16" in done.stdout
    assert os.listdir(tmp_path / "cache" / "converted")  # it converted (and cached) the file
