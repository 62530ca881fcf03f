"""The exact memory fixes (issue 44, item 4), each against the path it replaces: the same numbers, less held.
  - grpo.head_logprobs: the LM head one completion at a time, its logits recomputed in the backward pass;
  - lib/kv_cache.preallocate: the decode loop's buffers filled layer by layer, each prefill layer freed as its
    buffer is filled (not a second copy of the whole cache beside the buffers);
  - lib/runtime.expandable_segments: the CUDA allocator's expandable segments, set before CUDA
    starts, never over a user's setting.
What needs a GPU to be meaningful (peak and reserved memory) is measured by experiments/gpu_check.py."""
import gc
import weakref

import pytest
import torch

import rollout
from grpo import completion_mask, head_logprobs, token_logprobs
from rollout import completion_logprobs, encode_prompts, prefill
from lib import kv_cache


def scoring_batch(tok, D):
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
               for q in ("What is 17 + 25?", "Add 3 and 4, then stop.", "Hi")]
    ids, mask = encode_prompts(tok, prompts, "cpu")
    torch.manual_seed(2)
    comp = torch.randint(3, 200, (len(ids) * 2, 7))
    comp[1, 2] = tok.eos_token_id                                         # an early EOS: padding after it
    C = torch.randn(len(ids), 4, D, dtype=torch.float64) * 0.5
    return ids, mask, C, comp, completion_mask(comp, tok.eos_token_id)


@pytest.mark.parametrize("allowed", [False, True])
def test_head_logprobs_equal_token_logprobs_of_the_whole_head_output(allowed):
    """Parity with the path it replaces: token_logprobs over head(h) [N, T, V] at once; values and the gradient
    into h (and through it everything before), with a temperature and with constrained decoding's allowed mask."""
    torch.manual_seed(0)
    N, T, D, V = 3, 5, 8, 11
    head = torch.nn.Linear(D, V, bias=False).double().requires_grad_(False)
    h = torch.randn(N, T, D, dtype=torch.float64, requires_grad=True)
    tokens = torch.randint(0, V, (N, T))
    mask = None
    if allowed:
        mask = torch.rand(N, T, V) < 0.6
        mask.scatter_(-1, tokens[..., None], True)                         # the drawn token was allowed
    new = head_logprobs(head, h, tokens, 0.7, mask)
    (g_new,) = torch.autograd.grad(new.sum(), h)
    old = token_logprobs(head(h), tokens, 0.7, mask)
    (g_old,) = torch.autograd.grad(old.sum(), h)
    torch.testing.assert_close(new, old.float(), rtol=0, atol=0)          # both float32 out of the same rows
    torch.testing.assert_close(g_new, g_old, rtol=0, atol=1e-15)


def test_scoring_equals_the_whole_logits_path(policy64, monkeypatch):
    """completion_logprobs with the head run apart (head_logprobs) against the model's own forward returning
    [N, T, V] logits (PLAIN_HEADS emptied: the path for a head with more than a linear layer, and the old path of
    every model): log-probs and the gradient into LoRA and C."""
    model, tok = policy64
    ids, mask, C, comp, cmask = scoring_batch(tok, model.config.hidden_size)
    lora = [p for p in model.parameters() if p.requires_grad]

    def logp_and_grads():
        Cg = C.clone().requires_grad_()
        logp = completion_logprobs(model, ids, mask, Cg, comp, cmask, 0.8)
        return logp.detach(), torch.autograd.grad((logp * cmask).sum(), lora + [Cg])

    logp, grads = logp_and_grads()
    monkeypatch.setattr(rollout, "PLAIN_HEADS", ())
    want, want_grads = logp_and_grads()
    torch.testing.assert_close(logp, want, rtol=0, atol=0)
    for a, b in zip(grads, want_grads):
        assert (a - b).abs().max() <= 1e-13 * b.abs().max()
    assert all(g.abs().sum() > 0 for g in grads)


def vocabulary_sized_saved(model, ids, mask, C, comp, cmask):
    """Bytes of the tensors autograd keeps for the backward pass, among those with the vocabulary as a dimension
    (the weights left out: the head's weight is kept for its input's gradient either way)."""
    V, kept = model.config.vocab_size, {}
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def pack(t):
        if V in t.shape and t.untyped_storage().data_ptr() not in weights:
            kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        completion_logprobs(model, ids, mask, C.clone().requires_grad_(), comp, cmask, 1.0)
    return sum(kept.values())


