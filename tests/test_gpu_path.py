"""The GPU path, right by construction and checked on CPU (one test per failure a GPU run would meet):
no attention row with every key masked; every tensor of g_phi on the device asked for; LoRA computing in the
activations' dtype and --plan counting what autograd keeps under bfloat16; the sampler's log-probs whenever the
sampler is not the scoring pass; cached expert states that are copies; device/dtype combinations that cannot
work refused before loading; one decode loop per optimiser step; the device check's CPU mode (every phase at tiny
scale).
CUDA-only tests carry the `cuda` marker and are skipped without CUDA."""
import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import train
from support.harness import plan

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMOKE = ["--preset", "smoke", "--eval-items", "0"]


def empty_query_rows(mask):
    """Rows of an SDPA mask (bool: True = attend; float: -inf = masked) whose keys are all masked."""
    if mask is None:
        return 0
    visible = mask if mask.dtype == torch.bool else mask > torch.finfo(mask.dtype).min / 2
    return int((~visible.any(-1)).sum())


def count_attention_rows(monkeypatch):
    """Patch SDPA to count its calls and the query rows whose keys are all masked: {"calls": n, "empty": n}."""
    count = {"calls": 0, "empty": 0}
    real = F.scaled_dot_product_attention

    def counted(q, k, v, attn_mask=None, *a, **kw):
        count["calls"] += 1
        count["empty"] += empty_query_rows(attn_mask)
        return real(q, k, v, attn_mask, *a, **kw)
    monkeypatch.setattr(F, "scaled_dot_product_attention", counted)
    return count


def test_no_attention_call_sees_a_query_row_with_every_key_masked(monkeypatch, tmp_path):
    """Left padding made each padding position a query with nothing to attend to (24 of 174 SDPA calls on the
    smoke preset, before): CUDA's memory-efficient kernel is reported to return NaN for such rows. The policy's
    prompts and the experts' now keep their padding behind the first token (rollout.padding_behind_first_token)."""
    count = count_attention_rows(monkeypatch)
    train.main(SMOKE + ["--grad-accum", "2", "--out", str(tmp_path / "run")])
    assert count["calls"] > 50  # the check has teeth: attention ran, through SDPA
    assert count["empty"] == 0


def test_padding_behind_the_first_token_leaves_every_real_token_as_it_was(tiny_policy):
    """The same function: the real tokens' logits equal those of the left-padded batch (float rounding aside)."""
    import rollout
    policy, tok = tiny_policy
    tok.padding_side = "left"
    batch = tok(["short", "a somewhat longer prompt", "mid length"], return_tensors="pt", padding=True)
    ids, mask = batch["input_ids"], batch["attention_mask"].bool()
    moved_ids, moved_mask = rollout.padding_behind_first_token(ids, mask)
    assert (moved_mask[:, 0] & moved_mask[:, -1]).all() and moved_mask.sum() == mask.sum()
    with torch.no_grad():
        a = policy(input_ids=ids, attention_mask=mask, position_ids=rollout.position_ids(mask)).logits
        b = policy(input_ids=moved_ids, attention_mask=moved_mask, position_ids=rollout.position_ids(moved_mask)).logits
    for r in range(len(ids)):
        assert torch.allclose(a[r][mask[r]], b[r][moved_mask[r]], atol=1e-5)


@pytest.mark.parametrize("method", ["ours", "identical", "no_xattn", "hard_routing", "soft_prompt"])
def test_every_tensor_of_g_phi_is_on_the_device_asked_for(method):
    """StateNorm's buffers stayed on the CPU when only the adapter was moved: every `ours` run on a GPU failed at
    its first step (found by the device check on an H200). Built here on PyTorch's meta device."""
    from baselines import METHODS
    from experts import team_models
    args = train.parse_args(SMOKE + ["--method", method])
    meta = torch.device("meta")
    g = METHODS[method](team_models(args), 64, args, meta, torch.float32)
    tensors = list(g.parameters()) + list(g.buffers())
    assert tensors and all(t.device == meta for t in tensors)


def saved_bytes(fn):
    """Bytes of the distinct storages autograd keeps for the backward pass while fn runs (weights excluded)."""
    seen, weights = {}, set()

    def pack(t):
        seen.setdefault(t.untyped_storage().data_ptr(), (t.untyped_storage().nbytes(), t.dtype))
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return seen


