"""The export is the trained system (support/export.py): lora_peft/ names a base PEFT can resolve and holds the
tokenizer, so AutoPeftModelForCausalLM loads it alone and gives the trained policy's logits (without context
tokens); g_phi's state and what rebuilds it are beside it."""
import json
import os
from types import SimpleNamespace

import pytest
import torch

SMALL = ["--team", "tiny", "--task", "chain_sum", "--device", "cpu", "--dataset-size", "32", "--system-prompt",
         "simple", "--steps", "2", "--batch-size", "2", "--grad-accum", "1", "--group-size", "2",
         "--max-new-tokens", "6", "--latent-dim", "32", "--num-heads", "4", "--num-latents", "4"]


def test_the_export_loads_alone_and_gives_the_trained_policys_logits(tmp_path):
    peft = pytest.importorskip("peft")
    from transformers import AutoTokenizer

    from evaluate import load_policy
    from train import main
    out = str(tmp_path / "run")
    main(SMALL + ["--out", out])
    folder = os.path.join(out, "lora_peft")
    with open(os.path.join(folder, "adapter_config.json")) as f:
        base = json.load(f)["base_model_name_or_path"]
    # it was "tiny:llama", which nothing outside this repository can resolve
    assert not base.startswith(("tiny:", "pocket:")) and os.path.isdir(base), base
    tok = AutoTokenizer.from_pretrained(folder)  # the tokenizer is beside the adapter
    exported = peft.AutoPeftModelForCausalLM.from_pretrained(folder).eval()

    cfg = SimpleNamespace(**json.load(open(os.path.join(out, "config.json"))))
    state = torch.load(os.path.join(out, "checkpoint.pt"), weights_only=False)
    policy, _, _, _ = load_policy(cfg, state["lora"], state["method"])  # the trained run, from its checkpoint
    ids = torch.tensor([tok.encode("What is 2 + 3?")])
    with torch.no_grad():
        assert torch.allclose(exported(ids).logits, policy(ids).logits, atol=1e-5)

    from support.export import read_g_phi
    meta, g_state = read_g_phi(out)
    assert meta["method"] == "ours" and meta["context_tokens"] == 4 and meta["flags"]["num_latents"] == 4
    assert set(g_state) == set(state["method"])
    assert all(torch.equal(g_state[k], state["method"][k].cpu()) for k in g_state)


def test_load_trained_rebuilds_the_whole_system_from_the_export_alone(tmp_path):
    """support.export.load_trained(OUT): the policy with its LoRA and g_phi, from lora_peft/ and g_phi.* (the
    checkpoint deleted first): the same C and the same logits with C as the trained run loaded by evaluate.py."""
    import rollout
    from evaluate import load_policy
    from train import main
    try:
        from support.export import load_trained
    except ImportError:
        pytest.fail("support.export has no load_trained")
    out = str(tmp_path / "run")
    main(SMALL + ["--reward", "random", "--out", out])  # coin rewards: every step has a gradient, C moves
    cfg = SimpleNamespace(**json.load(open(os.path.join(out, "config.json"))))
    state = torch.load(os.path.join(out, "checkpoint.pt"), weights_only=False)
    policy, tok, g, _ = load_policy(cfg, state["lora"], state["method"])
    os.remove(os.path.join(out, "checkpoint.pt"))
    policy2, tok2, g2, _ = load_trained(out)
    questions = ["What is 2 + 3?", "What is 10 + 7?"]
    ids, mask = rollout.encode_prompts(tok, questions, "cpu")
    with torch.no_grad():
        C, C2 = g(questions).C, g2(questions).C
        assert C.abs().sum() > 0 and torch.equal(C, C2)
        pos = cfg.context_position
        emb, m, p = rollout.policy_inputs(policy.get_input_embeddings(), ids, mask, C, pos)
        emb2, m2, p2 = rollout.policy_inputs(policy2.get_input_embeddings(), ids, mask, C2, pos)
        logits = policy(inputs_embeds=emb, attention_mask=m, position_ids=p).logits
        assert torch.allclose(logits, policy2(inputs_embeds=emb2, attention_mask=m2, position_ids=p2).logits,
                              atol=1e-6)
