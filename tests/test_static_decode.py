"""lib/static_decode.py: the decode loop with fixed shapes (the one a CUDA graph captures), run eagerly on the
CPU against the eager loop (rollout.decode's on a CPU), the reference: the same tokens and log-probs from the same
uniforms, rows that end early cut alike, greedy alike, on the tiny policy with a LoRA that is not a no-op and on the
paper policy's layer shape (Qwen2.5-3B's widths and heads at one layer). Plus where rollout.decode sends each call."""
import copy
import json
import os

import pytest
import torch

import rollout
from lora import apply_lora
from lib import static_decode

SMOKE = ["--preset", "smoke", "--eval-items", "0"]


def lora_policy(spec, dtype=torch.float64):
    """The model with a LoRA whose B is not zero (so the unmerged products matter), in `dtype`."""
    from experts import load_model
    model, tok = load_model(spec)
    model = copy.deepcopy(model).to(dtype)
    apply_lora(model)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.05 * torch.randn(p.shape, generator=g))
    return model.eval(), tok


def both_loops(policy, tok, G=3, T=12, eos_ids=None, greedy=False, prompts=None):
    """(eager tokens, eager log-probs, static tokens, static log-probs) from two prefills of the same prompts."""
    prompts = prompts or ["What is 2 + 3?", "A longer question: what is 17 + 25, step by step?", "Hi"]
    ids, mask = rollout.encode_prompts(tok, prompts, "cpu")
    u = torch.rand(len(prompts) * G, T, generator=torch.Generator().manual_seed(1))
    eos = eos_ids if eos_ids is not None else rollout.eos_token_ids(policy, tok)
    out = []
    with torch.no_grad():
        for loop in (rollout.decode, static_decode.decode_static):
            start = rollout.prefill(policy, ids, mask, None, G, "after")
            out += loop(*[policy, *start], T, 1.0, eos, tok.pad_token_id, greedy=greedy, return_logprobs=True,
                        uniforms=u)
    return out


@pytest.mark.parametrize("dtype,atol", [(torch.float64, 1e-10), (torch.float32, 1e-4)])
def test_the_static_loop_draws_the_eager_loops_tokens_with_its_logprobs(dtype, atol):
    policy, tok = lora_policy("tiny:llama", dtype)
    tokens, logp, tokens_static, logp_static = both_loops(policy, tok)
    assert tokens.shape == tokens_static.shape == (9, 12)
    assert torch.equal(tokens, tokens_static)
    assert torch.allclose(logp, logp_static, atol=atol, rtol=0)


def test_rows_that_end_early_and_greedy_rows_are_cut_alike():
    """EOS ids that rows draw early: every row ends at its own step, the loops stop after the last one."""
    policy, tok = lora_policy("tiny:llama")
    eos = list(range(0, 260, 3))  # a third of the ids: the random policy writes one within a few tokens
    tokens, logp, tokens_static, logp_static = both_loops(policy, tok, T=40, eos_ids=eos)
    assert tokens.shape[1] < 40 and torch.equal(tokens, tokens_static)
    assert (tokens == tok.pad_token_id).any()  # some rows ended before the others
    assert torch.allclose(logp, logp_static, atol=1e-10, rtol=0)
    greedy = both_loops(policy, tok, T=10, greedy=True)
    assert torch.equal(greedy[0], greedy[2]) and torch.allclose(greedy[1], greedy[3], atol=1e-10, rtol=0)


@pytest.mark.parametrize("attention", ["sdpa", "grouped"])
def test_the_static_loop_on_the_paper_policys_layer_shape(attention):
    """Qwen2.5-3B's layer (hidden 2048, 16 query heads on 2 key/value heads of 128, q/k/v biases), one layer and a
    4,096-token vocabulary (the full 151,936 takes ~30 s to initialise on one core and changes no shape the loop
    handles); under transformers' SDPA and under lib/attention.py's grouped attention (train.py --attention,
    grouped on CUDA), which stacks the loop's [N, 1, 1, P + T] mask per group."""
    import transformers as tf
    from lib import shape_models
    cfg = shape_models.config("Qwen/Qwen2.5-3B-Instruct@1")
    V = 4096
    cfg.vocab_size, cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id = V, V - 4, V - 2, V - 1
    torch.manual_seed(0)
    policy = tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    tok = shape_models.tokenizer(V)
    apply_lora(policy)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    from lib import attention as attention_module
    attention_module.use(policy, attention)
    tokens, logp, tokens_static, logp_static = both_loops(policy.eval(), tok, G=2, T=6)
    assert torch.equal(tokens, tokens_static)
    assert torch.allclose(logp, logp_static, atol=1e-4, rtol=0)