def test_lora_keeps_no_float32_copy_of_its_input_under_bfloat16_weights():
    """A and B are float32 masters (an Adam step of 3e-5 on 0.02 rounds to nothing in bfloat16), but the low-rank
    product runs in the activations' dtype: casting x up made autograd keep a float32 copy of every wrapped
    layer's input. The gradients still reach A and B in float32, and equal the float32 maths within bf16 error."""
    from lora import LoRALinear
    torch.manual_seed(0)
    base = torch.nn.Linear(256, 128).to(torch.bfloat16)
    layer = LoRALinear(base, rank=8)
    with torch.no_grad():
        layer.lora_B.normal_(0, 0.1)
    x = torch.randn(64, 256, dtype=torch.bfloat16, requires_grad=True)
    kept = saved_bytes(lambda: layer(x).float().square().sum().backward())
    assert not [n for n, dt in kept.values() if dt == torch.float32 and n >= x.numel() * 4]
    assert layer.lora_A.grad.dtype == layer.lora_B.grad.dtype == torch.float32
    ref = LoRALinear(torch.nn.Linear(256, 128), rank=8)
    ref.base.load_state_dict({k: v.float() for k, v in base.state_dict().items()})
    ref.load_state_dict({k: v.float() for k, v in layer.state_dict().items()}, strict=False)
    ref(x.detach().float()).square().sum().backward()
    assert torch.allclose(layer.lora_B.grad, ref.lora_B.grad, rtol=0.05, atol=0.05 * ref.lora_B.grad.abs().max())


def test_plan_counts_what_autograd_keeps_under_bfloat16():
    """--plan's loss pass in bfloat16 against the saved tensors of a measured bf16 loss pass on the tiny policy:
    within 15 % (before: the plan counted 6 D at the frozen dtype, while autograd also kept float32 copies of each
    LoRA input and of each RMSNorm's upcast, ~2x more)."""
    import rollout
    from experts import load_model
    from lora import apply_lora
    args = train.parse_args(SMOKE + ["--dtype", "bfloat16", "--device", "cpu", "--batch-size", "2",
                                     "--group-size", "4", "--max-new-tokens", "16", "--num-latents", "4"])
    policy, _ = load_model("tiny:llama", "cpu", torch.bfloat16)
    import copy
    policy = copy.deepcopy(policy)
    apply_lora(policy, 8, 16)
    B, G, T, m = 2, 4, 16, 4
    _, info = plan.estimate(args)
    P = info["prompt_tokens"]
    weights = {p.untyped_storage().data_ptr() for p in policy.parameters()}
    torch.manual_seed(0)
    ids, mask = torch.randint(0, 250, (B, P)), torch.ones(B, P, dtype=torch.bool)
    C = torch.zeros(B, m, 64, dtype=torch.float32, requires_grad=True)
    comp, comp_mask = torch.randint(0, 250, (B * G, T)), torch.ones(B * G, T, dtype=torch.bool)
    kept = saved_bytes(lambda: rollout.completion_logprobs(policy, ids, mask, C, comp, comp_mask, 1.0, "after"))
    measured = sum(n for ptr, (n, _) in kept.items() if ptr not in weights)
    V, D, L = policy.config.vocab_size, policy.config.hidden_size, policy.config.num_hidden_layers
    loss = info["loss"]
    held_by_checkpoints = (B * (P + m) + B * G * T) * D * L * 2  # each MLP's bf16 input, held by its checkpoint
    estimated = loss["activations"] - held_by_checkpoints + loss["keys and values"] + B * G * T * V * 4
    assert measured == pytest.approx(estimated, rel=0.15)


def test_cached_expert_states_are_copies_not_views_of_the_batch(tiny_pool):
    """`states[:, -1]` is a view and `.float()` of a float32 tensor is that tensor: the cache kept each whole
    [B, T, d] batch alive (81,024 bytes held for a 192-byte state)."""
    tiny_pool.cache.clear()
    tiny_pool.encode(["What is 2 + 2?", "A much longer question about rotating a matrix by ninety degrees?"])
    for h in tiny_pool.cache.values():
        assert h.untyped_storage().nbytes() == h.numel() * h.element_size()


