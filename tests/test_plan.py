"""--plan (support/harness/plan.py) and --expert-device: the plan counts what a run builds, its activation count matches what
autograd keeps, it writes nothing; experts can run on another device and their states come back."""
import os
import subprocess
import sys

import pytest
import torch

from baselines import METHODS, Kind, SoftPrompt
from support.harness import plan
import train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--team", "tiny", "--task", "chain_sum", "--device", "cpu", "--dataset-size", "64", "--system-prompt",
        "simple", "--batch-size", "2", "--grad-accum", "1", "--group-size", "4", "--max-new-tokens", "8",
        "--latent-dim", "32", "--num-heads", "4", "--num-latents", "4"]


@pytest.mark.parametrize("method", sorted(METHODS))
def test_plan_counts_the_parameters_a_run_builds(method):
    """Parity: the meta-device build gives the same counts as loading the models for real."""
    args = train.parse_args(TINY + ["--method", method])
    _, info = plan.estimate(args)
    run = train.build_run(args, torch.device("cpu"))
    real = {"policy": sum(p.numel() for p in run.policy.parameters() if not p.requires_grad),
            "lora": sum(p.numel() for p in run.policy.parameters() if p.requires_grad),
            "g_phi": sum(p.numel() for p in run.method.parameters() if p.requires_grad)}
    pools = [getattr(run.method, k) for k in ("pool", "encoder") if hasattr(run.method, k)]
    real["experts"] = sum(p.numel() for pool in pools for m, _ in pool.models for p in m.parameters())
    assert info["params"] == real
    C = run.method(["What is 1 + 1?"]).C
    assert info["context_tokens"] == (0 if C is None else C.shape[1])  # the method's own count, not a table


def test_plan_asks_a_new_method_for_its_context_tokens(monkeypatch):
    """A fork's new context builder, one entry in baselines.METHODS: the plan reads its context_tokens (here 3
    tokens while --num-latents is 4). The plan used to look the count up by method name, with --num-latents for
    any name it did not know: 4 here."""
    def three_tokens(team, out_dim, args, device, dtype):
        return SoftPrompt(out_dim, args.latent_dim, 3).to(device)
    three_tokens.kind = Kind(tokens=True, experts=None)
    monkeypatch.setitem(METHODS, "three_tokens", three_tokens)
    _, info = plan.estimate(train.parse_args(TINY + ["--method", "three_tokens"]))
    assert info["context_tokens"] == 3


def saved_in_the_loss_pass(attention):
    """(what autograd keeps in one loss pass of the tiny policy: {storage: (bytes, shape)}, weights excluded, plan's
    estimate for the same shapes, (B, G, T, m, P))."""
    import rollout
    from experts import load_model
    from lora import apply_lora
    args = train.parse_args(TINY + ["--batch-size", "2", "--group-size", "4", "--max-new-tokens", "16",
                                    "--attention", attention])
    policy, _ = load_model("tiny:llama", attention=attention)
    apply_lora(policy, 8, 16)
    B, G, T, m = 2, 4, 16, 4
    _, info = plan.estimate(args)
    P = info["prompt_tokens"]
    weights = {p.untyped_storage().data_ptr() for p in policy.parameters()}
    seen = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in weights:
            seen[ptr] = (t.untyped_storage().nbytes(), tuple(t.shape))
        return t

    torch.manual_seed(0)
    ids, mask = torch.randint(0, 250, (B, P)), torch.ones(B, P, dtype=torch.bool)
    C = torch.zeros(B, m, 64, requires_grad=True)
    comp, comp_mask = torch.randint(0, 250, (B * G, T)), torch.ones(B * G, T, dtype=torch.bool)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        rollout.completion_logprobs(policy, ids, mask, C, comp, comp_mask, 1.0, "after")
    return seen, info, (B, G, T, m, P)


def test_grouped_attention_keeps_keys_and_values_at_their_own_width():
    """--attention grouped on the tiny policy (4 query heads on 2 key/value heads): every key or value autograd
    keeps has the 2 heads the cache holds (the SDPA path keeps them copied to 4), and the keys and values, the
    stacked masks and SDPA's own outputs it keeps are plan's counts of them, each within 10 %."""
    seen, info, (B, G, T, m, P) = saved_in_the_loss_pass("grouped")
    H, KV, hd, Pc = 4, 2, 16, P + m
    shapes = list(seen.values())
    # [rows, heads, keys, d] (RoPE's cos and sin are [rows, 1, keys, d])
    kv = [(n, s) for n, s in shapes if len(s) == 4 and s[1] > 1 and s[-1] == hd and s[2] in (Pc, Pc + T)]
    masks = [n for n, s in shapes if len(s) == 4 and s[1] == 1 and s[2] in (2 * Pc, 2 * T)]     # [rows, 1, n_rep q, k]
    outputs = [n for n, s in shapes if len(s) == 4 and s[1] == KV and s[2] in (2 * Pc, 2 * T)]  # packed query and out
    assert kv and {s[1] for _, s in kv} == {KV}
    assert sum(n for n, _ in kv) == pytest.approx(info["loss"]["keys and values"], rel=0.10)
    assert sum(masks) == pytest.approx(info["loss"]["attention masks"], rel=0.10)
    # the packed query is plan's "query (D)" among the activations; SDPA's output is the one more
    assert sum(outputs) / 2 == pytest.approx(info["loss"]["attention outputs"], rel=0.10)