def test_decode_sends_each_call_to_its_loop(monkeypatch, tiny_policy):
    """auto: the eager loop on a CPU (the bit-identical fixtures' path); static / graph: decode_static, except
    under constrained decoding (`allowed`), which keeps the eager loop; graph refuses a CPU."""
    calls = []
    real = static_decode.decode_static
    monkeypatch.setattr(static_decode, "decode_static",
                        lambda *a, **kw: calls.append(kw["graph"]) or real(*a, **kw))
    policy, tok = tiny_policy
    ids, mask = rollout.encode_prompts(tok, ["What is 2 + 3?"], "cpu")
    run = lambda **kw: rollout.sample(policy, ids, mask, None, 2, 4, 1.0, [tok.eos_token_id],  # noqa: E731
                                      tok.pad_token_id, **kw)
    run()
    assert calls == []
    monkeypatch.setattr(static_decode, "DECODE", "static")
    a = run(uniforms=torch.full((2, 4), 0.5))
    run(allowed=lambda last: torch.ones(2, len(tok), dtype=torch.bool))
    assert calls == [False]
    monkeypatch.setattr(static_decode, "DECODE", "eager")
    assert torch.equal(a, run(uniforms=torch.full((2, 4), 0.5)))
    monkeypatch.setattr(static_decode, "DECODE", "graph")
    with pytest.raises(ValueError, match="CUDA"):
        run()


def test_a_training_step_samples_the_same_completions_with_either_loop(monkeypatch, tmp_path):
    """train.py end to end (the smoke preset, one step): the static loop's completions are the eager loop's."""
    import train
    samples = {}
    for loop in ("eager", "static"):
        monkeypatch.setattr(static_decode, "DECODE", loop)
        out = str(tmp_path / loop)
        train.main(SMOKE + ["--steps", "1", "--out", out])
        samples[loop] = [json.loads(line) for line in open(os.path.join(out, "samples.jsonl"))]
    assert samples["eager"] == samples["static"]


@pytest.mark.cuda
def test_the_captured_graph_draws_the_static_loops_tokens_on_cuda():
    """On a GPU: the step captured once and replayed gives the tokens of the same loop run eagerly."""
    policy, tok = lora_policy("tiny:llama", torch.float32)
    policy = policy.cuda()
    ids, mask = rollout.encode_prompts(tok, ["What is 2 + 3?", "A longer question, 17 + 25?"], "cuda")
    u = torch.rand(6, 40, generator=torch.Generator().manual_seed(1)).cuda()
    out = []
    for graph in (False, True):
        start = rollout.prefill(policy, ids, mask, None, 3, "after")
        out.append(static_decode.decode_static(policy, *start, 40, 1.0, [-1], tok.pad_token_id,
                                               return_logprobs=True, uniforms=u, graph=graph))
    assert torch.equal(out[0][0], out[1][0])
    assert torch.allclose(out[0][1], out[1][1], atol=1e-4, rtol=0)


# --------------------------------------------------------------------------------------------------------------------
# The captured step on a CPU: static_decode.capture replaced by a stand-in that keeps its contract (WARMUP real steps,
# then the step "recorded"; each replay runs it eagerly), so that what the card does around the graph (fail-soft,
# capture once per run, weights read at the same addresses) is tested here.


class StandInGraph:
    """static_decode.capture's stand-in: counts captures, records at the capture and at every replay the addresses a
    real graph would read (the policy's weights, the loop's K/V buffers), and fails where it is told to."""

    def __init__(self, policy, fail_capture=False, fail_replay_at=None):
        self.policy, self.fail_capture, self.fail_replay_at = policy, fail_capture, fail_replay_at
        self.captures, self.replays, self.seen = 0, 0, []

    def addresses(self, loop):
        weights = [*self.policy.parameters(), *self.policy.buffers()] if self.policy is not None else []
        return tuple(t.data_ptr() for t in weights), tuple(layer.keys.data_ptr() for layer in loop.cache.layers)

    def __call__(self, loop, held):
        for _ in range(static_decode.WARMUP):
            loop.step()
        if self.fail_capture:
            raise RuntimeError("stand-in: capture failed")
        self.captures += 1
        at_capture = self.addresses(loop)

        def replay():
            self.replays += 1
            if self.replays == self.fail_replay_at:
                raise RuntimeError("stand-in: replay failed")
            self.seen.append(self.addresses(loop) == at_capture)  # a real graph reads the captured addresses
            loop.step()
        return replay, static_decode.WARMUP