def test_the_loss_pass_keeps_no_completion_logits(policy64, monkeypatch):
    """With gradient, no [T, V] row of logits is kept for the backward pass (only the prefill's one logit row per
    prompt, which predicts y_0), and the head runs on one completion at a time. The old path kept every
    completion's float32 logits: the same count there is at least N x (T - 1) x V x 4 bytes."""
    model, tok = policy64
    ids, mask, C, comp, cmask = scoring_batch(tok, model.config.hidden_size)
    N, T, V = *comp.shape, model.config.vocab_size
    shapes = []
    hook = model.get_output_embeddings().register_forward_hook(lambda m, a, out: shapes.append(tuple(out.shape)))
    try:
        kept = vocabulary_sized_saved(model, ids, mask, C, comp, cmask)
    finally:
        hook.remove()
    assert kept <= N * V * 4                                                    # y_0's row per completion at most
    assert max(s[0] * s[1] for s in shapes) <= max(len(ids), T)               # a prompt's last token, or one row
    monkeypatch.setattr(rollout, "PLAIN_HEADS", ())
    assert vocabulary_sized_saved(model, ids, mask, C, comp, cmask) >= N * (T - 1) * V * 4   # float32 rows


def test_preallocate_frees_each_prefill_layer_as_its_buffer_is_filled(policy64):
    """The decode loop's buffers [N, H_kv, P + extra, d] are filled one layer at a time, and each layer of the
    G-fold prefill cache is gone before the next buffer is made: at most one prefill layer beside the buffers made
    so far, never the whole prefill cache (the list built whole kept every prefill layer until the last buffer)."""
    model, tok = policy64
    ids, mask, C, _, _ = scoring_batch(tok, model.config.hidden_size)
    with torch.no_grad():
        cache = prefill(model, ids, mask, C, 4, "after")[0]
    before = [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]
    alive = [weakref.ref(layer.keys) for layer in cache.layers]
    seen = []
    real = kv_cache.Preallocated.__init__

    def counting(self, layer, extra):
        gc.collect()
        seen.append(sum(r() is not None for r in alive))
        real(self, layer, extra)

    kv_cache.Preallocated.__init__ = counting
    try:
        kv_cache.preallocate(cache, 5)
    finally:
        kv_cache.Preallocated.__init__ = real
    L = len(alive)
    assert L > 1 and seen == [L - i for i in range(L)]                # layer i's turn: layers i.. of the prefill left
    for layer, (k, v) in zip(cache.layers, before):                  # the same keys and values, room for 5 more
        assert torch.equal(layer.keys, k) and torch.equal(layer.values, v) and layer.k_buf.shape[2] == k.shape[2] + 5


@pytest.mark.parametrize("device, cuda_here, env, wanted", [
    ("cuda", False, {}, "expandable_segments:True"),
    ("cuda:1", False, {}, "expandable_segments:True"),
    ("auto", True, {}, "expandable_segments:True"),
    ("auto", False, {}, None),
    ("cpu", True, {}, None),
    ("cuda", True, {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128"}, "max_split_size_mb:128"),
    ("cuda", True, {"PYTORCH_ALLOC_CONF": "backend:cudaMallocAsync"}, None),
])
def test_expandable_segments_on_cuda_only_and_never_over_the_users(device, cuda_here, env, wanted, monkeypatch):
    import argparse
    import os
    from lib import runtime
    for k in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda_here)
    runtime.expandable_segments(argparse.Namespace(device=device))
    assert os.environ.get("PYTORCH_CUDA_ALLOC_CONF") == wanted


def test_train_sets_the_allocator_before_anything_else(monkeypatch):
    """train.main calls expandable_segments right after parsing, before any model or tensor is built."""
    import train
    order = []
    monkeypatch.setattr(train, "expandable_segments", lambda args: order.append("allocator"))

    class Stop(Exception):
        pass

    def world():
        order.append("world")
        raise Stop

    monkeypatch.setattr(train.distributed, "world_from_env", world)
    with pytest.raises(Stop):
        train.main(["--preset", "smoke"])
    assert order == ["allocator", "world"]


@pytest.mark.cuda
def test_on_cuda_the_allocator_takes_expandable_segments(tmp_path):
    """A fresh process whose run is on CUDA: runtime.expandable_segments before the first CUDA tensor, and the
    allocator's segments are expandable."""
    import os
    import subprocess
    import sys
    env = {k: v for k, v in os.environ.items() if k not in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")}
    code = ("import argparse, torch; from support import runtime; "
            "runtime.expandable_segments(argparse.Namespace(device='cuda')); "
            "x = torch.zeros(1 << 20, device='cuda'); "
            "print(all(s.get('is_expandable') for s in torch.cuda.memory._snapshot()['segments']))")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "True", out.stderr[-2000:]


def test_every_phase_the_memory_script_measures_names_a_function_that_exists():
    """experiments/memory.py wraps each (module, function) of PHASES with a meter; a name that moved (save_peft left
    support/harness/run.py for export.py) stopped the script at its start with an AttributeError."""
    import importlib
    import os
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "experiments"))
    from memory import PHASES
    for module, attr, label in PHASES:
        owner = importlib.import_module(module)
        for part in attr.split("."):
            assert hasattr(owner, part), f"{module}.{attr} ({label})"
            owner = getattr(owner, part)