def test_activation_count_matches_what_autograd_keeps():
    """The loss pass's saved tensors (distinct storages, weights excluded), measured with saved_tensors_hooks
    on the tiny policy, against plan's count for the same shapes: within 10 %."""
    seen, info, (B, G, T, m, P) = saved_in_the_loss_pass("sdpa")
    loss = info["loss"]
    V, D, L = 260, 64, 2                                                # the tiny policy's
    # each MLP's input is held by its checkpoint (lib.recompute.mlps_recomputed), not as a tensor autograd saves
    held_by_checkpoints = (B * (P + m) + B * G * T) * D * L * 4
    # + y_0's float32 logits (the completions' are computed again in the backward pass: grpo.head_logprobs)
    estimated = loss["activations"] - held_by_checkpoints + loss["keys and values"] + B * G * V * 4
    assert sum(n for n, _ in seen.values()) == pytest.approx(estimated, rel=0.10)


def test_plan_prints_and_writes_nothing(tmp_path):
    """Not the run's folder, and not a state store's (--expert-cache): the plan's pool once created the folder."""
    out, cache = str(tmp_path / "never"), str(tmp_path / "no-states")
    res = subprocess.run([sys.executable, "train.py", *TINY, "--method", "ours", "--expert-cache", cache, "--plan",
                          "--out", out], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "cpu: peak" in res.stdout and "LoRA + grad + AdamW" in res.stdout
    assert " GB" not in res.stdout and res.stdout.count(" GiB") > 3  # 2 ** 30 bytes, labelled as such
    assert not os.path.exists(out) and not os.path.exists(cache)


def test_plan_knows_the_paper_teams_without_a_hub():
    # the experts without their LM heads (only read, never generated from): Qwen2.5-Coder-7B's untied head alone
    # is 0.545 B parameters (12.37 B with heads for the default team)
    for team, experts_b in (("default", 11.83), ("generalist", 14.99), ("llm", 28.95)):
        args = train.parse_args(["--team", team, "--device", "cuda", "--task", "arithmetic"])
        parts, info = plan.estimate(args)
        assert info["params"]["policy"] / 1e9 == pytest.approx(3.09, abs=0.01)  # Qwen2.5-3B
        assert info["params"]["experts"] / 1e9 == pytest.approx(experts_b, abs=0.01)
        assert info["dtype"] == "bfloat16" and list(parts) == ["cuda"]


def test_experts_run_on_their_device_and_their_states_come_back():
    """On a CPU machine the only other device is meta: states produced on the CPU must arrive there."""
    from experts import TEAMS, ExpertPool
    pool = ExpertPool(TEAMS["tiny"]["experts"], "cpu", out_device=torch.device("meta"))
    states = pool.encode(["What is 2 + 2?"])
    assert [h.device.type for h in states] == ["meta"] * 3 and pool.models[0][0].device.type == "cpu"


def test_expert_device_trains(tmp_path):
    out = str(tmp_path / "run")
    train.main(TINY + ["--steps", "1", "--expert-device", "cpu", "--out", out])
    assert os.path.exists(os.path.join(out, "checkpoint.pt"))


@pytest.mark.parametrize("value", ["tpu", "cuda:1"])
def test_bad_expert_device_fails_in_one_line(value, tmp_path, capfd):
    if value.startswith("cuda") and torch.cuda.is_available():
        pytest.skip("CUDA is here")
    out = str(tmp_path / "run")
    with pytest.raises(SystemExit) as exc:
        train.main(TINY + ["--steps", "1", "--expert-device", value, "--out", out])
    lines = capfd.readouterr().err.strip().splitlines()
    assert exc.value.code == 2 and len(lines) == 1 and "--expert-device" in lines[0] and not os.path.exists(out)


def test_plan_leaves_out_experts_whose_states_are_precomputed(tmp_path):
    """A run on precomputed states (train.py --precompute-states, then --expert-cache) never loads its experts, so
    the plan must not count their weights or forward pass. It built its pool on the meta device, which looked for
    states filed under "meta" and found none: on an H200 it planned 62.1 GiB for a run that peaked at 40.4."""
    cache = str(tmp_path / "states")
    flags = TINY + ["--method", "ours", "--expert-cache", cache, "--steps", "2", "--eval-items", "4"]
    before, _ = plan.estimate(train.parse_args(flags))
    train.main(flags + ["--precompute-states", "--out", str(tmp_path / "pre")])
    after, info = plan.estimate(train.parse_args(flags))
    assert before["cpu"]["expert weights"] > 0 and before["cpu"]["expert forward"] > 0
    assert after["cpu"]["expert weights"] == 0 and after["cpu"]["expert forward"] == 0
    assert info["params"]["experts"] == 0


def test_plan_counts_keys_and_values_at_the_width_attention_reads_them():
    """The default team's loss pass on CUDA: --attention grouped (auto there) keeps keys and values at Qwen2.5-3B's
    2 key/value heads, sdpa at its 16 query heads plus the G-fold cache (the issue's 15.7 GiB); the plan says
    which it counted. On a CPU auto is sdpa (the fixtures' path)."""
    from lib.shape_models import config
    c = config("Qwen/Qwen2.5-3B-Instruct")
    L, H, KV, hd = c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads, c.hidden_size // c.num_attention_heads
    flags = ["--team", "default", "--device", "cuda", "--task", "arithmetic"]
    (_, auto), (_, grouped), (_, sdpa) = (plan.estimate(train.parse_args(flags + extra))
                                          for extra in ([], ["--attention", "grouped"], ["--attention", "sdpa"]))
    B, G, T, Pc = 4, 8, 128, auto["prompt_tokens"] + auto["context_tokens"]
    tokens = B * G * (Pc + T) + B * Pc
    assert auto["loss"] == grouped["loss"] and auto["attention"].startswith("grouped")
    assert grouped["loss"]["keys and values"] == tokens * L * 2 * KV * hd * 2
    assert sdpa["loss"]["keys and values"] == tokens * L * 2 * H * hd * 2 + B * G * Pc * L * 2 * KV * hd * 2
    assert sdpa["attention"] == f"sdpa: keys and values at {H} of {H} heads"
    _, cpu = plan.estimate(train.parse_args(TINY))
    assert cpu["attention"].startswith("sdpa")


def test_plan_counts_one_completions_logits_and_one_prefill_layer():
    """The loss pass's logits: y_0's rows and one completion's (grpo.head_logprobs), not [N, T, V]; the rollout's
    cache: the decode buffers and one layer of the prefill's (kv_cache.preallocate), not a second whole cache."""
    from lib.shape_models import config
    c = config("Qwen/Qwen2.5-3B-Instruct")
    parts, info = plan.estimate(train.parse_args(["--team", "default", "--device", "cuda", "--task", "arithmetic"]))
    B, G, T, V, Pc = 4, 8, 128, c.vocab_size, info["prompt_tokens"] + info["context_tokens"]
    assert info["loss"]["logits"] == B * G * V * (2 + 4) + T * V * (2 + 8)
    kv_token = c.num_hidden_layers * 2 * c.num_key_value_heads * (c.hidden_size // c.num_attention_heads) * 2
    R = B * G * 8                                                       # the whole step's rows in one decode loop
    held = parts["cuda"].get("decode graph: KV cache", 0)  # CUDA's captured decode keeps its buffers: resident
    assert info["rollout"]["KV cache"] + held == R * (Pc + T) * kv_token + R * Pc * kv_token // c.num_hidden_layers


def test_on_cuda_the_plan_keeps_the_captured_decodes_buffers_through_the_loss_pass(monkeypatch):
    """The decode step captured once per run (static_decode.DECODE's graph, CUDA's default) keeps its KV cache and the
    merged LoRA weights it reads (lora_merged(keep=True)) allocated between steps, so the loss pass runs beside them:
    the plan counts them as resident on CUDA, and as the rollout's transients where the loop is not captured."""
    from lib import static_decode
    args = train.parse_args(TINY[:TINY.index("--device")] + TINY[TINY.index("--device") + 2:] + ["--device", "cuda"])
    parts = {}
    for loop in ("eager", "graph"):
        monkeypatch.setattr(static_decode, "DECODE", loop)
        parts[loop] = plan.estimate(args)[0]["cuda"]
    held = {k: v for k, v in parts["graph"].items() if k.startswith("decode graph")}
    assert set(held) == {"decode graph: merged LoRA weights", "decode graph: KV cache"} and all(held.values())
    assert not any(k.startswith("decode graph") for k in parts["eager"])
    moved = parts["eager"]["rollout (one decode loop)"] - parts["graph"]["rollout (one decode loop)"]
    assert moved == sum(held.values())  # the same bytes, resident instead of transient
    assert plan.peak(parts["graph"]) > plan.peak(parts["eager"])
    monkeypatch.setattr(static_decode, "GRAPH_MERGED", False)  # LoRA unmerged inside the graph: no merged copy anywhere
    unmerged = plan.estimate(args)[0]["cuda"]
    assert "decode graph: merged LoRA weights" not in unmerged
    assert unmerged["rollout (one decode loop)"] == parts["graph"]["rollout (one decode loop)"]