def sample_both(policy, tok, monkeypatch, T=12, prompts=("What is 2 + 3?", "A longer question: what is 17 + 25?")):
    """rollout.sample as train.py calls it (LoRA merged, uniforms, log-probs) on the eager loop and on the graph path
    (the stand-in's): (eager tokens, eager log-probs, graph tokens, graph log-probs)."""
    ids, mask = rollout.encode_prompts(tok, list(prompts), "cpu")
    u = torch.rand(6, T, generator=torch.Generator().manual_seed(3))
    out = []
    for loop in ("eager", "graph"):
        monkeypatch.setattr(static_decode, "decode_loop", lambda device, _loop=loop: _loop, raising=False)
        monkeypatch.setattr(static_decode, "DECODE", loop)
        out += rollout.sample(policy, ids, mask, None, 3, T, 1.0, [-1], tok.pad_token_id, return_logprobs=True,
                              uniforms=u)
    return out


@pytest.mark.parametrize("where", ["capture", "replay"])
def test_a_graph_that_fails_leaves_the_same_tokens_says_so_once_and_the_run_goes_on(where, monkeypatch, capsys):
    """Fail-soft: a capture (or a replay) that raises does not end the call: it goes on with the same loop run
    eagerly, from where the step counter stands, and draws the eager loop's tokens; stderr says so once per run,
    and static_decode.decode_path says which loop ran and why (the run's metrics record it)."""
    policy, tok = lora_policy("tiny:llama")
    standin = StandInGraph(policy, fail_capture=where == "capture", fail_replay_at=3 if where == "replay" else None)
    monkeypatch.setattr(static_decode, "capture", standin, raising=False)
    for _ in range(2):
        tokens, logp, tokens_graph, logp_graph = sample_both(policy, tok, monkeypatch)
        assert tokens.shape == (6, 12) and torch.equal(tokens, tokens_graph)
        assert torch.allclose(logp, logp_graph, atol=1e-10, rtol=0)
    err = capsys.readouterr().err
    assert err.count("CUDA graph") == 1 and f"{where} failed" in err, err
    path, why = static_decode.decode_path(policy)
    assert path == "static" and why.startswith(f"{where}: RuntimeError: stand-in")
    assert standin.captures == (0 if where == "capture" else 1)  # not tried again after a failure


@pytest.mark.parametrize("merged", [True, False])
def test_the_step_is_captured_once_per_run_and_reads_the_weights_updated_in_place(merged, monkeypatch):
    """Capture once, replay every step: LoRA's update is merged into the same buffers each step (lora_merged's
    keep; or, static_decode.GRAPH_MERGED False, read unmerged from its parameters, which the optimiser updates in
    place), the loop's K/V buffers stay where they are, so the step captured at step 1 replays at step 2 and draws
    the eager loop's tokens and log-probs under the updated weights. A weight replaced by a new tensor (not updated
    in place) is seen, and the step captured again: a graph must never read a freed address."""
    monkeypatch.setattr(static_decode, "GRAPH_MERGED", merged, raising=False)
    policy, tok = lora_policy("tiny:llama")
    standin = StandInGraph(policy)
    monkeypatch.setattr(static_decode, "capture", standin, raising=False)
    first = sample_both(policy, tok, monkeypatch)
    kept = [t.clone() for t in first]
    with torch.no_grad():  # an optimiser step: every LoRA B moves, in place
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.add_(0.02)
    tokens, logp, tokens_graph, logp_graph = sample_both(policy, tok, monkeypatch)
    assert not torch.equal(tokens, kept[0])  # the update changed what is drawn
    atol = 1e-10 if merged else 1e-5  # unmerged: x W^T + s (x A^T) B^T, another order of sums, float32 log-probs
    assert torch.equal(tokens, tokens_graph) and torch.allclose(logp, logp_graph, atol=atol, rtol=0)
    assert standin.captures == 1 and standin.replays > 10 and all(standin.seen)
    assert all(torch.equal(a, b) for a, b in zip(first, kept))  # the call's output is its own, not the buffers'
    assert static_decode.decode_path(policy) == ("graph", None)
    loop = static_decode.HELD[policy].loop
    assert loop.L % static_decode.ALIGN == 0 and static_decode.ALIGN == 16  # 32-byte rows of bf16 keys
    tokens, _, tokens_graph, _ = sample_both(policy, tok, monkeypatch, prompts=("Hi", "What is 2 + 3?"))
    assert standin.captures == 1 and torch.equal(tokens, tokens_graph)  # shorter prompts: the same Loop, replayed
    norm = policy.model.norm  # a weight the graph reads as it is (the merged ones it reads in lora_merged's buffers)
    norm.weight.data = norm.weight.data.clone()  # replaced, not updated in place
    tokens, _, tokens_graph, _ = sample_both(policy, tok, monkeypatch)
    assert standin.captures == 2 and torch.equal(tokens, tokens_graph) and all(standin.seen)