def test_int8_rollout_with_device_auto_on_a_cuda_machine_is_refused_before_loading(monkeypatch, capsys):
    """--rollout-dtype int8 runs on CPU kernels only; --device auto picks cuda where there is one, so the run
    loaded every model and then died in its first rollout with an uncaught ValueError."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(SystemExit) as e:
        train.parse_args(SMOKE + ["--rollout-dtype", "int8"])
    assert e.value.code == 2 and "--rollout-dtype int8" in capsys.readouterr().err


def test_sampler_logprobs_and_gap_are_logged_whenever_the_sampler_is_not_the_scorer(tmp_path):
    """Under bfloat16 frozen weights (a GPU's default) the sampler runs LoRA merged into bf16 weights and the
    scoring pass unmerged: their gap is logged and --tis-cap accepted, with the default --rollout-dtype."""
    out = str(tmp_path / "run")
    train.main(SMOKE + ["--dtype", "bfloat16", "--device", "cpu", "--tis-cap", "2", "--steps", "2", "--out", out])
    recs = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    assert all(r["rollout_logp_gap"] is not None and r["rollout_logp_gap"] >= 0 for r in recs)
    assert all("is_weight_mean" in r for r in recs)


def test_one_decode_loop_per_optimiser_step(monkeypatch, tmp_path):
    """The rollout ran once per micro-batch (--grad-accum 8: 8 decode loops of 32 rows for the paper's step);
    now once per step, and the step's prompts, G and completions per prompt are those of before."""
    import rollout
    loops, rows = [], []
    real = rollout.decode

    def counted(policy, cache, logits, *a, **kw):
        loops.append(1)
        rows.append(logits.shape[0])
        return real(policy, cache, logits, *a, **kw)

    monkeypatch.setattr(rollout, "decode", counted)
    train.main(SMOKE + ["--grad-accum", "4", "--steps", "2", "--out", str(tmp_path / "run")])
    assert len(loops) == 2 and rows == [2 * 4 * 4] * 2   # 2 steps; 4 micro-batches x 2 prompts x G 4 each
    loops.clear(), rows.clear()
    train.main(SMOKE + ["--grad-accum", "4", "--steps", "1", "--rollout-batch", "2", "--out", str(tmp_path / "r2")])
    assert rows == [16, 16]                              # split by --rollout-batch


def test_a_row_draws_the_same_completion_whichever_rows_share_its_decode_loop(tmp_path):
    """Each micro-batch's rows draw with uniforms of their own seed: one loop for the step or one loop per
    micro-batch, the same completions (so N processes still train as one)."""
    outs = {}
    for name, extra in (("one_loop", []), ("a_loop_each", ["--rollout-batch", "1"])):
        out = str(tmp_path / name)
        train.main(SMOKE + ["--grad-accum", "3", "--steps", "2", "--out", out])
        outs[name] = [json.loads(line) for line in open(os.path.join(out, "samples.jsonl"))]
    assert outs["one_loop"] == outs["a_loop_each"]


def test_device_check_runs_on_cpu_at_tiny_scale(tmp_path):
    """experiments/gpu_check.py --tiny: every phase runs and is recorded (so the GPU check cannot rot). TRL's phase
    and the CUDA tests' have tests of their own (tests/test_gpu_check.py)."""
    out = str(tmp_path / "gpu_check.json")
    phases = ["preflight", "env", "tiny_parity", "decode", "default_step", "default_step_before", "default_step_single",
              "default_step_stress", "default_step_cached", "default_step_stress_before", "padded_rows", "writers",
              "default_step_per_micro", "determinism"]
    res = subprocess.run([sys.executable, "experiments/gpu_check.py", "--tiny", "--phases", ",".join(phases),
                          "--out", out], cwd=ROOT, capture_output=True, text=True, timeout=900,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    report = json.load(open(out))
    got = {p["phase"]: p for p in report["phases"]}
    assert list(got) == phases
    assert all(p["ok"] for p in got.values())
    assert got["tiny_parity"]["smoke_bf16_step1_kl_exactly_0"] is True
    assert got["tiny_parity"]["decode_loops"]["tokens_equal"] == 1.0  # the eager loop vs the static one
    assert got["padded_rows"]["math"]["behind_first"]["nonfinite_real_tokens"] == 0
    assert got["writers"]["float32_equal"] is True  # on CPU "the device" is the CPU: the same texts
    assert len(got["default_step"]["steps"]) == 3  # --steps 3: a warm-up and two measured
    assert got["default_step"]["steps"][0]["metrics"]["decode"] == "eager"  # a CPU's loop, recorded each step
    assert got["preflight"]["matmul_ok"] is True and os.path.exists(tmp_path / "decode.started")
    assert got["default_step_before"]["switches"]["DECODE"] == "'eager'"
    assert got["decode"]["before"]["loop"] == "eager" and got["decode"]["after"]["loop"] == "static"
    assert got["determinism"]["deterministic_all_equal"] is True
    assert report["goals"]["step_s"]["measured"] is not None


@pytest.mark.cuda
def test_cuda_smoke_run_is_finite_and_starts_at_the_reference(tmp_path):
    """On a GPU: the smoke preset in bfloat16, step 1's KL exactly 0 and no skipped update."""
    out = str(tmp_path / "run")
    train.main(SMOKE + ["--device", "cuda", "--dtype", "bfloat16", "--steps", "2", "--out", out])
    recs = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    assert recs[0]["kl"] == 0.0 and not any(r["skipped_update"] for r in recs)


def test_precomputed_states_let_a_run_train_without_loading_its_experts(tmp_path, monkeypatch):
    """--precompute-states writes every state the run will read (its steps' prompts, its validation items) into
    --expert-cache; the run then never loads an expert (the default team's are 23 GB of GPU memory)."""
    import experts
    cache = str(tmp_path / "states")
    flags = SMOKE + ["--expert-cache", cache, "--steps", "2", "--grad-accum", "2", "--eval-items", "4"]
    train.main(flags + ["--precompute-states", "--out", str(tmp_path / "pre")])
    assert not os.path.exists(tmp_path / "pre")  # it writes states, no run folder
    loaded, real = [], experts.load_model
    monkeypatch.setattr(experts, "load_model", lambda spec, *a, **kw: loaded.append(spec) or real(spec, *a, **kw))
    train.main(flags + ["--out", str(tmp_path / "run")])
    assert loaded == []  # no expert (the policy is loaded by train.py's own import of load_model)
    recs = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    assert len(recs) == 2 and all(len(r["utilization"]) == 3 for r in recs)


def test_deterministic_sets_the_cuda_determinism_switches(monkeypatch, tmp_path):
    """--deterministic: cuBLAS's fixed workspace, no cuDNN autotuning, cuDNN's deterministic kernels and torch's
    deterministic algorithms in STRICT mode. With warn_only=True the flash and memory-efficient attention
    backward kernels keep their atomic-add algorithm and only warn: on an H200 (results/gpu.md) 3 of 9 processes
    of the same 4-step run, with the flag and without, reached a different step-2 gradient norm. The run itself
    goes through on the CPU with the strict switch on (no op of the smoke path lacks a deterministic version)."""
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", True)
    monkeypatch.setattr(torch.backends.cudnn, "deterministic", False)
    before = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
    try:
        train.main(SMOKE + ["--steps", "1", "--deterministic", "--out", str(tmp_path / "run")])
        on, warn_only = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
    assert on and not warn_only, "warn_only=True leaves the attention backward non-deterministic on a GPU"
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8" and torch.backends.cudnn.benchmark is False
    assert torch.backends.cudnn.deterministic is True


def test_device_check_run_peak_survives_the_per_phase_resets(monkeypatch):
    """gpu_check's phase clock resets the card's peak counter before each timed call; the run's peak must still
    be the whole run's (the fifth and sixth GPU runs printed 28.6 GiB for a step whose policy pass peaked at 62.7:
    the counter only remembered the time after the last reset). A fake counter stands in for the card."""
    sys.path.insert(0, os.path.join(ROOT, "experiments"))
    import gpu_check
    import rollout
    card = {"peak": 0, "reserved": 0}
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: card.update(peak=0))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: card["peak"])
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device=None: card["reserved"])
    monkeypatch.setattr(rollout, "sample", lambda: card.update(peak=max(card["peak"], 9 << 30), reserved=12 << 30))
    monkeypatch.setattr(torch.optim.AdamW, "step", lambda self: card.update(peak=max(card["peak"], 1 << 30)))
    times, run = {}, {}
    with gpu_check.phase_clock(torch.device("cuda"), times, run):
        rollout.sample()                                 # peaks at 9 GiB
        torch.optim.AdamW.step(None)                     # resets first, then peaks at 1 GiB
    assert times["rollout"]["peak_allocated_gib"] == 9 and times["optimizer step"]["peak_allocated_gib"] == 1
    assert max(run["peak_bytes"], card["peak"]) == 9 << 30
    assert run["reserved_bytes"] == 12 << 30