def test_a_policy_is_not_kept_alive_by_its_captured_step(monkeypatch):
    """HELD[policy] keeps the policy's Loop for as long as the policy lives, not longer: a Loop that held its policy
    would keep every policy a process ever captured for (on the card: a finished run's weights, KV cache and merged
    copy under the next one's)."""
    import gc
    import weakref
    policy, tok = lora_policy("tiny:llama")
    monkeypatch.setattr(static_decode, "capture", StandInGraph(None), raising=False)
    sample_both(policy, tok, monkeypatch)
    assert static_decode.HELD[policy].captures == 1
    gone = weakref.ref(policy)
    del policy
    gc.collect()
    assert gone() is None


def test_the_runs_metrics_say_which_decode_loop_and_attention_ran(monkeypatch, tmp_path, capsys):
    """train.py with a graph whose capture fails (the stand-in's): the run goes on, its samples are the eager loop's,
    and every step's record names the loop that ran, why the graph did not, and the policy's attention."""
    import train
    samples = {}
    for loop in ("eager", "graph"):
        monkeypatch.setattr(static_decode, "decode_loop", lambda device, _loop=loop: _loop, raising=False)
        monkeypatch.setattr(static_decode, "DECODE", loop)
        monkeypatch.setattr(static_decode, "capture", StandInGraph(None, fail_capture=True), raising=False)
        out = str(tmp_path / loop)
        train.main(SMOKE + ["--steps", "2", "--max-new-tokens", "8", "--out", out])
        samples[loop] = [json.loads(line) for line in open(os.path.join(out, "samples.jsonl"))]
        recs = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
        assert [r["decode"] for r in recs] == (["eager"] * 2 if loop == "eager" else ["static"] * 2)
        assert all(r["attention"] == "sdpa" for r in recs)
        assert all(r.get("decode_fallback") == (None if loop == "eager" else
                                                "capture: RuntimeError: stand-in: capture failed") for r in recs)
    assert samples["eager"] == samples["graph"]
    assert capsys.readouterr().err.count("CUDA graph") == 1


@pytest.mark.cuda
def test_on_cuda_the_step_captured_once_replays_the_static_loop_after_a_weight_update(monkeypatch):
    """On a GPU, the in-place contract itself: the step captured at step 1 replays at step 2, after LoRA moved in
    place, and draws what the same loop not captured draws; one capture, no fallback."""
    policy, tok = lora_policy("tiny:llama", torch.float32)
    policy = policy.cuda()
    ids, mask = rollout.encode_prompts(tok, ["What is 2 + 3?", "A longer question, 17 + 25?"], "cuda")
    u = torch.rand(6, 40, generator=torch.Generator().manual_seed(1)).cuda()

    def run(loop):
        monkeypatch.setattr(static_decode, "DECODE", loop)
        return rollout.sample(policy, ids, mask, None, 3, 40, 1.0, [-1], tok.pad_token_id, return_logprobs=True,
                              uniforms=u)
    run("graph")
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.add_(0.02)
    graph, static = run("graph"), run("static")
    held = static_decode.HELD[policy]
    assert held.captures == 1 and held.failed is None and static_decode.decode_path(policy) == ("static", None)
    assert torch.equal(graph[0], static[0]) and torch.allclose(graph[1], static[1], atol=1e-5, rtol=0)
